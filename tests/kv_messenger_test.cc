// The KV messenger across processes: one prefill rank process (serving all its TP shards with
// one engine) feeding several decoder processes, over shm and tcp. The prefill "model" writes
// each layer's pages and bumps the layer counter; every decoder page and aux slot is checked
// byte for byte.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <memory>
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

// A chunked request's passes: pages [0, 2), [2, 4), [4, 5) of its 5.
constexpr size_t kChunkStarts[] = {0, 2, 4, 5};
constexpr int kChunkPasses = 3;
constexpr int64_t kAuxBytes = 1000;

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
    // The dead prefill was taken out of the engine before the slots were freed, so a slot is
    // free for a new request to it. That request adds it again (a prefill that only hung would
    // serve it) and ends not OK: refused at Submit, or told by its callback within its deadline
    // and the cancel's wait.
    KvDecoder::Request again;
    again.request_id = 999;
    again.prefill_address = addresses[0];
    again.prefill = prefill_side;
    again.pages = pages[0];
    auto told = std::make_shared<std::atomic<int>>(0);
    auto outcome = std::make_shared<Status>();
    Status s = decoder->Submit(again, Deadline::After(1s), [told, outcome](const Status& st) {
      *outcome = st;
      told->fetch_add(1);
    });
    if (s.ok()) {
      const Deadline by = Deadline::After(15s);
      while (told->load() == 0 && !by.Expired()) std::this_thread::sleep_for(1ms);
      CHECK_OR_RETURN(told->load() == 1, "a request to the dead prefill never ended");
      s = *outcome;
    }
    CHECK_OR_RETURN(!s.ok(), "a request to the dead prefill: " + s.ToString());
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
  auto exits = testing_util::RunRanks(1 + c.decoders, [&](Bootstrap& b) -> Status {
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

}  // namespace
}  // namespace ferry
