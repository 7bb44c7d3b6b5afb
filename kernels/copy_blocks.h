// Host-side pieces of the copy_blocks binding, shared with the native submission path (fast_path.cpp).
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "tkv_kernels.cuh"
#include "tkv_torch.h"

namespace tiered_kv {

// The geometry of copying blocks of `src` tensors to blocks of `dst` tensors (checked: shapes, dtypes, sizes).
BlockCopyGeometry geometry_of(at::TensorList dst, at::TensorList src, int64_t num_pairs, int64_t num_tokens);

// The device a copy between `dst` and `src` runs on (the side on CUDA).
at::Device run_device(at::TensorList dst, at::TensorList src);

// Host addresses of a side's tensors (what cudaMemcpy takes).
std::vector<char*> host_bases(at::TensorList side);

// Device-readable bases: `src` tensors then `dst` tensors (device views of pinned host memory), `extra` reserved.
std::vector<int64_t> kernel_bases(at::TensorList dst, at::TensorList src, size_t extra);

// One cudaMemcpy(2D)Async per run of blocks consecutive on both sides and per group (whole blocks, or partial blocks
// whose rows go on from one block into the next on both sides; else per block); the 1-D ones batched.
void issue_dma(const BlockCopyGeometry& g, const std::vector<char*>& dbase, const std::vector<char*>& sbase,
               const int64_t* sb, const int64_t* db, cudaStream_t stream);

// A launch's bases (`nb` of them, src tensors then dst tensors) and block indices from the host: by value in
// the kernel's parameters when they fit (InlineMeta; else, for pairs in few runs, RunMeta; else InlineMetaLarge: no
// allocation, no H2D copy), else one pinned H2D on `stream`. Calls `on_inline(meta)` or `on_staged(bases,
// src_blocks, dst_blocks)` (device pointers) once.
template <typename OnInline, typename OnStaged>
void with_host_meta(std::vector<int64_t> bases, size_t nb, const int64_t* sb, const int64_t* db, size_t pairs,
                    const at::Device& device, cudaStream_t stream, OnInline&& on_inline, OnStaged&& on_staged) {
  auto fill = [&](auto& meta) {
    std::copy_n(bases.begin(), nb, meta.v);
    std::copy_n(sb, pairs, meta.v + nb);
    std::copy_n(db, pairs, meta.v + nb + pairs);
    meta.src_index = static_cast<int64_t>(nb);
    meta.dst_index = static_cast<int64_t>(nb + pairs);
  };
  if (nb + 2 * pairs <= static_cast<size_t>(kInlineSlots)) {
    InlineMeta meta{};
    fill(meta);
    on_inline(meta);
    return;
  }
  RunMeta runs;  // under 1 KiB: filled up to what the call uses
  if (fill_runs(runs, bases.data(), nb, sb, db, pairs)) {
    on_inline(runs);
    return;
  }
  if (nb + 2 * pairs <= static_cast<size_t>(kInlineSlotsLarge)) {
    InlineMetaLarge meta;  // 5 KiB: filled up to what the call uses, not zeroed whole
    fill(meta);
    on_inline(meta);
    return;
  }
  bases.resize(nb);
  bases.insert(bases.end(), sb, sb + pairs);
  bases.insert(bases.end(), db, db + pairs);
  // the caching allocators tie the pinned staging buffer and the device copy to the current stream: make it ours
  const c10::cuda::CUDAStreamGuard stream_guard(c10::cuda::getStreamFromExternal(stream, device.index()));
  const at::Tensor meta = to_device_pinned(bases, device);
  const int64_t* base_ptr = meta.data_ptr<int64_t>();
  on_staged(base_ptr, base_ptr + nb, base_ptr + nb + pairs);
}

// One kernel launch with host-side block indices: by value in the parameters when they fit, else one pinned H2D.
// `bases` holds the src_tensors + dst_tensors device-readable bases (kernel_bases).
void issue_kernel_host_indices(const BlockCopyGeometry& g, std::vector<int64_t> bases, const int64_t* sb,
                               const int64_t* db, const at::Device& device, cudaStream_t stream);

}  // namespace tiered_kv
