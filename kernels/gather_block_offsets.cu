// Block-offset gather kernel (torch-free). One CTA per (pool, sequence); threads stride over kv x columns.
#include "tkv_kernels.cuh"

namespace tiered_kv {
namespace {

template <typename IdxT>
__global__ void gather_block_offsets_kernel(int32_t* __restrict__ dst, const int32_t* __restrict__ src,
                                            const IdxT* __restrict__ idx, const int32_t* __restrict__ scale,
                                            const int32_t* __restrict__ v_offset, int64_t seqs, int64_t kv,
                                            int64_t dst_cols, int64_t src_rows, int64_t src_cols,
                                            int64_t max_blocks, int32_t sentinel) {
  const int64_t p = blockIdx.y;
  for (int64_t s = blockIdx.x; s < seqs; s += gridDim.x) {
    const int64_t row = static_cast<int64_t>(idx[s]);
    const int32_t mul = scale ? scale[p] : 1;
    const int32_t add = v_offset ? v_offset[p] : 0;
    const int32_t* in = src + (p * src_rows + row) * kv * src_cols;
    int32_t* out = dst + (p * seqs + s) * kv * dst_cols;
    // 32-bit element arithmetic (the launcher checks kv * max_blocks fits): a 64-bit division per element
    // would cost more than the load
    const int n = static_cast<int>(kv * max_blocks), cols = static_cast<int>(max_blocks);
    const int scols = static_cast<int>(src_cols), dcols = static_cast<int>(dst_cols);
    for (int e = threadIdx.x; e < n; e += blockDim.x) {
      const int k = e / cols;
      const int j = e - k * cols;
      const int32_t v = in[k * scols + j];
      // unsigned arithmetic: wraps like the int32 reference instead of being undefined on overflow
      const uint32_t scaled = static_cast<uint32_t>(v) * static_cast<uint32_t>(mul) +
                              (k == 1 ? static_cast<uint32_t>(add) : 0u);
      out[k * dcols + j] = v == sentinel ? v : static_cast<int32_t>(scaled);
    }
  }
}

}  // namespace

#ifndef TKV_HOST_EMULATION  // tests/kernel_emulation.cpp runs the kernels above on the CPU, lane by lane
cudaError_t launch_gather_block_offsets(int32_t* dst, const int32_t* src, const void* idx, bool idx_is_64,
                                        const int32_t* scale, const int32_t* v_offset, int64_t pools, int64_t seqs,
                                        int64_t kv, int64_t dst_cols, int64_t src_rows, int64_t src_cols,
                                        int64_t max_blocks, int32_t sentinel, cudaStream_t stream) {
  if (pools == 0 || seqs == 0 || max_blocks == 0 || kv == 0) return cudaSuccess;
  const int64_t per_row = kv * max_blocks;
  if (per_row >= (int64_t{1} << 31) || kv * src_cols >= (int64_t{1} << 31) || kv * dst_cols >= (int64_t{1} << 31)) {
    return cudaErrorInvalidValue;
  }
  const int threads = per_row >= 256 ? 256 : (per_row >= 128 ? 128 : 64);
  const dim3 grid(static_cast<unsigned>(seqs < 65535 ? seqs : 65535), static_cast<unsigned>(pools));
  if (idx_is_64) {
    gather_block_offsets_kernel<int64_t><<<grid, threads, 0, stream>>>(
        dst, src, static_cast<const int64_t*>(idx), scale, v_offset, seqs, kv, dst_cols, src_rows, src_cols, max_blocks,
        sentinel);
  } else {
    gather_block_offsets_kernel<int32_t><<<grid, threads, 0, stream>>>(
        dst, src, static_cast<const int32_t*>(idx), scale, v_offset, seqs, kv, dst_cols, src_rows, src_cols, max_blocks,
        sentinel);
  }
  return cudaGetLastError();
}

#endif  // TKV_HOST_EMULATION

}  // namespace tiered_kv
