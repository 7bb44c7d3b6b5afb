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

// Index is the type of the work-item arithmetic: uint32_t whenever the item count fits (64-bit division is
// emulated on the GPU and costs more than copying a short row), int64_t otherwise. Addresses are 64-bit.
template <typename Index>
__global__ void copy_blocks_kernel(BlockCopyGeometry g, const int64_t* __restrict__ bases,
                                   const int64_t* __restrict__ src_blocks, const int64_t* __restrict__ dst_blocks,
                                   int64_t pieces_per_row, int64_t total_items) {
  const int lane = threadIdx.x & 31;
  const Index warps = static_cast<Index>(gridDim.x) * kWarpsPerBlock;
  const Index total = static_cast<Index>(total_items), pieces = static_cast<Index>(pieces_per_row);
  const Index rows = static_cast<Index>(g.rows), groups = static_cast<Index>(g.groups);
  const Index src_per = static_cast<Index>(g.groups / g.src_tensors), dst_per = static_cast<Index>(g.groups / g.dst_tensors);
  for (Index item = static_cast<Index>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5); item < total; item += warps) {
    // item -> (pair, group, row, piece); pair is the slowest so one warp's neighbours touch one block
    Index rest = item;
    const Index piece = rest % pieces;
    rest /= pieces;
    const Index row = rest % rows;
    rest /= rows;
    const Index group = rest % groups;
    const Index pair = rest / groups;
    const int64_t off = static_cast<int64_t>(piece) * kSegmentBytes;
    int64_t len = g.width - off;
    if (len > kSegmentBytes) len = kSegmentBytes;
    const int64_t within = static_cast<int64_t>(row) * g.row_pitch + off;
    const char* s = reinterpret_cast<const char*>(bases[group / src_per]) + src_blocks[pair] * g.src_block_stride +
                    static_cast<int64_t>(group % src_per) * g.group_bytes + within;
    char* d = reinterpret_cast<char*>(bases[g.src_tensors + group / dst_per]) + dst_blocks[pair] * g.dst_block_stride +
              static_cast<int64_t>(group % dst_per) * g.group_bytes + within;
    warp_copy(d, s, len, lane);
  }
}

__global__ void copy_segments_kernel(const int64_t* __restrict__ segments, int64_t count) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5); item < count;
       item += warps) {
    const int64_t* row = segments + 3 * item;
    warp_copy(reinterpret_cast<char*>(row[1]), reinterpret_cast<const char*>(row[0]), row[2], lane);
  }
}

unsigned grid_for(int64_t items) {
  // Enough warps to cover the work, capped: each warp loops, and more CTAs than ~16 per SM only add
  // scheduling cost.
  int64_t blocks = (items + kWarpsPerBlock - 1) / kWarpsPerBlock;
  constexpr int64_t kMaxBlocks = 132 * 16;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

}  // namespace

#ifndef TKV_HOST_EMULATION  // tests/kernel_emulation.cpp runs the kernels above on the CPU, lane by lane
cudaError_t launch_copy_blocks(const BlockCopyGeometry& g, const int64_t* bases, const int64_t* src_blocks,
                               const int64_t* dst_blocks, cudaStream_t stream) {
  if (g.num_pairs == 0 || g.width == 0) return cudaSuccess;
  const int64_t pieces = (g.width + kSegmentBytes - 1) / kSegmentBytes;
  const int64_t total = g.num_pairs * g.groups * g.rows * pieces;
  // the 32-bit variant needs every item index (up to total + one grid of warps) to fit
  if (total + static_cast<int64_t>(grid_for(total)) * kWarpsPerBlock < (int64_t{1} << 32)) {
    copy_blocks_kernel<uint32_t><<<grid_for(total), kThreads, 0, stream>>>(g, bases, src_blocks, dst_blocks, pieces, total);
  } else {
    copy_blocks_kernel<int64_t><<<grid_for(total), kThreads, 0, stream>>>(g, bases, src_blocks, dst_blocks, pieces, total);
  }
  return cudaGetLastError();
}

cudaError_t launch_copy_segments(const int64_t* segments, int64_t count, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  copy_segments_kernel<<<grid_for(count), kThreads, 0, stream>>>(segments, count);
  return cudaGetLastError();
}

#endif  // TKV_HOST_EMULATION

}  // namespace tiered_kv
