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

// The copy-engine calls of a block copy, in issue order: per run of blocks consecutive on both sides (whole blocks,
// or partial blocks whose rows go on from one block into the next on both sides; else per block) and per group,
// `call(dst tensor, dst byte offset, src tensor, src byte offset, dst pitch, src pitch, width, height)`; a call of
// height 0 is one 1-D copy of `width` bytes (batched by issue_dma). issue_dma issues them; the `dma_calls` entry of
// the native module returns them (tests check them against the reference without a GPU).
template <typename Call>
void for_each_dma_call(const BlockCopyGeometry& g, const int64_t* sb, const int64_t* db, Call&& call) {
  const int64_t groups = g.groups;
  const int64_t sper = groups / g.src_tensors, dper = groups / g.dst_tensors;
  const size_t n = static_cast<size_t>(g.num_pairs);
  // partial blocks whose rows go on from one block into the next on both sides (one group per tensor, dense): a
  // run of blocks is one 2-D call of its rows (the copy engine's cost is mostly per call)
  const bool rows_go_on = g.rows > 1 && g.src_block_stride == g.rows * g.row_pitch &&
                          g.dst_block_stride == g.rows * g.row_pitch;
  size_t i = 0;
  while (i < n) {
    size_t j = i + 1;  // a run: consecutive blocks on both sides
    if (g.rows == 1 || rows_go_on) {
      while (j < n && sb[j] == sb[j - 1] + 1 && db[j] == db[j - 1] + 1) ++j;
    }
    const int64_t run = static_cast<int64_t>(j - i);
    for (int64_t grp = 0; grp < groups; ++grp) {
      const int64_t dt = grp / dper, st = grp / sper;
      const int64_t doff = db[i] * g.dst_block_stride + (grp % dper) * g.group_bytes;
      const int64_t soff = sb[i] * g.src_block_stride + (grp % sper) * g.group_bytes;
      if (g.rows == 1 && g.width == g.src_block_stride && g.width == g.dst_block_stride) {
        call(dt, doff, st, soff, 0, 0, run * g.width, 0);  // dense run: one 1-D copy
      } else if (g.rows == 1 && run == 1) {
        call(dt, doff, st, soff, 0, 0, g.width, 0);  // one chunk of one block (scattered layer-major): 1-D too
      } else if (g.rows == 1) {
        call(dt, doff, st, soff, g.dst_block_stride, g.src_block_stride, g.width, run);
      } else {
        call(dt, doff, st, soff, g.row_pitch, g.row_pitch, g.width, g.rows * run);
      }
    }
    i = j;
  }
}

// One cudaMemcpy(2D)Async per call of for_each_dma_call (the 1-D ones batched).
void issue_dma(const BlockCopyGeometry& g, const std::vector<char*>& dbase, const std::vector<char*>& sbase,
               const int64_t* sb, const int64_t* db, cudaStream_t stream);

// A launch's bases (`nb` of them, src tensors then dst tensors) and block indices from the host: by value in
// the kernel's parameters when they fit (InlineMeta, else InlineMetaLarge: no allocation, no H2D copy), else
// one pinned H2D on `stream`. Calls `on_inline(meta)` or `on_staged(bases, src_blocks, dst_blocks)` (device
// pointers) once.
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
