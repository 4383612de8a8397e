// Heartbeats between the ranks that wait for each other (design in liveness.h).
#include "moe/liveness.h"

#include <string>

#include "common/leak.h"
#include "moe/relay.h"

namespace ferry::moe {
namespace {

int64_t NowNs(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

}  // namespace

Liveness::Liveness(const AllToAllConfig& config, TransferEngine* engine, std::vector<int> watched)
    : c_(config),
      engine_(engine),
      watched_(std::move(watched)),
      index_(size_t(config.world_size), -1),
      heard_ns_(new std::atomic<int64_t>[watched_.size()]) {
  const int64_t now = NowNs(std::chrono::steady_clock::now());
  for (size_t i = 0; i < watched_.size(); ++i) {
    index_[size_t(watched_[i])] = static_cast<int>(i);
    heard_ns_[i].store(now - std::chrono::nanoseconds(kSilence).count(),
                       std::memory_order_relaxed);  // nothing heard yet
    sent_.push_back(std::make_unique<TransferCounter>());
  }
  posted_.assign(watched_.size(), 0);
  counts_.assign(watched_.size(), 0);
}

StatusOr<std::unique_ptr<Liveness>> Liveness::Create(const AllToAllConfig& config,
                                                     TransferEngine* engine,
                                                     Bootstrap& bootstrap,
                                                     std::vector<int> watched,
                                                     bool adopt_counters) {
  if (!engine) return InvalidArgumentError("Liveness: no engine");
  for (int r : watched) {
    if (r < 0 || r >= config.world_size || r == config.rank) {
      return InvalidArgumentError("Liveness: rank " + std::to_string(r) + " cannot be watched");
    }
  }
  std::unique_ptr<Liveness> l(new Liveness(config, engine, std::move(watched)));
  // Counters before anyone learns our address: no heartbeat finds none.
  for (int r : l->watched_) {
    const uint32_t imm = RelayImm(kRelayAlive, 0, config.instance, r);
    const Status s = engine->CreateImmCounter(imm);
    if (adopt_counters && s.code() == StatusCode::kAlreadyExists) {
      ASSIGN_OR_RETURN(l->counts_[l->imms_.size()], engine->ImmCount(imm));
    } else if (!s.ok()) {
      return CounterError(s, config.instance);
    }
    l->imms_.push_back(imm);
  }
  RETURN_IF_ERROR(l->Meet(bootstrap, std::chrono::seconds(60)));
  l->thread_ = std::thread([p = l.get()] { p->Main(); });
  return l;
}

Status Liveness::Meet(Bootstrap& group, std::chrono::milliseconds timeout) {
  ASSIGN_OR_RETURN(auto addresses, group.AllGather(engine_->Address(), timeout));
  const bool first = peers_.empty();
  for (size_t i = 0; i < watched_.size(); ++i) {
    // An engine already our peer (the hops' relays add the same ones) keeps its PeerId.
    ASSIGN_OR_RETURN(PeerId peer, engine_->AddPeer(addresses[size_t(watched_[i])]));
    if (first) {
      peers_.push_back(peer);
      continue;
    }
    if (peer == peers_[i]) continue;
    // A new process for that rank: the one it replaced is forgotten, which ends a heartbeat
    // still pending to it at once; one that would not end is left to its counter, leaked.
    (void)engine_->RemovePeer(peers_[i]);
    if (!sent_[i]->Wait(posted_[i], Deadline::After(std::chrono::seconds(1))).ok()) {
      LeakOnPurpose(sent_[i].release());
    }
    sent_[i] = std::make_unique<TransferCounter>();
    posted_[i] = 0;
    peers_[i] = peer;
    heard_ns_[i].store(NowNs(std::chrono::steady_clock::now()) -
                           std::chrono::nanoseconds(kSilence).count(),
                       std::memory_order_release);  // nothing heard from the new process yet
  }
  return group.Barrier(timeout);
}

Status Liveness::Rejoin(Bootstrap& group, std::chrono::milliseconds timeout) {
  Stop();
  RETURN_IF_ERROR(Meet(group, timeout));
  stop_.store(false, std::memory_order_release);
  thread_ = std::thread([this] { Main(); });
  return Status::Ok();
}

void Liveness::Stop() {
  stop_.store(true, std::memory_order_release);
  if (thread_.joinable()) thread_.join();
}

void Liveness::Mirror(volatile int32_t* words, std::vector<int> ranks) {
  MutexLock lock(mirrors_mu_);
  mirrors_.push_back({words, std::move(ranks)});
}

void Liveness::Unmirror(volatile int32_t* words) {
  MutexLock lock(mirrors_mu_);
  std::erase_if(mirrors_, [words](const Mirrored& m) { return m.words == words; });
}

Liveness::~Liveness() {
  Stop();
  // A heartbeat to a dead peer ends at the engine's transfer timeout; one that never ends (a
  // wedged provider) still counts into its counter, which is then leaked.
  const auto wait = std::chrono::milliseconds(engine_->options().transfer_timeout_ms) +
                    std::chrono::seconds(1);
  for (size_t i = 0; i < sent_.size(); ++i) {
    if (!sent_[i]->Wait(posted_[i], Deadline::After(wait)).ok()) {
      LeakOnPurpose(sent_[i].release());
    }
  }
}

bool Liveness::Heard(int rank) const {
  if (rank < 0 || rank >= c_.world_size || index_[size_t(rank)] < 0) return false;
  const int64_t heard = heard_ns_[size_t(index_[size_t(rank)])].load(std::memory_order_acquire);
  return NowNs(std::chrono::steady_clock::now()) - heard <
         std::chrono::nanoseconds(kSilence).count();
}

void Liveness::Main() {
  while (!stop_.load(std::memory_order_acquire)) {
    Beat(std::chrono::steady_clock::now());
    std::this_thread::sleep_for(kBeat);
  }
}

void Liveness::Beat(std::chrono::steady_clock::time_point now) {
  const uint32_t mine = RelayImm(kRelayAlive, 0, c_.instance, c_.rank);
  for (size_t i = 0; i < watched_.size(); ++i) {
    // What arrived: any heartbeat since the last beat says the rank lives.
    const StatusOr<uint64_t> count = engine_->ImmCount(imms_[i]);
    if (count.ok() && *count != counts_[i]) {
      counts_[i] = *count;
      heard_ns_[i].store(NowNs(now), std::memory_order_release);
    }
    // Ours while we are inside a receive step, one in flight per rank: a peer that stopped
    // answering gets no queue of them. A refused submit (a peer forgotten as lost, a full
    // queue) is tried at the next beat.
    if (stepping_.load(std::memory_order_acquire) == 0) continue;
    TransferCounter& sent = *sent_[i];
    if (sent.done.load() + sent.failed.load() < posted_[i]) continue;
    if (engine_->WriteImm(peers_[i], mine, Completion::Counter(&sent)).ok()) ++posted_[i];
  }
  MutexLock lock(mirrors_mu_);
  for (const Mirrored& m : mirrors_) {
    for (size_t i = 0; i < m.ranks.size(); ++i) m.words[i] = Heard(m.ranks[i]) ? 1 : 0;
  }
}

}  // namespace ferry::moe
