// TransferEngine tests inside one process: two engines, each the other's peer, over every
// software provider. Data is verified byte for byte; bad input must be refused with the right
// code and must not disturb transfers in flight. What goes wrong underneath (faults, dead
// processes' files): engine_faults_test.cc.
#include "ferry/fabric.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>

#include "fabric/test_util.h"

namespace ferry {
namespace {

using namespace std::chrono_literals;

class EnginePairTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    EngineOptions o = testing_util::TestOptions(GetParam());
    auto a = TransferEngine::Create(o);
    ASSERT_TRUE(a.ok()) << a.status();
    auto b = TransferEngine::Create(o);
    ASSERT_TRUE(b.ok()) << b.status();
    a_ = std::move(a).value();
    b_ = std::move(b).value();
    auto pb = a_->AddPeer(b_->Address());
    ASSERT_TRUE(pb.ok()) << pb.status();
    auto pa = b_->AddPeer(a_->Address());
    ASSERT_TRUE(pa.ok()) << pa.status();
    b_on_a_ = *pb;
    a_on_b_ = *pa;
    src_.resize(kBytes);
    dst_.assign(kBytes, 0);
    std::mt19937 rng(42);
    for (auto& c : src_) c = static_cast<uint8_t>(rng());
    auto s = a_->RegisterMemory(src_.data(), src_.size());
    ASSERT_TRUE(s.ok()) << s.status();
    src_reg_ = std::move(s).value();
    auto d = b_->RegisterMemory(dst_.data(), dst_.size());
    ASSERT_TRUE(d.ok()) << d.status();
    dst_reg_ = std::move(d).value();
    // The descriptor crosses "the wire" as bytes.
    auto parsed = RemoteRegion::Parse(dst_reg_.remote().Serialize());
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    dst_remote_ = *parsed;
  }

  void TearDown() override {
    src_reg_ = MemoryRegion();
    dst_reg_ = MemoryRegion();
    a_.reset();
    b_.reset();
  }

  SingleWrite Single(uint64_t src_off, uint64_t dst_off, uint64_t len) {
    SingleWrite w;
    w.src = &src_reg_;
    w.src_offset = src_off;
    w.peer = b_on_a_;
    w.dst = dst_remote_;
    w.dst_offset = dst_off;
    w.length = len;
    return w;
  }

  PagedWrite Paged(std::span<const uint32_t> src_pages, std::span<const uint32_t> dst_pages,
                   uint64_t page_bytes, uint64_t stride) {
    PagedWrite w;
    w.src = &src_reg_;
    w.peer = b_on_a_;
    w.dst = dst_remote_;
    w.page_bytes = page_bytes;
    w.src_stride = stride;
    w.dst_stride = stride;
    w.src_pages = src_pages;
    w.dst_pages = dst_pages;
    return w;
  }

  // A group of b alone and a scatter plan from our source to b's destination.
  void GroupOfB(GroupId* group, ScatterPlanId* plan) {
    std::vector<PeerId> members = {b_on_a_};
    auto g = a_->AddPeerGroup(members);
    ASSERT_TRUE(g.ok()) << g.status();
    std::vector<RemoteRegion> dsts = {dst_remote_};
    auto p = a_->PrepareScatter(*g, src_reg_, dsts);
    ASSERT_TRUE(p.ok()) << p.status();
    *group = *g;
    *plan = *p;
  }

  static constexpr size_t kBytes = 4 << 20;
  std::unique_ptr<TransferEngine> a_, b_;
  PeerId b_on_a_ = 0, a_on_b_ = 0;
  std::vector<uint8_t> src_, dst_;
  MemoryRegion src_reg_, dst_reg_;
  RemoteRegion dst_remote_;
};

TEST_P(EnginePairTest, SingleWritesLandByteForByteWithImmediate) {
  ASSERT_TRUE(b_->CreateImmCounter(11).ok());
  const uint64_t sizes[] = {1, 7, 4096, 65537, 1 << 20, 3 * (1 << 20) + 5};
  uint64_t off = 0;
  TransferCounter counter;
  for (uint64_t len : sizes) {
    SingleWrite w = Single(off, kBytes - len - off % 13, len);
    w.imm = 11;
    Status submitted = a_->Write(w, Completion::Counter(&counter));
    ASSERT_TRUE(submitted.ok()) << submitted;
    ASSERT_TRUE(counter.Wait(1, Deadline::After(10s)).ok());
    ASSERT_EQ(counter.failed.load(), 0u);
    counter.done = 0;
    ASSERT_TRUE(b_->WaitImm(11, 1, Deadline::After(10s)).ok());
    ASSERT_TRUE(b_->ConsumeImm(11, 1).ok());
    ASSERT_EQ(0, std::memcmp(dst_.data() + w.dst_offset, src_.data() + off, len)) << len;
    off = (off + 4099) % 4096;
  }
  EXPECT_EQ(*b_->ImmCount(11), 0u);
}

TEST_P(EnginePairTest, PagedWritesPermutePagesAndCountEachPage) {
  const uint32_t kPage = 4096, kPages = 256;
  std::vector<uint32_t> src_pages(kPages), dst_pages(kPages);
  std::iota(src_pages.begin(), src_pages.end(), 0);
  std::iota(dst_pages.begin(), dst_pages.end(), 0);
  std::mt19937 rng(7);
  std::shuffle(dst_pages.begin(), dst_pages.end(), rng);
  ASSERT_TRUE(b_->CreateImmCounter(0xABCD0001).ok());
  PagedWrite w = Paged(src_pages, dst_pages, kPage - 16, kPage);  // pages need not fill strides
  w.src_offset = 8;
  w.dst_offset = 16;
  w.imm = 0xABCD0001;
  std::atomic<int> calls{0};
  Status result = InternalError("not called");
  ASSERT_TRUE(a_->WritePaged(w, Completion::Callback([&](const Status& s) {
                               result = s;
                               calls.fetch_add(1);
                             })).ok());
  ASSERT_TRUE(b_->WaitImm(0xABCD0001, kPages, Deadline::After(10s)).ok());
  for (int i = 0; i < 10000 && calls.load() == 0; ++i) std::this_thread::sleep_for(1ms);
  ASSERT_EQ(calls.load(), 1);
  ASSERT_TRUE(result.ok()) << result;
  for (uint32_t i = 0; i < kPages; ++i) {
    ASSERT_EQ(0, std::memcmp(dst_.data() + 16 + uint64_t{dst_pages[i]} * kPage,
                             src_.data() + 8 + uint64_t{src_pages[i]} * kPage, kPage - 16))
        << "page " << i;
  }
  EXPECT_EQ(*b_->ImmCount(0xABCD0001), kPages);
}

// imm_once: one weighted immediate (one NIC here) for the whole paged write, after every page
// landed: it counts as the pages.
TEST_P(EnginePairTest, PagedWriteWithOneWeightedImmediateCountsItsPages) {
  constexpr uint32_t kImm = 0xAB000003, kMask = 0x00FFF000;
  const uint32_t kPage = 4096, kPages = 200;
  std::vector<uint32_t> src_pages(kPages), dst_pages(kPages);
  std::iota(src_pages.begin(), src_pages.end(), 0);
  std::iota(dst_pages.rbegin(), dst_pages.rend(), 0);  // reversed
  ASSERT_TRUE(b_->CreateWeightedImmCounter(kImm, kMask).ok());
  EXPECT_EQ(b_->CreateWeightedImmCounter(kImm + 1, 0).code(), StatusCode::kInvalidArgument);
  const uint64_t imms_before = b_->stats().imms_received;
  PagedWrite w = Paged(src_pages, dst_pages, kPage, kPage);
  w.imm = kImm;
  w.imm_once = true;
  EXPECT_EQ(a_->WritePaged(w, {}).code(), StatusCode::kInvalidArgument);  // no weight mask
  w.imm_weight_mask = 0x0F000000;  // overlaps the immediate
  EXPECT_EQ(a_->WritePaged(w, {}).code(), StatusCode::kInvalidArgument);
  w.imm_weight_mask = 0x00000F00 << 4;  // 4 bits: 15 pages, fewer than one NIC carries
  EXPECT_EQ(a_->WritePaged(w, {}).code(), StatusCode::kInvalidArgument);
  w.imm_weight_mask = kMask;
  TransferCounter done;
  ASSERT_TRUE(a_->WritePaged(w, Completion::Counter(&done)).ok());
  ASSERT_TRUE(b_->WaitImm(kImm, kPages, Deadline::After(10s)).ok());
  // The count jumps once, by the pages, after the last one landed: every page is there.
  for (uint32_t i = 0; i < kPages; ++i) {
    ASSERT_EQ(0, std::memcmp(dst_.data() + uint64_t{dst_pages[i]} * kPage,
                             src_.data() + uint64_t{src_pages[i]} * kPage, kPage))
        << "page " << i;
  }
  ASSERT_TRUE(done.Wait(1, Deadline::After(10s)).ok());
  EXPECT_EQ(done.failed.load(), 0u);
  EXPECT_EQ(*b_->ImmCount(kImm), kPages);
  EXPECT_EQ(b_->stats().imms_received - imms_before, 1u);
}

// The weighted immediate goes right behind its pages where the provider places writes on a
// connection in order (FabricInfo::ordered_write_bytes; tcp;ofi_rxm does), and waits for their
// completions where it does not (shm) or where the engine is told not to trust the order. Either
// way every page is in place once the count jumps.
TEST_P(EnginePairTest, AnImmediateWaitsForItsPagesOnlyWhereWritesAreUnordered) {
  constexpr uint32_t kImm = 0xAB000005, kMask = 0x00FFF000;
  const uint32_t kPage = 4096, kPages = 200;
  std::vector<uint32_t> src_pages(kPages), dst_pages(kPages);
  std::iota(src_pages.begin(), src_pages.end(), 0);
  std::iota(dst_pages.rbegin(), dst_pages.rend(), 0);
  ASSERT_TRUE(b_->CreateWeightedImmCounter(kImm, kMask).ok());

  // Writers: a_ (trusts the order, the default) and c, which does not.
  EngineOptions o = testing_util::TestOptions(GetParam());
  o.trust_write_order = false;
  auto c = TransferEngine::Create(o);
  ASSERT_TRUE(c.ok()) << c.status();
  auto b_on_c = (*c)->AddPeer(b_->Address());
  ASSERT_TRUE(b_on_c.ok()) << b_on_c.status();
  auto c_src = (*c)->RegisterMemory(src_.data(), src_.size());
  ASSERT_TRUE(c_src.ok()) << c_src.status();

  const bool ordered = a_->info().ordered_write_bytes >= kPage;
  std::printf("%s: writes placed in order up to %llu bytes\n", GetParam().c_str(),
              static_cast<unsigned long long>(a_->info().ordered_write_bytes));
  TransferEngine* writers[] = {a_.get(), c->get()};
  const MemoryRegion* sources[] = {&src_reg_, &*c_src};
  const PeerId peers[] = {b_on_a_, *b_on_c};
  for (int w = 0; w < 2; ++w) {
    std::fill(dst_.begin(), dst_.end(), 0);
    PagedWrite pw = Paged(src_pages, dst_pages, kPage, kPage);
    pw.src = sources[w];
    pw.peer = peers[w];
    pw.imm = kImm;
    pw.imm_once = true;
    pw.imm_weight_mask = kMask;
    const uint64_t waits_before = writers[w]->stats().imm_waits;
    TransferCounter done;
    ASSERT_TRUE(writers[w]->WritePaged(pw, Completion::Counter(&done)).ok());
    ASSERT_TRUE(b_->WaitImm(kImm, uint64_t{kPages} * (w + 1), Deadline::After(10s)).ok());
    for (uint32_t i = 0; i < kPages; ++i) {
      ASSERT_EQ(0, std::memcmp(dst_.data() + uint64_t{dst_pages[i]} * kPage,
                               src_.data() + uint64_t{src_pages[i]} * kPage, kPage))
          << "writer " << w << ", page " << i;
    }
    ASSERT_TRUE(done.Wait(1, Deadline::After(10s)).ok());
    EXPECT_EQ(done.failed.load(), 0u);
    // The worker posts all 200 pages before it polls a completion (the provider queues take
    // them: 1024 deep on shm, 2048 on tcp here), so an immediate that must wait always waits.
    const uint64_t waits = writers[w]->stats().imm_waits - waits_before;
    EXPECT_EQ(waits, w == 0 && ordered ? 0u : 1u) << "writer " << w;
  }
}

// An idle worker sleeps, but not while a notification is armed: the writes it waits for move
// only inside the worker's polls. Once it fired, the worker sleeps again.
TEST_P(EnginePairTest, AWorkerWithANotificationArmedDoesNotSleep) {
  auto sleeps = [&] { return b_->stats().worker_sleeps; };
  const uint64_t idle_start = sleeps();
  std::this_thread::sleep_for(30ms);
  EXPECT_GT(sleeps(), idle_start) << "an idle engine never slept";
  ASSERT_TRUE(b_->CreateImmCounter(7).ok());
  std::atomic<bool> fired{false};
  ASSERT_TRUE(b_->NotifyImm(7, 1, Deadline::After(10s), [&](const Status& s) {
    EXPECT_TRUE(s.ok()) << s;
    fired = true;
  }).ok());
  std::this_thread::sleep_for(5ms);  // the worker has taken the notification by now
  const uint64_t armed_start = sleeps();
  std::this_thread::sleep_for(30ms);
  EXPECT_LE(sleeps(), armed_start + 1) << "slept while a notification was armed";
  TransferCounter c;
  ASSERT_TRUE(a_->WriteImm(b_on_a_, 7, Completion::Counter(&c)).ok());
  ASSERT_TRUE(c.Wait(1, Deadline::After(10s)).ok());
  const Deadline deadline = Deadline::After(10s);
  while (!fired && !deadline.Expired()) std::this_thread::sleep_for(1ms);
  ASSERT_TRUE(fired);
  const uint64_t fired_at = sleeps();
  std::this_thread::sleep_for(30ms);
  EXPECT_GT(sleeps(), fired_at) << "the worker never slept again";
}

TEST_P(EnginePairTest, ImmediateOnlyAndNotify) {
  ASSERT_TRUE(b_->CreateImmCounter(5).ok());
  std::atomic<int> fired{0};
  Status seen = InternalError("not called");
  ASSERT_TRUE(b_->NotifyImm(5, 3, Deadline::After(10s), [&](const Status& s) {
                    seen = s;
                    fired.fetch_add(1);
                  }).ok());
  TransferCounter c;
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(a_->WriteImm(b_on_a_, 5, Completion::Counter(&c)).ok());
  ASSERT_TRUE(c.Wait(3, Deadline::After(10s)).ok());
  EXPECT_EQ(c.failed.load(), 0u);
  for (int i = 0; i < 10000 && fired.load() == 0; ++i) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(fired.load(), 1);
  EXPECT_TRUE(seen.ok()) << seen;
  EXPECT_EQ(*b_->ImmCount(5), 3u);
  // A notification that cannot be reached ends with DeadlineExceeded, naming the counter.
  std::atomic<int> late{0};
  Status late_status;
  ASSERT_TRUE(b_->NotifyImm(5, 100, Deadline::After(50ms), [&](const Status& s) {
                    late_status = s;
                    late.fetch_add(1);
                  }).ok());
  for (int i = 0; i < 10000 && late.load() == 0; ++i) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(late_status.code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(late_status.message().find("expected 100, seen 3"), std::string::npos) << late_status;
  Status wait = b_->WaitImm(5, 4, Deadline::After(20ms));
  EXPECT_EQ(wait.code(), StatusCode::kDeadlineExceeded);
  // Disarming ends an armed notification with Cancelled; then another can be armed.
  std::atomic<int> disarmed{0};
  Status disarm_status;
  ASSERT_TRUE(b_->NotifyImm(5, 100, Deadline::After(10s), [&](const Status& s) {
                    disarm_status = s;
                    disarmed.fetch_add(1);
                  }).ok());
  ASSERT_TRUE(b_->DisarmImm(5).ok());
  for (int i = 0; i < 10000 && disarmed.load() == 0; ++i) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(disarm_status.code(), StatusCode::kCancelled);
  std::atomic<int> rearmed{0};
  ASSERT_TRUE(b_->NotifyImm(5, 3, Deadline::After(10s), [&](const Status& s) {
                    if (s.ok()) rearmed.fetch_add(1);
                  }).ok());
  for (int i = 0; i < 10000 && rearmed.load() == 0; ++i) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(rearmed.load(), 1);
  EXPECT_EQ(b_->DisarmImm(12345).code(), StatusCode::kNotFound);
}

// MirrorImm keeps a word at the counter's total: set at once to what arrived so far, raised by
// each arrival (weighted ones by their weight), not lowered by ConsumeImm; another word replaces
// it, null stops it (nothing written after the call returns); a misaligned word or an unknown
// counter is refused.
TEST_P(EnginePairTest, MirrorImmKeepsAWordAtTheCountersTotal) {
  constexpr uint32_t kImm = 0xAB000004, kMask = 0x00FFF000;
  ASSERT_TRUE(b_->CreateWeightedImmCounter(kImm, kMask).ok());
  auto send = [&](uint32_t imm, int times) {
    TransferCounter c;
    for (int i = 0; i < times; ++i) {
      ASSERT_TRUE(a_->WriteImm(b_on_a_, imm, Completion::Counter(&c)).ok());
    }
    ASSERT_TRUE(c.Wait(times, Deadline::After(10s)).ok());
    EXPECT_EQ(c.failed.load(), 0u);
  };
  auto reaches = [](const uint64_t& word, uint64_t want) {
    for (int i = 0; i < 10000; ++i) {
      const uint64_t now = std::atomic_ref<const uint64_t>(word).load(std::memory_order_acquire);
      if (now == want) return true;
      std::this_thread::sleep_for(1ms);
    }
    return false;
  };
  send(kImm, 2);
  ASSERT_TRUE(b_->WaitImm(kImm, 2, Deadline::After(10s)).ok());
  alignas(8) uint64_t first = 99, second = 0;
  ASSERT_TRUE(b_->MirrorImm(kImm, &first).ok());
  EXPECT_EQ(first, 2u);  // what arrived before, stored before MirrorImm returned
  send(kImm, 3);
  send(WeightedImm(kImm, kMask, 10), 1);
  EXPECT_TRUE(reaches(first, 15)) << first;
  ASSERT_TRUE(b_->ConsumeImm(kImm, 15).ok());
  EXPECT_EQ(*b_->ImmCount(kImm), 0u);
  ASSERT_TRUE(b_->MirrorImm(kImm, &second).ok());  // replaces the first word
  EXPECT_EQ(second, 15u);  // the total: consumed arrivals stay counted
  send(kImm, 1);
  EXPECT_TRUE(reaches(second, 16)) << second;
  EXPECT_EQ(first, 15u);
  ASSERT_TRUE(b_->MirrorImm(kImm, nullptr).ok());
  send(kImm, 1);
  ASSERT_TRUE(b_->WaitImm(kImm, 2, Deadline::After(10s)).ok());
  EXPECT_EQ(second, 16u);  // stopped
  uint64_t words[2] = {};
  auto* misaligned = reinterpret_cast<uint64_t*>(reinterpret_cast<uint8_t*>(words) + 4);
  EXPECT_EQ(b_->MirrorImm(kImm, misaligned).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(b_->MirrorImm(12345, words).code(), StatusCode::kNotFound);
}

TEST_P(EnginePairTest, UnmatchedImmediatesGoToTheHandler) {
  std::atomic<uint32_t> got{0};
  b_->SetUnmatchedImmHandler([&](uint32_t imm) { got.store(imm); });
  TransferCounter c;
  ASSERT_TRUE(a_->WriteImm(b_on_a_, 0xFEED, Completion::Counter(&c)).ok());
  ASSERT_TRUE(c.Wait(1, Deadline::After(10s)).ok());
  for (int i = 0; i < 10000 && got.load() == 0; ++i) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(got.load(), 0xFEEDu);
  EXPECT_GE(b_->stats().imms_unmatched, 1u);
}

// Messages go by their first four bytes to the handler of that tag, the rest (shorter ones
// too) to the untagged handler; a tag has one handler at a time (AlreadyExists until it is
// given up with a null one), at most kMaxMessageTags are taken.
TEST_P(EnginePairTest, TaggedMessagesGoToTheirTagsHandler) {
  std::mutex mu;
  std::vector<std::pair<char, uint32_t>> got;  // (handler, first word or the length)
  auto word = [](std::span<const uint8_t> m) {
    uint32_t v = 0;
    if (m.size() >= 4) std::memcpy(&v, m.data(), 4);
    return m.size() >= 4 ? v : static_cast<uint32_t>(m.size());
  };
  auto handler = [&](char name) {
    return [&, name](std::optional<PeerId>, std::span<const uint8_t> m) {
      std::lock_guard<std::mutex> l(mu);
      got.emplace_back(name, word(m));
    };
  };
  b_->SetMessageHandler(handler('u'));
  ASSERT_TRUE(b_->SetTaggedMessageHandler(7, handler('a')).ok());
  ASSERT_TRUE(b_->SetTaggedMessageHandler(9, handler('b')).ok());
  EXPECT_EQ(b_->SetTaggedMessageHandler(7, handler('c')).code(), StatusCode::kAlreadyExists);
  auto send = [&](uint32_t first, size_t bytes) {
    std::vector<uint8_t> m(bytes, 0xAB);
    std::memcpy(m.data(), &first, std::min<size_t>(bytes, 4));
    TransferCounter c;
    ASSERT_TRUE(a_->Send(b_on_a_, m, Completion::Counter(&c)).ok());
    ASSERT_TRUE(c.Wait(1, Deadline::After(10s)).ok());
  };
  auto expect = [&](std::vector<std::pair<char, uint32_t>> want) {
    for (int i = 0; i < 10000; ++i) {
      {
        std::lock_guard<std::mutex> l(mu);
        if (got.size() >= want.size()) break;
      }
      std::this_thread::sleep_for(1ms);
    }
    std::lock_guard<std::mutex> l(mu);
    EXPECT_EQ(got, want);
    got.clear();
  };
  send(7, 16);
  send(9, 4);
  send(8, 16);
  send(7, 3);  // shorter than a tag: the untagged handler's, whatever its bytes
  expect({{'a', 7}, {'b', 9}, {'u', 8}, {'u', 3}});
  ASSERT_TRUE(b_->SetTaggedMessageHandler(7, nullptr).ok());
  ASSERT_TRUE(b_->SetTaggedMessageHandler(7, handler('c')).ok());
  send(7, 8);
  expect({{'c', 7}});
  for (uint32_t t = 100; t < 100 + TransferEngine::kMaxMessageTags - 2; ++t) {
    ASSERT_TRUE(b_->SetTaggedMessageHandler(t, handler('x')).ok()) << t;
  }
  EXPECT_EQ(b_->SetTaggedMessageHandler(1, handler('y')).code(),
            StatusCode::kResourceExhausted);
}

TEST_P(EnginePairTest, SendRecvRepostsBounceBuffers) {
  std::mutex mu;
  std::vector<std::vector<uint8_t>> received;
  std::vector<std::optional<PeerId>> senders;
  b_->SetMessageHandler([&](std::optional<PeerId> from, std::span<const uint8_t> m) {
    std::lock_guard<std::mutex> l(mu);
    received.emplace_back(m.begin(), m.end());
    senders.push_back(from);
  });
  // More messages than receive buffers: buffers must be re-posted.
  const int kMessages = 300;
  TransferCounter c;
  for (int i = 0; i < kMessages; ++i) {
    std::vector<uint8_t> m(static_cast<size_t>(i * 37 % 9000) + 1);
    for (size_t k = 0; k < m.size(); ++k) m[k] = static_cast<uint8_t>(i + k);
    Status s;
    while ((s = a_->Send(b_on_a_, m, Completion::Counter(&c))).code() ==
           StatusCode::kResourceExhausted) {
      std::this_thread::sleep_for(100us);
    }
    ASSERT_TRUE(s.ok()) << s;
  }
  ASSERT_TRUE(c.Wait(kMessages, Deadline::After(20s)).ok());
  EXPECT_EQ(c.failed.load(), 0u);
  for (int i = 0; i < 20000; ++i) {
    {
      std::lock_guard<std::mutex> l(mu);
      if (received.size() == kMessages) break;
    }
    std::this_thread::sleep_for(1ms);
  }
  std::lock_guard<std::mutex> l(mu);
  ASSERT_EQ(received.size(), static_cast<size_t>(kMessages));
  // Messages from one sender arrive in order (RDM endpoints with FI_ORDER_SAS by default) or not;
  // check the multiset by length and content.
  std::vector<bool> seen(kMessages, false);
  for (auto& m : received) {
    int i = -1;
    for (int cand = 0; cand < kMessages; ++cand) {
      if (!seen[cand] && m.size() == static_cast<size_t>(cand * 37 % 9000) + 1 &&
          m[0] == static_cast<uint8_t>(cand)) {
        i = cand;
        break;
      }
    }
    ASSERT_GE(i, 0);
    seen[i] = true;
    for (size_t k = 0; k < m.size(); ++k) ASSERT_EQ(m[k], static_cast<uint8_t>(i + k));
  }
  if (b_->info().provider == "shm" || b_->info().provider == "tcp;ofi_rxm") {
    for (auto& s : senders) EXPECT_EQ(s, std::optional<PeerId>(a_on_b_));
  }
}

TEST_P(EnginePairTest, BadInputsAreRefusedWithTheRightCode) {
  TransferCounter c;
  // Out-of-range offsets on either side.
  EXPECT_EQ(a_->Write(Single(kBytes - 10, 0, 11), Completion::Counter(&c)).code(),
            StatusCode::kOutOfRange);
  EXPECT_EQ(a_->Write(Single(0, kBytes, 1), Completion::Counter(&c)).code(),
            StatusCode::kOutOfRange);
  EXPECT_EQ(a_->Write(Single(0, ~uint64_t{0} - 2, 8), Completion::Counter(&c)).code(),
            StatusCode::kOutOfRange);
  EXPECT_EQ(a_->Write(Single(0, 0, 0), Completion::Counter(&c)).code(),
            StatusCode::kInvalidArgument);
  // Unknown peer, unknown group, unknown plan.
  SingleWrite w = Single(0, 0, 8);
  w.peer = 99;
  EXPECT_EQ(a_->Write(w, Completion::Counter(&c)).code(), StatusCode::kNotFound);
  EXPECT_EQ(a_->WriteImm(77, 1, {}).code(), StatusCode::kNotFound);
  EXPECT_EQ(a_->Barrier(3, 1, {}).code(), StatusCode::kNotFound);
  EXPECT_EQ(a_->Scatter({.plan = 9}, {}).code(), StatusCode::kNotFound);
  // A descriptor of another engine (our own region, sent to peer b).
  SingleWrite foreign = Single(0, 0, 8);
  foreign.dst = src_reg_.remote();
  EXPECT_EQ(a_->Write(foreign, {}).code(), StatusCode::kInvalidArgument);
  // A source region from another engine.
  SingleWrite wrong_src = Single(0, 0, 8);
  wrong_src.src = &dst_reg_;
  EXPECT_EQ(a_->Write(wrong_src, {}).code(), StatusCode::kInvalidArgument);
  // Page indices out of range, mismatched lists, zero pages bytes.
  std::vector<uint32_t> pages = {0, 1, 1024};
  std::vector<uint32_t> short_list = {0, 1};
  PagedWrite p = Paged(pages, pages, 4096, 4096);
  Status s = a_->WritePaged(p, {});
  EXPECT_EQ(s.code(), StatusCode::kOutOfRange);
  EXPECT_NE(s.message().find("page 2"), std::string::npos) << s;
  p.dst_pages = short_list;
  EXPECT_EQ(a_->WritePaged(p, {}).code(), StatusCode::kInvalidArgument);
  p.dst_pages = pages;
  p.page_bytes = 0;
  EXPECT_EQ(a_->WritePaged(p, {}).code(), StatusCode::kInvalidArgument);
  // Huge page index times stride overflows.
  std::vector<uint32_t> huge = {0xFFFFFFFFu};
  p.page_bytes = 8;
  p.src_pages = huge;
  p.dst_pages = huge;
  p.src_stride = p.dst_stride = ~uint64_t{0} / 2;
  EXPECT_EQ(a_->WritePaged(p, {}).code(), StatusCode::kOutOfRange);
  // Malformed descriptors and addresses.
  std::vector<uint8_t> bytes = dst_reg_.remote().Serialize();
  EXPECT_EQ(RemoteRegion::Parse(std::span(bytes).first(bytes.size() - 1)).status().code(),
            StatusCode::kInvalidArgument);
  bytes[0] ^= 0xFF;
  EXPECT_EQ(RemoteRegion::Parse(bytes).status().code(), StatusCode::kInvalidArgument);
  std::vector<uint8_t> addr = b_->Address();
  addr.push_back(0);
  EXPECT_EQ(a_->AddPeer(addr).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(a_->AddPeer({}).status().code(), StatusCode::kInvalidArgument);
  // Oversized message.
  std::vector<uint8_t> big(1 << 20);
  EXPECT_EQ(a_->Send(b_on_a_, big, {}).code(), StatusCode::kInvalidArgument);
  // None of these posted anything: nothing completed or failed.
  EXPECT_EQ(c.done.load() + c.failed.load(), 0u);
  // And a good transfer still works afterwards. Local completion means the source may be reused;
  // the data is known to have landed when the target sees the immediate.
  ASSERT_TRUE(b_->CreateImmCounter(3).ok());
  SingleWrite good = Single(0, 0, 4096);
  good.imm = 3;
  ASSERT_TRUE(a_->Write(good, Completion::Counter(&c)).ok());
  ASSERT_TRUE(c.Wait(1, Deadline::After(10s)).ok());
  EXPECT_EQ(c.done.load(), 1u);
  ASSERT_TRUE(b_->WaitImm(3, 1, Deadline::After(10s)).ok());
  EXPECT_EQ(0, std::memcmp(dst_.data(), src_.data(), 4096));
}

TEST_P(EnginePairTest, ARemovedPeerRefusesWorkAndCanBeRemovedAgain) {
  TransferCounter done;
  ASSERT_TRUE(a_->Write(Single(0, 0, 4096), Completion::Counter(&done)).ok());
  ASSERT_TRUE(done.Wait(1, Deadline::After(5s)).ok());
  // An engine that is a peer already keeps its PeerId (what shares this engine shares it).
  auto same = a_->AddPeer(b_->Address());
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_EQ(*same, b_on_a_);
  ASSERT_TRUE(a_->RemovePeer(b_on_a_).ok());
  EXPECT_TRUE(*a_->PeerLost(b_on_a_));
  Status s = a_->Write(Single(0, 0, 64), Completion());
  EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;
  EXPECT_EQ(a_->WriteImm(b_on_a_, 1, Completion()).code(), StatusCode::kUnavailable);
  // Lost or removed already: removing again succeeds (a caller cleaning up need not know which).
  EXPECT_TRUE(a_->RemovePeer(b_on_a_).ok());
  EXPECT_EQ(a_->RemovePeer(12345).code(), StatusCode::kNotFound);
  // The other direction is untouched.
  TransferCounter back;
  ASSERT_TRUE(b_->WriteImm(a_on_b_, 3, Completion::Counter(&back)).ok());
  ASSERT_TRUE(back.Wait(1, Deadline::After(5s)).ok());
  EXPECT_EQ(back.failed.load(), 0u);
  // Removed, the engine is a new peer when added again.
  auto again = a_->AddPeer(b_->Address());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_NE(*again, b_on_a_);
  EXPECT_FALSE(*a_->PeerLost(*again));
}

// A second registration of the same bytes is a second key, and revoking it (Revoke: OK, the
// region empty after) revokes that key alone: a write under it, posted after, changes neither
// the bytes nor the immediate counter it names, while writes under the first key still land.
// (The KV decoder gives each prefill a key of its own this way, to fence one that hung.)
// Revoke refuses an empty region and one of another engine.
TEST_P(EnginePairTest, ADeregisteredKeyRefusesLaterWritesAndLeavesTheOtherKeysWorking) {
  ASSERT_TRUE(b_->CreateImmCounter(11).ok());
  auto second = b_->RegisterMemory(dst_.data(), dst_.size());
  ASSERT_TRUE(second.ok()) << second.status();
  MemoryRegion alias = std::move(second).value();
  SingleWrite w = Single(0, 0, 4096);
  w.dst = *RemoteRegion::Parse(alias.remote().Serialize());
  w.imm = 11;
  // Posts `write` (4 KiB at offset 0) and expects it landed and counted once.
  auto lands = [&](const SingleWrite& write) {
    TransferCounter landed;
    ASSERT_TRUE(a_->Write(write, Completion::Counter(&landed)).ok());
    ASSERT_TRUE(landed.Wait(1, Deadline::After(10s)).ok());
    ASSERT_EQ(landed.failed.load(), 0u);
    ASSERT_TRUE(b_->WaitImm(11, 1, Deadline::After(10s)).ok());
    ASSERT_EQ(0, std::memcmp(dst_.data(), src_.data(), 4096));
    ASSERT_TRUE(b_->ConsumeImm(11, 1).ok());
  };
  lands(w);

  MemoryRegion empty;
  EXPECT_EQ(b_->Revoke(empty).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(a_->Revoke(alias).code(), StatusCode::kInvalidArgument);  // b's region
  ASSERT_TRUE(alias.valid());
  ASSERT_TRUE(b_->Revoke(alias).ok());
  EXPECT_FALSE(alias.valid());
  std::fill(dst_.begin(), dst_.end(), uint8_t{0xAB});
  TransferCounter refused;
  uint64_t posted = 0;
  for (uint64_t len : {uint64_t{64}, uint64_t{65536}}) {
    SingleWrite late = w;
    late.length = len;
    Status s = a_->Write(late, Completion::Counter(&refused));
    if (s.ok()) {
      ++posted;
    } else {
      EXPECT_EQ(s.code(), StatusCode::kUnavailable) << s;  // the first failure lost the peer
    }
  }
  // What the writer hears is the provider's: tcp completes a write once it has left, and the
  // target drops it; shm fails it. Either way nothing lands.
  ASSERT_GE(posted, 1u);
  ASSERT_TRUE(refused.Wait(posted, Deadline::After(15s)).ok());
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(*b_->ImmCount(11), 0u);
  EXPECT_TRUE(std::all_of(dst_.begin(), dst_.end(), [](uint8_t c) { return c == 0xAB; }));

  // The first key still works (after adding the peer again where the failure lost it).
  PeerId peer = b_on_a_;
  if (*a_->PeerLost(peer)) {
    auto again = a_->AddPeer(b_->Address());
    ASSERT_TRUE(again.ok()) << again.status();
    peer = *again;
  }
  SingleWrite fine = Single(0, 0, 4096);
  fine.peer = peer;
  fine.imm = 11;
  lands(fine);
}

// The peer table holds the peers of now: a removed peer's slot serves the next AddPeer, so an
// engine of two slots can add and remove peers without end, and a PeerId of a removed peer never
// reaches whoever holds its slot later.
TEST_P(EnginePairTest, RemovedPeersFreeTheirSlotsAndTheirIdsStayDead) {
  EngineOptions o = testing_util::TestOptions(GetParam());
  o.max_peers = 2;
  auto small = TransferEngine::Create(o);
  ASSERT_TRUE(small.ok()) << small.status();
  TransferEngine& c = **small;
  auto third = TransferEngine::Create(testing_util::TestOptions(GetParam()));
  ASSERT_TRUE(third.ok()) << third.status();
  ASSERT_TRUE(b_->CreateImmCounter(77).ok());
  ASSERT_TRUE((*third)->CreateImmCounter(77).ok());

  std::vector<PeerId> old;
  uint64_t landed_on_b = 0;
  for (int round = 0; round < 6; ++round) {
    // Two engines fill the table; a third does not fit until one is removed.
    auto pb = c.AddPeer(b_->Address());
    ASSERT_TRUE(pb.ok()) << "round " << round << ": " << pb.status();
    auto pa = c.AddPeer(a_->Address());
    ASSERT_TRUE(pa.ok()) << pa.status();
    EXPECT_EQ(c.AddPeer((*third)->Address()).status().code(), StatusCode::kResourceExhausted);
    for (PeerId p : old) EXPECT_NE(p, *pb) << "a PeerId came back";
    TransferCounter sent;
    ASSERT_TRUE(c.WriteImm(*pb, 77, Completion::Counter(&sent)).ok());
    ASSERT_TRUE(sent.Wait(1, Deadline::After(10s)).ok());
    EXPECT_EQ(sent.failed.load(), 0u);
    ++landed_on_b;
    ASSERT_TRUE(c.RemovePeer(*pb).ok());
    ASSERT_TRUE(c.RemovePeer(*pa).ok());
    old.push_back(*pb);
    old.push_back(*pa);
    // The slots are now the third engine's (and then b's again): every old PeerId is refused
    // as removed, reports lost, and removing it again touches nobody.
    auto p3 = c.AddPeer((*third)->Address());
    ASSERT_TRUE(p3.ok()) << p3.status();
    for (PeerId p : old) {
      EXPECT_EQ(c.WriteImm(p, 77, Completion()).code(), StatusCode::kUnavailable) << p;
      EXPECT_TRUE(*c.PeerLost(p));
      EXPECT_TRUE(c.RemovePeer(p).ok());
    }
    EXPECT_FALSE(*c.PeerLost(*p3));
    std::vector<PeerId> stale_group = {old.back()};
    EXPECT_EQ(c.AddPeerGroup(stale_group).status().code(), StatusCode::kUnavailable);
    ASSERT_TRUE(c.WriteImm(*p3, 77, Completion::Counter(&sent)).ok());
    ASSERT_TRUE(sent.Wait(2, Deadline::After(10s)).ok());
    EXPECT_EQ(sent.failed.load(), 0u);
    ASSERT_TRUE(c.RemovePeer(*p3).ok());
  }
  // Only what went to each engine's current PeerId arrived: the stale submits were refused.
  ASSERT_TRUE(b_->WaitImm(77, landed_on_b, Deadline::After(10s)).ok());
  EXPECT_EQ(*b_->ImmCount(77), landed_on_b);
  ASSERT_TRUE((*third)->WaitImm(77, 6, Deadline::After(10s)).ok());
  EXPECT_EQ(*(*third)->ImmCount(77), 6u);
  // A PeerId whose slot was never used, or of a generation not yet reached, is unknown.
  EXPECT_EQ(c.WriteImm(old.back() + (1u << 16) * 100, 77, Completion()).code(),
            StatusCode::kNotFound);
  o.max_peers = 1u << 17;
  EXPECT_EQ(TransferEngine::Create(o).status().code(), StatusCode::kInvalidArgument);
}

// A group member removed after the group was made: scatters and barriers that name it fail
// (Unavailable), at submit and, for one already queued, when the worker reaches it.
TEST_P(EnginePairTest, AGroupWithARemovedMemberFailsItsWrites) {
  GroupId group = 0;
  ScatterPlanId plan = 0;
  ASSERT_NO_FATAL_FAILURE(GroupOfB(&group, &plan));
  std::vector<ScatterTarget> targets = {{0, 0, 0, 4096}};
  ASSERT_TRUE(a_->RemovePeer(b_on_a_).ok());
  EXPECT_EQ(a_->Scatter({plan, targets, std::nullopt}, {}).code(), StatusCode::kUnavailable);
  EXPECT_EQ(a_->Barrier(group, 5, {}).code(), StatusCode::kUnavailable);
  // Added again (into the same slot, a new generation): the old group still names the old
  // PeerId, and stays refused.
  auto again = a_->AddPeer(b_->Address());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(a_->Scatter({plan, targets, std::nullopt}, {}).code(), StatusCode::kUnavailable);
  EXPECT_EQ(a_->Barrier(group, 5, {}).code(), StatusCode::kUnavailable);
}

TEST_P(EnginePairTest, ScatterAndBarrierOverAGroupOfOne) {
  GroupId group = 0;
  ScatterPlanId plan = 0;
  ASSERT_NO_FATAL_FAILURE(GroupOfB(&group, &plan));
  ASSERT_TRUE(b_->CreateImmCounter(42).ok());
  std::vector<ScatterTarget> targets = {
      {0, 0, 1000, 100}, {0, 5000, 3000, 1}, {0, 9000, 20000, 65536}};
  TransferCounter c;
  ASSERT_TRUE(a_->Scatter({plan, targets, 42}, Completion::Counter(&c)).ok());
  ASSERT_TRUE(a_->Barrier(group, 42, Completion::Counter(&c)).ok());
  ASSERT_TRUE(c.Wait(2, Deadline::After(10s)).ok());
  EXPECT_EQ(c.failed.load(), 0u);
  ASSERT_TRUE(b_->WaitImm(42, 4, Deadline::After(10s)).ok());
  for (auto& t : targets) {
    EXPECT_EQ(0, std::memcmp(dst_.data() + t.dst_offset, src_.data() + t.src_offset, t.length));
  }
  std::vector<ScatterTarget> bad = {{1, 0, 0, 8}};
  EXPECT_EQ(a_->Scatter({plan, bad, 42}, {}).code(), StatusCode::kOutOfRange);
  bad = {{0, 0, kBytes - 4, 8}};
  EXPECT_EQ(a_->Scatter({plan, bad, 42}, {}).code(), StatusCode::kOutOfRange);
}

// A plan re-prepared in place keeps its id and writes under the new key: b's first key is
// revoked and the scatter still lands, under the second; the group replaced in place keeps
// its id too. Bad arguments leave both as they were.
TEST_P(EnginePairTest, APlanRePreparedInPlaceWritesUnderTheNewKey) {
  GroupId group = 0;
  ScatterPlanId plan = 0;
  ASSERT_NO_FATAL_FAILURE(GroupOfB(&group, &plan));
  ASSERT_TRUE(b_->CreateImmCounter(43).ok());
  auto second = b_->RegisterMemory(dst_.data(), dst_.size());
  ASSERT_TRUE(second.ok()) << second.status();
  MemoryRegion alias = std::move(second).value();
  const RemoteRegion alias_remote = *RemoteRegion::Parse(alias.remote().Serialize());

  std::vector<PeerId> members = {b_on_a_};
  EXPECT_EQ(a_->ReplacePeerGroup(group + 7, members).code(), StatusCode::kNotFound);
  EXPECT_EQ(a_->ReplacePeerGroup(group, {}).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(a_->ReplacePeerGroup(group, members).ok());
  std::vector<RemoteRegion> two = {alias_remote, alias_remote};
  EXPECT_EQ(a_->RePrepareScatter(plan, group, src_reg_, two).code(),
            StatusCode::kInvalidArgument);
  std::vector<RemoteRegion> one = {alias_remote};
  EXPECT_EQ(a_->RePrepareScatter(plan + 7, group, src_reg_, one).code(), StatusCode::kNotFound);
  ASSERT_TRUE(a_->RePrepareScatter(plan, group, src_reg_, one).ok());
  ASSERT_TRUE(b_->Revoke(dst_reg_).ok());

  std::vector<ScatterTarget> targets = {{0, 0, 512, 4096}, {0, 8192, 70000, 100}};
  TransferCounter c;
  ASSERT_TRUE(a_->Scatter({plan, targets, 43}, Completion::Counter(&c)).ok());
  ASSERT_TRUE(c.Wait(1, Deadline::After(10s)).ok());
  EXPECT_EQ(c.failed.load(), 0u);
  ASSERT_TRUE(b_->WaitImm(43, 2, Deadline::After(10s)).ok());
  for (auto& t : targets) {
    EXPECT_EQ(0, std::memcmp(dst_.data() + t.dst_offset, src_.data() + t.src_offset, t.length));
  }
}

INSTANTIATE_TEST_SUITE_P(Providers, EnginePairTest, ::testing::ValuesIn(testing_util::Providers()),
                         testing_util::ProviderTestName);

}  // namespace
}  // namespace ferry
