#include "moe/proxy.h"

#include <cstring>
#include <string>

#include "common/backoff.h"
#include "common/leak.h"

namespace ferry::moe {

Proxy::Proxy(const ProxyParams& params) : p_(params), layout_(params.config) {
  targets_.reserve(p_.config.world_size);
  thread_ = std::thread([this] { Main(); });
}

Proxy::~Proxy() { Quiesce(); }

bool Proxy::Quiesce() {
  stop_.store(true, std::memory_order_release);
  if (thread_.joinable()) thread_.join();
  // Writes still in flight read our targets and the send region.
  if (writes_.Drain(std::chrono::milliseconds(p_.peer_timeout_ms))) return true;
  LeakOnPurpose(new std::vector<std::vector<ScatterTarget>>(std::move(posted_)));  // still read
  return false;
}

void Proxy::Main() {
  for (uint64_t epoch = 0;; ++epoch) {
    Status s = Dispatch(epoch);
    if (s.ok()) s = Combine(epoch);
    if (!s.ok()) {
      if (s.code() != StatusCode::kCancelled) {
        p_.channel->Fail(s.WithContext("moe proxy, rank " + std::to_string(p_.config.rank) +
                                       ", epoch " + std::to_string(epoch)));
      }
      return;
    }
  }
}

Status Proxy::Dispatch(uint64_t epoch) {
  const AllToAllConfig& c = p_.config;
  const int n = c.world_size, me = c.rank;
  const int64_t priv = c.max_private_tokens, slot = layout_.slot_bytes;
  Routing& routing = *p_.routing;

  RETURN_IF_ERROR(WaitDevice(p_.channel->route_ready, epoch));
  // Our counts, as the device left them; our row of the routing table.
  const size_t row_bytes = size_t(routing.width()) * 4;
  std::memcpy(routing.row(me), p_.send + layout_.send_counts_off, row_bytes);
  // Every peer has read what we wrote last epoch before we write again.
  if (epoch > 0) RETURN_IF_ERROR(AwaitPeers(kDispatchConsumed, epoch - 1, n - 1));
  dispatch_bytes_.store(0, std::memory_order_relaxed);
  targets_.clear();
  for (int r = 0; r < n; ++r) {
    if (r == me) continue;
    targets_.push_back({Member(r), uint64_t(layout_.send_counts_off),
                        uint64_t(layout_.counts_off) + uint64_t(me) * row_bytes, row_bytes});
  }
  RETURN_IF_ERROR(Post(kCounts, epoch));

  // Private part: the first P slots for each receiver, at once, without waiting for routes.
  RETURN_IF_ERROR(WaitDevice(p_.channel->send_ready, epoch));
  targets_.clear();
  for (int r = 0; r < n; ++r) {
    if (r == me) continue;
    int64_t count = std::min<int64_t>(routing.Slots(me, r), priv);
    targets_.push_back({Member(r),
                        uint64_t(layout_.send_dispatch_off + routing.SlotStart(me, r) * slot),
                        uint64_t(layout_.private_off + int64_t{me} * priv * slot),
                        uint64_t(count * slot)});
  }
  RETURN_IF_ERROR(Post(kPrivate, epoch));

  // Every rank's routing: now the rest can go, one write per receiver at its computed offset.
  RETURN_IF_ERROR(AwaitPeers(kCounts, epoch, n - 1));
  for (int s = 0; s < n; ++s) {
    if (s == me) continue;
    std::memcpy(routing.row(s), p_.recv + layout_.counts_off + int64_t{s} * row_bytes,
                row_bytes);
    RETURN_IF_ERROR(CheckCountsRow(c, layout_, routing, s, me));
  }
  targets_.clear();
  uint64_t overflow_in = 0;
  for (int r = 0; r < n; ++r) {
    if (r == me) continue;
    if (routing.Slots(r, me) > priv) ++overflow_in;
    int64_t sent = routing.Slots(me, r);
    if (sent <= priv) continue;
    targets_.push_back({Member(r),
                        uint64_t(layout_.send_dispatch_off +
                                 (routing.SlotStart(me, r) + priv) * slot),
                        uint64_t(layout_.overflow_off + routing.OverflowStart(me, r) * slot),
                        uint64_t((sent - priv) * slot)});
  }
  RETURN_IF_ERROR(Post(kOverflow, epoch));

  // What lands here: a private write from every peer, an overflow write from each peer that
  // sent more than P copies. Then our own writes, so the device may refill the send area.
  RETURN_IF_ERROR(AwaitPeers(kPrivate, epoch, n - 1));
  RETURN_IF_ERROR(AwaitPeers(kOverflow, epoch, overflow_in));
  RETURN_IF_ERROR(WaitOwnWrites());
  p_.channel->recv_ready.store(epoch + 1, std::memory_order_release);

  RETURN_IF_ERROR(WaitDevice(p_.channel->recv_consumed, epoch));
  return Barrier(kDispatchConsumed, epoch);
}

Status Proxy::Combine(uint64_t epoch) {
  const AllToAllConfig& c = p_.config;
  const int n = c.world_size, me = c.rank;
  const int64_t row = layout_.row_bytes;
  const Routing& routing = *p_.routing;

  RETURN_IF_ERROR(WaitDevice(p_.channel->combine_ready, epoch));
  if (epoch > 0) RETURN_IF_ERROR(AwaitPeers(kCombineConsumed, epoch - 1, n - 1));
  // The device packed the rows for sender s after those for lower ranks, in s's order; they
  // land in s's combine region after the rows of lower expert ranks.
  combine_bytes_.store(0, std::memory_order_relaxed);
  targets_.clear();
  int64_t start = 0;
  for (int s = 0; s < n; ++s) {
    const int64_t rows = routing.Rows(s, me);
    if (s != me) {
      targets_.push_back({Member(s), uint64_t(layout_.send_combine_off + start * row),
                          uint64_t(layout_.combine_off + routing.RowStart(s, me) * row),
                          uint64_t(rows * row)});
    }
    start += rows;
  }
  RETURN_IF_ERROR(Post(kCombine, epoch));
  RETURN_IF_ERROR(AwaitPeers(kCombine, epoch, n - 1));
  RETURN_IF_ERROR(WaitOwnWrites());
  p_.channel->combine_done.store(epoch + 1, std::memory_order_release);

  RETURN_IF_ERROR(WaitDevice(p_.channel->combine_consumed, epoch));
  return Barrier(kCombineConsumed, epoch);
}

Status Proxy::WaitDevice(const std::atomic<uint64_t>& flag, uint64_t epoch) {
  Backoff backoff(256, 1024, 50);
  while (flag.load(std::memory_order_acquire) <= epoch) {
    if (stop_.load(std::memory_order_acquire)) return CancelledError("proxy stopped");
    backoff.Pause();
  }
  return Status::Ok();
}

Status Proxy::AwaitPeers(ImmKind kind, uint64_t epoch, uint64_t count) {
  if (count == 0) return Status::Ok();
  const uint32_t imm = MoeImm(kind, epoch, p_.config.instance);
  const Deadline deadline = Deadline::After(std::chrono::milliseconds(p_.peer_timeout_ms));
  // Short slices, so that a stop request is seen promptly.
  for (;;) {
    Deadline slice = Deadline::After(std::chrono::milliseconds(20));
    if (deadline.at < slice.at) slice = deadline;
    Status s = p_.engine->WaitImm(imm, count, slice);
    if (s.ok()) break;
    if (s.code() != StatusCode::kDeadlineExceeded) return s;
    if (stop_.load(std::memory_order_acquire)) return CancelledError("proxy stopped");
    if (deadline.Expired()) {
      return s.WithContext("waiting for " + std::to_string(count) + " immediates of kind " +
                           std::to_string(kind));
    }
  }
  return p_.engine->ConsumeImm(imm, count);
}

Status Proxy::Post(ImmKind kind, uint64_t epoch) {
  if (targets_.empty()) return Status::Ok();
  uint64_t bytes = 0;
  for (const ScatterTarget& t : targets_) bytes += t.length;
  (kind == kCombine ? combine_bytes_ : dispatch_bytes_).fetch_add(bytes, std::memory_order_relaxed);
  posted_.push_back(targets_);  // the engine reads the targets until the scatter completes
  return writes_.Post([&](Completion done) {
    return p_.engine->Scatter({p_.plan, posted_.back(), MoeImm(kind, epoch, p_.config.instance)},
                              std::move(done));
  });
}

Status Proxy::Barrier(ImmKind kind, uint64_t epoch) {
  if (p_.config.world_size == 1) return Status::Ok();
  return writes_.Post([&](Completion done) {
    return p_.engine->Barrier(p_.group, MoeImm(kind, epoch, p_.config.instance), std::move(done));
  });
}

Status Proxy::WaitOwnWrites() {
  RETURN_IF_ERROR(writes_.Wait(Deadline::After(std::chrono::milliseconds(p_.peer_timeout_ms))));
  posted_.clear();
  return Status::Ok();
}

}  // namespace ferry::moe
