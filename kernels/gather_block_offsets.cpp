// CUDA implementation of tiered_kv::gather_block_offsets (schema and CPU reference: tiered_kv/ops.py).
#include <torch/library.h>

#include "tkv_kernels.cuh"
#include "tkv_torch.h"

namespace tiered_kv {
namespace {

void gather_block_offsets_cuda(const at::Tensor& dst, const at::Tensor& src, const at::Tensor& idx,
                               const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& v_offset,
                               int64_t max_blocks, int64_t sentinel) {
  TORCH_CHECK(dst.is_cuda(), "gather_block_offsets: dst must be on a CUDA device");
  TORCH_CHECK(dst.scalar_type() == at::kInt && src.scalar_type() == at::kInt, "gather_block_offsets: tables must be int32");
  TORCH_CHECK(dst.dim() == 4 && src.dim() == 4, "gather_block_offsets: tables must be 4-D");
  TORCH_CHECK(dst.is_contiguous() && src.is_contiguous(), "gather_block_offsets: tables must be contiguous");
  TORCH_CHECK(idx.dim() == 1 && (idx.scalar_type() == at::kInt || idx.scalar_type() == at::kLong),
              "gather_block_offsets: idx must be 1-D int32/int64");
  TORCH_CHECK(idx.is_contiguous(), "gather_block_offsets: idx must be contiguous");
  const int64_t pools = dst.size(0), seqs = dst.size(1), kv = dst.size(2), dst_cols = dst.size(3);
  TORCH_CHECK(src.size(0) == pools && src.size(2) == kv && idx.size(0) == seqs, "gather_block_offsets: shapes disagree");
  TORCH_CHECK(max_blocks >= 0 && max_blocks <= dst_cols && max_blocks <= src.size(3), "gather_block_offsets: max_blocks out of range");
  const at::Tensor* opt[2] = {scale ? &*scale : nullptr, v_offset ? &*v_offset : nullptr};
  for (const at::Tensor* t : opt) {
    if (t) TORCH_CHECK(t->scalar_type() == at::kInt && t->numel() == pools && t->is_contiguous(),
                       "gather_block_offsets: scale / v_offset must be contiguous int32 [pools]");
  }
  const c10::cuda::CUDAGuard guard(dst.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  check_launch(launch_gather_block_offsets(
                   dst.data_ptr<int32_t>(), static_cast<const int32_t*>(device_view(src, "src")),
                   device_view(idx, "idx"), idx.scalar_type() == at::kLong,
                   opt[0] ? static_cast<const int32_t*>(device_view(*opt[0], "scale")) : nullptr,
                   opt[1] ? static_cast<const int32_t*>(device_view(*opt[1], "v_offset")) : nullptr, pools, seqs, kv,
                   dst_cols, src.size(1), src.size(3), max_blocks, static_cast<int32_t>(sentinel), stream),
               "gather_block_offsets kernel launch");
}

}  // namespace

TORCH_LIBRARY_IMPL(tiered_kv, CUDA, m) { m.impl("gather_block_offsets", &gather_block_offsets_cuda); }

}  // namespace tiered_kv
