// The host device: the four steps of dispatch and combine on the CPU, on host memory. It is the
// reference the CUDA kernels are checked against and the device CI runs the protocol with.
#include <cstring>
#include <string>
#include <vector>

#include "common/backoff.h"
#include "moe/device.h"

namespace ferry::moe {

Status WaitForProxy(Channel& channel, const std::atomic<uint64_t>& flag, const char* name,
                    uint64_t epoch, Deadline deadline) {
  Backoff backoff;
  for (;;) {
    uint64_t seen = flag.load(std::memory_order_acquire);
    if (seen > epoch) return Status::Ok();
    if (channel.failed.load(std::memory_order_acquire)) return channel.Error();
    if (deadline.Expired()) {
      return DeadlineExceededError(std::string("moe: waiting for the proxy's ") + name +
                                   " of epoch " + std::to_string(epoch) + " (flag holds " +
                                   std::to_string(seen) + ")");
    }
    backoff.Pause();
  }
}

namespace {

class HostDevice final : public MoeDevice {
 public:
  explicit HostDevice(const DeviceParams& p) : p_(p), layout_(p.config) {}

  Status DispatchSend(const DispatchInput& in, uint64_t epoch) override {
    const AllToAllConfig& c = p_.config;
    const int n = c.world_size, k = c.experts_per_token, l = c.local_experts();
    num_tokens_ = in.num_tokens;
    weights_.assign(in.weights, in.weights + size_t(in.num_tokens) * k);
    // Route: per receiving rank, its slots (a token with its entries for that rank) and the
    // combine rows it will return, both in token order.
    slots_.resize(n);
    rows_.resize(n);
    for (int r = 0; r < n; ++r) {
      slots_[r].clear();
      rows_[r].clear();
    }
    entries_.clear();
    auto* counts = reinterpret_cast<int32_t*>(p_.send + layout_.send_counts_off);
    std::fill(counts, counts + layout_.counts_per_rank, 0);
    for (int t = 0; t < in.num_tokens; ++t) {
      for (int r = 0; r < n; ++r) {
        bool first = true;
        for (int j = 0; j < k; ++j) {
          const int32_t e = in.indices[size_t(t) * k + j];
          if (e < 0 || e / l != r) continue;  // -1: no expert, nothing sent or summed
          ++counts[e];
          if (first || !c.dispatch_once_per_rank) {
            slots_[r].push_back({t, static_cast<int32_t>(entries_.size()), 0});
          }
          if (first || !c.combine_reduce_at_expert_rank) rows_[r].push_back({t, j});
          entries_.push_back({e % l, j, in.weights[size_t(t) * k + j]});
          ++slots_[r].back().entries;
          first = false;
        }
      }
    }
    for (int r = 0; r < n; ++r) {
      counts[c.num_experts + r] = static_cast<int32_t>(slots_[r].size());
      counts[c.num_experts + n + r] = static_cast<int32_t>(rows_[r].size());
    }
    p_.channel->route_ready.store(epoch + 1, std::memory_order_release);
    // Pack, receiver by receiver.
    const int64_t payload = c.token_bytes(), spt = c.scales_per_token();
    int64_t slot_index = 0;
    for (int r = 0; r < n; ++r) {
      for (const OutSlot& os : slots_[r]) {
        uint8_t* slot = p_.send + layout_.send_dispatch_off + slot_index++ * layout_.slot_bytes;
        const SlotHeader header{os.token, os.entries};
        std::memcpy(slot, &header, sizeof header);
        std::memcpy(slot + sizeof header, &entries_[os.first_entry],
                    size_t(os.entries) * sizeof(SlotEntry));
        uint8_t* body = slot + layout_.meta_bytes;
        std::memcpy(body, static_cast<const uint8_t*>(in.x) + int64_t{os.token} * payload, payload);
        if (spt) std::memcpy(body + payload, in.scales + int64_t{os.token} * spt, spt * 4);
      }
    }
    p_.channel->send_ready.store(epoch + 1, std::memory_order_release);
    return Status::Ok();
  }

  Status DispatchRecv(const DispatchOutput& out, uint64_t epoch, Deadline deadline) override {
    const AllToAllConfig& c = p_.config;
    const int n = c.world_size, me = c.rank, l = c.local_experts(), k = c.experts_per_token;
    const int64_t priv = c.max_private_tokens, slot_bytes = layout_.slot_bytes;
    RETURN_IF_ERROR(
        WaitForProxy(*p_.channel, p_.channel->recv_ready, "recv-ready", epoch, deadline));
    const Routing& routing = *p_.routing;
    const bool token_major = c.dispatch_layout == DispatchLayout::kTokenMajor;
    std::fill(out.num_tokens, out.num_tokens + l, 0);
    if (token_major) {
      token_routes_.assign(size_t(c.expert_capacity()), Route{});
    } else {
      routes_.assign(size_t(out.expert_padding ? c.padded_rows(out.expert_padding)
                                               : l * c.expert_capacity()),
                     Route{});
    }
    // Where each local expert's rows start: its block of capacity rows, or (padded) after the
    // rounded-up blocks of the experts before it, from every sender's counts.
    // Peers' announced counts size the blocks, so each is checked, and each expert's rows are
    // held to its count (expert_limit_) as they are placed: nothing lands outside x.
    expert_base_.assign(l, 0);
    expert_limit_.assign(l, c.expert_capacity());
    if (const int p = out.expert_padding; p > 0) {
      int64_t next = 0;
      for (int e = 0; e < l; ++e) {
        int64_t rows = 0;
        for (int s = 0; s < n; ++s) {
          const int64_t announced = routing.row(s)[me * l + e];
          if (announced < 0 || announced > c.max_tokens_per_rank) {
            return Malformed(DataLossError(
                "moe: rank " + std::to_string(s) + " announces " + std::to_string(announced) +
                " tokens for local expert " + std::to_string(e) + " (at most " +
                std::to_string(c.max_tokens_per_rank) + ")"));
          }
          rows += announced;
        }
        expert_base_[e] = next;
        expert_limit_[e] = rows;
        next += (rows + p - 1) / p * p;
      }
      if (next > c.padded_rows(p)) {
        return Malformed(DataLossError("moe: the announced counts take " + std::to_string(next) +
                                       " padded rows, more than the " +
                                       std::to_string(c.padded_rows(p)) + " any routing can"));
      }
    } else {
      for (int e = 0; e < l; ++e) expert_base_[e] = int64_t{e} * c.expert_capacity();
    }
    int32_t num_rows = 0;
    const int64_t payload = c.token_bytes(), spt = c.scales_per_token();
    const int64_t own_start = routing.SlotStart(me, me);
    // Sender by sender, each in its send order; our own slots straight from the send area.
    for (int s = 0; s < n; ++s) {
      const int64_t slots = routing.Slots(s, me), rows = routing.Rows(s, me);
      const int64_t overflow_start = routing.OverflowStart(s, me);
      int64_t row = -1;
      int32_t last_token = -1;
      for (int64_t j = 0; j < slots; ++j) {
        const uint8_t* slot;
        if (s == me) {
          slot = p_.send + layout_.send_dispatch_off + (own_start + j) * slot_bytes;
        } else if (j < priv) {
          slot = p_.recv + layout_.private_off + (int64_t{s} * priv + j) * slot_bytes;
        } else {
          slot = p_.recv + layout_.overflow_off + (overflow_start + j - priv) * slot_bytes;
        }
        SlotHeader header;
        std::memcpy(&header, slot, sizeof header);
        if (header.entries < 1 || header.entries > k || header.src_token < 0 ||
            header.src_token >= c.max_tokens_per_rank) {
          return Malformed(DataLossError("moe: malformed slot " + std::to_string(j) +
                                         " from rank " + std::to_string(s)));
        }
        const uint8_t* body = slot + layout_.meta_bytes;
        // Token-major: the slot is one output row, whatever its entries.
        const int64_t token_row = num_rows;
        if (token_major) {
          ++num_rows;
          std::memcpy(static_cast<uint8_t*>(out.x) + token_row * payload, body, payload);
          if (spt) std::memcpy(out.scales + token_row * spt, body + payload, spt * 4);
          std::fill_n(out.token_experts + token_row * k, k, -1);
          std::fill_n(out.token_weights + token_row * k, k, 0.0f);
        }
        for (int i = 0; i < header.entries; ++i) {
          SlotEntry entry;
          std::memcpy(&entry, slot + sizeof header + i * sizeof(SlotEntry), sizeof entry);
          // The combine row this copy feeds: its own, or its token's when the expert rank sums.
          if (!c.combine_reduce_at_expert_rank || header.src_token != last_token) ++row;
          last_token = header.src_token;
          if (entry.local_expert < 0 || entry.local_expert >= l || entry.k < 0 || entry.k >= k ||
              row >= rows) {
            return Malformed(DataLossError(
                "moe: slot " + std::to_string(j) + " from rank " + std::to_string(s) +
                " names local expert " + std::to_string(entry.local_expert) + ", copy " +
                std::to_string(entry.k) + " or overruns its " + std::to_string(rows) + " rows"));
          }
          const int32_t pos = out.num_tokens[entry.local_expert]++;
          if (pos >= expert_limit_[entry.local_expert]) {
            return Malformed(DataLossError(
                "moe: rank " + std::to_string(s) + " sends local expert " +
                std::to_string(entry.local_expert) + " more copies than announced or fit (" +
                std::to_string(expert_limit_[entry.local_expert]) + ")"));
          }
          if (token_major) {
            out.token_experts[token_row * k + entry.k] = entry.local_expert;
            out.token_weights[token_row * k + entry.k] = entry.weight;
            continue;
          }
          const int64_t dst = expert_base_[entry.local_expert] + pos;
          std::memcpy(static_cast<uint8_t*>(out.x) + dst * payload, body, payload);
          if (spt) std::memcpy(out.scales + dst * spt, body + payload, spt * 4);
          routes_[dst] = Route{s, row, entry.weight};
        }
        // One combine row per slot (options (a) and (b)): the one its entries counted.
        if (token_major) token_routes_[token_row] = Route{s, row, 1.0f};
      }
    }
    if (token_major) *out.num_rows = num_rows;
    expert_rows_.assign(out.num_tokens, out.num_tokens + l);
    token_rows_ = num_rows;
    p_.channel->recv_consumed.store(epoch + 1, std::memory_order_release);
    return Status::Ok();
  }

  Status CombineSend(const uint16_t* expert_out, uint64_t epoch) override {
    const AllToAllConfig& c = p_.config;
    const int n = c.world_size, me = c.rank, l = c.local_experts(), h = c.hidden;
    const Routing& routing = *p_.routing;
    // Rows for sender s, in s's send order, after those of lower ranks.
    row_start_.assign(n + 1, 0);
    for (int s = 0; s < n; ++s) row_start_[s + 1] = row_start_[s] + routing.Rows(s, me);
    uint8_t* area = p_.send + layout_.send_combine_off;
    if (c.dispatch_layout == DispatchLayout::kTokenMajor) {
      // The caller summed each token's experts: its rows go back as they are.
      for (int32_t i = 0; i < token_rows_; ++i) {
        const Route& route = token_routes_[i];
        std::memcpy(area + (row_start_[route.src] + route.row) * layout_.row_bytes,
                    expert_out + int64_t{i} * h, layout_.row_bytes);
      }
    } else if (c.combine_reduce_at_expert_rank) {
      // Each returned row is the weighted fp32 sum of our experts' outputs for one token.
      partial_.assign(size_t(row_start_[n]) * h, 0.0f);
      for (int e = 0; e < l; ++e) {
        for (int32_t pos = 0; pos < expert_rows_[e]; ++pos) {
          const int64_t src = expert_base_[e] + pos;
          const Route& route = routes_[src];
          float* acc = partial_.data() + size_t(row_start_[route.src] + route.row) * h;
          const uint16_t* y = expert_out + src * h;
          for (int i = 0; i < h; ++i) acc[i] += route.weight * Bf16ToFloat(y[i]);
        }
      }
      auto* rows = reinterpret_cast<uint16_t*>(area);
      for (size_t i = 0; i < partial_.size(); ++i) rows[i] = FloatToBf16(partial_[i]);
    } else {
      for (int e = 0; e < l; ++e) {
        for (int32_t pos = 0; pos < expert_rows_[e]; ++pos) {
          const int64_t src = expert_base_[e] + pos;
          const Route& route = routes_[src];
          std::memcpy(area + (row_start_[route.src] + route.row) * layout_.row_bytes,
                      expert_out + src * h, layout_.row_bytes);
        }
      }
    }
    p_.channel->combine_ready.store(epoch + 1, std::memory_order_release);
    return Status::Ok();
  }

  Status CombineRecv(const CombineOutput& to, uint64_t epoch, Deadline deadline) override {
    uint16_t* out = to.out;
    const bool accumulate = to.accumulate;
    const float* weights = to.weights ? to.weights : weights_.data();
    const AllToAllConfig& c = p_.config;
    const int n = c.world_size, me = c.rank, k = c.experts_per_token, h = c.hidden;
    RETURN_IF_ERROR(
        WaitForProxy(*p_.channel, p_.channel->combine_done, "combine-done", epoch, deadline));
    const Routing& routing = *p_.routing;
    acc_.assign(size_t(num_tokens_) * h, 0.0f);
    if (accumulate) {
      for (size_t i = 0; i < acc_.size(); ++i) acc_[i] = Bf16ToFloat(out[i]);
    }
    for (int r = 0; r < n; ++r) {
      // Rows we returned to ourselves never left: they sit in our combine send area.
      const uint8_t* base =
          r == me ? p_.send + layout_.send_combine_off + row_start_[me] * layout_.row_bytes
                  : p_.recv + layout_.combine_off + routing.RowStart(me, r) * layout_.row_bytes;
      for (size_t j = 0; j < rows_[r].size(); ++j) {
        const OutRow& row_of = rows_[r][j];
        // A summed row already carries its weights.
        const float w =
            c.combine_reduce_at_expert_rank ? 1.0f : weights[size_t(row_of.token) * k + row_of.k];
        const auto* row = reinterpret_cast<const uint16_t*>(base + j * layout_.row_bytes);
        float* dst = acc_.data() + size_t(row_of.token) * h;
        for (int i = 0; i < h; ++i) dst[i] += w * Bf16ToFloat(row[i]);
      }
    }
    for (size_t i = 0; i < acc_.size(); ++i) out[i] = FloatToBf16(acc_[i]);
    p_.channel->combine_consumed.store(epoch + 1, std::memory_order_release);
    return Status::Ok();
  }

 private:
  // A slot that cannot have come from a well-behaved peer: the epoch cannot be finished (its
  // combine rows would go to the wrong places), so every later step reports it too.
  Status Malformed(const Status& s) {
    p_.channel->Fail(s);
    return s;
  }

  struct OutSlot {
    int32_t token;
    int32_t first_entry;  // into entries_
    int32_t entries;
  };
  struct OutRow {
    int32_t token;
    int32_t k;  // the first k of the token for this rank when the expert rank sums
  };
  struct Route {
    int32_t src = -1;  // sending rank
    int64_t row = -1;  // combine row, in that sender's order
    float weight = 0;  // used when the expert rank sums
  };

  const DeviceParams p_;
  const MoeLayout layout_;
  int num_tokens_ = 0;
  std::vector<float> weights_;               // [T, K] of the current iteration
  std::vector<std::vector<OutSlot>> slots_;  // per receiving rank, in send order
  std::vector<std::vector<OutRow>> rows_;    // per expert rank, the rows it returns, in order
  std::vector<SlotEntry> entries_;           // what the slots carry
  std::vector<Route> routes_;                // [L, capacity] where each received row came from
  std::vector<int32_t> expert_rows_;         // [L]
  std::vector<int64_t> expert_base_;         // [L] each local expert's first output row
  std::vector<int64_t> expert_limit_;        // [L] the rows its block holds
  std::vector<Route> token_routes_;          // token-major: [capacity] the same per output row
  int32_t token_rows_ = 0;                   // token-major: rows of the last DispatchRecv
  std::vector<int64_t> row_start_;           // [N + 1] combine rows per sender, in our send area
  std::vector<float> partial_;               // [rows, hidden] fp32 sums at the expert rank
  std::vector<float> acc_;                   // [T, hidden] fp32 accumulator
};

}  // namespace

std::unique_ptr<MoeDevice> NewHostDevice(const DeviceParams& params) {
  return std::make_unique<HostDevice>(params);
}

}  // namespace ferry::moe
