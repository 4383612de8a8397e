// The public value types of ferry/fabric.h that are not the engine: completions and their
// counters, memory regions (which outlive their engine through a RegistrationOwner), and the
// engine's options from the environment.
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "common/backoff.h"
#include "common/env.h"
#include "common/mutex.h"
#include "common/strings.h"
#include "fabric/engine_internal.h"
#include "ferry/fabric.h"

namespace ferry {

void Completion::Finish(const Status& status) {
  if (counter_) {
    (status.ok() ? counter_->done : counter_->failed).fetch_add(1, std::memory_order_acq_rel);
    counter_ = nullptr;
  }
  if (callback_) {
    callback_(status);
    callback_.Reset();
  }
}

Status TransferCounter::Wait(uint64_t n, Deadline deadline) const {
  Backoff backoff;
  for (;;) {
    uint64_t seen = done.load(std::memory_order_acquire) + failed.load(std::memory_order_acquire);
    if (seen >= n) return Status::Ok();
    if (deadline.Expired()) {
      return DeadlineExceededError("transfer counter: waited for " + std::to_string(n) +
                                   " completions, saw " + std::to_string(seen) + " (" +
                                   std::to_string(failed.load()) + " failed)");
    }
    backoff.Pause();
  }
}

void MemoryRegion::Release() {
  if (!owner_) return;
  {
    MutexLock lock(owner_->mu);
    if (owner_->engine) (void)owner_->engine->Deregister(*this);  // see Revoke
  }
  owner_.reset();
  handle_ = nullptr;
}

MemoryRegion::MemoryRegion(MemoryRegion&& other) noexcept { *this = std::move(other); }

MemoryRegion& MemoryRegion::operator=(MemoryRegion&& other) noexcept {
  if (this != &other) {
    Release();
    owner_ = std::move(other.owner_);
    handle_ = std::exchange(other.handle_, nullptr);
    data_ = other.data_;
    length_ = other.length_;
    kind_ = other.kind_;
    device_ = other.device_;
    local_descs_ = other.local_descs_;
    remote_ = other.remote_;
  }
  return *this;
}

MemoryRegion::~MemoryRegion() { Release(); }

StatusOr<EngineOptions> EngineOptions::FromEnv() {
  EngineOptions o;
  if (const char* p = std::getenv("FERRY_PROVIDER")) o.provider = p;
  if (const char* n = std::getenv("FERRY_NODE")) o.node = n;
  RETURN_IF_ERROR(EnvNumber("FERRY_PORT", &o.port));
  RETURN_IF_ERROR(EnvNumber("FERRY_WORKER_CPU", &o.worker_cpu, -1));
  RETURN_IF_ERROR(EnvNumber("FERRY_SPIN_US", &o.spin_us));
  RETURN_IF_ERROR(EnvNumber("FERRY_CUDA_MEMORY", &o.cuda_memory));
  if (const char* n = std::getenv("FERRY_NICS")) o.nics = SplitCommaList(n);
  RETURN_IF_ERROR(EnvNumber("FERRY_NUM_NICS", &o.num_nics));
  RETURN_IF_ERROR(EnvNumber("FERRY_MAX_TRANSFERS", &o.max_transfers));
  RETURN_IF_ERROR(EnvNumber("FERRY_MAX_WRS", &o.max_outstanding_wrs));
  RETURN_IF_ERROR(EnvNumber("FERRY_MSG_BYTES", &o.message_bytes));
  RETURN_IF_ERROR(EnvNumber("FERRY_TRANSFER_TIMEOUT_MS", &o.transfer_timeout_ms));
  RETURN_IF_ERROR(EnvNumber("FERRY_IDLE_SLEEP_US", &o.idle_sleep_us));
  RETURN_IF_ERROR(EnvNumber("FERRY_TRUST_WRITE_ORDER", &o.trust_write_order));
  // The verbs settings in C's notation too (0x hex): keys and PSNs are written so.
  VerbsOptions& v = o.verbs;
  RETURN_IF_ERROR(EnvNumberAnyBase("FERRY_IB_PORT", &v.port));
  RETURN_IF_ERROR(EnvNumberAnyBase("FERRY_IB_GID_INDEX", &v.gid_index));
  RETURN_IF_ERROR(EnvNumberAnyBase("FERRY_IB_QKEY", &v.qkey));
  RETURN_IF_ERROR(EnvNumberAnyBase("FERRY_IB_PSN", &v.psn));
  RETURN_IF_ERROR(EnvNumberAnyBase("FERRY_IB_MTU", &v.mtu_bytes));
  RETURN_IF_ERROR(EnvNumberAnyBase("FERRY_IB_TIMEOUT", &v.timeout));
  RETURN_IF_ERROR(EnvNumberAnyBase("FERRY_IB_RETRY", &v.retry_count));
  RETURN_IF_ERROR(EnvNumberAnyBase("FERRY_IB_RNR_RETRY", &v.rnr_retry));
  RETURN_IF_ERROR(EnvNumberAnyBase("FERRY_IB_SL", &v.service_level));
  RETURN_IF_ERROR(EnvNumberAnyBase("FERRY_IB_TC", &v.traffic_class));
  RETURN_IF_ERROR(EnvNumber("FERRY_IB_RELAXED_ORDERING", &v.relaxed_ordering));
  RETURN_IF_ERROR(EnvNumberAnyBase("FERRY_IB_MAX_UNCLAIMED", &v.max_unclaimed_peers));
  RETURN_IF_ERROR(EnvNumberAnyBase("FERRY_IB_RELEASE_MS", &v.release_delay_ms));
  return o;
}

}  // namespace ferry
