// The KV messenger across processes: one prefill rank process (serving all its TP shards with
// one engine) feeding several decoder processes, over shm and tcp. The prefill "model" writes
// each layer's pages and bumps the layer counter; every decoder page and aux slot is checked
// byte for byte.
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

namespace ferry {
namespace {

using namespace std::chrono_literals;


uint8_t Logical(uint64_t request, int layer, size_t page, int c, int h, int t, int64_t k) {
  uint64_t x = request * 0x100000001B3ull ^ (uint64_t(layer) << 48) ^ (uint64_t(page) << 32) ^
               (uint64_t(c) << 28) ^ (uint64_t(h) << 16) ^ (uint64_t(t) << 4) ^
               uint64_t(k) * 0x9E3779B97F4A7C15ull;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  return static_cast<uint8_t>(x >> 56);
}
uint8_t AuxByte(uint64_t request, int64_t k) { return static_cast<uint8_t>(request * 31 + k * 7); }

struct Case {
  std::string provider;
  KvModel model;
  KvOrder prefill_order, decode_order;
  int prefill_tp, decode_tp;
  int decoders = 3;
  int requests_per_decoder = 3;
  bool chunked = false;
  int pages_per_request = 5;
  bool kill_prefill = false;  // the prefill dies after taking the requests
  uint32_t prefill_max_transfers = 0;  // >0: a small engine, so posting must pause and resume
  bool never_idle = false;  // the prefill's engine with spin_us < 0, so its watcher never sleeps
  int pages_per_layer() const { return std::max(24, pages_per_request * requests_per_decoder); }
};

std::string Describe(const Case& c) {
  return std::string(c.provider == "shm" ? "shm" : "tcp") + (c.model.mla ? "_mla" : "_gqa") +
         "_tp" + std::to_string(c.prefill_tp) + "_to_tp" + std::to_string(c.decode_tp) +
         (c.prefill_order == KvOrder::kHND ? "_hnd" : "_nhd") +
         (c.decode_order == KvOrder::kHND ? "_hnd" : "_nhd") + (c.chunked ? "_chunked" : "") +
         "_r" + std::to_string(c.decoders * c.requests_per_decoder) +
         (c.kill_prefill ? "_killed" : "") + (c.prefill_max_transfers ? "_throttled" : "") +
         (c.never_idle ? "_neveridle" : "");
}

std::string CaseName(const ::testing::TestParamInfo<Case>& info) { return Describe(info.param); }
void PrintTo(const Case& c, std::ostream* os) { *os << Describe(c); }

constexpr int kLayers = 3;
// A chunked request's passes: pages [0, 2), [2, 4), [4, 5) of its 5.
constexpr size_t kChunkStarts[] = {0, 2, 4, 5};
constexpr int kChunkPasses = 3;
constexpr int64_t kAuxBytes = 1000;

// One side's memory on this node: one region per TP rank, layers back to back.
struct Shards {
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<MemoryRegion> regs;
  KvRegions regions;

  Status Init(TransferEngine& e, const KvSide& side, int pages_per_layer) {
    const int64_t stride = side.page_bytes() * pages_per_layer;
    bytes.assign(side.tp, std::vector<uint8_t>(stride * kLayers, 0));
    for (auto& b : bytes) {
      ASSIGN_OR_RETURN(MemoryRegion r, e.RegisterMemory(b.data(), b.size()));
      regs.push_back(std::move(r));
    }
    for (auto& r : regs) regions.ranks.push_back(&r);
    regions.num_layers = kLayers;
    regions.layer_stride = stride;
    return Status::Ok();
  }
};

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

Status RunPrefill(const Case& c, Bootstrap& b) {
  const KvSide side{c.model, c.prefill_order, c.prefill_tp};
  EngineOptions options = testing_util::TestOptions(c.provider);
  if (c.prefill_max_transfers > 0) options.max_transfers = c.prefill_max_transfers;
  if (c.never_idle) options.spin_us = -1;
  ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(options));
  CHECK_OR_RETURN(engine->options().spin_us == options.spin_us, "options() differs");
  Shards shards;
  RETURN_IF_ERROR(shards.Init(*engine, side, c.pages_per_layer()));
  const int total = c.decoders * c.requests_per_decoder;
  std::vector<uint8_t> aux(kAuxBytes * total);
  ASSIGN_OR_RETURN(MemoryRegion aux_reg, engine->RegisterMemory(aux.data(), aux.size()));
  std::atomic<uint64_t> layers_done{0};
  std::mutex mu;
  std::deque<KvPrefill::Incoming> incoming;
  std::atomic<int> released{0}, failed{0};
  std::deque<int64_t> free_pages;
  for (int p = 0; p < c.pages_per_layer(); ++p) free_pages.push_back(p);
  std::unordered_map<uint64_t, std::vector<int64_t>> held;
  KvPrefill::Callbacks cb;
  cb.on_request = [&](const KvPrefill::Incoming& in) {
    std::lock_guard<std::mutex> l(mu);
    incoming.push_back(in);
  };
  cb.on_released = [&](uint64_t id, const Status& s) {
    if (!s.ok()) failed.fetch_add(1);
    std::lock_guard<std::mutex> l(mu);
    for (int64_t p : held[id]) free_pages.push_back(p);
    held.erase(id);
    released.fetch_add(1);
  };
  ASSIGN_OR_RETURN(auto prefill,
                   KvPrefill::Create(engine.get(), side, shards.regions, &aux_reg, &layers_done, cb));
  RETURN_IF_ERROR(b.AllGather(engine->Address(), 30s).status());
  int64_t aux_slot = 0;
  Deadline deadline = Deadline::After(60s);
  while (released.load() < total) {
    if (deadline.Expired()) return DeadlineExceededError("prefill: requests never all released");
    // One forward pass over whatever arrived and fits.
    std::vector<KvPrefill::Incoming> batch;
    {
      std::lock_guard<std::mutex> l(mu);
      while (!incoming.empty() && free_pages.size() >= size_t(c.pages_per_request)) {
        batch.push_back(incoming.front());
        incoming.pop_front();
        for (int i = 0; i < c.pages_per_request; ++i) {
          held[batch.back().request_id].push_back(free_pages.front());
          free_pages.pop_front();
        }
      }
    }
    if (batch.empty()) {
      std::this_thread::sleep_for(1ms);
      continue;
    }
    const uint64_t base = layers_done.load();
    if (c.kill_prefill) {
      // Die mid-transfer: after posting the first layer of the first pass.
      for (const auto& in : batch) {
        std::vector<int64_t> pages;
        {
          std::lock_guard<std::mutex> l(mu);
          pages = held[in.request_id];
        }
        RETURN_IF_ERROR(prefill->Schedule(in.request_id, pages, base, 0));
      }
      layers_done.fetch_add(1);
      // Die once the first layer's writes are out of the provider: shm peers spin forever on a
      // shared-memory lock held by a process killed inside the provider (an shm limitation;
      // EFA and verbs peers have no such lock), which would hang the decoders' engines instead
      // of testing ferry's deadlines.
      Deadline settle = Deadline::After(5s);
      for (;;) {
        EngineStats st = engine->stats();
        const bool settled = st.transfers_submitted > 0 &&
                             st.transfers_completed + st.transfers_failed >= st.transfers_submitted;
        if (settled || settle.Expired()) {
          break;
        }
        std::this_thread::sleep_for(1ms);
      }
      raise(SIGKILL);
    }
    for (const auto& in : batch) {
      CHECK_OR_RETURN(in.num_pages == c.pages_per_request, "page count");
      // Odd requests ask for speculative mode: the prefill computes one token less.
      const bool speculative = in.request_id % 2 == 1;
      CHECK_OR_RETURN(in.speculative == speculative, "speculative flag lost");
      CHECK_OR_RETURN(in.num_tokens == c.pages_per_request * c.model.page_tokens -
                                           (speculative ? 1 : 0),
                      "tokens to compute: " + std::to_string(in.num_tokens));
      std::vector<int64_t> pages;
      {
        std::lock_guard<std::mutex> l(mu);
        pages = held[in.request_id];
      }
      const int64_t aux_off = (aux_slot++ % total) * kAuxBytes;
      for (int64_t k = 0; k < kAuxBytes; ++k) aux[aux_off + k] = AuxByte(in.request_id, k);
      std::vector<int64_t> beyond(pages.size(), c.pages_per_layer());
      CHECK_OR_RETURN(prefill->Schedule(in.request_id, beyond, base, aux_off).code() ==
                          StatusCode::kOutOfRange, "source page beyond the region accepted");
      if (c.chunked) {
        // Chunked prefill: kChunkStarts' pages in consecutive passes, the aux data with the
        // last; a chunk that skips pages is refused.
        const std::span<const int64_t> all(pages);
        for (int pass = 0; pass < kChunkPasses; ++pass) {
          const size_t first = kChunkStarts[pass], n = kChunkStarts[pass + 1] - first;
          const bool last = pass + 1 == kChunkPasses;
          RETURN_IF_ERROR(prefill->ScheduleChunk(in.request_id, first, all.subspan(first, n),
                                                 base + pass * kLayers, last ? aux_off : 0));
          if (pass == 0) {
            CHECK_OR_RETURN(prefill->ScheduleChunk(in.request_id, 3, all.subspan(3, 2), base, 0)
                                    .code() == StatusCode::kFailedPrecondition,
                            "out-of-order chunk accepted");
          }
        }
      } else {
        RETURN_IF_ERROR(prefill->Schedule(in.request_id, pages, base, aux_off));
      }
      // Bad schedules are refused without disturbing the request.
      CHECK_OR_RETURN(prefill->Schedule(in.request_id + 999999, pages, base, 0).code() ==
                          StatusCode::kNotFound, "unknown request accepted");

    }
    const int passes = c.chunked ? kChunkPasses : 1;
    for (int step = 0; step < passes * kLayers; ++step) {
      const int layer = step % kLayers;
      // "Attention" for this layer: fill every scheduled request's pages of this pass on every
      // shard (refilling an earlier chunk's pages would write under the writes still reading
      // them).
      for (const auto& in : batch) {
        std::vector<int64_t> pages;
        {
          std::lock_guard<std::mutex> l(mu);
          pages = held[in.request_id];
        }
        const int pass = step / kLayers;
        const size_t first = c.chunked ? kChunkStarts[pass] : 0;
        const size_t last = c.chunked ? kChunkStarts[pass + 1] : pages.size();
        for (int s = 0; s < side.tp; ++s) {
          uint8_t* base_ptr = shards.bytes[s].data() + layer * shards.regions.layer_stride;
          for (size_t i = first; i < last; ++i) {
            for (int comp = 0; comp < c.model.components(); ++comp) {
              for (int hl = 0; hl < side.heads_per_rank(); ++hl) {
                for (int t = 0; t < c.model.page_tokens; ++t) {
                  uint8_t* v = base_ptr + side.Offset(pages[i], comp, hl, t);
                  for (int64_t k = 0; k < side.vector_bytes(); ++k) {
                    v[k] = Logical(in.request_id, layer, i, comp, side.first_head(s) + hl, t, k);
                  }
                }
              }
            }
          }
        }
      }
      layers_done.fetch_add(1, std::memory_order_release);  // the output projection finished
      std::this_thread::sleep_for(200us);
    }
  }
  CHECK_OR_RETURN(failed.load() == 0, "a request was released with an error");
  return b.Barrier(60s);
}

Status RunDecoder(const Case& c, Bootstrap& b) {
  const KvSide side{c.model, c.decode_order, c.decode_tp};
  const KvSide prefill_side{c.model, c.prefill_order, c.prefill_tp};
  ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(testing_util::TestOptions(c.provider)));
  Shards shards;
  RETURN_IF_ERROR(shards.Init(*engine, side, c.pages_per_layer()));
  std::vector<uint8_t> aux(kAuxBytes * c.requests_per_decoder, 0);
  ASSIGN_OR_RETURN(MemoryRegion aux_reg, engine->RegisterMemory(aux.data(), aux.size()));
  // With a prefill that dies, exactly as many slots as requests: they must all come back.
  ASSIGN_OR_RETURN(auto decoder,
                   KvDecoder::Create(engine.get(), side, shards.regions, &aux_reg,
                                     c.kill_prefill ? c.requests_per_decoder : 256));
  ASSIGN_OR_RETURN(auto addresses, b.AllGather(engine->Address(), 30s));
  // Disjoint page sets per request, shuffled.
  std::vector<int64_t> ids(c.pages_per_layer());
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937 rng(b.rank());
  std::shuffle(ids.begin(), ids.end(), rng);
  std::atomic<int> ready{0}, bad{0};
  std::vector<std::atomic<int>> ready_mask(c.requests_per_decoder);
  std::vector<std::vector<int64_t>> pages(c.requests_per_decoder);
  for (int j = 0; j < c.requests_per_decoder; ++j) {
    pages[j].assign(ids.begin() + j * c.pages_per_request,
                    ids.begin() + (j + 1) * c.pages_per_request);
    KvDecoder::Request req;
    req.request_id = uint64_t(b.rank()) * 1000 + j;
    req.prefill_address = addresses[0];
    req.prefill = prefill_side;
    req.pages = pages[j];
    req.num_tokens = c.pages_per_request * c.model.page_tokens;
    req.aux_offset = j * kAuxBytes;
    req.aux_bytes = kAuxBytes;
    req.speculative = req.request_id % 2 == 1;
    // The caller owns back-pressure: a full send queue is ResourceExhausted, retry.
    Status submitted;
    for (int attempt = 0; attempt < 100000; ++attempt) {
      submitted = decoder->Submit(req, Deadline::After(c.kill_prefill ? 3s : 60s),
                                  [&, j](const Status& s) {
                                    if (!s.ok()) bad.fetch_add(1);
                                    ready_mask[j] = s.ok() ? 1 : 2;
                                    ready.fetch_add(1);
                                  });
      if (submitted.code() != StatusCode::kResourceExhausted) break;
      std::this_thread::sleep_for(100us);
    }
    RETURN_IF_ERROR(submitted);
  }
  // A request for a page outside our regions is refused before anything is sent.
  std::vector<int64_t> outside = {c.pages_per_layer()};
  KvDecoder::Request wrong;
  wrong.request_id = 77;
  wrong.prefill_address = addresses[0];
  wrong.prefill = prefill_side;
  wrong.pages = outside;
  CHECK_OR_RETURN(decoder->Submit(wrong, Deadline::After(1s), [](const Status&) {}).code() ==
                      StatusCode::kOutOfRange, "page outside the region accepted");
  // Pages and aux slots whose byte offsets would overflow: refused, not wrapped (UBSan watches
  // under `make sanitize`).
  for (int64_t huge : {int64_t{1} << 62, std::numeric_limits<int64_t>::max()}) {
    const std::vector<int64_t> one = {huge};
    wrong.pages = one;
    CHECK_OR_RETURN(decoder->Submit(wrong, Deadline::After(1s), [](const Status&) {}).code() ==
                        StatusCode::kOutOfRange, "page " + std::to_string(huge) + " accepted");
  }
  wrong.pages = pages[0];
  wrong.aux_offset = std::numeric_limits<int64_t>::max();
  wrong.aux_bytes = 2;
  CHECK_OR_RETURN(decoder->Submit(wrong, Deadline::After(1s), [](const Status&) {}).code() ==
                      StatusCode::kOutOfRange, "an aux slot past 2^63 accepted");
  wrong.aux_offset = 0;
  wrong.aux_bytes = 0;
  // A prefill layout that describes another cache is refused too.
  wrong.pages = pages[0];
  wrong.prefill.model.head_dim += 1;
  CHECK_OR_RETURN(decoder->Submit(wrong, Deadline::After(1s), [](const Status&) {}).code() ==
                      StatusCode::kInvalidArgument, "layout mismatch accepted");
  Deadline deadline = Deadline::After(60s);
  while (ready.load() < c.requests_per_decoder && !deadline.Expired()) {
    std::this_thread::sleep_for(1ms);
  }
  CHECK_OR_RETURN(ready.load() == c.requests_per_decoder,
                  "requests ended: " + std::to_string(ready.load()));
  if (c.kill_prefill) {
    // The prefill died during its first pass: every request fails at its deadline, none hangs.
    CHECK_OR_RETURN(bad.load() == c.requests_per_decoder,
                    "requests that did not fail although the prefill died: " +
                        std::to_string(c.requests_per_decoder - bad.load()));
    // The dead prefill was taken out of the engine before the slots were freed: a new request
    // to it finds a slot and is refused at once as unreachable.
    KvDecoder::Request again;
    again.request_id = 999;
    again.prefill_address = addresses[0];
    again.prefill = prefill_side;
    again.pages = pages[0];
    Status s = decoder->Submit(again, Deadline::After(1s), [](const Status&) {});
    CHECK_OR_RETURN(s.code() == StatusCode::kUnavailable,
                    "a request to the removed prefill: " + s.ToString());
  } else {
    CHECK_OR_RETURN(bad.load() == 0, "failed requests: " + std::to_string(bad.load()));
    // A layer's writes that share a source/destination pair and a length travel as one paged
    // write with one weighted immediate: fewer immediates than writes, at least one per layer.
    uint64_t writes = 0;
    for (int j = 0; j < c.requests_per_decoder; ++j) {
      ASSIGN_OR_RETURN(KvPlan plan, PlanKvTransfer(prefill_side, side, pages[j], pages[j],
                                                   uint64_t(b.rank()) * 1000 + j));
      writes += plan.writes.size() * kLayers + 1;
    }
    const uint64_t imms = engine->stats().imms_received;
    CHECK_OR_RETURN(imms < writes && imms >= uint64_t(c.requests_per_decoder) * (kLayers + 1),
                    std::to_string(imms) + " immediates for " + std::to_string(writes) +
                        " writes");
  }
  for (int j = 0; j < c.requests_per_decoder; ++j) {
    if (ready_mask[j] != 1) continue;
    const uint64_t id = uint64_t(b.rank()) * 1000 + j;
    for (int64_t k = 0; k < kAuxBytes; ++k) {
      CHECK_OR_RETURN(aux[j * kAuxBytes + k] == AuxByte(id, k), "aux byte");
    }
    for (int d = 0; d < side.tp; ++d) {
      for (int layer = 0; layer < kLayers; ++layer) {
        const uint8_t* base = shards.bytes[d].data() + layer * shards.regions.layer_stride;
        for (size_t i = 0; i < pages[j].size(); ++i) {
          for (int comp = 0; comp < c.model.components(); ++comp) {
            for (int hl = 0; hl < side.heads_per_rank(); ++hl) {
              for (int t = 0; t < c.model.page_tokens; ++t) {
                const uint8_t* v = base + side.Offset(pages[j][i], comp, hl, t);
                for (int64_t k = 0; k < side.vector_bytes(); ++k) {
                  CHECK_OR_RETURN(v[k] == Logical(id, layer, i, comp, side.first_head(d) + hl, t, k),
                                  "request " + std::to_string(id) + " rank " + std::to_string(d) +
                                      " layer " + std::to_string(layer) + " page " +
                                      std::to_string(i));
                }
              }
            }
          }
        }
      }
    }
  }
  return b.Barrier(60s);
}

class KvMessengerTest : public ::testing::TestWithParam<Case> {};

TEST_P(KvMessengerTest, OnePrefillFeedsDecodersPageForPage) {
  const Case c = GetParam();
  auto exits = RunLocalRanks(1 + c.decoders, [&](Bootstrap& b) -> Status {
    if (b.rank() == 0) return RunPrefill(c, b);
    Status s = RunDecoder(c, b);
    // With a dead prefill the final barrier cannot complete; the decoders' checks are the test.
    if (c.kill_prefill && s.code() == StatusCode::kUnavailable) return Status::Ok();
    return s;
  }, 180s);
  if (c.kill_prefill) {
    EXPECT_EQ(exits[0].signal, SIGKILL);
    exits.erase(exits.begin());
  }
  for (size_t r = 0; r < exits.size(); ++r) {
    EXPECT_TRUE(exits[r].ok()) << (r == 0 ? "prefill" : "decoder ") << r << ": exit "
                               << exits[r].exit_code << " signal " << exits[r].signal
                               << (exits[r].timed_out ? " (timed out)" : "");
  }
}

std::vector<Case> Cases() {
  const KvModel gqa{8, 16, 2, false, 4};  // 8 KV heads (GQA), small head_dim to keep CI fast
  const KvModel mla{1, 72, 2, true, 4};
  const auto hnd = KvOrder::kHND, nhd = KvOrder::kNHD;
  std::vector<Case> all = {
      {"shm", gqa, hnd, hnd, 4, 2},
      {"shm", gqa, hnd, hnd, 2, 4},
      {"shm", gqa, hnd, hnd, 4, 2, 3, 3, true},
      {"tcp;ofi_rxm", mla, hnd, hnd, 2, 2, 2, 2, true},
      {"shm", gqa, nhd, hnd, 4, 4},
      {"shm", mla, hnd, hnd, 4, 2},
      {"tcp;ofi_rxm", gqa, hnd, hnd, 4, 2},
      {"tcp;ofi_rxm", mla, hnd, nhd, 2, 4},
      // 600 pages a layer between one pair: each layer's paged write goes in two weighted
      // pieces (at most 511 pages each).
      {"shm", mla, hnd, hnd, 1, 1, 1, 1, false, 600},
      // 201 requests in flight at once (67 per decoder, one page each).
      {"shm", gqa, hnd, hnd, 4, 2, 3, 67, false, 1},
      // A prefill engine that admits 6 transfers at a time: posting pauses and resumes.
      {"shm", gqa, hnd, hnd, 4, 2, 3, 3, false, 5, false, 6},
      // Chunked, with a prefill engine (and so a layer watcher) that never idles.
      {"shm", gqa, hnd, hnd, 4, 2, 1, 3, true, 5, false, 0, true},
      // The prefill dies mid-transfer.
      {"shm", gqa, hnd, hnd, 4, 2, 3, 3, false, 5, true},
      {"tcp;ofi_rxm", gqa, hnd, hnd, 4, 2, 3, 3, false, 5, true},
  };
  std::vector<Case> out;
  for (const Case& c : all) {
    for (const std::string& p : testing_util::Providers()) {
      if (p == c.provider) out.push_back(c);
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Cases, KvMessengerTest, ::testing::ValuesIn(Cases()), CaseName);

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
  auto exits = RunLocalRanks(2, [&, how = how, provider = provider](Bootstrap& b) {
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
  auto exits = RunLocalRanks(2, [&](Bootstrap& b) -> Status {
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
  auto exits = RunLocalRanks(2, [&](Bootstrap& b) {
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
  auto exits = RunLocalRanks(3, [&](Bootstrap& b) {
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
  auto exits = RunLocalRanks(3, [&](Bootstrap& b) {
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
  KvPrefill::Callbacks cb;
  cb.on_request = [&](const KvPrefill::Incoming& in) {
    std::vector<int64_t> pages(static_cast<size_t>(in.num_pages));
    std::iota(pages.begin(), pages.end(), 0);
    if (!prefill->Schedule(in.request_id, pages, layers.load(), 0).ok()) bad.fetch_add(1);
    layers.fetch_add(kLayers);
  };
  cb.on_released = [&](uint64_t, const Status& s) {
    if (!s.ok()) bad.fetch_add(1);
    released.fetch_add(1);
  };
  ASSIGN_OR_RETURN(prefill, KvPrefill::Create(e.engine.get(), e.side, e.shards.regions, nullptr,
                                              &layers, cb));
  RETURN_IF_ERROR(b.AllGather(e.engine->Address(), 30s).status());
  for (int turn = 0; turn < turns; ++turn) RETURN_IF_ERROR(b.Barrier(60s));
  RETURN_IF_ERROR(b.Barrier(60s));  // the decoders are done
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
  auto exits = RunLocalRanks(4, [&](Bootstrap& b) {
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
  auto exits = RunLocalRanks(3, [&](Bootstrap& b) {
    return b.rank() == 0 ? ServingPrefill(provider, b, 4, /*max_peers=*/1, /*turns=*/4)
                         : TakingTurns(provider, b);
  }, 120s);
  for (auto& e : exits) EXPECT_TRUE(e.ok()) << e.exit_code << " " << e.signal;
}

TEST(KvCancelStormTest, APrefillServesMoreRequestsThanItsEngineHoldsPeers) {
  const std::string provider = testing_util::Providers().front();
  auto exits = RunLocalRanks(2, [&](Bootstrap& b) {
    return b.rank() == 0 ? StormPrefill(provider, b, 2) : StormDecoder(provider, b);
  }, 120s);
  for (auto& e : exits) EXPECT_TRUE(e.ok()) << e.exit_code << " " << e.signal;
}

}  // namespace
}  // namespace ferry
