// Block-offset gather kernel (torch-free). One CTA per (pool, sequence); threads stride over kv x columns,
// four columns (one 16-byte load and store) per thread when the tables allow it (gather_vec4).
#include "tkv_kernels.cuh"

namespace tiered_kv {
namespace {

// 16-byte accesses: both tables 16-byte aligned and every row start and the copied width a multiple of 4
// columns. The source usually sits in pinned host memory, so this cuts the PCIe read requests by four.
bool gather_vec4(const int32_t* dst, const int32_t* src, int64_t dst_cols, int64_t src_cols, int64_t max_blocks) {
  return ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15) == 0 && dst_cols % 4 == 0 &&
         src_cols % 4 == 0 && max_blocks % 4 == 0;
}

__device__ __forceinline__ int32_t gather_value(int32_t v, int32_t mul, uint32_t add, int32_t sentinel) {
  // unsigned arithmetic: wraps like the int32 reference instead of being undefined on overflow
  const uint32_t scaled = static_cast<uint32_t>(v) * static_cast<uint32_t>(mul) + add;
  return v == sentinel ? v : static_cast<int32_t>(scaled);
}

template <typename IdxT>
__global__ void gather_block_offsets_kernel(int32_t* __restrict__ dst, const int32_t* __restrict__ src,
                                            const IdxT* __restrict__ idx, const int32_t* __restrict__ scale,
                                            const int32_t* __restrict__ v_offset, int64_t seqs, int64_t kv,
                                            int64_t dst_cols, int64_t src_rows, int64_t src_cols,
                                            int64_t max_blocks, int32_t sentinel, bool vec4) {
  const int64_t p = blockIdx.y;
  for (int64_t s = blockIdx.x; s < seqs; s += gridDim.x) {
    const int64_t row = static_cast<int64_t>(idx[s]);
    const int32_t mul = scale ? scale[p] : 1;
    const int32_t add = v_offset ? v_offset[p] : 0;
    const int32_t* in = src + (p * src_rows + row) * kv * src_cols;
    int32_t* out = dst + (p * seqs + s) * kv * dst_cols;
    // 32-bit element arithmetic (the launcher checks kv * max_blocks fits): a 64-bit division per element
    // would cost more than the load
    const int scols = static_cast<int>(src_cols), dcols = static_cast<int>(dst_cols);
    if (vec4) {
      const int cols = static_cast<int>(max_blocks / 4), n = static_cast<int>(kv) * cols;
      for (int e = threadIdx.x; e < n; e += blockDim.x) {
        const int k = e / cols;
        const int j = (e - k * cols) * 4;
        const int4 v = *reinterpret_cast<const int4*>(in + k * scols + j);
        const uint32_t a = k == 1 ? static_cast<uint32_t>(add) : 0u;
        *reinterpret_cast<int4*>(out + k * dcols + j) = make_int4(gather_value(v.x, mul, a, sentinel), gather_value(v.y, mul, a, sentinel),
                                                                  gather_value(v.z, mul, a, sentinel), gather_value(v.w, mul, a, sentinel));
      }
      continue;
    }
    const int n = static_cast<int>(kv * max_blocks), cols = static_cast<int>(max_blocks);
    for (int e = threadIdx.x; e < n; e += blockDim.x) {
      const int k = e / cols;
      const int j = e - k * cols;
      out[k * dcols + j] = gather_value(in[k * scols + j], mul, k == 1 ? static_cast<uint32_t>(add) : 0u, sentinel);
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
  const bool vec4 = gather_vec4(dst, src, dst_cols, src_cols, max_blocks);
  const int64_t per_thread = vec4 ? per_row / 4 : per_row;  // one thread per element (or 4-column vector)
  const int threads = per_thread >= 256 ? 256 : (per_thread >= 128 ? 128 : 64);
  const dim3 grid(static_cast<unsigned>(seqs < 65535 ? seqs : 65535), static_cast<unsigned>(pools));
  if (idx_is_64) {
    gather_block_offsets_kernel<int64_t><<<grid, threads, 0, stream>>>(
        dst, src, static_cast<const int64_t*>(idx), scale, v_offset, seqs, kv, dst_cols, src_rows, src_cols, max_blocks,
        sentinel, vec4);
  } else {
    gather_block_offsets_kernel<int32_t><<<grid, threads, 0, stream>>>(
        dst, src, static_cast<const int32_t*>(idx), scale, v_offset, seqs, kv, dst_cols, src_rows, src_cols, max_blocks,
        sentinel, vec4);
  }
  return cudaGetLastError();
}

#endif  // TKV_HOST_EMULATION

}  // namespace tiered_kv
