// Copy kernels (torch-free): structured block copies (block-major / layer-major, full or partial) and
// batched byte segments. Work is split into pieces of at most kSegmentBytes, one warp per piece, so a
// launch keeps thousands of 16-byte loads in flight -- what a PCIe read through unified addressing needs.
#include "tkv_kernels.cuh"

namespace tiered_kv {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;

// One warp copies len bytes. 16-byte accesses when source and destination share their alignment modulo
// 16 (after a byte head), 4-byte ones when they share it modulo 4, bytes otherwise: correct for any
// alignment, fast for the aligned case that real pools have.
__device__ __forceinline__ void warp_copy(char* dst, const char* src, int64_t len, int lane) {
  const uintptr_t sa = reinterpret_cast<uintptr_t>(src), da = reinterpret_cast<uintptr_t>(dst);
  if ((sa & 15) == (da & 15)) {
    int64_t head = static_cast<int64_t>((16 - (da & 15)) & 15);
    if (head > len) head = len;
    if (lane < head) dst[lane] = src[lane];
    src += head;
    dst += head;
    len -= head;
    const int64_t nvec = len >> 4;
    const uint4* s4 = reinterpret_cast<const uint4*>(src);
    uint4* d4 = reinterpret_cast<uint4*>(dst);
    int64_t i = lane;
    for (; i + 96 < nvec; i += 128) {  // four loads in flight per lane before the stores
      const uint4 a = s4[i], b = s4[i + 32], c = s4[i + 64], d = s4[i + 96];
      d4[i] = a;
      d4[i + 32] = b;
      d4[i + 64] = c;
      d4[i + 96] = d;
    }
    for (; i < nvec; i += 32) d4[i] = s4[i];
    for (int64_t j = (nvec << 4) + lane; j < len; j += 32) dst[j] = src[j];
  } else if ((sa & 3) == (da & 3)) {
    int64_t head = static_cast<int64_t>((4 - (da & 3)) & 3);
    if (head > len) head = len;
    if (lane < head) dst[lane] = src[lane];
    src += head;
    dst += head;
    len -= head;
    const int64_t nw = len >> 2;
    const uint32_t* s1 = reinterpret_cast<const uint32_t*>(src);
    uint32_t* d1 = reinterpret_cast<uint32_t*>(dst);
    for (int64_t i = lane; i < nw; i += 32) d1[i] = s1[i];
    for (int64_t j = (nw << 2) + lane; j < len; j += 32) dst[j] = src[j];
  } else {
    for (int64_t j = lane; j < len; j += 32) dst[j] = src[j];
  }
}

// One warp copies nvec 16-byte words (both sides 16-byte aligned): each lane issues kUnroll independent loads
// before its stores (4 KiB in flight per warp at kUnroll 8), what a read of pinned memory over PCIe needs.
template <int kUnroll>
__device__ __forceinline__ void warp_copy16(char* dst, const char* src, uint32_t nvec, int lane) {
  const uint4* s4 = reinterpret_cast<const uint4*>(src);
  uint4* d4 = reinterpret_cast<uint4*>(dst);
  for (uint32_t base = 0; base < nvec; base += 32 * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const uint32_t f = base + static_cast<uint32_t>(lane + 32 * k);
      if (f < nvec) v[k] = s4[f];
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const uint32_t f = base + static_cast<uint32_t>(lane + 32 * k);
      if (f < nvec) d4[f] = v[k];
    }
  }
}

// Rows per item: enough rows of a short partial row to make one kSegmentBytes item; one row (split into
// pieces) otherwise. vec16 needs 16-byte alignment of bases, strides, group and row offsets, and width.
CopyWork plan_copy_work(const BlockCopyGeometry& g, bool bases_aligned16, int64_t batch_bytes = kSegmentBytes) {
  CopyWork w{};
  w.pieces = (g.width + kSegmentBytes - 1) / kSegmentBytes;
  w.batch = 1;
  if (w.pieces == 1 && g.rows > 1) {
    w.batch = batch_bytes / (g.width > 0 ? g.width : 1);
    if (w.batch < 1) w.batch = 1;
    if (w.batch > g.rows) w.batch = g.rows;
  }
  w.row_batches = (g.rows + w.batch - 1) / w.batch;
  w.items = g.num_pairs * g.groups * w.row_batches * w.pieces;
  w.vec16 = bases_aligned16 && ((g.src_block_stride | g.dst_block_stride | g.group_bytes | g.row_pitch | g.width) & 15) == 0;
  return w;
}

// Index is the type of the work-item arithmetic: uint32_t whenever the item count fits (64-bit division is
// emulated on the GPU and costs more than copying a short row), int64_t otherwise. Addresses are 64-bit.
//
// A work item is (pair, group, row batch, piece): `w.batch` consecutive rows of one group (partial copies of
// short rows: a 1 KiB row alone would leave a warp with two 16-byte loads per lane and a chain of index
// loads per KiB) or one piece of at most kSegmentBytes of one row (full copies). When every row start and
// the width are 16-byte aligned on both sides (w.vec16, checked by the launcher) a lane issues kUnroll
// independent 16-byte loads across the batch's rows before its stores: up to 4 KiB in flight per warp.
//
// Meta says where bases and block indices live: PtrMeta (device-readable arrays) or InlineMeta (the kernel's
// own parameters, read in place: __grid_constant__ keeps the compiler from copying them per thread).
struct PtrMeta {
  const int64_t* __restrict__ bases;
  const int64_t* __restrict__ src_blocks;
  const int64_t* __restrict__ dst_blocks;
  __host__ __device__ __forceinline__ int64_t base(int64_t i) const { return bases[i]; }
  __host__ __device__ __forceinline__ int64_t src(int64_t p) const { return src_blocks[p]; }
  __host__ __device__ __forceinline__ int64_t dst(int64_t p) const { return dst_blocks[p]; }
};

__host__ __device__ __forceinline__ int64_t meta_base(const PtrMeta& m, int64_t i) { return m.base(i); }
__host__ __device__ __forceinline__ int64_t meta_src(const PtrMeta& m, int64_t p) { return m.src(p); }
__host__ __device__ __forceinline__ int64_t meta_dst(const PtrMeta& m, int64_t p) { return m.dst(p); }
template <int Slots>
__host__ __device__ __forceinline__ int64_t meta_base(const InlineMetaN<Slots>& m, int64_t i) { return m.v[i]; }
template <int Slots>
__host__ __device__ __forceinline__ int64_t meta_src(const InlineMetaN<Slots>& m, int64_t p) { return m.v[m.src_index + p]; }
template <int Slots>
__host__ __device__ __forceinline__ int64_t meta_dst(const InlineMetaN<Slots>& m, int64_t p) { return m.v[m.dst_index + p]; }

// RunMeta: the run of pair p by binary search over the runs' first pairs (a few param-space loads per work item)
template <int Slots>
__host__ __device__ __forceinline__ int64_t run_slot(const RunMetaN<Slots>& m, int64_t p) {
  int64_t lo = 0, hi = m.runs - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) >> 1;
    if (m.v[m.run_index + 3 * mid] <= p) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return m.run_index + 3 * lo;
}
template <int Slots>
__host__ __device__ __forceinline__ int64_t meta_base(const RunMetaN<Slots>& m, int64_t i) { return m.v[i]; }
template <int Slots>
__host__ __device__ __forceinline__ int64_t meta_src(const RunMetaN<Slots>& m, int64_t p) {
  const int64_t r = run_slot(m, p);
  return m.v[r + 1] + (p - m.v[r]);
}
template <int Slots>
__host__ __device__ __forceinline__ int64_t meta_dst(const RunMetaN<Slots>& m, int64_t p) {
  const int64_t r = run_slot(m, p);
  return m.v[r + 2] + (p - m.v[r]);
}

template <typename Index, typename Meta, int kUnroll = 8>
__global__ void copy_blocks_kernel(BlockCopyGeometry g, const __grid_constant__ Meta meta, CopyWork w) {
  const int lane = threadIdx.x & 31;
  const Index warps = static_cast<Index>(gridDim.x) * kWarpsPerBlock;
  const Index total = static_cast<Index>(w.items), pieces = static_cast<Index>(w.pieces);
  const Index batches = static_cast<Index>(w.row_batches), groups = static_cast<Index>(g.groups);
  const Index src_per = static_cast<Index>(g.groups / g.src_tensors), dst_per = static_cast<Index>(g.groups / g.dst_tensors);
  for (Index item = static_cast<Index>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5); item < total; item += warps) {
    // item -> (pair, group, row batch, piece); pair is the slowest so one warp's neighbours touch one block
    Index rest = item;
    const Index piece = rest % pieces;
    rest /= pieces;
    const Index rb = rest % batches;
    rest /= batches;
    const Index group = rest % groups;
    const Index pair = rest / groups;
    const int64_t off = static_cast<int64_t>(piece) * kSegmentBytes;
    int64_t len = g.width - off;
    if (len > kSegmentBytes) len = kSegmentBytes;
    const int64_t row0 = static_cast<int64_t>(rb) * w.batch;
    int64_t nrows = g.rows - row0;
    if (nrows > w.batch) nrows = w.batch;
    const int64_t within = row0 * g.row_pitch + off;
    const char* s = reinterpret_cast<const char*>(meta_base(meta, group / src_per)) +
                    meta_src(meta, pair) * g.src_block_stride + static_cast<int64_t>(group % src_per) * g.group_bytes +
                    within;
    char* d = reinterpret_cast<char*>(meta_base(meta, g.src_tensors + group / dst_per)) +
              meta_dst(meta, pair) * g.dst_block_stride + static_cast<int64_t>(group % dst_per) * g.group_bytes + within;
    if (w.vec16) {
      const uint32_t nvec = static_cast<uint32_t>(len >> 4);
      const uint32_t count = nvec * static_cast<uint32_t>(nrows);
      const int64_t pitch = g.row_pitch;
      for (uint32_t base = 0; base < count; base += 32 * kUnroll) {
        uint4 v[kUnroll];  // offsets are recomputed for the stores: an array of them costs 16 more registers
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
          const uint32_t f = base + static_cast<uint32_t>(lane + 32 * k);
          const uint32_t r = nrows == 1 ? 0u : f / nvec;
          if (f < count) v[k] = *reinterpret_cast<const uint4*>(s + static_cast<int64_t>(r) * pitch + (f - r * nvec) * 16ull);
        }
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
          const uint32_t f = base + static_cast<uint32_t>(lane + 32 * k);
          const uint32_t r = nrows == 1 ? 0u : f / nvec;
          if (f < count) *reinterpret_cast<uint4*>(d + static_cast<int64_t>(r) * pitch + (f - r * nvec) * 16ull) = v[k];
        }
      }
    } else {
      for (int64_t r = 0; r < nrows; ++r) warp_copy(d + r * g.row_pitch, s + r * g.row_pitch, len, lane);
    }
  }
}

// One warp per segment. A segment whose source, destination and length are 16-byte multiples (what real pools
// have) takes the same unrolled path as copy_blocks_kernel: each lane issues kUnroll independent 16-byte loads
// before its stores (4 KiB in flight per warp), what a read of pinned memory over PCIe needs; any other segment
// is copied by warp_copy.
template <int kUnroll = 8>
__global__ void copy_segments_kernel(const int64_t* __restrict__ segments, int64_t count) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5); item < count;
       item += warps) {
    const int64_t* row = segments + 3 * item;
    const char* src = reinterpret_cast<const char*>(row[0]);
    char* dst = reinterpret_cast<char*>(row[1]);
    const int64_t len = row[2];
    if (((static_cast<uint64_t>(row[0]) | static_cast<uint64_t>(row[1]) | static_cast<uint64_t>(len)) & 15) != 0) {
      warp_copy(dst, src, len, lane);
      continue;
    }
    warp_copy16<kUnroll>(dst, src, static_cast<uint32_t>(len >> 4), lane);
  }
}

// One warp per (pair, chunk, piece) of a chunked copy (ChunkCopyGeometry): the chunk's row of the table
// gives both sides' tensor, offset and block stride, the meta the bases and block indices. Pieces past a
// shorter chunk's end are skipped. vec16 takes the unrolled 16-byte path of the kernels above.
template <typename Index, typename Meta, int kUnroll = 8>
__global__ void copy_chunk_blocks_kernel(ChunkCopyGeometry g, const __grid_constant__ Meta meta,
                                         const int64_t* __restrict__ table, Index total) {
  const int lane = threadIdx.x & 31;
  const Index warps = static_cast<Index>(gridDim.x) * kWarpsPerBlock;
  const Index pieces = static_cast<Index>(g.pieces), chunks = static_cast<Index>(g.chunks);
  for (Index item = static_cast<Index>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5); item < total; item += warps) {
    Index rest = item;
    const Index piece = rest % pieces;
    rest /= pieces;
    const Index chunk = rest % chunks;
    const Index pair = rest / chunks;
    const int64_t* row = table + 7 * static_cast<int64_t>(chunk);
    const int64_t off = static_cast<int64_t>(piece) * kSegmentBytes;
    int64_t len = row[6] - off;
    if (len <= 0) continue;
    if (len > kSegmentBytes) len = kSegmentBytes;
    const char* s = reinterpret_cast<const char*>(meta_base(meta, row[0])) + row[1] + meta_src(meta, pair) * row[2] + off;
    char* d = reinterpret_cast<char*>(meta_base(meta, g.src_tensors + row[3])) + row[4] + meta_dst(meta, pair) * row[5] + off;
    if (!g.vec16) {
      warp_copy(d, s, len, lane);
      continue;
    }
    warp_copy16<kUnroll>(d, s, static_cast<uint32_t>(len >> 4), lane);
  }
}

unsigned grid_for(int64_t items, int64_t max_blocks = 132 * 16) {
  // Enough warps to cover the work, capped (each warp loops): more CTAs than ~16 per SM only add
  // scheduling cost. The launcher passes 16 x the device's SM count.
  int64_t blocks = (items + kWarpsPerBlock - 1) / kWarpsPerBlock;
  return static_cast<unsigned>(blocks < max_blocks ? blocks : max_blocks);
}

// Bytes per work item when short rows are batched (partial copies). Between GPU buffers, 4 KiB items: the op's
// device time on 128 blocks, as a fraction of one contiguous copy (H100), with 16 KiB items -> 4 KiB: 4 of 16
// tokens 0.856 -> 0.917, 8 of 16 0.917 -> 0.935, 12 of 16 0.923 -> 0.963 (whole blocks unchanged at 0.95; 2 KiB
// items lose 4-token rows, 8 KiB ones are between). Through PCIe the small grid keeps kSegmentBytes.
constexpr int64_t kDeviceItemBytes = 4096;

inline int64_t item_bytes(const BlockCopyGeometry& g) { return g.via_host ? kSegmentBytes : kDeviceItemBytes; }

}  // namespace

#ifndef TKV_HOST_EMULATION  // tests/kernel_emulation.cpp runs the kernels above on the CPU, lane by lane
// Launch shape (measured on an H200): a grid of at most kCtasPerSm CTAs per SM, and short rows batched into
// work items (item_bytes above). No other setting (2/4 CTAs per SM, 8/32 KiB items, 4 loads in flight per lane
// instead of 8) is better on every row: 4-token partial rows gain ~10%, 12-token ones lose ~4%.
constexpr int64_t kCtasPerSm = 16;

// A copy through PCIe needs few SMs: 4 CTAs of 512 threads already carry the link at 50-52 GB/s on an H100,
// as does the full grid (kernels/probes/pcie_probe.cu, `grid`). One CTA of kThreads per 16 SMs (9 CTAs, 72 warps,
// on an H100) moves 64 KiB chunks as fast as one per 4 or 8 SMs did, and a layer-by-layer load beside compute
// overlaps far better with it: the forced-kernel prefill went from 1.40-1.47x to 1.21-1.24x of max(load, compute)
// (H100, same run, 4 -> 16 SMs per CTA). Copies between GPU buffers keep the full grid: they are bound by HBM.
constexpr int kSmsPerPcieCta = 16;

int max_ctas(bool via_host) {
  // kCtasPerSm x the current device's SM count (looked up once per device); SMs / kSmsPerPcieCta via host
  static int cached[64] = {0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
    cudaGetLastError();
    return via_host ? 132 / kSmsPerPcieCta : 132 * static_cast<int>(kCtasPerSm);
  }
  if (cached[dev] == 0) {
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms <= 0) {
      cudaGetLastError();
      sms = 132;
    }
    cached[dev] = sms;
  }
  return via_host ? (cached[dev] + kSmsPerPcieCta - 1) / kSmsPerPcieCta : cached[dev] * static_cast<int>(kCtasPerSm);
}

template <typename Meta>
cudaError_t launch_with(const BlockCopyGeometry& g, const Meta& meta, bool bases_aligned16, cudaStream_t stream) {
  if (g.num_pairs == 0 || g.width == 0) return cudaSuccess;
  const CopyWork w = plan_copy_work(g, bases_aligned16, item_bytes(g));
  const unsigned grid = grid_for(w.items, max_ctas(g.via_host));
  // the 32-bit variant needs every item index (up to items + one grid of warps) to fit
  if (w.items + static_cast<int64_t>(grid) * kWarpsPerBlock < (int64_t{1} << 32)) {
    copy_blocks_kernel<uint32_t, Meta><<<grid, kThreads, 0, stream>>>(g, meta, w);
  } else {
    copy_blocks_kernel<int64_t, Meta><<<grid, kThreads, 0, stream>>>(g, meta, w);
  }
  return cudaGetLastError();
}

cudaError_t launch_copy_blocks(const BlockCopyGeometry& g, const int64_t* bases, const int64_t* src_blocks,
                               const int64_t* dst_blocks, bool bases_aligned16, cudaStream_t stream) {
  return launch_with(g, PtrMeta{bases, src_blocks, dst_blocks}, bases_aligned16, stream);
}

cudaError_t launch_copy_blocks_inline(const BlockCopyGeometry& g, const InlineMeta& meta, bool bases_aligned16,
                                      cudaStream_t stream) {
  return launch_with(g, meta, bases_aligned16, stream);
}

cudaError_t launch_copy_blocks_inline(const BlockCopyGeometry& g, const InlineMetaLarge& meta, bool bases_aligned16,
                                      cudaStream_t stream) {
  if (kInlineSlotsLarge == 0) return cudaErrorNotSupported;  // the caller checks kInlineSlotsLarge first
  return launch_with(g, meta, bases_aligned16, stream);
}

cudaError_t launch_copy_blocks_inline(const BlockCopyGeometry& g, const RunMeta& meta, bool bases_aligned16,
                                      cudaStream_t stream) {
  return launch_with(g, meta, bases_aligned16, stream);
}

template <typename Meta>
cudaError_t launch_chunks_with(const ChunkCopyGeometry& g, const int64_t* table, const Meta& meta, cudaStream_t stream) {
  const int64_t items = g.num_pairs * g.chunks * g.pieces;
  if (items == 0) return cudaSuccess;
  const unsigned grid = grid_for(items, max_ctas(g.via_host));
  if (items + static_cast<int64_t>(grid) * kWarpsPerBlock < (int64_t{1} << 32)) {
    copy_chunk_blocks_kernel<uint32_t, Meta><<<grid, kThreads, 0, stream>>>(g, meta, table, static_cast<uint32_t>(items));
  } else {
    copy_chunk_blocks_kernel<int64_t, Meta><<<grid, kThreads, 0, stream>>>(g, meta, table, items);
  }
  return cudaGetLastError();
}

cudaError_t launch_copy_chunk_blocks(const ChunkCopyGeometry& g, const int64_t* table, const int64_t* bases,
                                     const int64_t* src_blocks, const int64_t* dst_blocks, cudaStream_t stream) {
  return launch_chunks_with(g, table, PtrMeta{bases, src_blocks, dst_blocks}, stream);
}

cudaError_t launch_copy_chunk_blocks_inline(const ChunkCopyGeometry& g, const int64_t* table, const InlineMeta& meta,
                                            cudaStream_t stream) {
  return launch_chunks_with(g, table, meta, stream);
}

cudaError_t launch_copy_chunk_blocks_inline(const ChunkCopyGeometry& g, const int64_t* table,
                                            const InlineMetaLarge& meta, cudaStream_t stream) {
  if (kInlineSlotsLarge == 0) return cudaErrorNotSupported;  // the caller checks kInlineSlotsLarge first
  return launch_chunks_with(g, table, meta, stream);
}

cudaError_t launch_copy_chunk_blocks_inline(const ChunkCopyGeometry& g, const int64_t* table, const RunMeta& meta,
                                            cudaStream_t stream) {
  return launch_chunks_with(g, table, meta, stream);
}

cudaError_t launch_copy_segments(const int64_t* segments, int64_t count, bool via_host, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  copy_segments_kernel<<<grid_for(count, max_ctas(via_host)), kThreads, 0, stream>>>(segments, count);
  return cudaGetLastError();
}

#endif  // TKV_HOST_EMULATION

}  // namespace tiered_kv
