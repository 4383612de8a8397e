// The reshard planner: which bytes of which prefill rank rebuild which decode rank's pages.
//
// It walks every head_dim vector a decode rank holds, in the decode rank's byte order, finds the
// prefill rank (of the replica set chosen for this request) holding the same (page, component,
// head, token), and merges runs that are contiguous on both sides into one write. Same layout
// and sharding on both sides gives one write per page; HND head shards give one write per
// (page, component, head run); NHD to HND falls back to one write per vector.
#include <limits>
#include <random>
#include <string>

#include "ferry/kv.h"

namespace ferry {

Status KvModel::Validate() const {
  if (kv_heads < 1 || head_dim < 1 || page_tokens < 1) {
    return InvalidArgumentError("KvModel: kv_heads, head_dim and page_tokens must be >= 1");
  }
  if (dtype_bytes != 1 && dtype_bytes != 2 && dtype_bytes != 4) {
    return InvalidArgumentError("KvModel: dtype_bytes must be 1, 2 or 4");
  }
  if (mla && kv_heads != 1) return InvalidArgumentError("KvModel: MLA has one latent head");
  // Bounds far above any model, so that a page's bytes (at most 2^55) and every offset within
  // a page fit 64 bits whatever a peer's request says.
  if (kv_heads > kMaxKvHeads || head_dim > kMaxHeadDim || page_tokens > kMaxPageTokens) {
    return InvalidArgumentError("KvModel: kv_heads above " + std::to_string(kMaxKvHeads) +
                                ", head_dim above " + std::to_string(kMaxHeadDim) +
                                " or page_tokens above " + std::to_string(kMaxPageTokens));
  }
  return Status::Ok();
}

Status KvSide::Validate() const {
  RETURN_IF_ERROR(model.Validate());
  if (tp < 1) return InvalidArgumentError("KvSide: tp must be >= 1");
  if (model.mla) return Status::Ok();
  const int h = model.kv_heads;
  if (tp <= h ? h % tp != 0 : tp % h != 0) {
    return InvalidArgumentError("KvSide: " + std::to_string(h) +
                                " KV heads cannot be sharded over " + std::to_string(tp) +
                                " ranks (one must divide the other)");
  }
  return Status::Ok();
}

int KvSide::heads_per_rank() const {
  if (model.mla || tp >= model.kv_heads) return 1;
  return model.kv_heads / tp;
}

int KvSide::replicas() const {
  if (model.mla) return tp;
  return tp > model.kv_heads ? tp / model.kv_heads : 1;
}

int KvSide::first_head(int r) const {
  if (model.mla) return 0;
  return replicas() > 1 ? r / replicas() : r * heads_per_rank();
}

int64_t KvSide::page_bytes() const {
  return int64_t{model.components()} * heads_per_rank() * model.page_tokens * vector_bytes();
}

int64_t KvSide::Offset(int64_t page, int component, int local_head, int token) const {
  const int64_t hpr = heads_per_rank(), tokens = model.page_tokens;
  const int64_t component_bytes = hpr * tokens * vector_bytes();
  const int64_t index = order == KvOrder::kHND ? int64_t{local_head} * tokens + token
                                               : int64_t{token} * hpr + local_head;
  return page * page_bytes() + component * component_bytes + index * vector_bytes();
}

StatusOr<KvPlan> PlanKvTransfer(const KvSide& prefill, const KvSide& decode,
                                std::span<const int64_t> src_pages,
                                std::span<const int64_t> dst_pages, uint64_t seed) {
  RETURN_IF_ERROR(prefill.Validate());
  RETURN_IF_ERROR(decode.Validate());
  const KvModel& a = prefill.model;
  const KvModel& b = decode.model;
  if (a.kv_heads != b.kv_heads || a.head_dim != b.head_dim || a.dtype_bytes != b.dtype_bytes ||
      a.mla != b.mla || a.page_tokens != b.page_tokens) {
    return InvalidArgumentError("PlanKvTransfer: prefill and decode describe different caches "
                                "(heads, head_dim, dtype, MLA or page size)");
  }
  if (src_pages.size() != dst_pages.size()) {
    return InvalidArgumentError("PlanKvTransfer: " + std::to_string(src_pages.size()) +
                                " prefill pages for " + std::to_string(dst_pages.size()) +
                                " decode pages");
  }
  // Every byte offset of a page below these fits int64_t.
  const int64_t src_limit = std::numeric_limits<int64_t>::max() / prefill.page_bytes();
  const int64_t dst_limit = std::numeric_limits<int64_t>::max() / decode.page_bytes();
  for (size_t i = 0; i < src_pages.size(); ++i) {
    if (src_pages[i] < 0 || dst_pages[i] < 0) {
      return InvalidArgumentError("PlanKvTransfer: negative page id at position " +
                                  std::to_string(i));
    }
    if (src_pages[i] >= src_limit || dst_pages[i] >= dst_limit) {
      return InvalidArgumentError("PlanKvTransfer: page id at position " + std::to_string(i) +
                                  " overflows a 64-bit byte offset");
    }
  }
  KvPlan plan;
  plan.writes_per_dst.assign(decode.tp, 0);
  // Each decode replica set draws the prefill replica set that feeds it.
  std::mt19937_64 rng(seed);
  plan.source_replica.resize(decode.replicas());
  for (int& s : plan.source_replica) {
    s = static_cast<int>(rng() % static_cast<uint64_t>(prefill.replicas()));
  }
  const int tokens = a.page_tokens, comps = a.components();
  const int64_t vec = decode.vector_bytes();
  for (int d = 0; d < decode.tp; ++d) {
    const int sigma = plan.source_replica[d % decode.replicas()];
    const int hpr = decode.heads_per_rank();
    const size_t first_write = plan.writes.size();
    // Writes never span pages: the decoder counts writes without knowing the prefill's page
    // ids, so the count must not depend on whether ids happen to be adjacent.
    size_t page_first_write = first_write;
    auto add = [&](int src_rank, int64_t src_off, int64_t dst_off) {
      if (plan.writes.size() > page_first_write) {
        KvWrite& last = plan.writes.back();
        if (last.src_rank == src_rank && last.src_offset + last.length == src_off &&
            last.dst_offset + last.length == dst_off) {
          last.length += vec;
          return;
        }
      }
      plan.writes.push_back({src_rank, src_off, d, dst_off, vec});
    };
    for (size_t i = 0; i < dst_pages.size(); ++i) {
      page_first_write = plan.writes.size();
      for (int c = 0; c < comps; ++c) {
        const int outer = decode.order == KvOrder::kHND ? hpr : tokens;
        const int inner = decode.order == KvOrder::kHND ? tokens : hpr;
        for (int o = 0; o < outer; ++o) {
          for (int in = 0; in < inner; ++in) {
            const int hl = decode.order == KvOrder::kHND ? o : in;
            const int t = decode.order == KvOrder::kHND ? in : o;
            const int h = decode.first_head(d) + hl;
            const int s = prefill.replicas() > 1
                              ? (a.mla ? sigma : h * prefill.replicas() + sigma)
                              : h / prefill.heads_per_rank();
            add(s, prefill.Offset(src_pages[i], c, h - prefill.first_head(s), t),
                decode.Offset(dst_pages[i], c, hl, t));
          }
        }
      }
    }
    plan.writes_per_dst[d] = static_cast<int64_t>(plan.writes.size() - first_write);
  }
  return plan;
}

}  // namespace ferry
