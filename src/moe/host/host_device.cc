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
    // Route: copies grouped by receiving rank, in (token, k) order; counts per expert.
    for (auto& list : sent_) list.clear();
    sent_.resize(n);
    auto* counts = reinterpret_cast<int32_t*>(p_.send + layout_.send_counts_off);
    std::fill(counts, counts + c.num_experts, 0);
    for (int t = 0; t < in.num_tokens; ++t) {
      for (int j = 0; j < k; ++j) {
        const int32_t e = in.indices[size_t(t) * k + j];
        sent_[e / l].push_back({t, j, e % l});
        ++counts[e];
      }
    }
    p_.channel->route_ready.store(epoch + 1, std::memory_order_release);
    // Pack, receiver by receiver.
    const int64_t payload = c.token_bytes(), spt = c.scales_per_token();
    int64_t slot_index = 0;
    for (int r = 0; r < n; ++r) {
      for (const Copy& cp : sent_[r]) {
        uint8_t* slot = p_.send + layout_.send_dispatch_off + slot_index++ * layout_.slot_bytes;
        const SlotMeta meta{cp.token, cp.k, cp.local_expert, 0};
        std::memcpy(slot, &meta, sizeof meta);
        std::memcpy(slot + sizeof meta,
                    static_cast<const uint8_t*>(in.x) + int64_t{cp.token} * payload, payload);
        if (spt) {
          std::memcpy(slot + sizeof meta + payload, in.scales + int64_t{cp.token} * spt, spt * 4);
        }
      }
    }
    p_.channel->send_ready.store(epoch + 1, std::memory_order_release);
    return Status::Ok();
  }

  Status DispatchRecv(const DispatchOutput& out, uint64_t epoch, Deadline deadline) override {
    const AllToAllConfig& c = p_.config;
    const int n = c.world_size, me = c.rank, l = c.local_experts();
    const int64_t priv = c.max_private_tokens, slot_bytes = layout_.slot_bytes;
    RETURN_IF_ERROR(WaitForProxy(*p_.channel, p_.channel->recv_ready, "recv-ready", epoch,
                                 deadline));
    const Routing& routing = *p_.routing;
    std::fill(out.num_tokens, out.num_tokens + l, 0);
    routes_.assign(size_t(l) * c.expert_capacity(), Route{});
    const int64_t payload = c.token_bytes(), spt = c.scales_per_token();
    const int64_t own_start = routing.SendStart(me, me);
    // Sender by sender, each in its send order; our own copies straight from the send area.
    for (int s = 0; s < n; ++s) {
      const int64_t copies = routing.Copies(s, me);
      const int64_t overflow_start = routing.OverflowStart(s, me);
      for (int64_t j = 0; j < copies; ++j) {
        const uint8_t* slot;
        if (s == me) {
          slot = p_.send + layout_.send_dispatch_off + (own_start + j) * slot_bytes;
        } else if (j < priv) {
          slot = p_.recv + layout_.private_off + (int64_t{s} * priv + j) * slot_bytes;
        } else {
          slot = p_.recv + layout_.overflow_off + (overflow_start + j - priv) * slot_bytes;
        }
        SlotMeta meta;
        std::memcpy(&meta, slot, sizeof meta);
        if (meta.local_expert < 0 || meta.local_expert >= l) {
          return DataLossError("moe: slot from rank " + std::to_string(s) +
                               " names local expert " + std::to_string(meta.local_expert));
        }
        const int32_t row = out.num_tokens[meta.local_expert]++;
        const int64_t dst = int64_t{meta.local_expert} * c.expert_capacity() + row;
        std::memcpy(static_cast<uint8_t*>(out.x) + dst * payload, slot + sizeof meta, payload);
        if (spt) std::memcpy(out.scales + dst * spt, slot + sizeof meta + payload, spt * 4);
        routes_[dst] = Route{s, j};
      }
    }
    expert_rows_.assign(out.num_tokens, out.num_tokens + l);
    p_.channel->recv_consumed.store(epoch + 1, std::memory_order_release);
    return Status::Ok();
  }

  Status CombineSend(const uint16_t* expert_out, uint64_t epoch) override {
    const AllToAllConfig& c = p_.config;
    const int n = c.world_size, me = c.rank, l = c.local_experts();
    const Routing& routing = *p_.routing;
    // Rows for sender s, in s's send order, after those of lower ranks.
    row_start_.assign(n + 1, 0);
    for (int s = 0; s < n; ++s) row_start_[s + 1] = row_start_[s] + routing.Copies(s, me);
    for (int e = 0; e < l; ++e) {
      for (int32_t row = 0; row < expert_rows_[e]; ++row) {
        const int64_t src = int64_t{e} * c.expert_capacity() + row;
        const Route& route = routes_[src];
        std::memcpy(p_.send + layout_.send_combine_off +
                        (row_start_[route.src] + route.copy) * layout_.row_bytes,
                    expert_out + src * c.hidden, layout_.row_bytes);
      }
    }
    p_.channel->combine_ready.store(epoch + 1, std::memory_order_release);
    return Status::Ok();
  }

  Status CombineRecv(uint16_t* out, bool accumulate, uint64_t epoch, Deadline deadline) override {
    const AllToAllConfig& c = p_.config;
    const int n = c.world_size, me = c.rank, k = c.experts_per_token, h = c.hidden;
    RETURN_IF_ERROR(WaitForProxy(*p_.channel, p_.channel->combine_done, "combine-done", epoch,
                                 deadline));
    const Routing& routing = *p_.routing;
    acc_.assign(size_t(num_tokens_) * h, 0.0f);
    if (accumulate) {
      for (size_t i = 0; i < acc_.size(); ++i) acc_[i] = Bf16ToFloat(out[i]);
    }
    for (int r = 0; r < n; ++r) {
      // Our copies to ourselves never left: they sit in our combine send area.
      const uint8_t* base =
          r == me ? p_.send + layout_.send_combine_off + row_start_[me] * layout_.row_bytes
                  : p_.recv + layout_.combine_off + routing.SendStart(me, r) * layout_.row_bytes;
      for (size_t j = 0; j < sent_[r].size(); ++j) {
        const Copy& cp = sent_[r][j];
        const float w = weights_[size_t(cp.token) * k + cp.k];
        const auto* row = reinterpret_cast<const uint16_t*>(base + j * layout_.row_bytes);
        float* dst = acc_.data() + size_t(cp.token) * h;
        for (int i = 0; i < h; ++i) dst[i] += w * Bf16ToFloat(row[i]);
      }
    }
    for (size_t i = 0; i < acc_.size(); ++i) out[i] = FloatToBf16(acc_[i]);
    p_.channel->combine_consumed.store(epoch + 1, std::memory_order_release);
    return Status::Ok();
  }

 private:
  struct Copy {
    int32_t token;
    int32_t k;
    int32_t local_expert;
  };
  struct Route {
    int32_t src = -1;   // sending rank
    int64_t copy = -1;  // index in that rank's list for us
  };

  const DeviceParams p_;
  const MoeLayout layout_;
  int num_tokens_ = 0;
  std::vector<float> weights_;           // [T, K] of the current iteration
  std::vector<std::vector<Copy>> sent_;  // per receiving rank, in send order
  std::vector<Route> routes_;            // [L, capacity] where each received row came from
  std::vector<int32_t> expert_rows_;     // [L]
  std::vector<int64_t> row_start_;       // [N + 1] combine rows per sender, in our send area
  std::vector<float> acc_;               // [T, hidden] fp32 accumulator
};

}  // namespace

std::unique_ptr<MoeDevice> NewHostDevice(const DeviceParams& params) {
  return std::make_unique<HostDevice>(params);
}

}  // namespace ferry::moe
