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
#include "moe/cuda/cuda_util.cuh"

namespace ferry::moe {

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

__device__ inline void ReportError(int32_t* error, int32_t code, int32_t a, int32_t b) {
  if (atomicCAS(error, 0, code) == 0) {
    error[1] = a;
    error[2] = b;
  }
}

// The sizes every kernel needs (N ranks, E experts, L = E / N local, K experts per token).
struct Shape {
  int n, me, e, l, k;
  int t_max;   // max tokens per rank
  int hidden;
  int spt;     // fp32 scales per token (fp8), else 0
  int priv;    // private slots per (sender, receiver)
  int64_t payload, slot_bytes, meta_bytes, row_bytes;
  int64_t capacity;  // rows per local expert in the dispatch output
  bool once, reduce; // options (a) and (b)
};

// Dispatch send. T = tokens of this call.
struct SendView {
  Shape s;
  int tokens;
  const uint8_t* x;        // [T, payload] the caller's token rows (device)
  const float* scales;     // [T, spt] (fp8 only)
  const int32_t* indices;  // [T, K] global expert ids (our copy)
  const float* weights;    // [T, K] combine weights (our copy)
  int32_t* slot_pos;       // [N, t_max] token t's first slot among those for rank r
  int32_t* row_pos;        // [N, t_max] token t's first combine row among those from rank r
  int32_t* totals;         // [2N] slots per receiving rank, then combine rows per expert rank
  int32_t* expert_counts;  // [E] copies per expert
  int32_t* counts_row;     // [E + 2N] the counts row in the send region (pinned)
  uint8_t* dispatch_area;  // [T * K, slot_bytes] the send region's slots (pinned)
  int32_t* error;          // [3] code, detail, detail
};

// Dispatch receive and combine send. G = slots received this epoch, sender-major.
struct RecvView {
  Shape s;
  int64_t total_slots;            // G
  const int64_t* slot_prefix;     // [N + 1] slots received before sender s
  const int64_t* overflow_start;  // [N] sender s's first slot in our overflow region
  const int64_t* rows;            // [N] combine rows we return to sender s
  const int64_t* row_start;       // [N + 1] sender s's first row in our combine send area
  int64_t own_start;              // our own slots' first index in our dispatch area
  const uint8_t* recv;            // the receive region (pinned)
  int64_t private_off, overflow_off;
  const uint8_t* own_dispatch;    // our send region's slots (pinned)
  const uint8_t** slot_ptr;       // [G] where slot g lies
  int32_t* sender_of;             // [G]
  int32_t* token_of;              // [G] the sender's token index
  int32_t* entries_of;            // [G] valid entries (0 for a malformed slot)
  SlotEntry* entries;             // [G, K]
  int32_t* pos;                   // [G, K] row of entry i within its local expert
  int32_t* row_of;                // [G] combine row of the slot's first entry (or of its token)
  uint8_t* out_x;                 // [L, capacity, payload] dispatch output (device)
  float* out_scales;              // [L, capacity, spt]
  int32_t* num_tokens;            // [L] rows per local expert
  const uint16_t* expert_out;     // [L, capacity, hidden] bf16 expert outputs (device)
  uint8_t* combine_area;          // [rows, row_bytes] the send region's combine rows (pinned)
  int32_t* error;                 // [3]
};

// Combine receive.
struct SumView {
  Shape s;
  int tokens;
  const int32_t* indices;         // [T, K]
  const float* weights;           // [T, K]
  const int32_t* row_pos;         // [N, t_max]
  const uint8_t* const* rank_base;  // [N] where rank r's rows for us start (pinned)
  uint16_t* out;                  // [T, hidden] bf16 (device)
  bool accumulate;
};

// ---- dispatch send ----------------------------------------------------------------------------

// Block r: for each token in order, the slots and combine rows it has on rank r, as exclusive
// prefix sums (its positions among rank r's slots and rows). Counts copies per expert.
__global__ void RouteKernel(SendView v) {
  __shared__ typename cub::BlockScan<int32_t, kScanThreads>::TempStorage temp;
  const Shape& s = v.s;
  const int r = blockIdx.x;
  auto count = [&](int t) {
    int hits = 0;
    for (int j = 0; j < s.k; ++j) {
      const int32_t e = v.indices[int64_t{t} * s.k + j];
      if (e < 0 || e >= s.e) {
        if (r == 0) ReportError(v.error, kBadExpert, t, e);
        continue;
      }
      if (e / s.l != r) continue;
      ++hits;
      atomicAdd(&v.expert_counts[e], 1);
    }
    return make_int2(hits == 0 ? 0 : (s.once ? 1 : hits), hits == 0 ? 0 : (s.reduce ? 1 : hits));
  };
  ScanTokensForRank<kScanThreads>(r, s.n, v.tokens, s.t_max, count, v.slot_pos, v.row_pos,
                                  v.totals, temp);
}

// The counts row (per expert, slots per rank, rows per rank) into the send region.
__global__ void CountsKernel(SendView v) {
  for (int i = threadIdx.x; i < v.s.e + 2 * v.s.n; i += blockDim.x) {
    v.counts_row[i] = i < v.s.e ? v.expert_counts[i] : v.totals[i - v.s.e];
  }
}

// Block t: token t's slots, receiver by receiver, at the receiver's first slot plus the token's
// position. Slots are grouped by receiving rank in rank order, as the host device packs them.
__global__ void PackKernel(SendView v) {
  extern __shared__ int64_t rank_start[];  // [N]
  __shared__ int32_t hit_j[kMaxK];
  __shared__ int hit_count;
  const Shape& s = v.s;
  const int t = blockIdx.x;
  if (threadIdx.x == 0) {
    int64_t start = 0;
    for (int r = 0; r < s.n; ++r) {
      rank_start[r] = start;
      start += v.totals[r];
    }
  }
  __syncthreads();
  const uint8_t* row = v.x + int64_t{t} * s.payload;
  const float* row_scales = s.spt ? v.scales + int64_t{t} * s.spt : nullptr;
  for (int r = 0; r < s.n; ++r) {
    if (threadIdx.x == 0) {
      int hits = 0;
      for (int j = 0; j < s.k; ++j) {
        const int32_t e = v.indices[int64_t{t} * s.k + j];
        if (e >= 0 && e < s.e && e / s.l == r) hit_j[hits++] = j;
      }
      hit_count = hits;
    }
    __syncthreads();
    const int hits = hit_count;
    const int slots = hits == 0 ? 0 : (s.once ? 1 : hits);
    const int64_t first = rank_start[r] + v.slot_pos[int64_t{r} * s.t_max + t];
    for (int o = 0; o < slots; ++o) {
      uint8_t* slot = v.dispatch_area + (first + o) * s.slot_bytes;
      const int entries = s.once ? hits : 1;
      if (threadIdx.x < entries) {
        const int j = hit_j[s.once ? threadIdx.x : o];
        const int32_t e = v.indices[int64_t{t} * s.k + j];
        SlotEntry entry{e % s.l, j, v.weights[int64_t{t} * s.k + j]};
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

__device__ inline const uint8_t* SlotAddress(const RecvView& v, int sender, int64_t j) {
  const Shape& s = v.s;
  if (sender == s.me) return v.own_dispatch + (v.own_start + j) * s.slot_bytes;
  if (j < s.priv) return v.recv + v.private_off + (int64_t{sender} * s.priv + j) * s.slot_bytes;
  return v.recv + v.overflow_off + (v.overflow_start[sender] + j - s.priv) * s.slot_bytes;
}

// Thread g: received slot g (sender-major, each sender in its send order): validated, its
// metadata into device memory.
__global__ void LoadSlotsKernel(RecvView v) {
  const Shape& s = v.s;
  const int64_t g = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (g >= v.total_slots) return;
  const int sender = SenderOf(v.slot_prefix, s.n, g);
  const int64_t j = g - v.slot_prefix[sender];
  const uint8_t* slot = SlotAddress(v, sender, j);
  SlotHeader header;
  memcpy(&header, slot, sizeof header);
  v.slot_ptr[g] = slot;
  v.sender_of[g] = sender;
  v.token_of[g] = header.src_token;
  bool ok = header.entries >= 1 && header.entries <= s.k && header.src_token >= 0 &&
            header.src_token < s.t_max;
  for (int i = 0; ok && i < header.entries; ++i) {
    SlotEntry entry;
    memcpy(&entry, slot + sizeof header + i * sizeof(SlotEntry), sizeof entry);
    ok = entry.local_expert >= 0 && entry.local_expert < s.l;
    v.entries[g * s.k + i] = entry;
  }
  v.entries_of[g] = ok ? header.entries : 0;
  if (!ok) ReportError(v.error, kBadSlot, sender, static_cast<int32_t>(j));
}

// Block e: the position of every copy for local expert e, in (slot, entry) order; the count.
__global__ void PositionsKernel(RecvView v) {
  using Scan = cub::BlockScan<int32_t, kScanThreads>;
  __shared__ typename Scan::TempStorage temp;
  const Shape& s = v.s;
  const int e = blockIdx.x;
  int32_t carry = 0;
  for (int64_t base = 0; base < v.total_slots; base += kScanThreads) {
    const int64_t g = base + threadIdx.x;
    int32_t mine = 0;
    if (g < v.total_slots) {
      for (int i = 0; i < v.entries_of[g]; ++i) mine += v.entries[g * s.k + i].local_expert == e;
    }
    int32_t prefix, sum;
    Scan(temp).ExclusiveSum(mine, prefix, sum);
    __syncthreads();
    if (mine > 0) {
      int32_t next = carry + prefix;
      for (int i = 0; i < v.entries_of[g]; ++i) {
        if (v.entries[g * s.k + i].local_expert == e) v.pos[g * s.k + i] = next++;
      }
    }
    carry += sum;
  }
  if (threadIdx.x == 0) {
    v.num_tokens[e] = carry;
    if (carry > s.capacity) ReportError(v.error, kRowOverrun, -1, e);
  }
}

// Block `sender`: the combine row of each of its slots (plain: one per copy, the first copy's
// row is stored; summed: one per token).
__global__ void RowsKernel(RecvView v) {
  using Scan = cub::BlockScan<int32_t, kScanThreads>;
  __shared__ typename Scan::TempStorage temp;
  const Shape& s = v.s;
  const int sender = blockIdx.x;
  const int64_t begin = v.slot_prefix[sender], end = v.slot_prefix[sender + 1];
  int32_t carry = 0;
  for (int64_t base = begin; base < end; base += kScanThreads) {
    const int64_t g = base + threadIdx.x;
    int32_t c = 0;
    if (g < end) {
      c = s.reduce ? (g == begin || v.token_of[g] != v.token_of[g - 1]) : v.entries_of[g];
    }
    int32_t prefix, sum;
    Scan(temp).ExclusiveSum(c, prefix, sum);
    __syncthreads();
    if (g < end) {
      // Summed: the row of the token's first slot (inclusive count - 1); plain: the first copy.
      const int32_t row = s.reduce ? carry + prefix + c - 1 : carry + prefix;
      const int32_t last = s.reduce ? row : row + v.entries_of[g] - 1;
      v.row_of[g] = row;
      if (last >= v.rows[sender]) {
        ReportError(v.error, kRowOverrun, sender, static_cast<int32_t>(g - begin));
      }
    }
    carry += sum;
  }
}

// Block g: slot g's row into each of its experts' output rows. (Where each copy returns is read
// back from the slot metadata at combine time.)
__global__ void UnpackKernel(RecvView v) {
  const Shape& s = v.s;
  const int64_t g = blockIdx.x;
  const uint8_t* body = v.slot_ptr[g] + s.meta_bytes;
  for (int i = 0; i < v.entries_of[g]; ++i) {
    const SlotEntry entry = v.entries[g * s.k + i];
    const int64_t dst = int64_t{entry.local_expert} * s.capacity + v.pos[g * s.k + i];
    CopyBytes(v.out_x + dst * s.payload, body, s.payload);
    if (s.spt) {
      CopyBytes(reinterpret_cast<uint8_t*>(v.out_scales + dst * s.spt), body + s.payload,
                int64_t{s.spt} * 4);
    }
  }
}

// ---- combine ----------------------------------------------------------------------------------

// Block g: each copy's expert output row to its place among the rows for its sender.
__global__ void CombineCopyKernel(RecvView v) {
  const Shape& s = v.s;
  const int64_t g = blockIdx.x;
  for (int i = 0; i < v.entries_of[g]; ++i) {
    const SlotEntry entry = v.entries[g * s.k + i];
    const int64_t src = int64_t{entry.local_expert} * s.capacity + v.pos[g * s.k + i];
    const int64_t row = v.row_start[v.sender_of[g]] + v.row_of[g] + i;
    CopyBytes(v.combine_area + row * s.row_bytes,
              reinterpret_cast<const uint8_t*>(v.expert_out + src * s.hidden), s.row_bytes);
  }
}

// Block g (the first slot of a token from its sender): the weighted fp32 sum of the token's
// expert outputs, taken in (local expert, position) order as the host device does, unfused.
__global__ void CombineReduceKernel(RecvView v) {
  __shared__ int64_t src[kMaxK];
  __shared__ float weight[kMaxK];
  __shared__ int count;
  const Shape& s = v.s;
  const int64_t g = blockIdx.x;
  const bool first = g == 0 || v.sender_of[g] != v.sender_of[g - 1] ||
                     v.token_of[g] != v.token_of[g - 1];
  if (!first) return;
  if (threadIdx.x == 0) {
    int c = 0;
    for (int64_t h = g; h < v.total_slots && v.sender_of[h] == v.sender_of[g] &&
                        v.token_of[h] == v.token_of[g];
         ++h) {
      for (int i = 0; i < v.entries_of[h] && c < kMaxK; ++i) {
        const SlotEntry entry = v.entries[h * s.k + i];
        const int64_t at = int64_t{entry.local_expert} * s.capacity + v.pos[h * s.k + i];
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
  auto* out = reinterpret_cast<uint16_t*>(
      v.combine_area + (v.row_start[v.sender_of[g]] + v.row_of[g]) * s.row_bytes);
  for (int col = threadIdx.x; col < s.hidden; col += blockDim.x) {
    float acc = 0.0f;
    for (int c = 0; c < count; ++c) {
      acc = __fadd_rn(acc,
                      __fmul_rn(weight[c], Bf16ToFloatD(v.expert_out[src[c] * s.hidden + col])));
    }
    out[col] = FloatToBf16D(acc);
  }
}

// Block t: token t's returned rows, rank by rank and k by k, summed in fp32 (unfused, in the
// host device's order) onto the previous output or zero.
__global__ void CombineSumKernel(SumView v) {
  __shared__ int32_t row_of_j[kMaxK];
  __shared__ float weight_of_j[kMaxK];
  __shared__ int32_t rank_of_j[kMaxK];
  __shared__ int rows;
  const Shape& s = v.s;
  const int t = blockIdx.x;
  if (threadIdx.x == 0) {
    int c = 0;
    for (int r = 0; r < s.n; ++r) {
      int hits = 0;
      for (int j = 0; j < s.k; ++j) {
        const int32_t e = v.indices[int64_t{t} * s.k + j];
        if (e / s.l != r) continue;
        if (s.reduce && hits > 0) continue;  // one summed row per (token, rank)
        rank_of_j[c] = r;
        row_of_j[c] = v.row_pos[int64_t{r} * s.t_max + t] + hits;
        weight_of_j[c] = s.reduce ? 1.0f : v.weights[int64_t{t} * s.k + j];
        ++hits;
        ++c;
      }
    }
    rows = c;
  }
  __syncthreads();
  uint16_t* y = v.out + int64_t{t} * s.hidden;
  for (int col = threadIdx.x; col < s.hidden; col += blockDim.x) {
    float acc = v.accumulate ? Bf16ToFloatD(y[col]) : 0.0f;
    for (int c = 0; c < rows; ++c) {
      const auto* row = reinterpret_cast<const uint16_t*>(v.rank_base[rank_of_j[c]] +
                                                          int64_t{row_of_j[c]} * s.row_bytes);
      acc = __fadd_rn(acc, __fmul_rn(weight_of_j[c], Bf16ToFloatD(row[col])));
    }
    y[col] = FloatToBf16D(acc);
  }
}

// ---- launchers: framework-free, each returns the launch's cudaError_t -------------------------

cudaError_t RouteAndCount(const SendView& v, cudaStream_t stream) {
  RouteKernel<<<v.s.n, kScanThreads, 0, stream>>>(v);
  CountsKernel<<<1, 256, 0, stream>>>(v);
  return cudaGetLastError();
}

cudaError_t Pack(const SendView& v, cudaStream_t stream) {
  if (v.tokens > 0) {
    PackKernel<<<v.tokens, kCopyThreads, v.s.n * sizeof(int64_t), stream>>>(v);
  }
  return cudaGetLastError();
}

cudaError_t Unpack(const RecvView& v, cudaStream_t stream) {
  if (v.total_slots > 0) {
    LoadSlotsKernel<<<(v.total_slots + 255) / 256, 256, 0, stream>>>(v);
  }
  PositionsKernel<<<v.s.l, kScanThreads, 0, stream>>>(v);
  RowsKernel<<<v.s.n, kScanThreads, 0, stream>>>(v);
  if (v.total_slots > 0) UnpackKernel<<<v.total_slots, kCopyThreads, 0, stream>>>(v);
  return cudaGetLastError();
}

cudaError_t CombinePack(const RecvView& v, cudaStream_t stream) {
  if (v.total_slots > 0) {
    if (v.s.reduce) {
      CombineReduceKernel<<<v.total_slots, kCopyThreads, 0, stream>>>(v);
    } else {
      CombineCopyKernel<<<v.total_slots, kCopyThreads, 0, stream>>>(v);
    }
  }
  return cudaGetLastError();
}

cudaError_t CombineSum(const SumView& v, cudaStream_t stream) {
  if (v.tokens > 0) CombineSumKernel<<<v.tokens, kCopyThreads, 0, stream>>>(v);
  return cudaGetLastError();
}

// ---- the device -------------------------------------------------------------------------------

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
    const Shape shape{n,
                      c.rank,
                      c.num_experts,
                      c.local_experts(),
                      k,
                      t,
                      c.hidden,
                      c.scales_per_token(),
                      c.max_private_tokens,
                      c.token_bytes(),
                      layout_.slot_bytes,
                      layout_.meta_bytes,
                      layout_.row_bytes,
                      c.expert_capacity(),
                      c.dispatch_once_per_rank,
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

    // The views' fixed parts; each step fills in its call's pointers and sizes.
    send_ = SendView{};
    send_.s = shape;
    send_.indices = indices_.get();
    send_.weights = weights_.get();
    send_.slot_pos = slot_pos_.get();
    send_.row_pos = row_pos_.get();
    send_.totals = totals_.get();
    send_.expert_counts = expert_counts_.get();
    send_.counts_row = reinterpret_cast<int32_t*>(p_.send + layout_.send_counts_off);
    send_.dispatch_area = p_.send + layout_.send_dispatch_off;
    send_.error = error_.get();
    recv_ = RecvView{};
    recv_.s = shape;
    recv_.slot_prefix = slot_prefix_.get();
    recv_.overflow_start = overflow_start_.get();
    recv_.rows = rows_.get();
    recv_.row_start = row_start_.get();
    recv_.recv = p_.recv;
    recv_.private_off = layout_.private_off;
    recv_.overflow_off = layout_.overflow_off;
    recv_.own_dispatch = p_.send + layout_.send_dispatch_off;
    recv_.slot_ptr = slot_ptr_.get();
    recv_.sender_of = sender_of_.get();
    recv_.token_of = token_of_.get();
    recv_.entries_of = entries_of_.get();
    recv_.entries = entries_.get();
    recv_.pos = pos_.get();
    recv_.row_of = row_of_.get();
    recv_.combine_area = p_.send + layout_.send_combine_off;
    recv_.error = error_.get();
    sum_ = SumView{};
    sum_.s = shape;
    sum_.indices = indices_.get();
    sum_.weights = weights_.get();
    sum_.row_pos = row_pos_.get();
    sum_.rank_base = rank_base_.get();
    return Status::Ok();
  }

  Status DispatchSend(const DispatchInput& in, uint64_t epoch) override {
    const AllToAllConfig& c = p_.config;
    FERRY_CUDA(cudaSetDevice(device_));
    const size_t copies = size_t(in.num_tokens) * c.experts_per_token;
    FERRY_CUDA(cudaMemsetAsync(error_.get(), 0, 3 * sizeof(int32_t), stream_));
    FERRY_CUDA(cudaMemsetAsync(expert_counts_.get(), 0, c.num_experts * sizeof(int32_t), stream_));
    if (copies > 0) {
      // The routing and weights live on until CombineRecv; the caller's buffers may not.
      FERRY_CUDA(cudaMemcpyAsync(indices_.get(), in.indices, copies * 4, cudaMemcpyDefault,
                                 stream_));
      FERRY_CUDA(cudaMemcpyAsync(weights_.get(), in.weights, copies * 4, cudaMemcpyDefault,
                                 stream_));
    }
    send_.tokens = in.num_tokens;
    send_.x = static_cast<const uint8_t*>(in.x);
    send_.scales = in.scales;
    FERRY_CUDA(RouteAndCount(send_, stream_));
    RETURN_IF_ERROR(Finish("dispatch routing"));
    p_.channel->route_ready.store(epoch + 1, std::memory_order_release);
    FERRY_CUDA(Pack(send_, stream_));
    RETURN_IF_ERROR(Finish("dispatch packing"));
    p_.channel->send_ready.store(epoch + 1, std::memory_order_release);
    return Status::Ok();
  }

  Status DispatchRecv(const DispatchOutput& out, uint64_t epoch, Deadline deadline) override {
    const AllToAllConfig& c = p_.config;
    const int n = c.world_size, me = c.rank;
    RETURN_IF_ERROR(WaitForProxy(*p_.channel, p_.channel->recv_ready, "recv-ready", epoch,
                                 deadline));
    FERRY_CUDA(cudaSetDevice(device_));
    // What the proxy published: per sender, the slots it sent us, where its overflow lies, and
    // the combine rows we owe it.
    const Routing& routing = *p_.routing;
    std::vector<int64_t> prefix(n + 1, 0), overflow(n), rows(n);
    row_start_host_.assign(n + 1, 0);
    for (int s = 0; s < n; ++s) {
      prefix[s + 1] = prefix[s] + routing.Slots(s, me);
      overflow[s] = routing.OverflowStart(s, me);
      rows[s] = routing.Rows(s, me);
      row_start_host_[s + 1] = row_start_host_[s] + rows[s];
    }
    FERRY_CUDA(cudaMemcpyAsync(slot_prefix_.get(), prefix.data(), (n + 1) * 8,
                               cudaMemcpyHostToDevice, stream_));
    FERRY_CUDA(cudaMemcpyAsync(overflow_start_.get(), overflow.data(), n * 8,
                               cudaMemcpyHostToDevice, stream_));
    FERRY_CUDA(cudaMemcpyAsync(rows_.get(), rows.data(), n * 8, cudaMemcpyHostToDevice, stream_));
    FERRY_CUDA(cudaMemcpyAsync(row_start_.get(), row_start_host_.data(), (n + 1) * 8,
                               cudaMemcpyHostToDevice, stream_));
    recv_.total_slots = prefix[n];
    recv_.own_start = routing.SlotStart(me, me);
    recv_.out_x = static_cast<uint8_t*>(out.x);
    recv_.out_scales = out.scales;
    recv_.num_tokens = out.num_tokens;
    FERRY_CUDA(Unpack(recv_, stream_));
    RETURN_IF_ERROR(Finish("dispatch unpacking"));
    p_.channel->recv_consumed.store(epoch + 1, std::memory_order_release);
    return Status::Ok();
  }

  Status CombineSend(const uint16_t* expert_out, uint64_t epoch) override {
    FERRY_CUDA(cudaSetDevice(device_));
    recv_.expert_out = expert_out;
    FERRY_CUDA(CombinePack(recv_, stream_));
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
    sum_.tokens = send_.tokens;
    sum_.out = out;
    sum_.accumulate = accumulate;
    FERRY_CUDA(CombineSum(sum_, stream_));
    RETURN_IF_ERROR(Finish("combine sum"));
    p_.channel->combine_consumed.store(epoch + 1, std::memory_order_release);
    return Status::Ok();
  }

 private:
  // Waits for the stream; an execution failure or an error a kernel reported becomes the Status.
  Status Finish(const char* stage) {
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
  SendView send_{};
  RecvView recv_{};
  SumView sum_{};
  std::vector<int64_t> row_start_host_;
  // Device scratch (shapes in the views' comments).
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
