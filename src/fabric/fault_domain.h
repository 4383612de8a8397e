// FaultInjectionDomain: a Domain decorator for tests, in the manner of LevelDB's
// FaultInjectionTestEnv. It forwards to a real backend and, on demand, turns the completions of
// writes aimed at one remote key into provider errors, or swallows them (a peer that never acks).
#pragma once

#include <atomic>
#include <chrono>
#include <thread>
#include <unordered_set>

#include "common/mutex.h"
#include "fabric/domain.h"

namespace ferry::fabric {

class FaultInjectionDomain final : public Domain {
 public:
  explicit FaultInjectionDomain(std::unique_ptr<Domain> base) : base_(std::move(base)) {}

  // Writes to `key` complete with an error carrying `message`.
  void FailWritesToKey(uint64_t key) { fail_key_.store(key); }
  // Writes to `key` never complete.
  void SwallowWritesToKey(uint64_t key) { swallow_key_.store(key); }
  // PostWrite blocks (a provider call that never returns) until Unwedge().
  void Wedge() { wedged_.store(true); }
  void Unwedge() { wedged_.store(false); }
  bool InsideWedge() const { return inside_wedge_.load(); }

  const DomainCaps& caps() const override { return base_->caps(); }
  const FabricInfo& info() const override { return base_->info(); }
  std::vector<uint8_t> Name() const override { return base_->Name(); }
  StatusOr<uint64_t> InsertPeer(std::span<const uint8_t> name) override {
    return base_->InsertPeer(name);
  }
  Status RemovePeer(uint64_t addr) override { return base_->RemovePeer(addr); }
  StatusOr<Registration> Register(void* data, uint64_t length, MemoryKind kind,
                                  int device) override {
    return base_->Register(data, length, kind, device);
  }
  void Deregister(void* handle) override { base_->Deregister(handle); }

  PostResult PostWrite(const WriteWr& wr, Status* error) override {
    if (wedged_.load()) {
      inside_wedge_.store(true);
      while (wedged_.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      inside_wedge_.store(false);
      return PostResult::kAgain;  // come back out without touching the provider
    }
    PostResult r = base_->PostWrite(wr, error);
    if (r == PostResult::kPosted) {
      MutexLock l(mu_);
      if (wr.key == fail_key_.load()) failing_.insert(wr.context);
      if (wr.key == swallow_key_.load()) swallowed_.insert(wr.context);
    }
    return r;
  }
  PostResult PostSend(const void* data, uint64_t length, void* desc, uint64_t peer,
                      OpContext* ctx, Status* error) override {
    return base_->PostSend(data, length, desc, peer, ctx, error);
  }
  PostResult PostRecv(void* data, uint64_t length, void* desc, OpContext* ctx,
                      Status* error) override {
    return base_->PostRecv(data, length, desc, ctx, error);
  }

  size_t Poll(std::span<DomainCompletion> out) override {
    size_t n = base_->Poll(out);
    size_t kept = 0;
    MutexLock l(mu_);
    for (size_t i = 0; i < n; ++i) {
      DomainCompletion& c = out[i];
      if (c.kind == CompletionKind::kLocal && swallowed_.erase(c.context)) continue;
      if (c.kind == CompletionKind::kLocal && failing_.erase(c.context)) {
        c.error = InternalError("injected fault: remote access error");
      }
      if (kept != i) out[kept] = std::move(c);
      ++kept;
    }
    return kept;
  }

 private:
  std::unique_ptr<Domain> base_;
  std::atomic<uint64_t> fail_key_{~uint64_t{0}};
  std::atomic<uint64_t> swallow_key_{~uint64_t{0}};
  std::atomic<bool> wedged_{false}, inside_wedge_{false};
  Mutex mu_;
  std::unordered_set<const OpContext*> failing_ GUARDED_BY(mu_), swallowed_ GUARDED_BY(mu_);
};

}  // namespace ferry::fabric
