// Host-side pieces of the copy_blocks binding, shared with the native submission path (fast_path.cpp).
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "tkv_kernels.cuh"

namespace tiered_kv {

// The geometry of copying blocks of `src` tensors to blocks of `dst` tensors (checked: shapes, dtypes, sizes).
BlockCopyGeometry geometry_of(at::TensorList dst, at::TensorList src, int64_t num_pairs, int64_t num_tokens);

// The device a copy between `dst` and `src` runs on (the side on CUDA).
at::Device run_device(at::TensorList dst, at::TensorList src);

// Host addresses of a side's tensors (what cudaMemcpy takes).
std::vector<char*> host_bases(at::TensorList side);

// Device-readable bases: `src` tensors then `dst` tensors (device views of pinned host memory), `extra` reserved.
std::vector<int64_t> kernel_bases(at::TensorList dst, at::TensorList src, size_t extra);

// One cudaMemcpy(2D)Async per run of blocks contiguous on both sides and per group (dense runs batched).
void issue_dma(const BlockCopyGeometry& g, const std::vector<char*>& dbase, const std::vector<char*>& sbase,
               const int64_t* sb, const int64_t* db, cudaStream_t stream);

// One kernel launch with host-side block indices: by value in the parameters when they fit, else one pinned H2D.
// `bases` holds the src_tensors + dst_tensors device-readable bases (kernel_bases).
void issue_kernel_host_indices(const BlockCopyGeometry& g, std::vector<int64_t> bases, const int64_t* sb,
                               const int64_t* db, const at::Device& device, cudaStream_t stream);

}  // namespace tiered_kv
