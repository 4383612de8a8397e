// The host device (moe/device.h): the CUDA kernels' part of the relay protocol, on the CPU, and
// the buffers and relay it owns when the shell creates it (CreateHostDevice).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "common/backoff.h"
#include "common/leak.h"
#include "moe/device.h"
#include "moe/host/host_sums.h"
#include "moe/numerics.h"
#include "moe/wire.h"

namespace ferry::moe {
namespace {

using host::AddScaledRow;
using host::LoadSums;
using host::StoreSums;

// What a host device the shell creates owns: the relay's layout, its buffers, the relay. The
// relay stops first; then no write may still read or fill the boxes before they go. Writes to a
// dead peer end at the engine's transfer timeout; if some never end (a wedged provider), the
// boxes are leaked rather than freed under the NIC (the relay leaks their registrations).
struct HostRig {
  explicit HostRig(const AllToAllConfig& c)
      : layout(c, SlotFormat(c, false).slot_bytes, 1), boxes(layout) {}
  ~HostRig() {
    if (relay && !relay->Stop()) LeakOnPurpose(new HostBoxes(std::move(boxes)));
  }
  const RelayLayout layout;  // every other rank remote: the host device has no NVLink
  HostBoxes boxes;
  std::unique_ptr<Relay> relay;  // after what it reads: stopped first
};

class HostDevice final : public MoeDevice {
 public:
  explicit HostDevice(const DeviceParams& p, std::unique_ptr<HostRig> rig = nullptr)
      : rig_(std::move(rig)),
        p_(p),
        c_(p_.config),
        lay_(*p.layout),
        slot_(c_, false),
        self_section_(size_t(lay_.section_bytes)) {}

  Status DispatchSend(const DispatchInput& in, uint64_t epoch) override {
    const int n = c_.world_size, k = c_.experts_per_token, l = c_.local_experts();
    num_tokens_ = in.num_tokens;
    for (int r = 0; r < n; ++r) send_to_[r] = r == c_.rank || !Masked(r);
    weights_.assign(in.weights, in.weights + size_t(in.num_tokens) * k);
    // Per receiving rank: its slots and the combine rows it returns, in token order; per
    // expert, the copies so far (an entry's pos).
    std::vector<int64_t> slots(n, 0), rows(n, 0), copies(c_.num_experts, 0);
    for (int r = 0; r < n; ++r) rows_[r].clear();
    for (int t = 0; t < in.num_tokens; ++t) {
      for (int r = 0; r < n; ++r) {
        const int hits = Hits(in.indices + size_t(t) * k, r);
        if (hits == 0) continue;
        slots[r] += c_.dispatch_once_per_rank ? 1 : hits;
        rows[r] += c_.combine_reduce_at_expert_rank ? 1 : hits;
      }
    }
    row_starts_.assign(n + 1, 0);
    int64_t send_start = 0;
    for (int r = 0; r < n; ++r) {
      row_starts_[r + 1] = row_starts_[r] + rows[r];
      int32_t* row = CountsOut(r);
      std::fill(row, row + CountsWidth(c_), 0);
      row[l + kColSlots] = static_cast<int32_t>(slots[r]);
      row[l + kColSendStart] = static_cast<int32_t>(send_start);
      row[l + kColRowStart] = static_cast<int32_t>(row_starts_[r]);
      row[l + kColRows] = static_cast<int32_t>(rows[r]);
      send_start += slots[r];
      if (lay_.Remote(r)) *lay_.OutSlots(p_.boxes.control, Remote(r)) = slots[r];
    }
    // Lay out each token's slots rank by rank, as the send kernels do.
    const int64_t payload = c_.token_bytes(), spt = c_.scales_per_token();
    std::vector<int64_t> slot_at(n, 0), row_at(n, 0);
    for (int t = 0; t < in.num_tokens; ++t) {
      const int32_t* ids = in.indices + size_t(t) * k;
      for (int r = 0; r < n; ++r) {
        const int hits = Hits(ids, r);
        if (hits == 0) continue;
        const int64_t first_row = row_starts_[r] + row_at[r];
        int within = 0;  // the token's copies for r so far
        for (int j = 0; j < k; ++j) {
          const int32_t e = ids[j];
          if (e < 0 || e / l != r) continue;  // -1: no expert, nothing sent or summed
          ++CountsOut(r)[e % l];
          const SlotEntry entry{e % l, j, in.weights[size_t(t) * k + j],
                                static_cast<int32_t>(copies[e]++)};
          const bool once = c_.dispatch_once_per_rank;
          uint8_t* slot = SlotOut(r, slot_at[r] + (once ? 0 : within));
          std::memcpy(slot + sizeof(SlotHeader) + (once ? within : 0) * sizeof(SlotEntry), &entry,
                      sizeof entry);
          if (!once || within == 0) {
            const int64_t row = first_row + (once || c_.combine_reduce_at_expert_rank ? 0 : within);
            const SlotHeader header{t, once ? hits : 1, static_cast<int32_t>(row),
                                    static_cast<int16_t>(once ? 0 : within),
                                    static_cast<int16_t>(once ? 1 : hits)};
            std::memcpy(slot, &header, sizeof header);
            uint8_t* body = slot + slot_.meta_bytes;
            std::memcpy(body, static_cast<const uint8_t*>(in.x) + t * payload, payload);
            if (spt) std::memcpy(body + payload, in.scales + t * spt, spt * 4);
          }
          if (within == 0 || !c_.combine_reduce_at_expert_rank) rows_[r].push_back({t, j});
          ++within;
        }
        slot_at[r] += c_.dispatch_once_per_rank ? 1 : hits;
        row_at[r] += c_.combine_reduce_at_expert_rank ? 1 : hits;
      }
    }
    RaiseOutbox(false, epoch);
    return Status::Ok();
  }

  Status DispatchRecv(const DispatchOutput& out, uint64_t epoch, Deadline deadline) override {
    const int n = c_.world_size, l = c_.local_experts();
    const Deadline late = LateBound(deadline);
    for (int s : lay_.remotes) {
      RETURN_IF_ERROR(WaitOrMask(false, s, epoch, deadline, late, out.wait_cost));
    }
    // Every sender's counts row, checked before anything is computed from it; a masked sender
    // sent nothing we read.
    offset_.assign(size_t(n + 1) * l, 0);
    from_.assign(n, {});
    for (int s = 0; s < n; ++s) {
      if (s != c_.rank && Masked(s)) {
        std::copy_n(&offset_[size_t(s) * l], l, &offset_[size_t(s + 1) * l]);
        continue;
      }
      const int32_t* row = CountsIn(s);
      From& f = from_[s];
      f.slots = row[l + kColSlots];
      f.row_start = row[l + kColRowStart];
      f.rows = row[l + kColRows];
      if (f.slots < 0 || f.slots > lay_.slots_per_pair || f.rows < 0 ||
          f.rows > lay_.rows_per_pair || f.row_start < 0 ||
          f.row_start + f.rows > lay_.combine_rows) {
        return Malformed(DataLossError(
            "moe: the counts row from rank " + std::to_string(s) + " announces " +
            std::to_string(f.slots) + " slots and " + std::to_string(f.rows) +
            " combine rows at row " + std::to_string(f.row_start) + " (at most " +
            std::to_string(lay_.slots_per_pair) + " and " + std::to_string(lay_.rows_per_pair) +
            ", within " + std::to_string(lay_.combine_rows) + " rows)"));
      }
      for (int e = 0; e < l; ++e) {
        // Counted in 64 bits and held to the expert's capacity as they add up, so the offsets
        // (int32, as the kernels keep them) cannot wrap.
        const int64_t announced = row[e], sum = offset_[size_t(s) * l + e] + announced;
        if (announced < 0 || sum > c_.expert_capacity()) {
          return Malformed(DataLossError(
              "moe: the counts row from rank " + std::to_string(s) + " announces " +
              std::to_string(announced) + " copies for local expert " + std::to_string(e) + " (" +
              std::to_string(sum) + " from the senders up to it, capacity " +
              std::to_string(c_.expert_capacity()) + ")"));
        }
        offset_[size_t(s + 1) * l + e] = static_cast<int32_t>(sum);
      }
      // For the relay's combine write: where this sender's rows go and how many (relay.h).
      if (lay_.Remote(s)) {
        int64_t* in_rows = lay_.InRows(p_.boxes.control, Remote(s));
        in_rows[0] = f.row_start;
        in_rows[1] = f.rows;
      }
    }
    // Where each local expert's rows start: its block of capacity rows, or (padded) after the
    // rounded-up blocks of the experts before it.
    const bool token_major = c_.dispatch_layout == DispatchLayout::kTokenMajor;
    // The expert-major rows (token-major too: its entries are checked against them).
    const int64_t block = out.expert_rows > 0 ? out.expert_rows : c_.expert_capacity();
    const int64_t out_rows =
        out.expert_padding ? c_.padded_rows(out.expert_padding) : int64_t{l} * block;
    expert_base_.assign(l, 0);
    int64_t next = 0;
    for (int e = 0; e < l; ++e) {
      const int64_t total = offset_[size_t(n) * l + e];
      const int p = out.expert_padding;
      if (!token_major && p == 0 && total > block) {
        return Malformed(ResourceExhaustedError(
            "moe: local expert " + std::to_string(e) + " received " + std::to_string(total) +
            " copies, more than the " + std::to_string(block) +
            " rows of its output block (DispatchOutput::expert_rows); this AllToAll is unusable"));
      }
      expert_base_[e] = p > 0 ? next : int64_t{e} * block;
      if (p > 0) next += (total + p - 1) / p * p;
    }
    if (next > out_rows) {
      return Malformed(DataLossError("moe: the announced counts take " + std::to_string(next) +
                                     " padded rows, more than the " + std::to_string(out_rows) +
                                     " any routing can"));
    }
    if (token_major) {
      token_routes_.assign(size_t(c_.expert_capacity()), Route{});
    } else {
      routes_.assign(size_t(out_rows), Route{});
    }
    const SlotLimits base_limits{
        c_.experts_per_token, l, c_.max_tokens_per_rank, c_.combine_reduce_at_expert_rank, 0,
        c_.expert_capacity()};
    const int64_t payload = c_.token_bytes(), spt = c_.scales_per_token();
    const int k = c_.experts_per_token;
    int32_t g = 0;  // received slot g, sender-major: token-major output row g
    for (int s = 0; s < n; ++s) {
      const From& f = from_[s];
      SlotLimits limits = base_limits;
      limits.row_cap = f.rows;
      for (int64_t j = 0; j < f.slots; ++j, ++g) {
        const uint8_t* slot = SlotIn(s, j);
        SlotHeader header;
        std::memcpy(&header, slot, sizeof header);
        const int64_t row = int64_t{header.row} - f.row_start;
        if (!SlotHeaderValid(header, row, limits)) {
          return Malformed(DataLossError(
              "moe: malformed slot " + std::to_string(j) + " from rank " + std::to_string(s) +
              ": token " + std::to_string(header.src_token) + ", " +
              std::to_string(header.entries) + " entries, part " + std::to_string(header.part) +
              " of " + std::to_string(header.parts) + ", combine row " + std::to_string(row) +
              " of the " + std::to_string(f.rows) + " it expects back"));
        }
        // Every entry checked before any is placed: a bad slot writes nothing.
        if (token_major && g >= c_.expert_capacity()) {
          return Malformed(DataLossError(
              "moe: slot " + std::to_string(j) + " from rank " + std::to_string(s) +
              " is past the " + std::to_string(c_.expert_capacity()) + " token-major rows"));
        }
        SlotEntry* entries = entries_.data();
        int64_t* dst = dst_.data();
        for (int i = 0; i < header.entries; ++i) {
          std::memcpy(&entries[i], slot + sizeof header + i * sizeof(SlotEntry), sizeof(SlotEntry));
          const SlotEntry& entry = entries[i];
          const bool valid = SlotEntryValid(entry, offset_.data(), s, limits);
          dst[i] = valid ? expert_base_[entry.local_expert] +
                               offset_[size_t(s) * l + entry.local_expert] + entry.pos
                         : -1;
          if (!valid || dst[i] >= out_rows) {
            return Malformed(
                DataLossError("moe: slot " + std::to_string(j) + " from rank " + std::to_string(s) +
                              " names local expert " + std::to_string(entry.local_expert) +
                              ", copy " + std::to_string(entry.k) + ", position " +
                              std::to_string(entry.pos) + " among its announced copies"));
          }
        }
        const uint8_t* body = slot + slot_.meta_bytes;
        if (token_major) {
          if (out.source_tokens) out.source_tokens[g] = header.src_token;
          if (out.source_ranks) out.source_ranks[g] = s;
          std::memcpy(static_cast<uint8_t*>(out.x) + g * payload, body, payload);
          if (spt) std::memcpy(out.scales + g * spt, body + payload, spt * 4);
          const int64_t first = int64_t{g} * k;
          if (out.token_experts) std::fill_n(out.token_experts + first, k, -1);
          if (out.token_experts64) std::fill_n(out.token_experts64 + first, k, int64_t{-1});
          std::fill_n(out.token_weights + first, k, 0.0f);
          for (int i = 0; i < header.entries; ++i) {
            const int64_t at = first + entries[i].k;
            if (out.token_experts) out.token_experts[at] = entries[i].local_expert;
            if (out.token_experts64) out.token_experts64[at] = entries[i].local_expert;
            out.token_weights[at] = entries[i].weight;
          }
          // One combine row per slot (options (a) and (b)).
          token_routes_[g] = Route{s, row, 1.0f};
          continue;
        }
        for (int i = 0; i < header.entries; ++i) {
          if (out.source_tokens) out.source_tokens[dst[i]] = header.src_token;
          if (out.source_ranks) out.source_ranks[dst[i]] = s;
          std::memcpy(static_cast<uint8_t*>(out.x) + dst[i] * payload, body, payload);
          if (spt) std::memcpy(out.scales + dst[i] * spt, body + payload, spt * 4);
          // The combine row this copy feeds: its own, or its token's when the expert rank sums.
          const int64_t feeds = row + (c_.combine_reduce_at_expert_rank ? 0 : i);
          routes_[dst[i]] = Route{s, feeds, entries[i].weight};
        }
      }
    }
    if (token_major) *out.num_rows = g;
    for (int e = 0; e < l; ++e) out.num_tokens[e] = offset_[size_t(n) * l + e];
    for (int e = 0; out.sender_ranges && e < l; ++e) {
      for (int s = 0; s < n; ++s) {
        out.sender_ranges[int64_t{e} * n + s] = SenderRange(offset_.data(), l, s, e);
      }
    }
    expert_rows_.assign(out.num_tokens, out.num_tokens + l);
    token_rows_ = g;
    return Status::Ok();
  }

  Status CombineSend(const CombineInput& in, uint64_t epoch) override {
    const int n = c_.world_size, l = c_.local_experts(), h = c_.hidden;
    const auto* expert_out = static_cast<const uint8_t*>(in.expert_out);
    const Elem elem = ElemOf(c_, in.fp16);
    // Sender s's rows, in its numbering from its row start for us.
    row_base_.assign(n + 1, 0);
    for (int s = 0; s < n; ++s) row_base_[s + 1] = row_base_[s] + from_[s].rows;
    const int64_t row_bytes = lay_.row_bytes;
    if (c_.dispatch_layout == DispatchLayout::kTokenMajor) {
      // The caller summed each token's experts: its rows go back as they are.
      for (int32_t i = 0; i < token_rows_; ++i) {
        const Route& route = token_routes_[i];
        std::memcpy(RowOut(route.src, route.row), expert_out + i * row_bytes, row_bytes);
      }
    } else if (c_.combine_reduce_at_expert_rank) {
      // Each returned row is the weighted fp32 sum of our experts' outputs for one token.
      partial_.assign(size_t(row_base_[n]) * h, 0.0f);
      for (int e = 0; e < l; ++e) {
        for (int32_t pos = 0; pos < expert_rows_[e]; ++pos) {
          const int64_t src = expert_base_[e] + pos;
          const Route& route = routes_[src];
          if (route.src < 0) continue;  // announced, never sent: nothing to return
          AddScaledRow(partial_.data() + size_t(row_base_[route.src] + route.row) * h,
                       expert_out + src * row_bytes, route.weight, h, elem);
        }
      }
      for (int s = 0; s < n; ++s) {
        for (int64_t r = 0; r < from_[s].rows; ++r) {
          StoreSums(RowOut(s, r), partial_.data() + size_t(row_base_[s] + r) * h, h, elem);
        }
      }
    } else {
      for (int e = 0; e < l; ++e) {
        for (int32_t pos = 0; pos < expert_rows_[e]; ++pos) {
          const int64_t src = expert_base_[e] + pos;
          const Route& route = routes_[src];
          if (route.src < 0) continue;
          std::memcpy(RowOut(route.src, route.row), expert_out + src * row_bytes, row_bytes);
        }
      }
    }
    RaiseOutbox(true, epoch);
    return Status::Ok();
  }

  Status CombineRecv(const CombineOutput& to, uint64_t epoch, Deadline deadline) override {
    auto* out = static_cast<uint8_t*>(to.out);
    const float* weights = to.weights ? to.weights : weights_.data();
    const int n = c_.world_size, k = c_.experts_per_token, h = c_.hidden;
    const Elem elem = ElemOf(c_, to.fp16);
    const Deadline late = LateBound(deadline);
    for (int r : lay_.remotes) {
      RETURN_IF_ERROR(WaitOrMask(true, r, epoch, deadline, late, to.wait_cost));
    }
    // The output's element: the rows', or fp32 (fp32_out: the sums stored unrounded).
    const Elem out_elem = to.fp32_out ? Elem::kFp32 : elem;
    acc_.assign(size_t(num_tokens_) * h, 0.0f);
    if (to.accumulate) LoadSums(acc_.data(), out, int64_t{num_tokens_} * h, out_elem);
    // Our rows from every expert rank, ourselves included, at their place in our region.
    const uint8_t* region = p_.boxes.inbox + lay_.in_combine_off;
    for (int r = 0; r < n; ++r) {
      // A masked expert rank's copies add nothing (its rows may never have come).
      if (r != c_.rank && Masked(r)) continue;
      const uint8_t* base = region + row_starts_[r] * lay_.row_bytes;
      for (size_t j = 0; j < rows_[r].size(); ++j) {
        const OutRow& row_of = rows_[r][j];
        // A summed row already carries its weights.
        const float w =
            c_.combine_reduce_at_expert_rank ? 1.0f : weights[size_t(row_of.token) * k + row_of.k];
        AddScaledRow(acc_.data() + size_t(row_of.token) * h, base + j * lay_.row_bytes, w, h,
                     elem);
      }
    }
    StoreSums(out, acc_.data(), int64_t{num_tokens_} * h, out_elem);
    return Status::Ok();
  }

  DeviceCaps caps() const override { return {.host_inputs = true}; }

  Status Quantize(const DispatchInput& in, const void** x, const float** scales) override {
    fp8_.Quantize(c_, in, x, scales);
    return Status::Ok();
  }

  // The control block's mask words, which the relay and every step read.
  Status ApplyMasks(const std::vector<uint8_t>& ranks) override {
    for (int r = 0; r < c_.world_size; ++r) {
      if (ranks[r]) lay_.Mask(p_.boxes.control, r, kMaskedByCaller);
    }
    return Status::Ok();
  }
  bool masks_live() const override { return true; }
  bool masked_so_far(int rank) const override { return Masked(rank); }
  StatusOr<std::vector<uint8_t>> Masked() const override {
    std::vector<uint8_t> masks(size_t(c_.world_size));
    for (int r = 0; r < c_.world_size; ++r) masks[r] = Masked(r);
    return masks;
  }

  Status Readmit(Bootstrap& group, const std::vector<uint8_t>& readmitted, uint64_t epoch,
                 std::chrono::milliseconds timeout) override {
    if (!rig_ || !rig_->relay) {
      return FailedPreconditionError("AllToAll::Readmit: no rank outside this one to readmit");
    }
    RETURN_IF_ERROR(rig_->relay->Readmit(group, readmitted, epoch, timeout));
    for (int r = 0; r < c_.world_size; ++r) {
      if (readmitted[r]) lay_.Mask(p_.boxes.control, r, kUnmasked);
    }
    return Status::Ok();
  }

  Status Sticky() override {
    if (p_.relay && p_.relay->failed()) return p_.relay->error();
    return error_;
  }

  uint64_t dispatch_bytes_sent() const override {
    return p_.relay ? p_.relay->dispatch_bytes() : 0;
  }
  uint64_t combine_bytes_sent() const override { return p_.relay ? p_.relay->combine_bytes() : 0; }

 private:
  struct From {  // what sender s's counts row announced to us
    int64_t slots = 0, row_start = 0, rows = 0;
  };
  struct OutRow {
    int32_t token;
    int32_t k;  // the first k of the token for this rank when the expert rank sums
  };
  struct Route {
    int32_t src = -1;  // sending rank
    int64_t row = -1;  // combine row, from the first one that sender expects from us
    float weight = 0;  // used when the expert rank sums
  };

  // The token's copies for rank r (its ids: [K], -1 for none); none for a masked rank.
  int Hits(const int32_t* ids, int r) const {
    if (!send_to_[r]) return 0;
    int hits = 0;
    for (int j = 0; j < c_.experts_per_token; ++j) {
      hits += ids[j] >= 0 && ids[j] / c_.local_experts() == r;
    }
    return hits;
  }
  int Remote(int r) const { return lay_.RemoteIndex(c_.rank, r); }
  // Our section for rank r: its outbox section, or (ourselves) the one kept here.
  uint8_t* SectionOut(int r) {
    return r == c_.rank ? self_section_.data() : p_.boxes.outbox + lay_.OutSection(Remote(r));
  }
  const uint8_t* SectionIn(int s) const {
    return s == c_.rank ? self_section_.data() : p_.boxes.inbox + lay_.InSection(Remote(s));
  }
  int32_t* CountsOut(int r) { return reinterpret_cast<int32_t*>(SectionOut(r)); }
  const int32_t* CountsIn(int s) const { return reinterpret_cast<const int32_t*>(SectionIn(s)); }
  uint8_t* SlotOut(int r, int64_t j) {
    return SectionOut(r) + lay_.counts_bytes + j * slot_.slot_bytes;
  }
  const uint8_t* SlotIn(int s, int64_t j) const {
    return SectionIn(s) + lay_.counts_bytes + j * slot_.slot_bytes;
  }
  // Row `row` (from its row start for us) of the rows sender s expects back: in our outbox
  // section for s, or (ourselves) straight into our combine region.
  uint8_t* RowOut(int s, int64_t row) {
    if (s == c_.rank) {
      return p_.boxes.inbox + lay_.in_combine_off + (from_[s].row_start + row) * lay_.row_bytes;
    }
    return p_.boxes.outbox + lay_.OutRows(Remote(s)) + row * lay_.row_bytes;
  }

  // After the section's bytes (release; the relay acquires before it reads them).
  void RaiseOutbox(bool combine, uint64_t epoch) {
    std::atomic_ref<uint64_t>(*lay_.OutboxFlag(p_.boxes.control, combine))
        .store(epoch + 1, std::memory_order_release);
  }

  // Under mask_lost_peers with heartbeats to ask (DeviceParams::heard): how long a sender heard
  // from is waited for past `deadline` -- kLateWaits more of the step's wait (the deadline's
  // distance from the receive call, now). Else the deadline itself.
  Deadline LateBound(Deadline deadline) const {
    if (!c_.mask_lost_peers || !p_.heard) return deadline;
    return {deadline.at + kLateWaits * std::max(deadline.at - Clock::now(), Clock::duration{})};
  }

  // Until rank s's dispatch section (or combine rows) of this epoch landed, the relay failed, or
  // the deadline passed -- or, past it, `late` passed or s fell silent (a sender heard from is
  // late, not lost: DeviceParams::heard).
  Status WaitInbox(bool combine, int s, uint64_t epoch, Deadline deadline, Deadline late) {
    std::atomic_ref<uint64_t> flag(p_.boxes.inbox_flags[(combine ? c_.world_size : 0) + s]);
    Backoff backoff;
    for (;;) {
      const uint64_t seen = flag.load(std::memory_order_acquire);
      if (seen > epoch) return Status::Ok();
      if (p_.relay && p_.relay->failed()) return p_.relay->error();
      const Clock::time_point now = Clock::now();
      if (deadline.Expired(now) && (late.Expired(now) || !p_.heard || !p_.heard(s))) {
        return DeadlineExceededError(std::string("moe: waiting for rank ") + std::to_string(s) +
                                     "'s " + (combine ? "combine rows" : "dispatch section") +
                                     " of epoch " + std::to_string(epoch) + " (its flag holds " +
                                     std::to_string(seen) + ")");
      }
      backoff.Pause();
    }
  }

  bool Masked(int r) const { return lay_.Masked(p_.boxes.control, r); }

  // WaitInbox, where under mask_lost_peers a sender that missed the deadline (or, heard from,
  // `late`) is masked instead, and the step goes on without it. The nanoseconds it waited are
  // added to cost[s] (the step's wait_cost, if given): the ranks are waited for one after the
  // other, so each is charged what it kept the step waiting beyond the ranks before it.
  Status WaitOrMask(bool combine, int s, uint64_t epoch, Deadline deadline, Deadline late,
                    int64_t* cost) {
    if (Masked(s)) return Status::Ok();
    const auto start = std::chrono::steady_clock::now();
    Status waited = WaitInbox(combine, s, epoch, deadline, late);
    if (cost) {
      cost[s] += std::chrono::duration_cast<std::chrono::nanoseconds>(
                     std::chrono::steady_clock::now() - start)
                     .count();
    }
    if (waited.code() != StatusCode::kDeadlineExceeded || !c_.mask_lost_peers) return waited;
    lay_.Mask(p_.boxes.control, s, kMaskedLost);
    const std::string why(waited.message());
    std::fprintf(stderr, "[rank %d] moe: rank %d masked (mask_lost_peers): %s\n", c_.rank, s,
                 why.c_str());
    return Status::Ok();
  }

  Status Malformed(const Status& s) {
    if (error_.ok()) error_ = s;
    return s;
  }

  const std::unique_ptr<HostRig> rig_;  // CreateHostDevice's: what p_ points into, freed last
  const DeviceParams p_;
  const AllToAllConfig& c_;  // p_.config
  const RelayLayout& lay_;
  const SlotFormat slot_;
  std::vector<uint8_t> self_section_;  // our counts row and slots for ourselves
  Status error_;
  int num_tokens_ = 0;
  std::vector<char> send_to_ = std::vector<char>(size_t(c_.world_size), 1);  // unmasked ranks
  std::vector<float> weights_;                                    // [T, K] of the current epoch
  std::vector<std::vector<OutRow>> rows_{size_t(c_.world_size)};  // per expert rank, in order
  std::vector<int64_t> row_starts_;  // [N + 1] our combine rows per expert rank
  std::vector<From> from_;           // [N] per sender
  std::vector<SlotEntry> entries_ = std::vector<SlotEntry>(size_t(c_.experts_per_token));
  std::vector<int64_t> dst_ = std::vector<int64_t>(size_t(c_.experts_per_token));  // their rows
  std::vector<int32_t> offset_;       // [N + 1, L] copies of each expert from senders before
  std::vector<Route> routes_;         // [output rows] where each received row came from
  std::vector<int32_t> expert_rows_;  // [L]
  std::vector<int64_t> expert_base_;  // [L] each local expert's first output row
  std::vector<Route> token_routes_;   // token-major: [capacity] the same per output row
  int32_t token_rows_ = 0;            // token-major: rows of the last DispatchRecv
  std::vector<int64_t> row_base_;     // [N + 1] senders' rows in partial_
  std::vector<float> partial_;        // [rows, hidden] fp32 sums at the expert rank
  std::vector<float> acc_;            // [T, hidden] fp32 accumulator
  HostFp8Rows fp8_;                   // DispatchInput::x_bf16 quantised (Quantize)
};

}  // namespace

std::unique_ptr<MoeDevice> NewHostDevice(const DeviceParams& params) {
  return std::make_unique<HostDevice>(params);
}

StatusOr<std::unique_ptr<MoeDevice>> CreateHostDevice(const AllToAllConfig& c,
                                                      TransferEngine* engine,
                                                      Bootstrap& bootstrap,
                                                      uint64_t first_epoch,
                                                      bool adopt_counters,
                                                      std::function<bool(int)> heard) {
  auto rig = std::make_unique<HostRig>(c);
  const RelayBuffers boxes = rig->boxes.buffers();
  if (!rig->layout.remotes.empty()) {
    ASSIGN_OR_RETURN(rig->relay, Relay::Create(c, rig->layout, engine, bootstrap, boxes, 60000,
                                               first_epoch, adopt_counters));
  } else {
    // One rank: nothing crosses, but the instance is still this AllToAll's on its engine (each
    // AllToAll on an engine has its own), claimed by a counter no relay creates.
    Status s = engine->CreateImmCounter(RelayImm(kRelayDispatch, 0, c.instance, c.rank));
    if (adopt_counters && s.code() == StatusCode::kAlreadyExists) s = Status::Ok();
    if (!s.ok()) return CounterError(s, c.instance);
  }
  const DeviceParams params{c, &rig->layout, boxes, rig->relay.get(), std::move(heard)};
  return std::unique_ptr<MoeDevice>(std::make_unique<HostDevice>(params, std::move(rig)));
}

}  // namespace ferry::moe
