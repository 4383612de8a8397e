// The moe protocol on the host device, ranks as processes on localhost over shm and tcp.
//
// Every rank can regenerate every other rank's inputs from (seed, rank, iteration), so each
// checks on its own: the exact multiset of token rows (payload and scales) each of its experts
// received, and the combined output against a float64 reference of the same expert function.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>

#include "fabric/test_util.h"
#include "ferry/bootstrap.h"
#include "ferry/moe.h"
#include "moe_host_cases.h"
#include "moe_inputs.h"
#include "moe/numerics.h"

namespace ferry {
namespace {

using namespace std::chrono_literals;
using moe_host_cases::Case;
using moe_host_cases::Cases;
using moe_host_cases::Describe;
using moe_host_cases::Layouts;
using moe_host_cases::SenderOrder;
using moe_host_cases::Spec;
using moe_host_cases::TokenMajor;


std::string CaseName(const ::testing::TestParamInfo<Case>& info) { return Describe(info.param); }


// The token-major output, checked against its definition: every token routed to us once, in
// (sender rank, token) order, with its payload, scales, and column k naming the local expert of
// its k-th copy (or -1) and that copy's weight (or 0). Then the caller's side of combine into
// `expert_out` (SumTokenMajorExperts).
Status CheckTokenMajor(const Case& c, const AllToAllConfig& cfg, const std::vector<Inputs>& all,
                       const DispatchOutput& out, std::vector<uint8_t>& expert_out) {
  const int l = cfg.local_experts(), k = c.k, me = cfg.rank;
  const int64_t row = cfg.token_bytes(), spt = cfg.scales_per_token();
  std::vector<int32_t> copies(l, 0);
  int32_t i = 0;
  for (int sender : SenderOrder(c, cfg.world_size)) {
    const Inputs& src = all[size_t(sender)];
    for (int t = 0; t < src.tokens; ++t) {
      std::vector<int32_t> experts(k, -1);
      std::vector<float> weights(k, 0.0f);
      for (int j = 0; j < k; ++j) {
        const int32_t g = src.indices[size_t(t) * k + j];
        if (g < 0 || g / l != me) continue;
        experts[j] = g % l;
        weights[j] = src.weights[size_t(t) * k + j];
        ++copies[g % l];
      }
      if (std::all_of(experts.begin(), experts.end(), [](int32_t e) { return e < 0; })) continue;
      const std::string at = "row " + std::to_string(i);
      CHECK_OR_RETURN(i < *out.num_rows, at + " missing (" + std::to_string(*out.num_rows) + ")");
      const auto* x = static_cast<const uint8_t*>(out.x) + i * row;
      CHECK_OR_RETURN(std::memcmp(x, src.x.data() + t * row, row) == 0, at + ": other payload");
      CHECK_OR_RETURN(!spt || std::memcmp(out.scales + i * spt, &src.scales[t * spt],
                                          spt * 4) == 0,
                      at + ": other scales");
      CHECK_OR_RETURN(std::equal(experts.begin(), experts.end(), out.token_experts + i * k) &&
                          std::equal(weights.begin(), weights.end(), out.token_weights + i * k),
                      at + ": other experts or weights");
      ++i;
    }
  }
  CHECK_OR_RETURN(*out.num_rows == i, std::to_string(*out.num_rows) + " rows, expected " +
                                          std::to_string(i));
  SumTokenMajorExperts(cfg, static_cast<const uint8_t*>(out.x), out.scales, out.token_experts,
                       out.token_weights, i, expert_out.data(), c.fp16_combine);
  for (int e = 0; e < l; ++e) {
    CHECK_OR_RETURN(out.num_tokens[e] == copies[e], "expert " + std::to_string(e) + ": " +
                                                        std::to_string(out.num_tokens[e]) +
                                                        " copies, expected " +
                                                        std::to_string(copies[e]));
  }
  return Status::Ok();
}

// One rank's AllToAll driven through the four steps of each iteration, each step a call of its
// own so that two AllToAlls on one engine can interleave theirs; every check of this file's
// header runs as its step ends.
class RankRun {
 public:
  RankRun(const Case& c, Bootstrap& b) : c_(c), b_(b) {}

  Status Create(TransferEngine* engine, int instance = 0) {
    cfg_ = ConfigFor(c_, b_.world_size(), b_.rank());
    cfg_.instance = instance;
    if (c_.node_ranks) {
      cfg_.ranks_per_node = c_.node_ranks;
      cfg_.forwarding = Forwarding::kNodeOnce;
      if (c_.fp32_partials) cfg_.partial_sums = PartialSums::kFp32;
    }
    token_major_ = TokenMajor(c_, b_.rank());
    if (token_major_) cfg_.dispatch_layout = DispatchLayout::kTokenMajor;
    ASSIGN_OR_RETURN(a2a_, AllToAll::Create(cfg_, engine, b_));
    const int64_t l = cfg_.local_experts(), cap = cfg_.expert_capacity();
    out_x_.assign(size_t(l * cap * cfg_.token_bytes()), 0xCD);  // poisoned
    out_scales_.assign(size_t(l * cap * cfg_.scales_per_token()), -1.0f);
    out_counts_.assign(size_t(l), -1);
    expert_out_.assign(size_t(l * cap * cfg_.combine_row_bytes()), 0);
    token_experts_.assign(size_t(cap) * c_.k, -2);
    token_experts64_.assign(size_t(cap) * c_.k, int64_t{1} << 40);
    token_weights_.assign(size_t(cap) * c_.k, -1.0f);
    return Status::Ok();
  }

  Status DispatchSend(int it) {
    all_.clear();
    for (int r = 0; r < cfg_.world_size; ++r) all_.push_back(MakeInputs(Spec(c_), cfg_, r, it));
    const Inputs& mine = all_[b_.rank()];
    return a2a_->DispatchSend({mine.x.data(), mine.scales.empty() ? nullptr : mine.scales.data(),
                               mine.indices.data(), mine.weights.data(), mine.tokens});
  }

  // The received rows checked, and the experts' outputs computed from them for CombineSend.
  Status DispatchRecv() {
    DispatchOutput out{out_x_.data(), out_scales_.data(), out_counts_.data()};
    if (token_major_) {
      out.num_rows = &num_rows_;
      // Odd ranks take 64-bit ids (DispatchOutput::token_experts64): whole values, checked as
      // the 32-bit ones once narrowed.
      if (b_.rank() % 2) {
        out.token_experts64 = token_experts64_.data();
      } else {
        out.token_experts = token_experts_.data();
      }
      out.token_weights = token_weights_.data();
    }
    RETURN_IF_ERROR(a2a_->DispatchRecv(out, Deadline::After(30s)));
    if (token_major_) {
      if (out.token_experts64) {
        for (size_t i = 0; i < size_t(num_rows_) * size_t(c_.k); ++i) {
          const int64_t e = token_experts64_[i];
          CHECK_OR_RETURN(e >= -1 && e < cfg_.local_experts(),
                          "64-bit token expert " + std::to_string(e));
          token_experts_[i] = static_cast<int32_t>(e);
        }
        out.token_experts = token_experts_.data();
      }
      return CheckTokenMajor(c_, cfg_, all_, out, expert_out_);
    }
    const int l = cfg_.local_experts(), n = cfg_.world_size, h = cfg_.hidden;
    const int64_t cap = cfg_.expert_capacity(), row = cfg_.token_bytes();
    const int64_t spt = cfg_.scales_per_token();
    // Exact multiset per local expert: payload bytes and scales of every copy routed to it.
    for (int e = 0; e < l; ++e) {
      const int g = b_.rank() * l + e;
      std::vector<std::string> want, got;
      for (int r = 0; r < n; ++r) {
        const Inputs& src = all_[r];
        for (int t = 0; t < src.tokens; ++t) {
          for (int j = 0; j < c_.k; ++j) {
            if (src.indices[size_t(t) * c_.k + j] != g) continue;
            std::string key(reinterpret_cast<const char*>(src.x.data() + t * row), row);
            if (spt) key.append(reinterpret_cast<const char*>(&src.scales[t * spt]), spt * 4);
            want.push_back(std::move(key));
          }
        }
      }
      CHECK_OR_RETURN(out_counts_[e] == static_cast<int32_t>(want.size()),
                      "expert " + std::to_string(g) + " got " + std::to_string(out_counts_[e]) +
                          " rows, expected " + std::to_string(want.size()));
      for (int i = 0; i < out_counts_[e]; ++i) {
        int64_t r = int64_t{e} * cap + i;
        std::string key(reinterpret_cast<const char*>(out_x_.data() + r * row), row);
        if (spt) key.append(reinterpret_cast<const char*>(&out_scales_[r * spt]), spt * 4);
        got.push_back(std::move(key));
        // The expert computes; its output goes back through combine.
        for (int col = 0; col < h; ++col) {
          const float x = Dequant(cfg_, out_x_.data() + r * row, out_scales_.data() + r * spt, col);
          PutCombine(cfg_, expert_out_.data(), r * h + col, x * ExpertScale(g),
                     c_.fp16_combine);
        }
      }
      std::sort(want.begin(), want.end());
      std::sort(got.begin(), got.end());
      CHECK_OR_RETURN(want == got, "expert " + std::to_string(g) + " received other rows");
    }
    return Status::Ok();
  }

  Status CombineSend() {
    return a2a_->CombineSend(CombineInput{expert_out_.data(), c_.fp16_combine});
  }

  // The combined output against a float64 reference; odd iterations add to what y holds.
  Status CombineRecv(int it) {
    const Inputs& mine = all_[b_.rank()];
    const int h = cfg_.hidden;
    const int64_t row = cfg_.token_bytes(), spt = cfg_.scales_per_token();
    const bool fp16 = c_.fp16_combine;
    std::vector<uint8_t> y = CombineFilled(cfg_, int64_t{mine.tokens} * h, 0.5f, fp16);
    const bool accumulate = it % 2 == 1;
    // Late weights: others than the dispatch's, which the sums must then ignore.
    std::vector<float> weights = mine.weights;
    if (c_.late_weights) {
      for (float& w : weights) w = 0.25f + 0.5f * w;
    }
    RETURN_IF_ERROR(a2a_->CombineRecv(
        CombineOutput{.out = y.data(),
                      .accumulate = accumulate,
                      .weights = c_.late_weights ? weights.data() : nullptr,
                      .fp16 = fp16},
        Deadline::After(30s)));
    // Where the combine rounds once (node-once's fp32 partial sums, every rank returning its
    // rows as they are: no option (b), expert-major) each element is within half a unit in the
    // last place of the exact sum, widened by the fp32 additions' own error.
    const bool rounded_once = c_.fp32_partials && !c_.reduce_at_expert_rank &&
                              c_.layouts == Layouts::kExpertMajor && !cfg_.combines_fp32();
    for (int t = 0; t < mine.tokens; ++t) {
      const uint8_t* xr = mine.x.data() + t * row;
      const float* sr = spt ? &mine.scales[t * spt] : nullptr;
      double norm = 0, err = 0;
      for (int col = 0; col < h; ++col) {
        double ref = accumulate ? 0.5 : 0.0, size = std::abs(ref);
        for (int j = 0; j < c_.k; ++j) {
          int g = mine.indices[size_t(t) * c_.k + j];
          if (g < 0) continue;  // no expert: the copy adds nothing
          float expert = CombineRound(cfg_, Dequant(cfg_, xr, sr, col) * ExpertScale(g), fp16);
          ref += double(weights[size_t(t) * c_.k + j]) * expert;
          size += std::abs(double(weights[size_t(t) * c_.k + j]) * expert);
        }
        double got = GetCombine(cfg_, y.data(), int64_t{t} * h + col, fp16);
        norm += ref * ref;
        err += (got - ref) * (got - ref);
        if (rounded_once) {
          const double slack = 1e-6 * size;
          int e = 0;
          std::frexp(std::max(std::abs(ref) + slack, 1e-30), &e);
          const double half_unit = std::ldexp(1.0, e - 1 - (fp16 ? 10 : 7)) / 2;
          CHECK_OR_RETURN(std::abs(got - ref) <= half_unit + slack,
                          "token " + std::to_string(t) + " column " + std::to_string(col) +
                              ": " + std::to_string(got) + ", exact " + std::to_string(ref) +
                              ": more than one rounding");
        }
      }
      // bf16 sums round to 2^-9 of their size, fp16 ones to 2^-11; fp32 sums (combines_fp32)
      // to a few 2^-24.
      const double tolerance = cfg_.combines_fp32() ? 1e-6 : fp16 ? 5e-4 : 1e-2;
      CHECK_OR_RETURN(std::sqrt(err) <= tolerance * std::sqrt(norm) + 1e-9,
                      "token " + std::to_string(t) + " combine relative error " +
                          std::to_string(std::sqrt(err / std::max(norm, 1e-30))));
    }
    return Status::Ok();
  }

  Status Iteration(int it) {
    RETURN_IF_ERROR(DispatchSend(it));
    RETURN_IF_ERROR(DispatchRecv());
    RETURN_IF_ERROR(CombineSend());
    return CombineRecv(it);
  }

  void Destroy() { a2a_.reset(); }

 private:
  const Case c_;
  Bootstrap& b_;
  AllToAllConfig cfg_;
  bool token_major_ = false;
  std::unique_ptr<AllToAll> a2a_;
  std::vector<Inputs> all_;  // every rank's inputs of the current iteration
  std::vector<uint8_t> out_x_;
  std::vector<float> out_scales_;
  std::vector<int32_t> out_counts_;
  std::vector<uint8_t> expert_out_;  // the combine's element (AllToAllConfig::combine_row_bytes)
  int32_t num_rows_ = -1;
  std::vector<int32_t> token_experts_;
  std::vector<int64_t> token_experts64_;
  std::vector<float> token_weights_;
};

Status RunRank(const Case& c, Bootstrap& b) {
  ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(testing_util::TestOptions(c.provider)));
  RankRun run(c, b);
  RETURN_IF_ERROR(run.Create(engine.get()));
  for (int it = 0; it < c.iterations; ++it) RETURN_IF_ERROR(run.Iteration(it));
  return b.Barrier(30s);
}

class MoeHostTest : public ::testing::TestWithParam<Case> {};

TEST_P(MoeHostTest, DispatchExactAndCombineWithinTolerance) {
  const Case c = GetParam();
  auto exits =
      testing_util::RunRanks(c.world_size, [&](Bootstrap& b) { return RunRank(c, b); }, 240s);
  for (size_t r = 0; r < exits.size(); ++r) {
    EXPECT_TRUE(exits[r].ok()) << "rank " << r << ": exit " << exits[r].exit_code << " signal "
                               << exits[r].signal << (exits[r].timed_out ? " (timed out)" : "");
  }
}


INSTANTIATE_TEST_SUITE_P(Cases, MoeHostTest, ::testing::ValuesIn(Cases()), CaseName);

// Several AllToAlls on one engine (two micro-batches overlapped): each takes an instance of its
// own and their steps interleave; an instance once taken on an engine stays taken (its counters
// outlive the AllToAll: AlreadyExists), another still serves; ranks that differ in the instance
// are told so at Create.
TEST(MoeHostInstancesTest, TwoAllToAllsShareAnEngineTheirStepsInterleaved) {
  const auto bf16 = DispatchDtype::kBf16, fp8 = DispatchDtype::kFp8E4M3;
  const Case first{.provider = "shm", .world_size = 3, .tokens = 33, .hidden = 128, .experts = 48,
                   .k = 4, .dtype = bf16, .routing = Routing::kRandom, .private_tokens = 4};
  const Case second{.provider = "shm", .world_size = 3, .tokens = 20, .hidden = 256,
                    .experts = 48, .k = 2, .dtype = fp8, .routing = Routing::kRandom,
                    .private_tokens = 2, .once_per_rank = true, .reduce_at_expert_rank = true,
                    .layouts = Layouts::kMixed};
  auto exits = testing_util::RunRanks(3, [&](Bootstrap& b) -> Status {
    ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(testing_util::TestOptions("shm")));
    RankRun one(first, b), two(second, b);
    RETURN_IF_ERROR(one.Create(engine.get(), 0));
    RETURN_IF_ERROR(two.Create(engine.get(), 1));
    for (int it = 0; it < 3; ++it) {
      // The second micro-batch's dispatch in flight while the first's experts run, and so on.
      RETURN_IF_ERROR(one.DispatchSend(it));
      RETURN_IF_ERROR(two.DispatchSend(it));
      RETURN_IF_ERROR(one.DispatchRecv());
      RETURN_IF_ERROR(one.CombineSend());
      RETURN_IF_ERROR(two.DispatchRecv());
      RETURN_IF_ERROR(two.CombineSend());
      RETURN_IF_ERROR(one.CombineRecv(it));
      RETURN_IF_ERROR(two.CombineRecv(it));
    }
    RankRun again(second, b);
    Status s = again.Create(engine.get(), 1);
    CHECK_OR_RETURN(s.code() == StatusCode::kAlreadyExists, "instance 1 twice: " + s.ToString());
    two.Destroy();
    s = again.Create(engine.get(), 1);
    CHECK_OR_RETURN(s.code() == StatusCode::kAlreadyExists,
                    "instance 1 after its AllToAll is gone: " + s.ToString());
    RETURN_IF_ERROR(again.Create(engine.get(), 2));
    RETURN_IF_ERROR(again.Iteration(0));
    RETURN_IF_ERROR(one.Iteration(3));
    RankRun differ(first, b);
    s = differ.Create(engine.get(), 3 + b.rank() % 2);
    CHECK_OR_RETURN(s.code() == StatusCode::kInvalidArgument,
                    "instances 3 and 4 in one AllToAll: " + s.ToString());
    return b.Barrier(30s);
  }, 120s);
  for (size_t r = 0; r < exits.size(); ++r) {
    EXPECT_TRUE(exits[r].ok()) << "rank " << r << ": exit " << exits[r].exit_code << " signal "
                               << exits[r].signal << (exits[r].timed_out ? " (timed out)" : "");
  }
}

// Bad inputs: clear errors, and the protocol still works afterwards.
TEST(MoeHostBadInputTest, RefusesBadRoutesTooManyTokensAndMismatchedConfigs) {
  auto exits = testing_util::RunRanks(2, [](Bootstrap& b) -> Status {
    AllToAllConfig cfg{.world_size = 2, .rank = b.rank(), .num_experts = 8, .experts_per_token = 2,
                       .max_tokens_per_rank = 4, .hidden = 128, .dtype = DispatchDtype::kBf16,
                       .max_private_tokens = 2};
    ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(testing_util::TestOptions("shm")));
    ASSIGN_OR_RETURN(auto a2a, AllToAll::Create(cfg, engine.get(), b));
    std::vector<uint16_t> x(5 * 128, 0);
    std::vector<int32_t> idx = {0, 1, 2, 8, 3, 4, 5, 6, 7, 0};
    std::vector<float> w(10, 0.5f);
    Status s = a2a->DispatchSend({x.data(), nullptr, idx.data(), w.data(), 2});
    CHECK_OR_RETURN(s.code() == StatusCode::kOutOfRange, "expert 8 accepted: " + s.ToString());
    s = a2a->DispatchSend({x.data(), nullptr, idx.data(), w.data(), 5});
    CHECK_OR_RETURN(s.code() == StatusCode::kInvalidArgument, "5 > 4 tokens: " + s.ToString());
    s = a2a->CombineSend(nullptr);
    CHECK_OR_RETURN(s.code() == StatusCode::kFailedPrecondition, "out of order: " + s.ToString());
    AllToAllConfig bad = cfg;
    bad.num_experts = 7;
    CHECK_OR_RETURN(bad.Validate().code() == StatusCode::kInvalidArgument, "E % N accepted");
    bad = cfg;
    bad.hidden = 100;
    CHECK_OR_RETURN(bad.Validate().code() == StatusCode::kInvalidArgument, "hidden 100 accepted");
    bad = cfg;
    bad.instance = AllToAllConfig::kMaxInstances;
    CHECK_OR_RETURN(bad.Validate().code() == StatusCode::kInvalidArgument, "instance 16 accepted");
    bad = cfg;
    bad.rdma_buffers = static_cast<RdmaBuffers>(3);
    CHECK_OR_RETURN(bad.Validate().code() == StatusCode::kInvalidArgument, "placement 3 accepted");
    bad = cfg;
    bad.dispatch_layout = DispatchLayout::kTokenMajor;  // needs options (a) and (b)
    s = bad.Validate();
    CHECK_OR_RETURN(s.code() == StatusCode::kInvalidArgument &&
                        s.message().find("token-major") != std::string::npos,
                    "token-major without (a)+(b): " + s.ToString());
    bad.dispatch_once_per_rank = bad.combine_reduce_at_expert_rank = true;
    RETURN_IF_ERROR(bad.Validate());
    // What only the CUDA NVLink path offers is refused clearly on the host device.
    int32_t device_count = 2;
    DispatchInput counted{x.data(), nullptr, idx.data(), w.data(), 2};
    counted.device_num_tokens = &device_count;
    s = a2a->DispatchSend(counted);
    CHECK_OR_RETURN(s.code() == StatusCode::kInvalidArgument, "device count: " + s.ToString());
    s = a2a->SetStream(nullptr);
    CHECK_OR_RETURN(s.code() == StatusCode::kUnimplemented, "SetStream: " + s.ToString());
    RETURN_IF_ERROR(a2a->Synchronize());  // nothing enqueued: the steps wait themselves
    // A good iteration after the refusals.
    idx = {0, 5, 7, 2};
    std::vector<uint16_t> out_x(4 * 2 * 4 * 128), y(2 * 128), eo(4 * 2 * 4 * 128, 0);
    std::vector<int32_t> counts(4);
    RETURN_IF_ERROR(a2a->DispatchSend({x.data(), nullptr, idx.data(), w.data(), 2}));
    // The token-major outputs given to an expert-major AllToAll: refused, the step can be retried.
    int32_t rows = 0;
    DispatchOutput mixed_up{out_x.data(), nullptr, counts.data()};
    mixed_up.num_rows = &rows;
    s = a2a->DispatchRecv(mixed_up, Deadline::After(30s));
    CHECK_OR_RETURN(s.code() == StatusCode::kInvalidArgument &&
                        s.message().find("expert-major") != std::string::npos,
                    "token-major outputs: " + s.ToString());
    RETURN_IF_ERROR(
        a2a->DispatchRecv({out_x.data(), nullptr, counts.data()}, Deadline::After(30s)));
    RETURN_IF_ERROR(a2a->CombineSend(eo.data()));
    RETURN_IF_ERROR(a2a->CombineRecv(y.data(), false, Deadline::After(30s)));
    return b.Barrier(30s);
  }, 120s);
  for (auto& e : exits) EXPECT_TRUE(e.ok()) << e.exit_code;

  // Setup refusals before any collective step: a null engine where one is needed (the host
  // device; the CUDA device with more than one node).
  exits = testing_util::RunRanks(1, [](Bootstrap& b) -> Status {
    AllToAllConfig cfg{.world_size = 1, .rank = 0, .num_experts = 8, .experts_per_token = 2,
                       .max_tokens_per_rank = 4, .hidden = 128, .dtype = DispatchDtype::kBf16,
                       .max_private_tokens = 2};
    auto none = AllToAll::Create(cfg, nullptr, b);
    CHECK_OR_RETURN(none.status().code() == StatusCode::kInvalidArgument,
                    "null engine: " + none.status().ToString());
    return Status::Ok();
  }, 60s);
  for (auto& e : exits) EXPECT_TRUE(e.ok()) << e.exit_code;
  exits = testing_util::RunRanks(4, [](Bootstrap& b) -> Status {
    AllToAllConfig cfg{.world_size = 4, .rank = b.rank(), .ranks_per_node = 2, .num_experts = 8,
                       .experts_per_token = 2, .max_tokens_per_rank = 4, .hidden = 128,
                       .dtype = DispatchDtype::kBf16, .max_private_tokens = 2};
    cfg.device = MoeDeviceKind::kCuda;
    auto mixed = AllToAll::Create(cfg, nullptr, b);
    CHECK_OR_RETURN(mixed.status().code() == StatusCode::kInvalidArgument &&
                        mixed.status().message().find("null engine") != std::string::npos,
                    "2 nodes x 2 GPUs without an engine: " + mixed.status().ToString());
    return Status::Ok();
  }, 60s);
  for (auto& e : exits) EXPECT_TRUE(e.ok()) << e.exit_code;

  // Ranks that disagree on the configuration fail at setup, naming the problem.
  exits = testing_util::RunRanks(2, [](Bootstrap& b) -> Status {
    AllToAllConfig cfg{.world_size = 2, .rank = b.rank(), .num_experts = 8, .experts_per_token = 2,
                       .max_tokens_per_rank = 4, .hidden = b.rank() == 0 ? 128 : 256,
                       .dtype = DispatchDtype::kBf16, .max_private_tokens = 2};
    ASSIGN_OR_RETURN(auto engine, TransferEngine::Create(testing_util::TestOptions("shm")));
    auto a2a = AllToAll::Create(cfg, engine.get(), b);
    CHECK_OR_RETURN(!a2a.ok() && a2a.status().code() == StatusCode::kInvalidArgument,
                    "mismatched configs accepted: " + a2a.status().ToString());
    CHECK_OR_RETURN(a2a.status().message().find("different configuration") != std::string::npos,
                    a2a.status().ToString());
    return Status::Ok();
  }, 120s);
  for (auto& e : exits) EXPECT_TRUE(e.ok()) << e.exit_code;
}

}  // namespace
}  // namespace ferry
