// The KV messenger when requests end early or peers misbehave, across processes over shm and
// tcp: cancels from either side and deadlines, cancel storms, duplicate request ids, hostile
// senders, decoders sharing a prefill's peer entries, and one engine serving both sides. Every
// case checks that its request ends once and that nothing lands in its pages afterwards.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>

#include "fabric/test_util.h"
#include "ferry/bootstrap.h"
#include "ferry/kv.h"
#include "kv/messages.h"
#include "kv_test_util.h"

namespace ferry {
namespace {

using namespace std::chrono_literals;
using kv_test::kLayers;
using kv_test::Shards;

// One side of the small cache the cancel tests use (8 KV heads of 16, 4-token pages, 24 pages a
// layer): its engine and shards.
const KvModel kSmallModel{8, 16, 2, false, 4};
struct SmallEnd {
  KvSide side;
  std::unique_ptr<TransferEngine> engine;
  Shards shards;

  Status Open(const std::string& provider, int tp, uint32_t max_peers = 1024) {
    side = KvSide{kSmallModel, KvOrder::kHND, tp};
    EngineOptions options = testing_util::TestOptions(provider);
    options.max_peers = max_peers;
    ASSIGN_OR_RETURN(engine, TransferEngine::Create(options));
    return shards.Init(*engine, side, 24);
  }
};

// A small prefill whose callbacks count what arrives and what is released (the last release's
// status kept), its address given to every rank.
struct WatchedPrefill {
  SmallEnd e;
  std::atomic<uint64_t> layers{0};
  std::atomic<int> arrived{0}, released{0};
  Status release_status;
  std::unique_ptr<KvPrefill> prefill;

  Status Open(const std::string& provider, Bootstrap& b, uint32_t max_peers = 1024) {
    RETURN_IF_ERROR(e.Open(provider, 4, max_peers));
    KvPrefill::Callbacks cb;
    cb.on_request = [this](const KvPrefill::Incoming&) { arrived.fetch_add(1); };
    cb.on_released = [this](uint64_t, const Status& s) {
      release_status = s;
      released.fetch_add(1);
    };
    ASSIGN_OR_RETURN(prefill, KvPrefill::Create(e.engine.get(), e.side, e.shards.regions,
                                                nullptr, &layers, cb));
    return b.AllGather(e.engine->Address(), 30s).status();
  }
  // Until `n` requests arrived or the deadline passed.
  Status AwaitArrivals(int n, Deadline deadline) {
    while (arrived.load() < n && !deadline.Expired()) std::this_thread::sleep_for(1ms);
    CHECK_OR_RETURN(arrived.load() == n, std::to_string(arrived.load()) + " requests arrived, " +
                                             "expected " + std::to_string(n));
    return Status::Ok();
  }
  void AwaitRelease(Deadline deadline) {
    while (released.load() == 0 && !deadline.Expired()) std::this_thread::sleep_for(1ms);
  }
  // Schedules WatchedDecoder's request 7 (pages 0..4), runs the model's layers and expects the
  // request released OK.
  Status ServeRequest7(Deadline deadline) {
    std::vector<int64_t> pages = {0, 1, 2, 3, 4};
    RETURN_IF_ERROR(prefill->Schedule(7, pages, 0, 0));
    layers.fetch_add(kLayers);
    AwaitRelease(deadline);
    CHECK_OR_RETURN(released.load() == 1 && release_status.ok(),
                    "request 7 released with " + release_status.ToString());
    return Status::Ok();
  }
};

// A small decoder that asks the prefill (rank 0) for request 7 (five pages) and keeps its
// outcome and how many times it was told.
struct WatchedDecoder {
  SmallEnd e;
  std::unique_ptr<KvDecoder> decoder;
  std::vector<std::vector<uint8_t>> addresses;
  std::vector<int64_t> pages = {9, 3, 5, 7, 11};
  std::atomic<int> calls{0};
  Status outcome;

  Status Open(const std::string& provider, Bootstrap& b) {
    RETURN_IF_ERROR(e.Open(provider, 2));
    ASSIGN_OR_RETURN(decoder, KvDecoder::Create(e.engine.get(), e.side, e.shards.regions, nullptr));
    ASSIGN_OR_RETURN(addresses, b.AllGather(e.engine->Address(), 30s));
    return Status::Ok();
  }
  Status Submit(Deadline deadline) {
    KvDecoder::Request req;
    req.request_id = 7;
    req.prefill_address = addresses[0];
    req.prefill = KvSide{kSmallModel, KvOrder::kHND, 4};
    req.pages = pages;
    return decoder->Submit(req, deadline, [this](const Status& s) {
      outcome = s;
      calls.fetch_add(1);
    });
  }
  void AwaitOutcome(Deadline deadline) {
    while (calls.load() == 0 && !deadline.Expired()) std::this_thread::sleep_for(1ms);
  }
};

// Cancellation, three ways: the decoder cancels mid-way, the decoder's deadline passes before the
// prefill schedules, the prefill cancels mid-way. Each ends with one callback whose status says
// which, after which no write lands in the request's pages (they are poisoned and watched).
enum class Stop { kDecoderCancels, kDeadline, kPrefillCancels };

Status CancelPrefill(Stop how, const std::string& provider, Bootstrap& b) {
  WatchedPrefill w;
  RETURN_IF_ERROR(w.Open(provider, b));
  Deadline deadline = Deadline::After(30s);
  RETURN_IF_ERROR(w.AwaitArrivals(1, deadline));
  std::vector<int64_t> pages = {0, 1, 2, 3, 4};
  if (how != Stop::kDeadline) {
    RETURN_IF_ERROR(w.prefill->Schedule(7, pages, 0, 0));
    w.layers.fetch_add(1);  // layer 0 goes
    std::this_thread::sleep_for(50ms);
    if (how == Stop::kPrefillCancels) RETURN_IF_ERROR(w.prefill->Cancel(7));
  }
  RETURN_IF_ERROR(b.Barrier(30s));  // B1: the decoder cancels now (or its deadline passed)
  RETURN_IF_ERROR(b.Barrier(30s));  // B2
  // The decoder's cancel message may trail the barrier (another channel): released first, or
  // every write could land before it -- a request then rightly ends OK (the test ran into that
  // once with tcp;ofi_rxm on a loaded machine).
  w.AwaitRelease(deadline);
  CHECK_OR_RETURN(w.released.load() == 1, "source pages never released");
  CHECK_OR_RETURN(w.release_status.code() == StatusCode::kCancelled,
                  "released with " + w.release_status.ToString());
  RETURN_IF_ERROR(b.Barrier(30s));  // B3: the decoder poisoned its pages and watches them
  w.layers.fetch_add(kLayers);  // the rest of the pass: a cancelled request must post nothing
  return b.Barrier(30s);  // B4
}

Status CancelDecoder(Stop how, const std::string& provider, Bootstrap& b) {
  WatchedDecoder w;
  RETURN_IF_ERROR(w.Open(provider, b));
  RETURN_IF_ERROR(w.Submit(Deadline::After(how == Stop::kDeadline ? 300ms : 20s)));
  if (how == Stop::kDeadline) std::this_thread::sleep_for(400ms);
  RETURN_IF_ERROR(b.Barrier(30s));  // B1
  if (how == Stop::kDecoderCancels) RETURN_IF_ERROR(w.decoder->Cancel(7));
  RETURN_IF_ERROR(b.Barrier(30s));  // B2
  w.AwaitOutcome(Deadline::After(20s));
  CHECK_OR_RETURN(w.calls.load() == 1, "no outcome");
  const StatusCode want = how == Stop::kDeadline ? StatusCode::kDeadlineExceeded
                                                 : StatusCode::kCancelled;
  CHECK_OR_RETURN(w.outcome.code() == want, "outcome " + w.outcome.ToString());
  // The pages are ours again: poison them and make sure nothing more lands while the prefill
  // runs the rest of its pass.
  for (auto& shard : w.e.shards.bytes) std::fill(shard.begin(), shard.end(), 0xEE);
  RETURN_IF_ERROR(b.Barrier(30s));  // B3
  std::this_thread::sleep_for(200ms);
  for (auto& shard : w.e.shards.bytes) {
    CHECK_OR_RETURN(std::all_of(shard.begin(), shard.end(), [](uint8_t v) { return v == 0xEE; }),
                    "a write landed after the request ended");
  }
  CHECK_OR_RETURN(w.calls.load() == 1, "more than one outcome");
  CHECK_OR_RETURN(w.decoder->Cancel(7).code() == StatusCode::kNotFound,
                  "ended request cancellable");
  return b.Barrier(30s);  // B4
}

class KvCancelTest : public ::testing::TestWithParam<std::tuple<Stop, std::string>> {};

TEST_P(KvCancelTest, EndsOnceAndNothingLandsAfterwards) {
  const auto [how, provider] = GetParam();
  auto exits = testing_util::RunRanks(2, [&, how = how, provider = provider](Bootstrap& b) {
    return b.rank() == 0 ? CancelPrefill(how, provider, b) : CancelDecoder(how, provider, b);
  }, 120s);
  for (auto& e : exits) EXPECT_TRUE(e.ok()) << e.exit_code << " " << e.signal;
}

std::string CancelName(const ::testing::TestParamInfo<std::tuple<Stop, std::string>>& info) {
  static const char* const kHow[] = {"decoder_cancels", "deadline", "prefill_cancels"};
  return std::string(kHow[static_cast<int>(std::get<0>(info.param))]) + "_" +
         (std::get<1>(info.param) == "shm" ? "shm" : "tcp");
}

INSTANTIATE_TEST_SUITE_P(Ways, KvCancelTest,
                         ::testing::Combine(::testing::Values(Stop::kDecoderCancels,
                                                              Stop::kDeadline,
                                                              Stop::kPrefillCancels),
                                            ::testing::ValuesIn(testing_util::Providers())),
                         CancelName);

// A cancel storm: a decoder with 4 request slots cancels round after round of requests the prefill
// never schedules. Each slot comes back once the prefill acknowledges, not at the request's
// deadline (60 s), so the rounds run back to back.
// max_peers: the prefill engine's peer table, smaller than the requests its one decoder sends
// (a decoder is one peer however many requests it sends).
Status StormPrefill(const std::string& provider, Bootstrap& b, uint32_t max_peers = 1024) {
  WatchedPrefill w;
  RETURN_IF_ERROR(w.Open(provider, b, max_peers));
  RETURN_IF_ERROR(b.Barrier(60s));  // the decoder's rounds are over
  CHECK_OR_RETURN(w.released.load() == 12, "released " + std::to_string(w.released.load()));
  return Status::Ok();
}

Status StormDecoder(const std::string& provider, Bootstrap& b) {
  SmallEnd e;
  RETURN_IF_ERROR(e.Open(provider, 2));
  ASSIGN_OR_RETURN(auto decoder,
                   KvDecoder::Create(e.engine.get(), e.side, e.shards.regions, nullptr, 4));
  ASSIGN_OR_RETURN(auto addresses, b.AllGather(e.engine->Address(), 30s));
  std::vector<int64_t> pages = {1, 2};
  std::atomic<int> ended{0}, cancelled{0};
  const auto start = std::chrono::steady_clock::now();
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < 4; ++i) {
      KvDecoder::Request req;
      req.request_id = uint64_t(round) * 10 + i;
      req.prefill_address = addresses[0];
      req.prefill = KvSide{kSmallModel, KvOrder::kHND, 4};
      req.pages = pages;
      Status s;
      Deadline retry = Deadline::After(10s);  // a slot may come back just after its callback
      do {
        s = decoder->Submit(req, Deadline::After(60s), [&](const Status& st) {
          if (st.code() == StatusCode::kCancelled) cancelled.fetch_add(1);
          ended.fetch_add(1);
        });
        if (s.code() == StatusCode::kResourceExhausted) std::this_thread::sleep_for(1ms);
      } while (s.code() == StatusCode::kResourceExhausted && !retry.Expired());
      RETURN_IF_ERROR(s.WithContext("round " + std::to_string(round)));
    }
    for (int i = 0; i < 4; ++i) RETURN_IF_ERROR(decoder->Cancel(uint64_t(round) * 10 + i));
    Deadline wait = Deadline::After(20s);
    while (ended.load() < 4 * (round + 1) && !wait.Expired()) std::this_thread::sleep_for(1ms);
    CHECK_OR_RETURN(ended.load() == 4 * (round + 1), "round " + std::to_string(round) +
                                                         ": " + std::to_string(ended.load()) +
                                                         " requests ended");
  }
  CHECK_OR_RETURN(cancelled.load() == 12, "cancelled " + std::to_string(cancelled.load()));
  CHECK_OR_RETURN(std::chrono::steady_clock::now() - start < 30s,
                  "slots were held until the requests' deadlines");
  return b.Barrier(60s);
}

// One engine serves a KvPrefill and a KvDecoder at once (each takes its own messages by tag):
// each of two ranks asks the other's prefill for a request and serves the other's, and both
// end OK. A second KvPrefill on an engine that has one is refused, and a prefill made after
// the first is gone takes its place.
TEST(KvSharedEngineTest, OneEngineServesAPrefillAndADecoder) {
  const std::string provider = testing_util::Providers().front();
  auto exits = testing_util::RunRanks(2, [&](Bootstrap& b) -> Status {
    const KvSide pre_side{kSmallModel, KvOrder::kHND, 4}, dec_side{kSmallModel, KvOrder::kHND, 2};
    ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(testing_util::TestOptions(provider)));
    Shards pre_shards, dec_shards;
    RETURN_IF_ERROR(pre_shards.Init(*engine, pre_side, 24));
    RETURN_IF_ERROR(dec_shards.Init(*engine, dec_side, 24));
    std::atomic<uint64_t> layers{0};
    std::atomic<int> released{0};
    std::atomic<uint64_t> incoming{0};
    KvPrefill::Callbacks cb;
    cb.on_request = [&](const KvPrefill::Incoming& in) { incoming.store(in.request_id); };
    cb.on_released = [&](uint64_t, const Status& s) { released.fetch_add(s.ok() ? 1 : 100); };
    ASSIGN_OR_RETURN(auto prefill, KvPrefill::Create(engine.get(), pre_side, pre_shards.regions,
                                                     nullptr, &layers, cb));
    ASSIGN_OR_RETURN(auto decoder,
                     KvDecoder::Create(engine.get(), dec_side, dec_shards.regions, nullptr));
    const Status second = KvPrefill::Create(engine.get(), pre_side, pre_shards.regions, nullptr,
                                            &layers, cb).status();
    CHECK_OR_RETURN(second.code() == StatusCode::kAlreadyExists, "second: " + second.ToString());
    ASSIGN_OR_RETURN(auto addresses, b.AllGather(engine->Address(), 30s));
    std::atomic<int> calls{0};
    Status outcome;
    KvDecoder::Request req;
    req.request_id = 70 + static_cast<uint64_t>(b.rank());
    req.prefill_address = addresses[1 - b.rank()];
    req.prefill = pre_side;
    const std::vector<int64_t> pages = {9, 3, 5, 7, 11};
    req.pages = pages;
    RETURN_IF_ERROR(decoder->Submit(req, Deadline::After(30s), [&](const Status& st) {
      outcome = st;
      calls.fetch_add(1);
    }));
    const Deadline deadline = Deadline::After(30s);
    while (incoming.load() == 0 && !deadline.Expired()) std::this_thread::sleep_for(1ms);
    const uint64_t theirs = 70 + static_cast<uint64_t>(1 - b.rank());
    CHECK_OR_RETURN(incoming.load() == theirs, "request " + std::to_string(incoming.load()));
    RETURN_IF_ERROR(prefill->Schedule(theirs, std::vector<int64_t>{0, 1, 2, 3, 4}, 0, 0));
    layers.fetch_add(kLayers);
    while ((calls.load() == 0 || released.load() == 0) && !deadline.Expired()) {
      std::this_thread::sleep_for(1ms);
    }
    CHECK_OR_RETURN(calls.load() == 1 && outcome.ok(), "our request: " + outcome.ToString());
    CHECK_OR_RETURN(released.load() == 1, "their request released " +
                                              std::to_string(released.load()));
    RETURN_IF_ERROR(b.Barrier(30s));  // both done before either prefill goes
    prefill.reset();
    return KvPrefill::Create(engine.get(), pre_side, pre_shards.regions, nullptr, &layers, cb)
        .status();
  }, 120s);
  for (size_t r = 0; r < exits.size(); ++r) EXPECT_TRUE(exits[r].ok()) << "rank " << r;
}

// The prefill's options from the environment: the default without FERRY_KV_TRACE, the trace
// with 1, a value the switch cannot take refused naming the variable.
TEST(KvPrefillOptionsTest, FromEnvReadsTheTraceSwitch) {
  unsetenv("FERRY_KV_TRACE");
  StatusOr<KvPrefill::Options> o = KvPrefill::Options::FromEnv();
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_FALSE(o->trace);
  setenv("FERRY_KV_TRACE", "1", 1);
  o = KvPrefill::Options::FromEnv();
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_TRUE(o->trace);
  setenv("FERRY_KV_TRACE", "yes", 1);
  const Status bad = KvPrefill::Options::FromEnv().status();
  unsetenv("FERRY_KV_TRACE");
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("FERRY_KV_TRACE"), std::string::npos) << bad.ToString();
}

TEST(KvCancelStormTest, SlotsComeBackWhenThePrefillAcknowledges) {
  const std::string provider = testing_util::Providers().front();
  auto exits = testing_util::RunRanks(2, [&](Bootstrap& b) {
    return b.rank() == 0 ? StormPrefill(provider, b) : StormDecoder(provider, b);
  }, 120s);
  for (auto& e : exits) EXPECT_TRUE(e.ok()) << e.exit_code << " " << e.signal;
}

// Two decoders send one prefill requests with the same id (ids must be unique among in-flight
// requests): the first goes on and completes, the second is cancelled by the prefill at once
// (not at its deadline), and the prefill's scheduler hears of the first only.
Status DuplicatePrefill(const std::string& provider, Bootstrap& b) {
  WatchedPrefill w;
  RETURN_IF_ERROR(w.Open(provider, b));
  Deadline deadline = Deadline::After(30s);
  RETURN_IF_ERROR(w.AwaitArrivals(1, deadline));
  RETURN_IF_ERROR(b.Barrier(30s));  // B1: the second decoder sends its request now
  RETURN_IF_ERROR(b.Barrier(30s));  // B2: the second decoder's request has ended
  CHECK_OR_RETURN(w.arrived.load() == 1, "the scheduler heard of the duplicate");
  RETURN_IF_ERROR(w.ServeRequest7(deadline));
  return b.Barrier(30s);  // B3
}

Status DuplicateDecoder(const std::string& provider, Bootstrap& b) {
  WatchedDecoder w;
  RETURN_IF_ERROR(w.Open(provider, b));
  const bool first = b.rank() == 1;
  if (first) RETURN_IF_ERROR(w.Submit(Deadline::After(20s)));
  RETURN_IF_ERROR(b.Barrier(30s));  // B1
  const auto start = Clock::now();
  if (!first) {
    RETURN_IF_ERROR(w.Submit(Deadline::After(20s)));
    w.AwaitOutcome(Deadline::After(10s));
    CHECK_OR_RETURN(w.calls.load() == 1 && w.outcome.code() == StatusCode::kCancelled,
                    "the duplicate ended with " + w.outcome.ToString());
    CHECK_OR_RETURN(Clock::now() - start < 5s, "the duplicate waited for its deadline");
  }
  RETURN_IF_ERROR(b.Barrier(30s));  // B2
  if (first) {
    w.AwaitOutcome(Deadline::After(20s));
    CHECK_OR_RETURN(w.calls.load() == 1 && w.outcome.ok(),
                    "the first ended with " + w.outcome.ToString());
  }
  return b.Barrier(30s);  // B3
}

TEST(KvDuplicateTest, ARequestIdInFlightAtThePrefillCancelsTheNewcomer) {
  const std::string provider = testing_util::Providers().front();
  auto exits = testing_util::RunRanks(3, [&](Bootstrap& b) {
    return b.rank() == 0 ? DuplicatePrefill(provider, b) : DuplicateDecoder(provider, b);
  }, 120s);
  for (auto& e : exits) EXPECT_TRUE(e.ok()) << e.exit_code << " " << e.signal;
}

// A peer that sends a prefill garbage: random bytes, every truncation of a request, requests
// whose fields would overflow the prefill's arithmetic, a request from an address no engine has,
// control messages for nothing. The prefill drops each without a crash and without telling its
// scheduler, and serves the next decoder's request as if nothing had come before.
Status HostilePrefill(const std::string& provider, Bootstrap& b) {
  WatchedPrefill w;
  RETURN_IF_ERROR(w.Open(provider, b));
  RETURN_IF_ERROR(b.Barrier(60s));  // B1: every hostile message has been delivered
  Deadline deadline = Deadline::After(30s);
  RETURN_IF_ERROR(w.AwaitArrivals(1, deadline));
  RETURN_IF_ERROR(w.ServeRequest7(deadline));
  RETURN_IF_ERROR(b.Barrier(60s));  // B2: the decoder has its outcome
  // Delivered before the decoder's request, so drained before it: none reached the scheduler.
  CHECK_OR_RETURN(w.arrived.load() == 1,
                  std::to_string(w.arrived.load()) + " requests reached the scheduler");
  return Status::Ok();
}

Status HostileSender(const std::string& provider, Bootstrap& b) {
  SmallEnd e;
  RETURN_IF_ERROR(e.Open(provider, 2));
  ASSIGN_OR_RETURN(auto addresses, b.AllGather(e.engine->Address(), 30s));
  ASSIGN_OR_RETURN(PeerId prefill, e.engine->AddPeer(addresses[0]));
  std::vector<std::vector<uint8_t>> messages;
  std::mt19937 rng(11);
  for (int i = 0; i < 64; ++i) {
    std::vector<uint8_t> m(1 + rng() % 600);
    for (auto& v : m) v = static_cast<uint8_t>(rng());
    const uint32_t magic = i % 3 == 0 ? kv::kRequestMagic : i % 3 == 1 ? kv::kCancelMagic : 0;
    if (magic != 0 && m.size() >= 4) std::memcpy(m.data(), &magic, 4);
    messages.push_back(std::move(m));
  }
  kv::WireRequest q;
  q.request_id = 100;
  q.imm = kv::kImmBase;
  q.decoder_address = e.engine->Address();
  q.decode = e.side;
  q.num_layers = kLayers;
  q.layer_stride = static_cast<uint64_t>(e.shards.regions.layer_stride);
  for (const MemoryRegion& r : e.shards.regs) q.dst.push_back(r.remote());
  q.pages = {1, 2, 3, 4, 5};
  const std::vector<uint8_t> whole = q.Serialize();
  for (size_t n = 1; n < whole.size(); ++n) messages.emplace_back(whole.begin(), whole.begin() + n);
  auto hostile = [&](auto change) {
    kv::WireRequest h = q;
    change(h);
    messages.push_back(h.Serialize());
  };
  hostile([](kv::WireRequest& h) { h.pages[0] = int64_t{1} << 62; });
  hostile([](kv::WireRequest& h) { h.pages[0] = 24; });
  hostile([](kv::WireRequest& h) { h.num_tokens = -1; });
  hostile([](kv::WireRequest& h) { h.layer_stride = ~uint64_t{0}; });
  hostile([](kv::WireRequest& h) { h.aux_bytes = -1; });
  hostile([](kv::WireRequest& h) { h.decode.model.head_dim = 1 << 30; });
  hostile([](kv::WireRequest& h) { h.decoder_address.assign(40, 0xAB); });  // no engine's address
  messages.push_back(kv::ControlMessage(kv::kCancelMagic, 555, kv::kImmBase, 0));
  messages.push_back(kv::ControlMessage(kv::kAckMagic, 100, kv::kImmBase, 3));
  const std::vector<uint8_t> cancel = kv::ControlMessage(kv::kCancelMagic, 7, kv::kImmBase, 0);
  messages.emplace_back(cancel.begin(), cancel.end() - 1);

  TransferCounter sent;
  for (const auto& m : messages) {
    Status s;
    Deadline retry = Deadline::After(10s);
    do {
      s = e.engine->Send(prefill, m, Completion::Counter(&sent));
      if (s.code() == StatusCode::kResourceExhausted) std::this_thread::sleep_for(1ms);
    } while (s.code() == StatusCode::kResourceExhausted && !retry.Expired());
    RETURN_IF_ERROR(s);
  }
  RETURN_IF_ERROR(sent.Wait(messages.size(), Deadline::After(30s)));
  CHECK_OR_RETURN(sent.failed.load() == 0, std::to_string(sent.failed.load()) + " sends failed");
  RETURN_IF_ERROR(b.Barrier(60s));  // B1
  return b.Barrier(60s);            // B2
}

Status HostileDecoder(const std::string& provider, Bootstrap& b) {
  WatchedDecoder w;
  RETURN_IF_ERROR(w.Open(provider, b));
  RETURN_IF_ERROR(b.Barrier(60s));  // B1
  RETURN_IF_ERROR(w.Submit(Deadline::After(30s)));
  w.AwaitOutcome(Deadline::After(30s));
  CHECK_OR_RETURN(w.calls.load() == 1 && w.outcome.ok(), "ended with " + w.outcome.ToString());
  return b.Barrier(60s);  // B2
}

TEST(KvHostilePeerTest, APrefillDropsWhatIsMalformedAndServesTheNextRequest) {
  const std::string provider = testing_util::Providers().front();
  auto exits = testing_util::RunRanks(3, [&](Bootstrap& b) {
    switch (b.rank()) {
      case 0: return HostilePrefill(provider, b);
      case 1: return HostileSender(provider, b);
      default: return HostileDecoder(provider, b);
    }
  }, 120s);
  for (auto& e : exits) EXPECT_TRUE(e.ok()) << e.exit_code << " " << e.signal;
}

// A prefill that schedules each request as it arrives (pages 0..n-1, the model's layers done
// at once) and expects `expect` releases, all OK, before the decoder's last barrier.
// `turns`: barriers the decoders hold before their last (one per turn of TakingTurns).
Status ServingPrefill(const std::string& provider, Bootstrap& b, int expect,
                      uint32_t max_peers = 1024, int turns = 0) {
  SmallEnd e;
  RETURN_IF_ERROR(e.Open(provider, 4, max_peers));
  std::atomic<uint64_t> layers{0};
  std::atomic<int> released{0}, bad{0};
  std::unique_ptr<KvPrefill> prefill;
  // The callbacks' view of it, published once made: the watcher may run them before Create's
  // result is assigned (no request can come before the address is shared, but a thread
  // sanitizer cannot see that order, which runs through other processes).
  std::atomic<KvPrefill*> serving{nullptr};
  KvPrefill::Callbacks cb;
  cb.on_request = [&](const KvPrefill::Incoming& in) {
    std::vector<int64_t> pages(static_cast<size_t>(in.num_pages));
    std::iota(pages.begin(), pages.end(), 0);
    KvPrefill* p = serving.load(std::memory_order_acquire);
    if (!p || !p->Schedule(in.request_id, pages, layers.load(), 0).ok()) bad.fetch_add(1);
    layers.fetch_add(kLayers);
  };
  cb.on_released = [&](uint64_t, const Status& s) {
    if (!s.ok()) bad.fetch_add(1);
    released.fetch_add(1);
  };
  ASSIGN_OR_RETURN(prefill, KvPrefill::Create(e.engine.get(), e.side, e.shards.regions, nullptr,
                                              &layers, cb));
  serving.store(prefill.get(), std::memory_order_release);
  RETURN_IF_ERROR(b.AllGather(e.engine->Address(), 30s).status());
  for (int turn = 0; turn < turns; ++turn) RETURN_IF_ERROR(b.Barrier(60s));
  RETURN_IF_ERROR(b.Barrier(60s));  // the decoders are done
  // A decoder is done once the writes landed; the prefill releases a request once it saw its own
  // completions, which can come a little later.
  const Deadline by = Deadline::After(10s);
  while (released.load() < expect && !by.Expired()) std::this_thread::sleep_for(1ms);
  CHECK_OR_RETURN(released.load() == expect && bad.load() == 0,
                  std::to_string(released.load()) + " released, " + std::to_string(bad.load()) +
                      " failed or refused, expected " + std::to_string(expect));
  return Status::Ok();
}

// Asks the small prefill at `address` for request `id` into `pages`; OK once it ended OK.
Status AskSmall(KvDecoder& decoder, std::span<const uint8_t> address, uint64_t id,
                std::span<const int64_t> pages) {
  KvDecoder::Request req;
  req.request_id = id;
  req.prefill_address = address;
  req.prefill = KvSide{kSmallModel, KvOrder::kHND, 4};
  req.pages = pages;
  std::atomic<int> calls{0};
  Status outcome;
  RETURN_IF_ERROR(decoder.Submit(req, Deadline::After(20s), [&](const Status& s) {
    outcome = s;
    calls.fetch_add(1);
  }));
  Deadline wait = Deadline::After(30s);
  while (calls.load() == 0 && !wait.Expired()) std::this_thread::sleep_for(1ms);
  CHECK_OR_RETURN(calls.load() == 1, "request " + std::to_string(id) + " never ended");
  return outcome;
}

// A decoder whose engine holds two peers asks three prefills in turn, then the first again:
// each new prefill takes the entry of the least recently used idle one (before, the third
// request failed ResourceExhausted at Submit, for good).
Status RotatingDecoder(const std::string& provider, Bootstrap& b) {
  SmallEnd e;
  RETURN_IF_ERROR(e.Open(provider, 2, /*max_peers=*/2));
  ASSIGN_OR_RETURN(auto decoder, KvDecoder::Create(e.engine.get(), e.side, e.shards.regions,
                                                   nullptr));
  ASSIGN_OR_RETURN(auto addresses, b.AllGather(e.engine->Address(), 30s));
  const int order[] = {0, 1, 2, 0};
  const std::vector<int64_t> pages = {1, 2, 3};
  for (int i = 0; i < 4; ++i) {
    RETURN_IF_ERROR(AskSmall(*decoder, addresses[order[i]], 100 + i, pages)
                        .WithContext("request to prefill " + std::to_string(order[i])));
  }
  return b.Barrier(60s);
}

TEST(KvPeerTableTest, ADecoderReusesTheEntriesOfIdlePrefills) {
  const std::string provider = testing_util::Providers().front();
  auto exits = testing_util::RunRanks(4, [&](Bootstrap& b) {
    if (b.rank() == 3) return RotatingDecoder(provider, b);
    return ServingPrefill(provider, b, b.rank() == 0 ? 2 : 1);
  }, 120s);
  for (auto& e : exits) EXPECT_TRUE(e.ok()) << e.exit_code << " " << e.signal;
}

// A prefill whose engine holds one peer serves two decoders taking turns (1, 2, 1, 2): each
// newcomer takes the entry of the idle one, which is added again on its next request.
Status TakingTurns(const std::string& provider, Bootstrap& b) {
  SmallEnd e;
  RETURN_IF_ERROR(e.Open(provider, 2));
  ASSIGN_OR_RETURN(auto decoder, KvDecoder::Create(e.engine.get(), e.side, e.shards.regions,
                                                   nullptr));
  ASSIGN_OR_RETURN(auto addresses, b.AllGather(e.engine->Address(), 30s));
  const std::vector<int64_t> pages = {4, 5};
  for (int turn = 0; turn < 4; ++turn) {
    RETURN_IF_ERROR(b.Barrier(60s));  // one barrier per turn: the turn's decoder sends
    if (turn % 2 != b.rank() - 1) continue;
    RETURN_IF_ERROR(AskSmall(*decoder, addresses[0], 200 + turn, pages)
                        .WithContext("turn " + std::to_string(turn)));
  }
  return b.Barrier(60s);
}

TEST(KvPeerTableTest, APrefillOfOnePeerEntryServesDecodersTakingTurns) {
  const std::string provider = testing_util::Providers().front();
  auto exits = testing_util::RunRanks(3, [&](Bootstrap& b) {
    return b.rank() == 0 ? ServingPrefill(provider, b, 4, /*max_peers=*/1, /*turns=*/4)
                         : TakingTurns(provider, b);
  }, 120s);
  for (auto& e : exits) EXPECT_TRUE(e.ok()) << e.exit_code << " " << e.signal;
}

TEST(KvCancelStormTest, APrefillServesMoreRequestsThanItsEngineHoldsPeers) {
  const std::string provider = testing_util::Providers().front();
  auto exits = testing_util::RunRanks(2, [&](Bootstrap& b) {
    return b.rank() == 0 ? StormPrefill(provider, b, 2) : StormDecoder(provider, b);
  }, 120s);
  for (auto& e : exits) EXPECT_TRUE(e.ok()) << e.exit_code << " " << e.signal;
}

// A prefill that stops answering mid-request -- here a bare engine that takes request 7, writes
// into its pages and then ignores the cancel, as a hung one does -- is fenced before the decoder
// gives the pages back: what it writes once it was removed lands nowhere and counts toward no
// later request. Its writes before that landed (its keys were good), and a request naming it
// again gives it keys that work.
class KvFenceTest : public ::testing::TestWithParam<std::string> {};

TEST_P(KvFenceTest, AHungPrefillsLateWritesLandNowhere) {
  const std::string provider = GetParam();
  SmallEnd d;
  ASSERT_TRUE(d.Open(provider, 2).ok());
  auto made = KvDecoder::Create(d.engine.get(), d.side, d.shards.regions, nullptr,
                                /*max_requests=*/1);
  ASSERT_TRUE(made.ok()) << made.status();
  std::unique_ptr<KvDecoder> decoder = std::move(made).value();

  auto bare = TransferEngine::Create(testing_util::TestOptions(provider));
  ASSERT_TRUE(bare.ok()) << bare.status();
  TransferEngine& hung = **bare;
  std::mutex mu;
  std::vector<std::vector<uint8_t>> requests;
  ASSERT_TRUE(hung.SetTaggedMessageHandler(kv::kRequestMagic,
                                           [&](std::optional<PeerId>, std::span<const uint8_t> m) {
                                             std::lock_guard<std::mutex> l(mu);
                                             requests.emplace_back(m.begin(), m.end());
                                           })
                  .ok());
  std::vector<uint8_t> src(4096, 0x5C);
  auto src_reg = hung.RegisterMemory(src.data(), src.size());
  ASSERT_TRUE(src_reg.ok()) << src_reg.status();
  const std::vector<uint8_t> hung_address = hung.Address();

  std::atomic<int> calls{0};
  Status outcome;
  auto submit = [&](uint64_t id, Deadline deadline) {
    KvDecoder::Request req;
    req.request_id = id;
    req.prefill_address = hung_address;
    req.prefill = KvSide{kSmallModel, KvOrder::kHND, 4};
    const std::vector<int64_t> pages = {9, 3, 5, 7, 11};
    req.pages = pages;
    return decoder->Submit(req, deadline, [&](const Status& st) {
      outcome = st;
      calls.fetch_add(1);
    });
  };
  auto received = [&](size_t n) -> StatusOr<kv::WireRequest> {
    const Deadline deadline = Deadline::After(10s);
    for (;;) {
      {
        std::lock_guard<std::mutex> l(mu);
        if (requests.size() >= n) return kv::WireRequest::Parse(requests[n - 1]);
      }
      if (deadline.Expired()) return DeadlineExceededError("request not received");
      std::this_thread::sleep_for(1ms);
    }
  };
  // 4 KiB at the start of every rank's region, counted on the request's immediate; returns
  // how many of the writes succeeded at the writer.
  auto write_all = [&](const kv::WireRequest& w) -> uint64_t {
    StatusOr<PeerId> peer = hung.AddPeer(w.decoder_address);
    if (!peer.ok()) return 0;
    TransferCounter c;
    uint64_t posted = 0;
    for (const RemoteRegion& dst : w.dst) {
      SingleWrite sw;
      sw.src = &*src_reg;
      sw.peer = *peer;
      sw.dst = dst;
      sw.length = src.size();
      sw.imm = w.imm;
      if (hung.Write(sw, Completion::Counter(&c)).ok()) ++posted;
    }
    (void)c.Wait(posted, Deadline::After(15s));
    return c.done.load();
  };
  auto region_starts_with = [&](uint8_t v, size_t n) {
    for (const auto& bytes : d.shards.bytes) {
      if (!std::all_of(bytes.begin(), bytes.begin() + n, [v](uint8_t c) { return c == v; })) {
        return false;
      }
    }
    return true;
  };
  // Whether the 4 KiB written under `imm` land, by a deadline: their immediates counted (what
  // orders the bytes before this thread's reads), then the bytes.
  auto written_lands = [&](uint32_t imm) {
    return d.engine->WaitImm(imm, d.side.tp, Deadline::After(10s)).ok() &&
           region_starts_with(0x5C, src.size());
  };

  ASSERT_TRUE(submit(7, Deadline::After(300ms)).ok());
  auto seven = received(1);
  ASSERT_TRUE(seven.ok()) << seven.status();
  ASSERT_EQ(write_all(*seven), d.side.tp);
  ASSERT_TRUE(written_lands(seven->imm)) << "the prefill's keys did not work";

  // No acknowledgement: the request ends at its deadline plus the cancel's wait, removed.
  const Deadline told = Deadline::After(20s);
  while (calls.load() == 0 && !told.Expired()) std::this_thread::sleep_for(1ms);
  ASSERT_EQ(calls.load(), 1);
  EXPECT_EQ(outcome.code(), StatusCode::kUnavailable) << outcome;
  // The pages are the caller's again, and so is the slot: its count starts from zero.
  EXPECT_EQ(*d.engine->ImmCount(seven->imm), 0u);
  for (auto& bytes : d.shards.bytes) std::fill(bytes.begin(), bytes.end(), uint8_t{0xAB});

  // The prefill wakes and writes on, under the keys it was given.
  (void)write_all(*seven);
  std::this_thread::sleep_for(300ms);
  EXPECT_TRUE(region_starts_with(0xAB, d.shards.bytes[0].size())) << "a late write landed";
  EXPECT_EQ(*d.engine->ImmCount(seven->imm), 0u) << "a late immediate was counted";

  // Named again, it is added again with new keys, which work.
  ASSERT_TRUE(submit(8, Deadline::After(30s)).ok());
  auto eight = received(2);
  ASSERT_TRUE(eight.ok()) << eight.status();
  EXPECT_EQ(write_all(*eight), d.side.tp);
  EXPECT_TRUE(written_lands(eight->imm)) << "the new keys did not work";
  decoder.reset();  // request 8 ends Cancelled
  EXPECT_EQ(calls.load(), 2);
}
INSTANTIATE_TEST_SUITE_P(Providers, KvFenceTest, ::testing::ValuesIn(testing_util::Providers()),
                         testing_util::ProviderTestName);

}  // namespace
}  // namespace ferry
