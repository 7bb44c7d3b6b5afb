// CUDA implementation of tiered_kv::copy_blocks (schema and CPU reference: tiered_kv/ops.py).
//
// Both sides are reduced to one geometry (groups x rows x width, see tkv_kernels.cuh); the kernel path is
// one launch, the DMA path is one cudaMemcpy(2D)Async per run of blocks contiguous on both sides and per
// group, issued here in C++ (never a Python loop). copy_blocks_list is the engine's per-call path: int-list
// indices, an explicit stream, and (when they fit) bases and indices passed by value in the kernel's
// parameters, so a small copy is one launch with no allocation and no H2D copy of its metadata.
#include <torch/library.h>

#include <algorithm>

#include "copy_blocks.h"
#include "dma_batch.h"
#include "tkv_kernels.cuh"
#include "tkv_torch.h"

namespace tiered_kv {
namespace {

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

}  // namespace

BlockCopyGeometry geometry_of(at::TensorList dst, at::TensorList src, int64_t num_pairs, int64_t num_tokens) {
  check_side(src, "src");
  check_side(dst, "dst");
  const at::Tensor& s0 = src[0];
  const at::Tensor& d0 = dst[0];
  TORCH_CHECK(s0.scalar_type() == d0.scalar_type(), "copy_blocks: src and dst dtypes differ");
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
  g.num_pairs = num_pairs;
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
  g.via_host = s0.device().is_cpu() || d0.device().is_cpu();
  return g;
}

at::Device run_device(at::TensorList dst, at::TensorList src) {
  const at::Device device = src[0].is_cuda() ? src[0].device() : dst[0].device();
  TORCH_CHECK(device.is_cuda(), "copy_blocks: one side must be on a CUDA device");
  return device;
}

// The copy-engine calls of a block copy, in issue order: per run of blocks consecutive on both sides (whole blocks,
// or partial blocks whose rows go on from one block into the next on both sides; else per block) and per group,
// `call(dst tensor, dst byte offset, src tensor, src byte offset, dst pitch, src pitch, width, height)`; a call of
// height 0 is one 1-D copy of `width` bytes (batched by issue_dma). issue_dma issues them; the dma_calls op returns
// them (tests check them against the reference without a GPU).
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

// One cudaMemcpy(2D)Async per call of for_each_dma_call.
void issue_dma(const BlockCopyGeometry& g, const std::vector<char*>& dbase, const std::vector<char*>& sbase,
               const int64_t* sb, const int64_t* db, cudaStream_t stream) {
  DmaBatch dense;  // 1-D copies, issued together below (one cudaMemcpyBatchAsync where the runtime has it)
  for_each_dma_call(g, sb, db,
                    [&](int64_t dt, int64_t doff, int64_t st, int64_t soff, int64_t dpitch, int64_t spitch,
                        int64_t width, int64_t height) {
                      char* d = dbase[dt] + doff;
                      const char* s = sbase[st] + soff;
                      if (height == 0) {
                        dense.add(d, s, static_cast<size_t>(width));
                        return;
                      }
                      check_launch(cudaMemcpy2DAsync(d, dpitch, s, spitch, width, height, cudaMemcpyDefault, stream),
                                   "copy_blocks DMA");
                    });
  check_launch(dma_flush(dense, stream), "copy_blocks DMA");
}

std::vector<char*> host_bases(at::TensorList side) {
  std::vector<char*> out;
  out.reserve(side.size());
  for (const at::Tensor& t : side) out.push_back(static_cast<char*>(t.data_ptr()));
  return out;
}

// Kernel bases: source tensors then destination tensors, as the kernel addresses them.
std::vector<int64_t> kernel_bases(at::TensorList dst, at::TensorList src, size_t extra) {
  std::vector<int64_t> bases;
  bases.reserve(src.size() + dst.size() + extra);
  for (const at::Tensor& t : src) bases.push_back(reinterpret_cast<int64_t>(device_view(t, "a src tensor")));
  for (const at::Tensor& t : dst) bases.push_back(reinterpret_cast<int64_t>(device_view(t, "a dst tensor")));
  return bases;
}

bool all_aligned16(const std::vector<int64_t>& bases, size_t count) {
  bool aligned16 = true;
  for (size_t i = 0; i < count; ++i) aligned16 = aligned16 && (bases[i] & 15) == 0;
  return aligned16;
}

// Kernel launch with host-side indices: by value in the kernel's parameters when bases and indices fit
// (no allocation, no H2D copy: the small-call path), else one pinned H2D of bases + indices on `stream`.
void issue_kernel_host_indices(const BlockCopyGeometry& g, std::vector<int64_t> bases, const int64_t* sb,
                               const int64_t* db, const at::Device& device, cudaStream_t stream) {
  const size_t nb = static_cast<size_t>(g.src_tensors + g.dst_tensors);
  const bool aligned16 = all_aligned16(bases, nb);
  with_host_meta(
      std::move(bases), nb, sb, db, static_cast<size_t>(g.num_pairs), device, stream,
      [&](const auto& meta) {
        check_launch(launch_copy_blocks_inline(g, meta, aligned16, stream), "copy_blocks kernel launch");
      },
      [&](const int64_t* b, const int64_t* s, const int64_t* d) {
        check_launch(launch_copy_blocks(g, b, s, d, aligned16, stream), "copy_blocks kernel launch");
      });
}

namespace {

void copy_blocks_cuda(at::TensorList dst, at::TensorList src, const at::Tensor& src_blocks, const at::Tensor& dst_blocks,
                      int64_t num_tokens, int64_t method) {
  TORCH_CHECK(src_blocks.dim() == 1 && src_blocks.sizes() == dst_blocks.sizes(), "copy_blocks: block index shapes differ");
  const BlockCopyGeometry g = geometry_of(dst, src, src_blocks.numel(), num_tokens);
  if (g.num_pairs == 0) return;
  const at::Device device = run_device(dst, src);
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  if (method == 1) {  // DMA
    TORCH_CHECK(src_blocks.device().is_cpu() && dst_blocks.device().is_cpu(), "copy_blocks: DMA needs host indices");
    const std::vector<int64_t> sb = indices_on_host(src_blocks), db = indices_on_host(dst_blocks);
    issue_dma(g, host_bases(dst), host_bases(src), sb.data(), db.data(), stream);
    return;
  }
  if (src_blocks.device().is_cpu() && dst_blocks.device().is_cpu()) {
    const std::vector<int64_t> sb = indices_on_host(src_blocks), db = indices_on_host(dst_blocks);
    issue_kernel_host_indices(g, kernel_bases(dst, src, 2 * sb.size()), sb.data(), db.data(), device, stream);
    return;
  }
  const std::vector<int64_t> bases = kernel_bases(dst, src, 0);
  const at::Tensor meta = to_device_pinned(bases, device);
  const at::Tensor sb_dev = src_blocks.to(device, at::kLong).contiguous();
  const at::Tensor db_dev = dst_blocks.to(device, at::kLong).contiguous();
  check_launch(launch_copy_blocks(g, meta.data_ptr<int64_t>(), sb_dev.data_ptr<int64_t>(), db_dev.data_ptr<int64_t>(),
                                  all_aligned16(bases, bases.size()), stream),
               "copy_blocks kernel launch");
}

// The engine's per-call path: block indices as int lists (no index tensors), the stream as its raw handle
// (0: the current stream), indices checked against both pools here. One C++ call validates and launches.
void copy_blocks_list_cuda(at::TensorList dst, at::TensorList src, at::IntArrayRef src_blocks,
                           at::IntArrayRef dst_blocks, int64_t num_tokens, int64_t method, int64_t stream_handle) {
  TORCH_CHECK(src_blocks.size() == dst_blocks.size(),
              msg("copy_blocks_list: ", src_blocks.size(), " source and ", dst_blocks.size(), " destination blocks"));
  const BlockCopyGeometry g = geometry_of(dst, src, static_cast<int64_t>(src_blocks.size()), num_tokens);
  const int64_t ns = src[0].size(0), nd = dst[0].size(0);
  for (size_t i = 0; i < src_blocks.size(); ++i) {
    TORCH_CHECK(src_blocks[i] >= 0 && src_blocks[i] < ns,
                msg("copy_blocks_list: src_blocks holds ", src_blocks[i], ", out of range for a pool of ", ns, " blocks"));
    TORCH_CHECK(dst_blocks[i] >= 0 && dst_blocks[i] < nd,
                msg("copy_blocks_list: dst_blocks holds ", dst_blocks[i], ", out of range for a pool of ", nd, " blocks"));
  }
  if (g.num_pairs == 0) return;
  const at::Device device = run_device(dst, src);
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = stream_handle != 0 ? reinterpret_cast<cudaStream_t>(stream_handle)
                                                 : static_cast<cudaStream_t>(c10::cuda::getCurrentCUDAStream());
  if (method == 1) {
    issue_dma(g, host_bases(dst), host_bases(src), src_blocks.data(), dst_blocks.data(), stream);
  } else {
    issue_kernel_host_indices(g, kernel_bases(dst, src, 2 * src_blocks.size()), src_blocks.data(), dst_blocks.data(),
                              device, stream);
  }
}

// The copy-engine calls the DMA path makes for these arguments, 8 ints per call (for_each_dma_call's arguments):
// what tests check against the reference op without a GPU. Nothing is copied.
std::vector<int64_t> dma_calls(at::TensorList dst, at::TensorList src, at::IntArrayRef src_blocks,
                               at::IntArrayRef dst_blocks, int64_t num_tokens) {
  TORCH_CHECK(src_blocks.size() == dst_blocks.size(), "dma_calls: src_blocks and dst_blocks differ in length");
  const BlockCopyGeometry g = geometry_of(dst, src, static_cast<int64_t>(src_blocks.size()), num_tokens);
  std::vector<int64_t> out;
  for_each_dma_call(g, src_blocks.data(), dst_blocks.data(),
                    [&](int64_t dt, int64_t doff, int64_t st, int64_t soff, int64_t dpitch, int64_t spitch,
                        int64_t width, int64_t height) {
                      out.insert(out.end(), {dt, doff, st, soff, dpitch, spitch, width, height});
                    });
  return out;
}

}  // namespace

// Schemas in tiered_kv/opdefs.py; dma_calls copies nothing, so one kernel serves every device
TORCH_LIBRARY_IMPL(tiered_kv, CompositeExplicitAutograd, m) { m.impl("dma_calls", &dma_calls); }

TORCH_LIBRARY_IMPL(tiered_kv, CUDA, m) {
  m.impl("copy_blocks", &copy_blocks_cuda);
  m.impl("copy_blocks_list", &copy_blocks_list_cuda);
}

}  // namespace tiered_kv
