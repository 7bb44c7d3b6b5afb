// CUDA implementation of tiered_kv::copy_blocks (schema and CPU reference: tiered_kv/ops.py).
//
// Both sides are reduced to one geometry (groups x rows x width, see tkv_kernels.cuh); the kernel path is
// one launch, the DMA path is one cudaMemcpy(2D)Async per run of blocks contiguous on both sides and per
// group, issued here in C++ (never a Python loop).
#include <torch/library.h>

#include <algorithm>

#include "tkv_kernels.cuh"
#include "tkv_torch.h"

namespace tiered_kv {
namespace {

std::vector<int64_t> indices_on_host(const at::Tensor& t) {
  std::vector<int64_t> out(static_cast<size_t>(t.numel()));
  const at::Tensor c = t.contiguous();
  if (c.scalar_type() == at::kLong) {
    std::copy_n(c.data_ptr<int64_t>(), out.size(), out.begin());
  } else {
    std::copy_n(c.data_ptr<int32_t>(), out.size(), out.begin());
  }
  return out;
}

void check_side(at::TensorList side, const char* what) {
  TORCH_CHECK(!side.empty(), "copy_blocks: ", what, " is empty");
  const at::Tensor& f = side[0];
  for (const at::Tensor& t : side) {
    TORCH_CHECK(t.sizes() == f.sizes() && t.strides() == f.strides() && t.scalar_type() == f.scalar_type() &&
                    t.device() == f.device(),
                "copy_blocks: every ", what, " tensor must share shape, strides, dtype and device");
  }
  TORCH_CHECK(f.dim() >= 4 && f.dim() <= 6, "copy_blocks: ", what, " tensors must be 4-D to 6-D");
  if (f.size(0) > 0) TORCH_CHECK(f[0].is_contiguous(), "copy_blocks: the blocks of ", what, " must be dense");
}

void copy_blocks_cuda(at::TensorList dst, at::TensorList src, const at::Tensor& src_blocks, const at::Tensor& dst_blocks,
                      int64_t num_tokens, int64_t method) {
  check_side(src, "src");
  check_side(dst, "dst");
  const at::Tensor& s0 = src[0];
  const at::Tensor& d0 = dst[0];
  TORCH_CHECK(s0.scalar_type() == d0.scalar_type(), "copy_blocks: src and dst dtypes differ");
  TORCH_CHECK(src_blocks.dim() == 1 && src_blocks.sizes() == dst_blocks.sizes(), "copy_blocks: block index shapes differ");
  const int64_t isz = static_cast<int64_t>(s0.element_size());
  const int64_t tokens = s0.size(-2), head_dim = s0.size(-1);
  TORCH_CHECK(d0.size(-2) == tokens && d0.size(-1) == head_dim, "copy_blocks: token / head_dim geometry differs");
  TORCH_CHECK(num_tokens >= 1 && num_tokens <= tokens, "copy_blocks: num_tokens out of range");
  int64_t src_block = isz, dst_block = isz;
  for (int64_t i = 1; i < s0.dim(); ++i) src_block *= s0.size(i);
  for (int64_t i = 1; i < d0.dim(); ++i) dst_block *= d0.size(i);
  const int64_t ks = static_cast<int64_t>(src.size()), kd = static_cast<int64_t>(dst.size());
  const int64_t total = src_block * ks;
  TORCH_CHECK(total == dst_block * kd, "copy_blocks: src and dst blocks differ in size");
  const int64_t groups = std::max(ks, kd);
  TORCH_CHECK(groups % ks == 0 && groups % kd == 0, "copy_blocks: tensor counts do not split a block evenly");

  BlockCopyGeometry g{};
  g.num_pairs = src_blocks.numel();
  g.groups = groups;
  g.group_bytes = total / groups;
  if (num_tokens == tokens) {
    g.rows = 1;
    g.row_pitch = g.group_bytes;
    g.width = g.group_bytes;
  } else {
    g.row_pitch = tokens * head_dim * isz;
    g.rows = g.group_bytes / g.row_pitch;
    g.width = num_tokens * head_dim * isz;
  }
  g.src_tensors = ks;
  g.dst_tensors = kd;
  g.src_block_stride = s0.stride(0) * isz;
  g.dst_block_stride = d0.stride(0) * isz;
  if (g.num_pairs == 0) return;

  const at::Device device = s0.is_cuda() ? s0.device() : d0.device();
  TORCH_CHECK(device.is_cuda(), "copy_blocks: one side must be on a CUDA device");
  const c10::cuda::CUDAGuard guard(device);
  auto stream = c10::cuda::getCurrentCUDAStream();

  if (method == 1) {  // DMA
    TORCH_CHECK(src_blocks.device().is_cpu() && dst_blocks.device().is_cpu(), "copy_blocks: DMA needs host indices");
    const std::vector<int64_t> sb = indices_on_host(src_blocks), db = indices_on_host(dst_blocks);
    std::vector<char*> sbase, dbase;
    for (const at::Tensor& t : src) sbase.push_back(static_cast<char*>(t.data_ptr()));
    for (const at::Tensor& t : dst) dbase.push_back(static_cast<char*>(t.data_ptr()));
    const int64_t sper = groups / ks, dper = groups / kd;
    auto addr = [&](bool is_src, int64_t block, int64_t group) {
      const int64_t per = is_src ? sper : dper;
      char* base = is_src ? sbase[group / per] : dbase[group / per];
      return base + block * (is_src ? g.src_block_stride : g.dst_block_stride) + (group % per) * g.group_bytes;
    };
    size_t i = 0;
    while (i < sb.size()) {
      size_t j = i + 1;  // a run: consecutive blocks on both sides
      if (g.rows == 1) {
        while (j < sb.size() && sb[j] == sb[j - 1] + 1 && db[j] == db[j - 1] + 1) ++j;
      }
      const int64_t run = static_cast<int64_t>(j - i);
      for (int64_t grp = 0; grp < groups; ++grp) {
        char* d = addr(false, db[i], grp);
        const char* s = addr(true, sb[i], grp);
        cudaError_t err;
        if (g.rows == 1 && g.width == g.src_block_stride && g.width == g.dst_block_stride) {
          err = cudaMemcpyAsync(d, s, run * g.width, cudaMemcpyDefault, stream);  // dense run: one 1-D copy
        } else if (g.rows == 1) {
          err = cudaMemcpy2DAsync(d, g.dst_block_stride, s, g.src_block_stride, g.width, run, cudaMemcpyDefault, stream);
        } else {
          err = cudaMemcpy2DAsync(d, g.row_pitch, s, g.row_pitch, g.width, g.rows, cudaMemcpyDefault, stream);
        }
        check_launch(err, "copy_blocks DMA");
      }
      i = j;
    }
    return;
  }

  std::vector<int64_t> bases;
  bases.reserve(static_cast<size_t>(ks + kd + 2 * g.num_pairs));
  for (const at::Tensor& t : src) bases.push_back(reinterpret_cast<int64_t>(device_view(t, "a src tensor")));
  for (const at::Tensor& t : dst) bases.push_back(reinterpret_cast<int64_t>(device_view(t, "a dst tensor")));
  at::Tensor meta, sb_dev, db_dev;
  const int64_t *sb_ptr, *db_ptr;
  if (src_blocks.device().is_cpu() && dst_blocks.device().is_cpu()) {
    // One H2D for bases and both index lists.
    const std::vector<int64_t> sb = indices_on_host(src_blocks), db = indices_on_host(dst_blocks);
    bases.insert(bases.end(), sb.begin(), sb.end());
    bases.insert(bases.end(), db.begin(), db.end());
    meta = to_device_pinned(bases, device);
    sb_ptr = meta.data_ptr<int64_t>() + ks + kd;
    db_ptr = sb_ptr + g.num_pairs;
  } else {
    meta = to_device_pinned(bases, device);
    sb_dev = src_blocks.to(device, at::kLong).contiguous();
    db_dev = dst_blocks.to(device, at::kLong).contiguous();
    sb_ptr = sb_dev.data_ptr<int64_t>();
    db_ptr = db_dev.data_ptr<int64_t>();
  }
  bool aligned16 = true;
  for (int64_t i = 0; i < ks + kd; ++i) aligned16 = aligned16 && (bases[static_cast<size_t>(i)] & 15) == 0;
  check_launch(launch_copy_blocks(g, meta.data_ptr<int64_t>(), sb_ptr, db_ptr, aligned16, stream),
               "copy_blocks kernel launch");
}

}  // namespace

TORCH_LIBRARY_IMPL(tiered_kv, CUDA, m) { m.impl("copy_blocks", &copy_blocks_cuda); }

}  // namespace tiered_kv
