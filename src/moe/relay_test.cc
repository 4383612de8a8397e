// The relay without a GPU: each rank's "kernels" are the test body, writing its outbox and
// raising the outbox flags as the CUDA kernels do, then reading what the relays put into its
// inbox. Ranks run as processes over the shm provider.
#include "moe/relay.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "common/backoff.h"
#include "fabric/test_util.h"

namespace ferry::moe {
namespace {

using namespace std::chrono_literals;

AllToAllConfig Config(int world, int rank, int ranks_per_node) {
  AllToAllConfig c;
  c.world_size = world;
  c.rank = rank;
  c.ranks_per_node = ranks_per_node;
  c.num_experts = 2 * world;
  c.experts_per_token = 2;
  c.max_tokens_per_rank = 5;
  c.hidden = 128;
  return c;
}
constexpr int64_t kSlotBytes = 304;  // the NVLink slot of this configuration: 16 + 2 * 16 + 256

// Every AllToAll immediate -- each kind, epoch, instance and sender at its
// extremes -- lies in the AllToAll range of ferry/immediates.h, and distinct fields give
// distinct immediates; the KV range's extremes lie in the KV range.
TEST(ImmediatesTest, EachPartsImmediatesStayInTheirRange) {
  std::vector<uint32_t> seen;
  for (ImmKind kind : {kRelayDispatch, kRelayCombine}) {
    for (uint64_t epoch : {uint64_t{0}, uint64_t{3}, uint64_t{1} << 40}) {
      for (int instance : {0, AllToAllConfig::kMaxInstances - 1}) {
        for (int sender : {0, 1, AllToAllConfig::kMaxWorldSize - 1}) {
          const uint32_t v = RelayImm(kind, epoch, instance, sender);
          EXPECT_TRUE(imm::kMoe.Holds(v)) << std::hex << v;
          EXPECT_FALSE(imm::kKv.Holds(v) || imm::kCaller.Holds(v)) << std::hex << v;
          if (epoch < kEpochs) seen.push_back(v);
        }
      }
    }
  }
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(std::adjacent_find(seen.begin(), seen.end()), seen.end()) << "two fields collide";
  const uint32_t kv_last = imm::kKv.first | imm::kKvWeightMask | (imm::kKvMaxSlots - 1);
  EXPECT_TRUE(imm::kKv.Holds(imm::kKv.first) && imm::kKv.Holds(kv_last));
  EXPECT_FALSE(imm::kMoe.Holds(kv_last));
}

TEST(RelayLayoutTest, SectionsAndIndicesAgree) {
  for (auto [world, per_node] : {std::pair{2, 1}, {4, 2}, {6, 3}, {8, 2}, {8, 4}}) {
    for (int me = 0; me < world; ++me) {
      const RelayLayout layout(Config(world, me, per_node), kSlotBytes, per_node);
      ASSERT_EQ(layout.remotes.size(), size_t(world - per_node));
      std::set<int> indices;
      for (size_t q = 0; q < layout.remotes.size(); ++q) {
        const int r = layout.remotes[q];
        EXPECT_TRUE(layout.Remote(r));
        // Our index among r's remote senders: distinct for distinct senders, in range.
        const int at = layout.RemoteIndex(r, me);
        EXPECT_GE(at, 0);
        EXPECT_LT(at, world - per_node);
        // And r's remotes, seen from r, list us at that index.
        const RelayLayout theirs(Config(world, r, per_node), kSlotBytes, per_node);
        EXPECT_EQ(theirs.remotes[at], me);
        EXPECT_EQ(layout.RemoteIndex(me, r), static_cast<int>(q));
        indices.insert(at);
      }
      EXPECT_EQ(layout.RemoteIndex(me, me), -1);
      // Regions in order and inside the buffers.
      EXPECT_LE(layout.InSection(static_cast<int>(layout.remotes.size())),
                layout.in_combine_off);
      EXPECT_EQ(layout.OutSection(static_cast<int>(layout.remotes.size())), layout.outbox_bytes);
      EXPECT_EQ(layout.counts_bytes % 16, 0);
      // The control block: flags, then out_slots, then in_rows, inside it and apart.
      std::vector<uint8_t> control(layout.control_bytes);
      uint8_t* base = control.data();
      const int q = static_cast<int>(layout.remotes.size());
      EXPECT_EQ(reinterpret_cast<uint8_t*>(layout.OutboxFlag(base, false)), base);
      EXPECT_LE(reinterpret_cast<uint8_t*>(layout.OutboxFlag(base, true)) + 8,
                reinterpret_cast<uint8_t*>(layout.OutSlots(base, 0)));
      EXPECT_LE(reinterpret_cast<uint8_t*>(layout.OutSlots(base, q)),
                reinterpret_cast<uint8_t*>(layout.InRows(base, 0)));
      EXPECT_LE(reinterpret_cast<uint8_t*>(layout.InRows(base, q)), base + layout.control_bytes);
    }
  }
}

uint8_t SlotByte(int from, int to, uint64_t epoch, int64_t i) {
  return static_cast<uint8_t>(from * 31 + to * 7 + epoch * 13 + i * 5 + 1);
}
uint8_t RowByte(int from, int to, uint64_t epoch, int64_t i) {
  return static_cast<uint8_t>(from * 11 + to * 3 + epoch * 17 + i * 3 + 2);
}

// What rank `from` asks of rank `to` in an epoch: slots it sends, combine rows it expects back,
// and where they go in its combine region (disjoint per expert rank).
struct Ask {
  int64_t slots, rows, row_start;
};
Ask AskOf(const RelayLayout& from_layout, int from, int to, uint64_t epoch) {
  const int q = from_layout.RemoteIndex(from, to);
  const int64_t share = from_layout.combine_rows / int64_t(from_layout.remotes.size());
  return {(from * 7 + to * 3 + int64_t(epoch)) % (from_layout.slots_per_pair + 1),
          (from + 2 * to + int64_t(epoch)) % (share + 1), q * share};
}

// The relay's memory, host memory standing for the kernels' side.
struct Boxes : HostBoxes {
  explicit Boxes(const RelayLayout& layout) : HostBoxes(layout) {}
  // The flag the relay raises for sender s's dispatch or combine section.
  uint64_t* InboxFlag(const RelayLayout& layout, bool combine, int s) {
    return &flags[(combine ? layout.n : 0) + s];
  }
  // What the send kernel writes for remote rank q: the counts row, and its slot count again in
  // the control block.
  void SetCounts(const RelayLayout& layout, int q, const int32_t* row) {
    std::memcpy(outbox.data() + layout.OutSection(q), row, layout.counts_width * 4);
    *layout.OutSlots(control_bytes(), q) = row[layout.counts_width - kCountsColumns + kColSlots];
  }
  // What the receive kernel copies of remote sender q's counts row into the control block.
  void CopyInRows(const RelayLayout& layout, int q) {
    const auto* row = reinterpret_cast<const int32_t*>(inbox.data() + layout.InSection(q));
    const int l = static_cast<int>(layout.counts_width) - kCountsColumns;
    layout.InRows(control_bytes(), q)[0] = row[l + kColRowStart];
    layout.InRows(control_bytes(), q)[1] = row[l + kColRows];
  }
  void RaiseOutbox(const RelayLayout& layout, bool combine, uint64_t value) {
    std::atomic_ref<uint64_t>(*layout.OutboxFlag(control_bytes(), combine))
        .store(value, std::memory_order_release);
  }
};

// Until the relay fails or 10 s pass; the seconds waited.
double WaitForFailure(const Relay& relay) {
  const auto start = Clock::now();
  Backoff backoff;
  while (!relay.failed() && Clock::now() - start < 10s) backoff.Pause();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

Status WaitFlag(uint64_t* flag, uint64_t want, const std::string& what) {
  const Deadline deadline = Deadline::After(20s);
  Backoff backoff;
  while (std::atomic_ref<uint64_t>(*flag).load(std::memory_order_acquire) < want) {
    if (deadline.Expired()) return DeadlineExceededError("waiting for " + what);
    backoff.Pause();
  }
  return Status::Ok();
}

// One rank's relay, host memory standing for the kernels' side, driven epoch by epoch (so that
// two relays on one engine can alternate theirs). flush: a flush_landed hook (as for GPU-memory
// boxes), which must run once per landed section, before that section's flag goes up.
// instance: AllToAllConfig::instance.
class RelayRank {
 public:
  RelayRank(Bootstrap& b, int per_node, bool flush = false, int instance = 0)
      : c_(WithInstance(Config(b.world_size(), b.rank(), per_node), instance)),
        per_node_(per_node),
        flush_(flush),
        layout_(c_, kSlotBytes, per_node_),
        boxes_(layout_) {}

  Status Create(TransferEngine* engine, Bootstrap& b) {
    RelayBuffers buffers = boxes_.buffers();
    if (flush_) {
      buffers.flush_landed = [this]() -> Status {
        // Raises so far (each raise adds one to a flag): one per earlier flush, none for this one.
        uint64_t up = 0;
        for (int s : layout_.remotes) {
          for (bool combine : {false, true}) {
            up += std::atomic_ref<uint64_t>(*InboxFlag(combine, s)).load(std::memory_order_acquire);
          }
        }
        CHECK_OR_RETURN(up == flushes_.fetch_add(1), "a flag went up before its flush");
        return Status::Ok();
      };
    }
    ASSIGN_OR_RETURN(relay_, Relay::Create(c_, layout_, engine, b, buffers, 10000));
    return Status::Ok();
  }

  Status Epoch(uint64_t epoch) {
    const int me = c_.rank, l = c_.local_experts();
    std::vector<uint8_t>& inbox = boxes_.inbox;
    std::vector<uint8_t>& outbox = boxes_.outbox;
    const std::string at = " (epoch " + std::to_string(epoch) + ", instance " +
                           std::to_string(c_.instance) + ")";
    // Dispatch: a counts row and the slots for each remote rank, then the flag.
    for (size_t q = 0; q < layout_.remotes.size(); ++q) {
      const int r = layout_.remotes[q];
      const Ask ask = AskOf(layout_, me, r, epoch);
      std::vector<int32_t> counts(layout_.counts_width);
      for (int e = 0; e < l; ++e) counts[e] = me * 100 + e + c_.instance;
      counts[l + kColSlots] = static_cast<int32_t>(ask.slots);
      counts[l + kColRowStart] = static_cast<int32_t>(ask.row_start);
      counts[l + kColRows] = static_cast<int32_t>(ask.rows);
      boxes_.SetCounts(layout_, static_cast<int>(q), counts.data());
      uint8_t* slots = outbox.data() + layout_.OutSection(q) + layout_.counts_bytes;
      for (int64_t i = 0; i < ask.slots * kSlotBytes; ++i) {
        slots[i] = SlotByte(me, r, epoch, i) ^ static_cast<uint8_t>(c_.instance);
      }
    }
    boxes_.RaiseOutbox(layout_, false, epoch + 1);
    for (size_t q = 0; q < layout_.remotes.size(); ++q) {
      const int s = layout_.remotes[q];
      RETURN_IF_ERROR(WaitFlag(InboxFlag(false, s), epoch + 1,
                               "dispatch flag of rank " + std::to_string(s) + at));
      const RelayLayout theirs(Config(c_.world_size, s, per_node_), kSlotBytes, per_node_);
      const Ask ask = AskOf(theirs, s, me, epoch);
      const auto* counts = reinterpret_cast<const int32_t*>(inbox.data() + layout_.InSection(q));
      CHECK_OR_RETURN(counts[0] == s * 100 + c_.instance && counts[l + kColSlots] == ask.slots &&
                          counts[l + kColRows] == ask.rows,
                      "counts row from rank " + std::to_string(s) + at);
      const uint8_t* slots = inbox.data() + layout_.InSection(q) + layout_.counts_bytes;
      for (int64_t i = 0; i < ask.slots * kSlotBytes; ++i) {
        CHECK_OR_RETURN(slots[i] == (SlotByte(s, me, epoch, i) ^ static_cast<uint8_t>(c_.instance)),
                        "slot byte " + std::to_string(i) + " from rank " + std::to_string(s) + at);
      }
      boxes_.CopyInRows(layout_, static_cast<int>(q));
    }
    // Combine: the rows each remote sender expects, where its counts row said.
    for (size_t q = 0; q < layout_.remotes.size(); ++q) {
      const int s = layout_.remotes[q];
      const RelayLayout theirs(Config(c_.world_size, s, per_node_), kSlotBytes, per_node_);
      const Ask ask = AskOf(theirs, s, me, epoch);
      uint8_t* rows = outbox.data() + layout_.OutRows(q);
      for (int64_t i = 0; i < ask.rows * layout_.row_bytes; ++i) rows[i] = RowByte(me, s, epoch, i);
    }
    boxes_.RaiseOutbox(layout_, true, epoch + 1);
    for (int r : layout_.remotes) {
      RETURN_IF_ERROR(WaitFlag(InboxFlag(true, r), epoch + 1,
                               "combine flag of rank " + std::to_string(r) + at));
      const Ask ask = AskOf(layout_, me, r, epoch);
      const uint8_t* rows =
          inbox.data() + layout_.in_combine_off + ask.row_start * layout_.row_bytes;
      for (int64_t i = 0; i < ask.rows * layout_.row_bytes; ++i) {
        CHECK_OR_RETURN(rows[i] == RowByte(r, me, epoch, i),
                        "combine byte " + std::to_string(i) + " from rank " + std::to_string(r) +
                            at);
      }
    }
    CHECK_OR_RETURN(!relay_->failed(), relay_->error().ToString());
    return Status::Ok();
  }

  // After `epochs` epochs: every flush ran.
  Status Check(uint64_t epochs) {
    if (!flush_) return Status::Ok();
    const uint64_t want = epochs * 2 * layout_.remotes.size();
    CHECK_OR_RETURN(flushes_.load() == want, std::to_string(flushes_.load()) + " flushes, want " +
                                                 std::to_string(want));
    return Status::Ok();
  }

 private:
  static AllToAllConfig WithInstance(AllToAllConfig c, int instance) {
    c.instance = instance;
    return c;
  }
  uint64_t* InboxFlag(bool combine, int s) { return boxes_.InboxFlag(layout_, combine, s); }

  const AllToAllConfig c_;
  const int per_node_;
  const bool flush_;
  const RelayLayout layout_;
  Boxes boxes_;
  std::atomic<uint64_t> flushes_{0};
  std::unique_ptr<Relay> relay_;  // last: stopped before the memory it uses goes
};

Status RunRank(Bootstrap& b, int per_node, bool flush = false) {
  ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(testing_util::TestOptions("shm")));
  RelayRank rank(b, per_node, flush);
  RETURN_IF_ERROR(rank.Create(engine.get(), b));
  for (uint64_t epoch = 0; epoch < 4; ++epoch) RETURN_IF_ERROR(rank.Epoch(epoch));
  RETURN_IF_ERROR(rank.Check(4));
  return b.Barrier(30s);
}

TEST(RelayTest, FourEpochsBetweenTwoNodesOfTwo) {
  auto exits = RunLocalRanks(4, [](Bootstrap& b) { return RunRank(b, 2); }, 120s);
  for (size_t r = 0; r < exits.size(); ++r) EXPECT_TRUE(exits[r].ok()) << "rank " << r;
}

TEST(RelayTest, ThreeNodesOfOneFlushingWhatLands) {
  auto exits = RunLocalRanks(3, [](Bootstrap& b) { return RunRank(b, 1, true); }, 120s);
  for (size_t r = 0; r < exits.size(); ++r) EXPECT_TRUE(exits[r].ok()) << "rank " << r;
}

// Two relays on one engine (two AllToAlls: instances 0 and 1), their epochs alternating: each
// sender's immediates reach its own relay's counters and flags only.
TEST(RelayTest, TwoInstancesShareAnEngine) {
  auto exits = RunLocalRanks(4, [](Bootstrap& b) -> Status {
    ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(testing_util::TestOptions("shm")));
    RelayRank first(b, 2, false, 0), second(b, 1, false, 1);
    RETURN_IF_ERROR(first.Create(engine.get(), b));
    RETURN_IF_ERROR(second.Create(engine.get(), b));
    for (uint64_t epoch = 0; epoch < 6; ++epoch) {
      RETURN_IF_ERROR(first.Epoch(epoch));
      RETURN_IF_ERROR(second.Epoch(epoch));
    }
    RETURN_IF_ERROR(first.Check(6));
    RETURN_IF_ERROR(second.Check(6));
    return b.Barrier(30s);
  }, 120s);
  for (size_t r = 0; r < exits.size(); ++r) EXPECT_TRUE(exits[r].ok()) << "rank " << r;
}

// A flush that fails (the GPU cannot be shown what landed) fails the relay, naming the rank
// whose section it was, and no flag goes up for it.
TEST(RelayTest, AFailedFlushFailsTheRelay) {
  auto exits = RunLocalRanks(2, [](Bootstrap& b) -> Status {
    const AllToAllConfig c = Config(2, b.rank(), 1);
    const RelayLayout layout(c, kSlotBytes, c.ranks_per_node);
    Boxes boxes(layout);
    RelayBuffers buffers = boxes.buffers();
    buffers.flush_landed = [] { return InternalError("flush refused"); };
    ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(testing_util::TestOptions("shm")));
    ASSIGN_OR_RETURN(auto relay, Relay::Create(c, layout, engine.get(), b, buffers, 2000));
    std::vector<int32_t> counts(layout.counts_width);
    boxes.SetCounts(layout, 0, counts.data());
    boxes.RaiseOutbox(layout, false, 1);
    WaitForFailure(*relay);
    const Status s = relay->error();
    const int peer = 1 - b.rank();
    CHECK_OR_RETURN(s.message().find("flush refused") != std::string::npos &&
                        s.message().find("rank " + std::to_string(peer) + "'s section") !=
                            std::string::npos,
                    s.ToString());
    CHECK_OR_RETURN(*boxes.InboxFlag(layout, false, peer) == 0,
                    "a flag went up without its flush");
    return b.Barrier(30s);
  }, 60s);
  for (size_t r = 0; r < exits.size(); ++r) EXPECT_TRUE(exits[r].ok()) << "rank " << r;
}

// A remote rank that stops taking part: the survivor's relay fails within its peer timeout and
// says which wait it gave up on.
TEST(RelayTest, ALostPeerFailsTheRelay) {
  auto exits = RunLocalRanks(2, [](Bootstrap& b) -> Status {
    const AllToAllConfig c = Config(2, b.rank(), 1);
    const RelayLayout layout(c, kSlotBytes, c.ranks_per_node);
    Boxes boxes(layout);
    ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(testing_util::TestOptions("shm")));
    ASSIGN_OR_RETURN(auto relay, Relay::Create(c, layout, engine.get(), b, boxes.buffers(), 1000));
    RETURN_IF_ERROR(b.Barrier(30s));
    if (b.rank() == 1) return Status::Ok();  // leaves: its relay and engine go
    std::this_thread::sleep_for(200ms);
    boxes.RaiseOutbox(layout, false, 1);
    const double waited = WaitForFailure(*relay);
    CHECK_OR_RETURN(relay->failed(), "the relay still waits after 10 s");
    CHECK_OR_RETURN(waited < 7.0, "the relay failed after " + std::to_string(waited) + " s");
    const Status s = relay->error();
    CHECK_OR_RETURN(s.message().find("rank 1 sent no dispatch section") != std::string::npos,
                    "error does not name the lost rank: " + s.ToString());
    return Status::Ok();
  }, 60s);
  for (size_t r = 0; r < exits.size(); ++r) EXPECT_TRUE(exits[r].ok()) << "rank " << r;
}

// A counts row asking for more combine rows than a rank can return (a corrupt or hostile
// peer): the relay that would send them refuses with DataLoss naming the rank, and writes
// nothing outside the asker's combine region.
TEST(RelayTest, AnImpossibleCombineRequestIsRefused) {
  auto exits = RunLocalRanks(2, [](Bootstrap& b) -> Status {
    const AllToAllConfig c = Config(2, b.rank(), 1);
    const int l = c.local_experts();
    const RelayLayout layout(c, kSlotBytes, c.ranks_per_node);
    Boxes boxes(layout);
    ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(testing_util::TestOptions("shm")));
    ASSIGN_OR_RETURN(auto relay, Relay::Create(c, layout, engine.get(), b, boxes.buffers(), 1000));
    std::vector<int32_t> counts(layout.counts_width);
    counts[l + kColSlots] = 1;
    counts[l + kColRowStart] = 0;
    counts[l + kColRows] = b.rank() == 1 ? static_cast<int32_t>(layout.rows_per_pair + 1) : 1;
    boxes.SetCounts(layout, 0, counts.data());
    boxes.RaiseOutbox(layout, false, 1);
    RETURN_IF_ERROR(
        WaitFlag(boxes.InboxFlag(layout, false, 1 - b.rank()), 1, "dispatch"));
    boxes.CopyInRows(layout, 0);
    boxes.RaiseOutbox(layout, true, 1);
    WaitForFailure(*relay);
    const Status s = relay->error();
    if (b.rank() == 0) {
      CHECK_OR_RETURN(s.code() == StatusCode::kDataLoss &&
                          s.message().find("rank 1 expects") != std::string::npos,
                      "rank 0: " + s.ToString());
    } else {
      // Rank 1 never gets its rows: its relay gives up at the peer timeout.
      CHECK_OR_RETURN(s.code() == StatusCode::kDeadlineExceeded, "rank 1: " + s.ToString());
    }
    return Status::Ok();
  }, 60s);
  for (size_t r = 0; r < exits.size(); ++r) EXPECT_TRUE(exits[r].ok()) << "rank " << r;
}

// Every buffer is needed: a missing one is refused before any registration or exchange.
TEST(RelayTest, AMissingBufferIsRefused) {
  auto exits = RunLocalRanks(2, [](Bootstrap& b) -> Status {
    const AllToAllConfig c = Config(2, b.rank(), 1);
    const RelayLayout layout(c, kSlotBytes, c.ranks_per_node);
    Boxes boxes(layout);
    ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(testing_util::TestOptions("shm")));
    for (int missing = 0; missing < 4; ++missing) {
      RelayBuffers buffers = boxes.buffers();
      if (missing == 3) {
        buffers.inbox_flags = nullptr;
      } else {
        (missing == 0 ? buffers.inbox : missing == 1 ? buffers.outbox : buffers.control) = nullptr;
      }
      auto relay = Relay::Create(c, layout, engine.get(), b, buffers, 1000);
      CHECK_OR_RETURN(relay.status().code() == StatusCode::kInvalidArgument,
                      "buffer " + std::to_string(missing) + ": " + relay.status().ToString());
    }
    return Status::Ok();
  }, 60s);
  for (size_t r = 0; r < exits.size(); ++r) EXPECT_TRUE(exits[r].ok()) << "rank " << r;
}

}  // namespace
}  // namespace ferry::moe
