// CUDA implementation of tiered_kv::copy_chunks (schema and CPU reference: tiered_kv/ops.py).
//
// Kernel path: the host table becomes absolute (src, dst, nbytes) segments of at most kSegmentBytes, shipped
// in one pinned H2D, copied by one launch. DMA path: one cudaMemcpyAsync per run of chunks adjacent on both
// sides, issued here in C++.
#include <torch/library.h>

#include "tkv_kernels.cuh"
#include "tkv_torch.h"

namespace tiered_kv {
namespace {

void copy_chunks_cuda(at::TensorList dst, at::TensorList src, const at::Tensor& chunks, int64_t method) {
  TORCH_CHECK(chunks.device().is_cpu() && chunks.scalar_type() == at::kLong && chunks.dim() == 2 && chunks.size(1) == 5,
              "copy_chunks: chunks must be a CPU int64 [n, 5] table");
  const int64_t n = chunks.size(0);
  if (n == 0) return;
  at::Device device = at::kCPU;
  bool via_host = false;  // a side in pinned host memory: the kernel runs on the small grid of PCIe copies
  for (const at::Tensor& t : src) t.is_cuda() ? void(device = t.device()) : void(via_host = true);
  for (const at::Tensor& t : dst) t.is_cuda() ? void(device = t.device()) : void(via_host = true);
  TORCH_CHECK(device.is_cuda(), "copy_chunks: no tensor is on a CUDA device");
  const c10::cuda::CUDAGuard guard(device);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor table = chunks.contiguous();
  const int64_t* row = table.data_ptr<int64_t>();

  std::vector<int64_t> src_sizes, dst_sizes;
  for (const at::Tensor& t : src) src_sizes.push_back(t.numel() * static_cast<int64_t>(t.element_size()));
  for (const at::Tensor& t : dst) dst_sizes.push_back(t.numel() * static_cast<int64_t>(t.element_size()));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* r = row + 5 * i;
    TORCH_CHECK(r[0] >= 0 && r[0] < static_cast<int64_t>(src.size()) && r[2] >= 0 && r[2] < static_cast<int64_t>(dst.size()),
                "copy_chunks: tensor index out of range in row ", i);
    TORCH_CHECK(r[1] >= 0 && r[3] >= 0 && r[4] >= 0 && r[1] + r[4] <= src_sizes[r[0]] && r[3] + r[4] <= dst_sizes[r[2]],
                "copy_chunks: byte range out of bounds in row ", i);
  }

  if (method == 1) {  // DMA
    int64_t i = 0;
    while (i < n) {
      const int64_t* r = row + 5 * i;
      int64_t bytes = r[4];
      int64_t j = i + 1;
      while (j < n) {  // merge chunks that continue the run on both sides
        const int64_t* q = row + 5 * j;
        if (q[0] != r[0] || q[2] != r[2] || q[1] != r[1] + bytes || q[3] != r[3] + bytes) break;
        bytes += q[4];
        ++j;
      }
      if (bytes) {
        check_launch(cudaMemcpyAsync(static_cast<char*>(dst[r[2]].data_ptr()) + r[3],
                                     static_cast<const char*>(src[r[0]].data_ptr()) + r[1], bytes, cudaMemcpyDefault,
                                     stream),
                     "copy_chunks DMA");
      }
      i = j;
    }
    return;
  }

  std::vector<int64_t> sbase, dbase;
  for (const at::Tensor& t : src) sbase.push_back(reinterpret_cast<int64_t>(device_view(t, "a src tensor")));
  for (const at::Tensor& t : dst) dbase.push_back(reinterpret_cast<int64_t>(device_view(t, "a dst tensor")));
  std::vector<int64_t> segments;
  segments.reserve(static_cast<size_t>(3 * n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* r = row + 5 * i;
    for (int64_t off = 0; off < r[4]; off += kSegmentBytes) {
      segments.push_back(sbase[r[0]] + r[1] + off);
      segments.push_back(dbase[r[2]] + r[3] + off);
      segments.push_back(std::min(kSegmentBytes, r[4] - off));
    }
  }
  if (segments.empty()) return;
  const at::Tensor dev = to_device_pinned(segments, device);
  check_launch(launch_copy_segments(dev.data_ptr<int64_t>(), static_cast<int64_t>(segments.size() / 3), via_host, stream),
               "copy_chunks kernel launch");
}

}  // namespace

TORCH_LIBRARY_IMPL(tiered_kv, CUDA, m) { m.impl("copy_chunks", &copy_chunks_cuda); }

}  // namespace tiered_kv
