// CUDA kernels of dispatch and combine (see cuda_device.h for what this first form covers).
//
// Dispatch send:  Route (one block per receiving rank: scans tokens in order, giving each token
//                 its slot and combine-row positions for that rank; counts per expert) -> Counts
//                 (the counts row into the send region) -> [route-ready] -> Pack (one block per
//                 token: header, entries and the token row into each of its slots) -> [send-ready]
// Dispatch recv:  [recv-ready] -> LoadSlots (one thread per received slot: validate, copy the
//                 metadata to device memory) -> Positions (one block per local expert: its rows
//                 in sender, slot, entry order) -> Rows (one block per sender: the combine row of
//                 each copy) -> Unpack (one block per slot) -> [recv-consumed]
// Combine send:   CombineCopy (plain: each copy's expert output to its row) or CombineReduce
//                 (summed at the expert rank: one block per returned row) -> [combine-ready]
// Combine recv:   [combine-done] -> CombineSum (one block per token: its rows in rank and k
//                 order, fp32, then bf16) -> [combine-consumed]
#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "moe/cuda/cuda_device.h"

namespace ferry::moe {

#define FERRY_CUDA(expr)                                                               \
  do {                                                                                 \
    cudaError_t ferry_err_ = (expr);                                                   \
    if (ferry_err_ != cudaSuccess) {                                                   \
      return InternalError(std::string("CUDA: ") + #expr + ": " +                      \
                           cudaGetErrorString(ferry_err_));                            \
    }                                                                                  \
  } while (0)

PinnedBuffer::PinnedBuffer(PinnedBuffer&& o) noexcept { *this = std::move(o); }

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    if (data_) cudaFreeHost(data_);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

PinnedBuffer::~PinnedBuffer() {
  if (data_) cudaFreeHost(data_);
}

StatusOr<PinnedBuffer> PinnedBuffer::Allocate(size_t bytes) {
  PinnedBuffer b;
  void* p = nullptr;
  FERRY_CUDA(cudaHostAlloc(&p, bytes, cudaHostAllocPortable | cudaHostAllocMapped));
  std::memset(p, 0, bytes);
  b.data_ = static_cast<uint8_t*>(p);
  b.size_ = bytes;
  StatusOr<PinnedBuffer> out(std::move(b));  // nvcc's front end does not move implicitly
  return out;
}

int CudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

namespace {

constexpr int kScanThreads = 1024;
constexpr int kCopyThreads = 256;
constexpr int kMaxK = 32;  // AllToAllConfig allows experts_per_token up to 32

enum ErrorCode : int32_t {
  kNoError = 0,
  kBadExpert = 1,     // detail: token, expert id
  kBadSlot = 2,       // detail: sender, slot
  kRowOverrun = 3,    // detail: sender, slot
};

__device__ inline float Bf16ToFloatD(uint16_t b) { return __uint_as_float(uint32_t{b} << 16); }

__device__ inline uint16_t FloatToBf16D(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu)) return 0x7FC0;
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

__device__ inline void ReportError(int32_t* error, int32_t code, int32_t a, int32_t b) {
  if (atomicCAS(error, 0, code) == 0) {
    error[1] = a;
    error[2] = b;
  }
}

// Copies n bytes with the widest access both pointers and n allow; the block's threads share it.
__device__ inline void CopyBytes(uint8_t* dst, const uint8_t* src, int64_t n) {
  const uintptr_t align = reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) |
                          static_cast<uintptr_t>(n);
  if ((align & 15) == 0) {
    for (int64_t i = threadIdx.x; i < n / 16; i += blockDim.x) {
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
    }
  } else if ((align & 7) == 0) {
    for (int64_t i = threadIdx.x; i < n / 8; i += blockDim.x) {
      reinterpret_cast<uint2*>(dst)[i] = reinterpret_cast<const uint2*>(src)[i];
    }
  } else if ((align & 3) == 0) {
    for (int64_t i = threadIdx.x; i < n / 4; i += blockDim.x) {
      reinterpret_cast<uint32_t*>(dst)[i] = reinterpret_cast<const uint32_t*>(src)[i];
    }
  } else {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
  }
}

struct Shape {
  int n, me, e, l, k, t_max, hidden, spt, priv;
  int64_t payload, slot_bytes, meta_bytes, row_bytes, capacity;
  bool once, reduce;
};

// ---- dispatch send ----------------------------------------------------------------------------

// Block r: for each token in order, the slots and combine rows it has on rank r, as exclusive
// prefix sums (its positions among rank r's slots and rows). Counts copies per expert.
__global__ void RouteKernel(Shape s, const int32_t* indices, int tokens, int32_t* slot_pos,
                            int32_t* row_pos, int32_t* totals, int32_t* expert_counts,
                            int32_t* error) {
  using Scan = cub::BlockScan<int32_t, kScanThreads>;
  __shared__ typename Scan::TempStorage temp;
  const int r = blockIdx.x;
  int32_t carry_slots = 0, carry_rows = 0;
  for (int base = 0; base < tokens; base += kScanThreads) {
    const int t = base + threadIdx.x;
    int32_t slots = 0, rows = 0;
    if (t < tokens) {
      int hits = 0;
      for (int j = 0; j < s.k; ++j) {
        const int32_t e = indices[int64_t{t} * s.k + j];
        if (e < 0 || e >= s.e) {
          if (r == 0) ReportError(error, kBadExpert, t, e);
          continue;
        }
        if (e / s.l != r) continue;
        ++hits;
        atomicAdd(&expert_counts[e], 1);
      }
      slots = hits == 0 ? 0 : (s.once ? 1 : hits);
      rows = hits == 0 ? 0 : (s.reduce ? 1 : hits);
    }
    int32_t slot_prefix, row_prefix, slot_sum, row_sum;
    Scan(temp).ExclusiveSum(slots, slot_prefix, slot_sum);
    __syncthreads();
    Scan(temp).ExclusiveSum(rows, row_prefix, row_sum);
    __syncthreads();
    if (t < tokens) {
      slot_pos[int64_t{r} * s.t_max + t] = carry_slots + slot_prefix;
      row_pos[int64_t{r} * s.t_max + t] = carry_rows + row_prefix;
    }
    carry_slots += slot_sum;
    carry_rows += row_sum;
  }
  if (threadIdx.x == 0) {
    totals[r] = carry_slots;
    totals[s.n + r] = carry_rows;
  }
}

// The counts row (per expert, slots per rank, rows per rank) into the send region.
__global__ void CountsKernel(Shape s, const int32_t* expert_counts, const int32_t* totals,
                             int32_t* counts_row) {
  for (int i = threadIdx.x; i < s.e + 2 * s.n; i += blockDim.x) {
    counts_row[i] = i < s.e ? expert_counts[i] : totals[i - s.e];
  }
}

// Block t: token t's slots, receiver by receiver, at the receiver's first slot plus the token's
// position. Slots are grouped by receiving rank in rank order, as the host device packs them.
__global__ void PackKernel(Shape s, const uint8_t* x, const float* scales, const int32_t* indices,
                           const float* weights, const int32_t* slot_pos, const int32_t* totals,
                           uint8_t* dispatch_area) {
  extern __shared__ int64_t rank_start[];  // [n]
  __shared__ int32_t hit_j[kMaxK];
  __shared__ int hit_count;
  const int t = blockIdx.x;
  if (threadIdx.x == 0) {
    int64_t start = 0;
    for (int r = 0; r < s.n; ++r) {
      rank_start[r] = start;
      start += totals[r];
    }
  }
  __syncthreads();
  const uint8_t* row = x + int64_t{t} * s.payload;
  const float* row_scales = s.spt ? scales + int64_t{t} * s.spt : nullptr;
  for (int r = 0; r < s.n; ++r) {
    if (threadIdx.x == 0) {
      int hits = 0;
      for (int j = 0; j < s.k; ++j) {
        const int32_t e = indices[int64_t{t} * s.k + j];
        if (e >= 0 && e < s.e && e / s.l == r) hit_j[hits++] = j;
      }
      hit_count = hits;
    }
    __syncthreads();
    const int hits = hit_count;
    const int slots = hits == 0 ? 0 : (s.once ? 1 : hits);
    const int64_t first = rank_start[r] + slot_pos[int64_t{r} * s.t_max + t];
    for (int o = 0; o < slots; ++o) {
      uint8_t* slot = dispatch_area + (first + o) * s.slot_bytes;
      const int entries = s.once ? hits : 1;
      if (threadIdx.x < entries) {
        const int j = hit_j[s.once ? threadIdx.x : o];
        const int32_t e = indices[int64_t{t} * s.k + j];
        SlotEntry entry{e % s.l, j, weights[int64_t{t} * s.k + j]};
        memcpy(slot + sizeof(SlotHeader) + threadIdx.x * sizeof(SlotEntry), &entry,
               sizeof entry);
      }
      if (threadIdx.x == 0) {
        SlotHeader header{t, entries};
        memcpy(slot, &header, sizeof header);
      }
      CopyBytes(slot + s.meta_bytes, row, s.payload);
      if (s.spt) {
        CopyBytes(slot + s.meta_bytes + s.payload, reinterpret_cast<const uint8_t*>(row_scales),
                  int64_t{s.spt} * 4);
      }
    }
    __syncthreads();  // hit_j is rewritten for the next rank
  }
}

// ---- dispatch receive -------------------------------------------------------------------------

struct RecvPlan {
  const int64_t* slot_prefix;     // [n + 1] received slots before sender s
  const int64_t* overflow_start;  // [n] sender s's first slot in our overflow region
  const int64_t* rows;            // [n] combine rows we return to sender s
  int64_t own_start;              // our own slots' first index in our dispatch area
  int64_t total_slots;
};

__device__ inline int SenderOf(const int64_t* prefix, int n, int64_t g) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (prefix[mid] <= g) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__device__ inline const uint8_t* SlotAddress(const Shape& s, const RecvPlan& p, const uint8_t* recv,
                                             const uint8_t* own_dispatch,
                                             int64_t private_off, int64_t overflow_off, int sender,
                                             int64_t j) {
  if (sender == s.me) return own_dispatch + (p.own_start + j) * s.slot_bytes;
  if (j < s.priv) return recv + private_off + (int64_t{sender} * s.priv + j) * s.slot_bytes;
  return recv + overflow_off + (p.overflow_start[sender] + j - s.priv) * s.slot_bytes;
}

// Thread g: received slot g (sender-major, each sender in its send order): validated, its
// metadata into device memory.
__global__ void LoadSlotsKernel(Shape s, RecvPlan p, const uint8_t* recv,
                                const uint8_t* own_dispatch, int64_t private_off,
                                int64_t overflow_off, const uint8_t** slot_ptr, int32_t* sender_of,
                                int32_t* token_of, int32_t* entries_of, SlotEntry* entries,
                                int32_t* error) {
  const int64_t g = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (g >= p.total_slots) return;
  const int sender = SenderOf(p.slot_prefix, s.n, g);
  const int64_t j = g - p.slot_prefix[sender];
  const uint8_t* slot = SlotAddress(s, p, recv, own_dispatch, private_off, overflow_off, sender, j);
  SlotHeader header;
  memcpy(&header, slot, sizeof header);
  slot_ptr[g] = slot;
  sender_of[g] = sender;
  token_of[g] = header.src_token;
  bool ok = header.entries >= 1 && header.entries <= s.k && header.src_token >= 0 &&
            header.src_token < s.t_max;
  entries_of[g] = ok ? header.entries : 0;
  for (int i = 0; ok && i < header.entries; ++i) {
    SlotEntry entry;
    memcpy(&entry, slot + sizeof header + i * sizeof(SlotEntry), sizeof entry);
    ok = entry.local_expert >= 0 && entry.local_expert < s.l;
    entries[g * s.k + i] = entry;
  }
  if (!ok) {
    entries_of[g] = 0;
    ReportError(error, kBadSlot, sender, static_cast<int32_t>(j));
  }
}

// Block e: the position of every copy for local expert e, in (slot, entry) order; the count.
__global__ void PositionsKernel(Shape s, int64_t total_slots, const int32_t* entries_of,
                                const SlotEntry* entries, int32_t* pos, int32_t* num_tokens,
                                int32_t* error) {
  using Scan = cub::BlockScan<int32_t, kScanThreads>;
  __shared__ typename Scan::TempStorage temp;
  const int e = blockIdx.x;
  int32_t carry = 0;
  for (int64_t base = 0; base < total_slots; base += kScanThreads) {
    const int64_t g = base + threadIdx.x;
    int32_t mine = 0;
    if (g < total_slots) {
      for (int i = 0; i < entries_of[g]; ++i) mine += entries[g * s.k + i].local_expert == e;
    }
    int32_t prefix, sum;
    Scan(temp).ExclusiveSum(mine, prefix, sum);
    __syncthreads();
    if (mine > 0) {
      int32_t next = carry + prefix;
      for (int i = 0; i < entries_of[g]; ++i) {
        if (entries[g * s.k + i].local_expert == e) pos[g * s.k + i] = next++;
      }
    }
    carry += sum;
  }
  if (threadIdx.x == 0) {
    num_tokens[e] = carry;
    if (carry > s.capacity) ReportError(error, kRowOverrun, -1, e);
  }
}

// Block `sender`: the combine row of each of its slots (plain: one per copy, the first copy's
// row is stored; summed: one per token).
__global__ void RowsKernel(Shape s, RecvPlan p, const int32_t* token_of, const int32_t* entries_of,
                           int32_t* row_of, int32_t* error) {
  using Scan = cub::BlockScan<int32_t, kScanThreads>;
  __shared__ typename Scan::TempStorage temp;
  const int sender = blockIdx.x;
  const int64_t begin = p.slot_prefix[sender], end = p.slot_prefix[sender + 1];
  int32_t carry = 0;
  for (int64_t base = begin; base < end; base += kScanThreads) {
    const int64_t g = base + threadIdx.x;
    int32_t v = 0;
    if (g < end) {
      v = s.reduce ? (g == begin || token_of[g] != token_of[g - 1]) : entries_of[g];
    }
    int32_t prefix, sum;
    Scan(temp).ExclusiveSum(v, prefix, sum);
    __syncthreads();
    if (g < end) {
      // Summed: the row of the token's first slot (inclusive count - 1); plain: the first copy.
      const int32_t row = s.reduce ? carry + prefix + v - 1 : carry + prefix;
      const int32_t last = s.reduce ? row : row + entries_of[g] - 1;
      row_of[g] = row;
      if (last >= p.rows[sender]) {
        ReportError(error, kRowOverrun, sender, static_cast<int32_t>(g - begin));
      }
    }
    carry += sum;
  }
}

// Block g: slot g's row into each of its experts' output rows. (Where each copy returns is
// read back from the slot metadata at combine time.)
__global__ void UnpackKernel(Shape s, const uint8_t** slot_ptr, const int32_t* entries_of,
                             const SlotEntry* entries, const int32_t* pos, uint8_t* out_x,
                             float* out_scales) {
  const int64_t g = blockIdx.x;
  const uint8_t* body = slot_ptr[g] + s.meta_bytes;
  for (int i = 0; i < entries_of[g]; ++i) {
    const SlotEntry entry = entries[g * s.k + i];
    const int64_t dst = int64_t{entry.local_expert} * s.capacity + pos[g * s.k + i];
    CopyBytes(out_x + dst * s.payload, body, s.payload);
    if (s.spt) {
      CopyBytes(reinterpret_cast<uint8_t*>(out_scales + dst * s.spt), body + s.payload,
                int64_t{s.spt} * 4);
    }
  }
}

// ---- combine ----------------------------------------------------------------------------------

// Block g: each copy's expert output row to its place among the rows for its sender.
__global__ void CombineCopyKernel(Shape s, const int32_t* sender_of, const int32_t* entries_of,
                                  const SlotEntry* entries, const int32_t* pos,
                                  const int32_t* row_of, const int64_t* row_start,
                                  const uint16_t* expert_out, uint8_t* combine_area) {
  const int64_t g = blockIdx.x;
  for (int i = 0; i < entries_of[g]; ++i) {
    const SlotEntry entry = entries[g * s.k + i];
    const int64_t src = int64_t{entry.local_expert} * s.capacity + pos[g * s.k + i];
    const int64_t row = row_start[sender_of[g]] + row_of[g] + i;
    CopyBytes(combine_area + row * s.row_bytes,
              reinterpret_cast<const uint8_t*>(expert_out + src * s.hidden), s.row_bytes);
  }
}

// Block g (the first slot of a token from its sender): the weighted fp32 sum of the token's
// expert outputs, taken in (local expert, position) order as the host device does, unfused.
__global__ void CombineReduceKernel(Shape s, int64_t total_slots, const int32_t* sender_of,
                                    const int32_t* token_of, const int32_t* entries_of,
                                    const SlotEntry* entries, const int32_t* pos,
                                    const int32_t* row_of, const int64_t* row_start,
                                    const uint16_t* expert_out, uint8_t* combine_area) {
  __shared__ int64_t src[kMaxK];
  __shared__ float weight[kMaxK];
  __shared__ int count;
  const int64_t g = blockIdx.x;
  const bool first = g == 0 || sender_of[g] != sender_of[g - 1] || token_of[g] != token_of[g - 1];
  if (!first) return;
  if (threadIdx.x == 0) {
    int c = 0;
    for (int64_t h = g; h < total_slots && sender_of[h] == sender_of[g] &&
                        token_of[h] == token_of[g];
         ++h) {
      for (int i = 0; i < entries_of[h] && c < kMaxK; ++i) {
        const SlotEntry entry = entries[h * s.k + i];
        const int64_t at = int64_t{entry.local_expert} * s.capacity + pos[h * s.k + i];
        int q = c++;  // insertion sort by (expert, position): the row index orders both
        while (q > 0 && src[q - 1] > at) {
          src[q] = src[q - 1];
          weight[q] = weight[q - 1];
          --q;
        }
        src[q] = at;
        weight[q] = entry.weight;
      }
    }
    count = c;
  }
  __syncthreads();
  auto* out = reinterpret_cast<uint16_t*>(combine_area +
                                          (row_start[sender_of[g]] + row_of[g]) * s.row_bytes);
  for (int col = threadIdx.x; col < s.hidden; col += blockDim.x) {
    float acc = 0.0f;
    for (int c = 0; c < count; ++c) {
      acc = __fadd_rn(acc, __fmul_rn(weight[c], Bf16ToFloatD(expert_out[src[c] * s.hidden + col])));
    }
    out[col] = FloatToBf16D(acc);
  }
}

// Block t: token t's returned rows, rank by rank and k by k, summed in fp32 (unfused, in the
// host device's order) onto the previous output or zero.
__global__ void CombineSumKernel(Shape s, const int32_t* indices, const float* weights,
                                 const int32_t* row_pos, const uint8_t* const* rank_base,
                                 uint16_t* out, bool accumulate) {
  __shared__ int32_t row_of_j[kMaxK];
  __shared__ float weight_of_j[kMaxK];
  __shared__ int32_t rank_of_j[kMaxK];
  __shared__ int rows;
  const int t = blockIdx.x;
  if (threadIdx.x == 0) {
    int c = 0;
    for (int r = 0; r < s.n; ++r) {
      int hits = 0;
      for (int j = 0; j < s.k; ++j) {
        const int32_t e = indices[int64_t{t} * s.k + j];
        if (e / s.l != r) continue;
        if (s.reduce && hits > 0) continue;  // one summed row per (token, rank)
        rank_of_j[c] = r;
        row_of_j[c] = row_pos[int64_t{r} * s.t_max + t] + hits;
        weight_of_j[c] = s.reduce ? 1.0f : weights[int64_t{t} * s.k + j];
        ++hits;
        ++c;
      }
    }
    rows = c;
  }
  __syncthreads();
  uint16_t* y = out + int64_t{t} * s.hidden;
  for (int col = threadIdx.x; col < s.hidden; col += blockDim.x) {
    float acc = accumulate ? Bf16ToFloatD(y[col]) : 0.0f;
    for (int c = 0; c < rows; ++c) {
      const auto* row = reinterpret_cast<const uint16_t*>(rank_base[rank_of_j[c]] +
                                                          int64_t{row_of_j[c]} * s.row_bytes);
      acc = __fadd_rn(acc, __fmul_rn(weight_of_j[c], Bf16ToFloatD(row[col])));
    }
    y[col] = FloatToBf16D(acc);
  }
}

// ---- the device -------------------------------------------------------------------------------

template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() {
    if (p_) cudaFree(p_);
  }
  Status Allocate(size_t count) {
    count = std::max<size_t>(count, 1);
    FERRY_CUDA(cudaMalloc(&p_, count * sizeof(T)));
    return Status::Ok();
  }
  T* get() const { return p_; }

 private:
  T* p_ = nullptr;
};

class CudaDevice final : public MoeDevice {
 public:
  CudaDevice(const DeviceParams& p, int device) : p_(p), layout_(p.config), device_(device) {}
  ~CudaDevice() override {
    if (stream_) {
      cudaSetDevice(device_);
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
  }

  Status Init() {
    const AllToAllConfig& c = p_.config;
    if (c.experts_per_token > kMaxK) {
      return InvalidArgumentError("moe CUDA device: experts_per_token above " +
                                  std::to_string(kMaxK));
    }
    FERRY_CUDA(cudaSetDevice(device_));
    FERRY_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    const int n = c.world_size, t = c.max_tokens_per_rank, k = c.experts_per_token;
    const int64_t max_slots = int64_t{n} * layout_.slots_per_pair;
    shape_ = Shape{n, c.rank, c.num_experts, c.local_experts(), k, t, c.hidden,
                   c.scales_per_token(), c.max_private_tokens, c.token_bytes(),
                   layout_.slot_bytes, layout_.meta_bytes, layout_.row_bytes,
                   c.expert_capacity(), c.dispatch_once_per_rank,
                   c.combine_reduce_at_expert_rank};
    RETURN_IF_ERROR(slot_pos_.Allocate(size_t(n) * t));
    RETURN_IF_ERROR(row_pos_.Allocate(size_t(n) * t));
    RETURN_IF_ERROR(totals_.Allocate(2 * size_t(n)));
    RETURN_IF_ERROR(expert_counts_.Allocate(c.num_experts));
    RETURN_IF_ERROR(error_.Allocate(3));
    RETURN_IF_ERROR(indices_.Allocate(size_t(t) * k));
    RETURN_IF_ERROR(weights_.Allocate(size_t(t) * k));
    RETURN_IF_ERROR(slot_prefix_.Allocate(n + 1));
    RETURN_IF_ERROR(overflow_start_.Allocate(n));
    RETURN_IF_ERROR(rows_.Allocate(n));
    RETURN_IF_ERROR(row_start_.Allocate(n + 1));
    RETURN_IF_ERROR(rank_base_.Allocate(n));
    RETURN_IF_ERROR(slot_ptr_.Allocate(max_slots));
    RETURN_IF_ERROR(sender_of_.Allocate(max_slots));
    RETURN_IF_ERROR(token_of_.Allocate(max_slots));
    RETURN_IF_ERROR(entries_of_.Allocate(max_slots));
    RETURN_IF_ERROR(row_of_.Allocate(max_slots));
    RETURN_IF_ERROR(entries_.Allocate(size_t(max_slots) * k));
    RETURN_IF_ERROR(pos_.Allocate(size_t(max_slots) * k));
    return Status::Ok();
  }

  Status DispatchSend(const DispatchInput& in, uint64_t epoch) override {
    const AllToAllConfig& c = p_.config;
    FERRY_CUDA(cudaSetDevice(device_));
    tokens_ = in.num_tokens;
    const int n = c.world_size, k = c.experts_per_token;
    FERRY_CUDA(cudaMemsetAsync(error_.get(), 0, 3 * sizeof(int32_t), stream_));
    FERRY_CUDA(cudaMemsetAsync(expert_counts_.get(), 0, c.num_experts * sizeof(int32_t), stream_));
    if (tokens_ > 0) {
      // The routing and weights live on until CombineRecv; the caller's buffers may not.
      FERRY_CUDA(cudaMemcpyAsync(indices_.get(), in.indices, size_t(tokens_) * k * 4,
                                 cudaMemcpyDefault, stream_));
      FERRY_CUDA(cudaMemcpyAsync(weights_.get(), in.weights, size_t(tokens_) * k * 4,
                                 cudaMemcpyDefault, stream_));
    }
    RouteKernel<<<n, kScanThreads, 0, stream_>>>(shape_, indices_.get(), tokens_, slot_pos_.get(),
                                                 row_pos_.get(), totals_.get(),
                                                 expert_counts_.get(), error_.get());
    CountsKernel<<<1, 256, 0, stream_>>>(
        shape_, expert_counts_.get(), totals_.get(),
        reinterpret_cast<int32_t*>(p_.send + layout_.send_counts_off));
    RETURN_IF_ERROR(Finish("dispatch routing"));
    p_.channel->route_ready.store(epoch + 1, std::memory_order_release);
    if (tokens_ > 0) {
      PackKernel<<<tokens_, kCopyThreads, n * sizeof(int64_t), stream_>>>(
          shape_, static_cast<const uint8_t*>(in.x), in.scales, indices_.get(), weights_.get(),
          slot_pos_.get(), totals_.get(), p_.send + layout_.send_dispatch_off);
    }
    RETURN_IF_ERROR(Finish("dispatch packing"));
    p_.channel->send_ready.store(epoch + 1, std::memory_order_release);
    return Status::Ok();
  }

  Status DispatchRecv(const DispatchOutput& out, uint64_t epoch, Deadline deadline) override {
    const AllToAllConfig& c = p_.config;
    const int n = c.world_size, me = c.rank, l = c.local_experts();
    RETURN_IF_ERROR(WaitForProxy(*p_.channel, p_.channel->recv_ready, "recv-ready", epoch,
                                 deadline));
    FERRY_CUDA(cudaSetDevice(device_));
    const Routing& routing = *p_.routing;
    std::vector<int64_t> prefix(n + 1, 0), overflow(n), rows(n);
    for (int s = 0; s < n; ++s) {
      prefix[s + 1] = prefix[s] + routing.Slots(s, me);
      overflow[s] = routing.OverflowStart(s, me);
      rows[s] = routing.Rows(s, me);
    }
    total_slots_ = prefix[n];
    FERRY_CUDA(cudaMemcpyAsync(slot_prefix_.get(), prefix.data(), (n + 1) * 8,
                               cudaMemcpyHostToDevice, stream_));
    FERRY_CUDA(cudaMemcpyAsync(overflow_start_.get(), overflow.data(), n * 8,
                               cudaMemcpyHostToDevice, stream_));
    FERRY_CUDA(cudaMemcpyAsync(rows_.get(), rows.data(), n * 8, cudaMemcpyHostToDevice, stream_));
    const RecvPlan plan{slot_prefix_.get(), overflow_start_.get(), rows_.get(),
                        routing.SlotStart(me, me), total_slots_};
    if (total_slots_ > 0) {
      LoadSlotsKernel<<<(total_slots_ + 255) / 256, 256, 0, stream_>>>(
          shape_, plan, p_.recv, p_.send + layout_.send_dispatch_off, layout_.private_off,
          layout_.overflow_off, slot_ptr_.get(), sender_of_.get(), token_of_.get(),
          entries_of_.get(), entries_.get(), error_.get());
    }
    PositionsKernel<<<l, kScanThreads, 0, stream_>>>(shape_, total_slots_, entries_of_.get(),
                                                     entries_.get(), pos_.get(), out.num_tokens,
                                                     error_.get());
    RowsKernel<<<n, kScanThreads, 0, stream_>>>(shape_, plan, token_of_.get(), entries_of_.get(),
                                                row_of_.get(), error_.get());
    if (total_slots_ > 0) {
      UnpackKernel<<<total_slots_, kCopyThreads, 0, stream_>>>(
          shape_, slot_ptr_.get(), entries_of_.get(), entries_.get(), pos_.get(),
          static_cast<uint8_t*>(out.x), out.scales);
    }
    RETURN_IF_ERROR(Finish("dispatch unpacking"));
    // Rows for sender s go after those of lower ranks in our combine send area.
    row_start_host_.assign(n + 1, 0);
    for (int s = 0; s < n; ++s) row_start_host_[s + 1] = row_start_host_[s] + rows[s];
    FERRY_CUDA(cudaMemcpyAsync(row_start_.get(), row_start_host_.data(), (n + 1) * 8,
                               cudaMemcpyHostToDevice, stream_));
    p_.channel->recv_consumed.store(epoch + 1, std::memory_order_release);
    return Status::Ok();
  }

  Status CombineSend(const uint16_t* expert_out, uint64_t epoch) override {
    FERRY_CUDA(cudaSetDevice(device_));
    uint8_t* area = p_.send + layout_.send_combine_off;
    if (total_slots_ > 0) {
      if (p_.config.combine_reduce_at_expert_rank) {
        CombineReduceKernel<<<total_slots_, kCopyThreads, 0, stream_>>>(
            shape_, total_slots_, sender_of_.get(), token_of_.get(), entries_of_.get(),
            entries_.get(), pos_.get(), row_of_.get(), row_start_.get(), expert_out, area);
      } else {
        CombineCopyKernel<<<total_slots_, kCopyThreads, 0, stream_>>>(
            shape_, sender_of_.get(), entries_of_.get(), entries_.get(), pos_.get(),
            row_of_.get(), row_start_.get(), expert_out, area);
      }
    }
    RETURN_IF_ERROR(Finish("combine packing"));
    p_.channel->combine_ready.store(epoch + 1, std::memory_order_release);
    return Status::Ok();
  }

  Status CombineRecv(uint16_t* out, bool accumulate, uint64_t epoch, Deadline deadline) override {
    const AllToAllConfig& c = p_.config;
    const int n = c.world_size, me = c.rank;
    RETURN_IF_ERROR(WaitForProxy(*p_.channel, p_.channel->combine_done, "combine-done", epoch,
                                 deadline));
    FERRY_CUDA(cudaSetDevice(device_));
    const Routing& routing = *p_.routing;
    // Where rank r's rows for us start: ours never left our send area.
    std::vector<const uint8_t*> base(n);
    for (int r = 0; r < n; ++r) {
      base[r] = r == me ? p_.send + layout_.send_combine_off +
                              row_start_host_[me] * layout_.row_bytes
                        : p_.recv + layout_.combine_off +
                              routing.RowStart(me, r) * layout_.row_bytes;
    }
    FERRY_CUDA(cudaMemcpyAsync(rank_base_.get(), base.data(), n * sizeof(void*),
                               cudaMemcpyHostToDevice, stream_));
    if (tokens_ > 0) {
      CombineSumKernel<<<tokens_, kCopyThreads, 0, stream_>>>(shape_, indices_.get(),
                                                              weights_.get(), row_pos_.get(),
                                                              rank_base_.get(), out, accumulate);
    }
    RETURN_IF_ERROR(Finish("combine sum"));
    p_.channel->combine_consumed.store(epoch + 1, std::memory_order_release);
    return Status::Ok();
  }

 private:
  // Waits for the stream; a launch failure or an error a kernel reported becomes the Status.
  Status Finish(const char* stage) {
    FERRY_CUDA(cudaGetLastError());
    FERRY_CUDA(cudaStreamSynchronize(stream_));
    int32_t error[3] = {0, 0, 0};
    FERRY_CUDA(cudaMemcpy(error, error_.get(), sizeof error, cudaMemcpyDeviceToHost));
    switch (error[0]) {
      case kNoError: return Status::Ok();
      case kBadExpert:
        return OutOfRangeError("DispatchSend: token " + std::to_string(error[1]) +
                               " routes to expert " + std::to_string(error[2]) +
                               ", valid ids are [0, " +
                               std::to_string(p_.config.num_experts) + ")");
      case kBadSlot:
        return DataLossError(std::string("moe: malformed slot ") + std::to_string(error[2]) +
                             " from rank " + std::to_string(error[1]) + " (" + stage + ")");
      default:
        return DataLossError(std::string("moe: a slot from rank ") + std::to_string(error[1]) +
                             " overruns its rows (" + stage + ")");
    }
  }

  const DeviceParams p_;
  const MoeLayout layout_;
  const int device_;
  cudaStream_t stream_ = nullptr;
  Shape shape_{};
  int tokens_ = 0;
  int64_t total_slots_ = 0;
  std::vector<int64_t> row_start_host_;
  DeviceArray<int32_t> slot_pos_, row_pos_, totals_, expert_counts_, error_, indices_;
  DeviceArray<float> weights_;
  DeviceArray<int64_t> slot_prefix_, overflow_start_, rows_, row_start_;
  DeviceArray<const uint8_t*> rank_base_, slot_ptr_;
  DeviceArray<int32_t> sender_of_, token_of_, entries_of_, row_of_, pos_;
  DeviceArray<SlotEntry> entries_;
};

}  // namespace

StatusOr<std::unique_ptr<MoeDevice>> NewCudaDevice(const DeviceParams& params, int device) {
  if (device < 0 || device >= CudaDeviceCount()) {
    return FailedPreconditionError("moe: CUDA device " + std::to_string(device) +
                                   " does not exist (" + std::to_string(CudaDeviceCount()) +
                                   " visible)");
  }
  auto d = std::make_unique<CudaDevice>(params, device);
  RETURN_IF_ERROR(d->Init());
  return std::unique_ptr<MoeDevice>(std::move(d));
}

}  // namespace ferry::moe
