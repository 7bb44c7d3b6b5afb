// CUDA implementations of tiered_kv::copy_chunks and tiered_kv::copy_chunk_blocks (schemas and CPU
// references: tiered_kv/opdefs.py).
//
// copy_chunks (any byte chunks): the host table becomes absolute (src, dst, nbytes) segments of at most
// kSegmentBytes, shipped in one pinned H2D, copied by one launch; DMA: one cudaMemcpyAsync per run of chunks
// adjacent on both sides, issued here in C++.
//
// copy_chunk_blocks (whole blocks of chunked pools, the engine's path): a per-chunk table made once for a
// pair of pools (kept on the device by the caller) and the block indices of the call; the kernel computes
// every address itself, so a call ships only bases and indices (in the kernel's parameters when they fit).
// DMA: the (block, chunk) copies, merged where they continue each other on both sides, as batched copies.
#include <torch/library.h>

#include <algorithm>
#include <string>

#include "copy_blocks.h"
#include "dma_batch.h"
#include "tkv_kernels.cuh"
#include "tkv_torch.h"

namespace tiered_kv {
namespace {

// The CUDA device of a chunk copy's tensors; `via_host`: some tensor is (pinned) host memory.
at::Device cuda_side(at::TensorList src, at::TensorList dst, bool& via_host, const char* op) {
  at::Device device = at::kCPU;
  for (at::TensorList side : {src, dst}) {
    for (const at::Tensor& t : side) t.is_cuda() ? void(device = t.device()) : void(via_host = true);
  }
  TORCH_CHECK(device.is_cuda(), msg(op, ": no tensor is on a CUDA device"));
  return device;
}

void copy_chunks_cuda(at::TensorList dst, at::TensorList src, const at::Tensor& chunks, int64_t method) {
  TORCH_CHECK(chunks.device().is_cpu() && chunks.scalar_type() == at::kLong && chunks.dim() == 2 && chunks.size(1) == 5,
              "copy_chunks: chunks must be a CPU int64 [n, 5] table");
  const int64_t n = chunks.size(0);
  if (n == 0) return;
  bool via_host = false;  // a side in pinned host memory: the kernel runs on the small grid of PCIe copies
  const at::Device device = cuda_side(src, dst, via_host, "copy_chunks");
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
                msg("copy_chunks: tensor index out of range in row ", i));
    TORCH_CHECK(r[1] >= 0 && r[3] >= 0 && r[4] >= 0 && r[1] + r[4] <= src_sizes[r[0]] && r[3] + r[4] <= dst_sizes[r[2]],
                msg("copy_chunks: byte range out of bounds in row ", i));
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

// Why a copy_chunk_blocks call is refused ("" when it is not); on success also whether every offset, stride
// and size is a multiple of 16 and the largest chunk.
std::string check_chunk_call(at::TensorList src, at::TensorList dst, const int64_t* row, int64_t chunks,
                             at::IntArrayRef src_blocks, at::IntArrayRef dst_blocks, bool& vec16, int64_t& largest) {
  int64_t smax = 0, dmax = 0;
  for (const int64_t b : src_blocks) {
    if (b < 0) return "negative block index " + std::to_string(b);
    smax = std::max(smax, b);
  }
  for (const int64_t b : dst_blocks) {
    if (b < 0) return "negative block index " + std::to_string(b);
    dmax = std::max(dmax, b);
  }
  const int64_t ns = static_cast<int64_t>(src.size()), nd = static_cast<int64_t>(dst.size());
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t* r = row + 7 * c;
    if (r[0] < 0 || r[0] >= ns || r[3] < 0 || r[3] >= nd) return "tensor index out of range in row " + std::to_string(c);
    if (r[1] < 0 || r[2] < 0 || r[4] < 0 || r[5] < 0 || r[6] < 0) {
      return "negative offset, stride or size in row " + std::to_string(c);
    }
    const int64_t src_bytes = src[r[0]].numel() * static_cast<int64_t>(src[r[0]].element_size());
    const int64_t dst_bytes = dst[r[3]].numel() * static_cast<int64_t>(dst[r[3]].element_size());
    if (r[1] + smax * r[2] + r[6] > src_bytes || r[4] + dmax * r[5] + r[6] > dst_bytes) {
      return "chunk " + std::to_string(c) + " of the largest block index reaches past the end of its tensor";
    }
    vec16 = vec16 && ((r[1] | r[2] | r[4] | r[5] | r[6]) & 15) == 0;
    largest = std::max(largest, r[6]);
  }
  return "";
}

void copy_chunk_blocks_cuda(at::TensorList dst, at::TensorList src, const at::Tensor& table,
                            const std::optional<at::Tensor>& table_dev, at::IntArrayRef src_blocks,
                            at::IntArrayRef dst_blocks, int64_t method) {
  TORCH_CHECK(table.device().is_cpu() && table.scalar_type() == at::kLong && table.dim() == 2 && table.size(1) == 7,
              "copy_chunk_blocks: table must be a CPU int64 [chunks, 7] tensor");
  TORCH_CHECK(src_blocks.size() == dst_blocks.size(),
              msg("copy_chunk_blocks: ", src_blocks.size(), " source and ", dst_blocks.size(), " destination blocks"));
  TORCH_CHECK(!src.empty() && !dst.empty(), "copy_chunk_blocks: src and dst must be non-empty tensor lists");
  const int64_t chunks = table.size(0), pairs = static_cast<int64_t>(src_blocks.size());
  if (chunks == 0 || pairs == 0) return;
  bool via_host = false;  // a side in pinned host memory: the kernel runs on the small grid of PCIe copies
  const at::Device device = cuda_side(src, dst, via_host, "copy_chunk_blocks");
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  // every address of the call stays inside its tensor: per chunk, its offset + the largest block * stride
  const at::Tensor t = table.contiguous();
  const int64_t* row = t.data_ptr<int64_t>();
  bool vec16 = true;
  int64_t largest = 0;
  const std::string error = check_chunk_call(src, dst, row, chunks, src_blocks, dst_blocks, vec16, largest);
  TORCH_CHECK(error.empty(), msg("copy_chunk_blocks: ", error));
  if (largest == 0) return;
  const int64_t ns = static_cast<int64_t>(src.size()), nd = static_cast<int64_t>(dst.size());

  if (method == 1) {  // DMA: (block, chunk) copies in order, merged where one continues the last on both sides
    const std::vector<char*> sbase = host_bases(src), dbase = host_bases(dst);
    DmaBatch batch;
    for (int64_t p = 0; p < pairs; ++p) {
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t* r = row + 7 * c;
        if (r[6] == 0) continue;
        const char* s = sbase[r[0]] + r[1] + src_blocks[p] * r[2];
        char* d = dbase[r[3]] + r[4] + dst_blocks[p] * r[5];
        if (!batch.sizes.empty() && static_cast<const char*>(batch.srcs.back()) + batch.sizes.back() == s &&
            static_cast<char*>(batch.dsts.back()) + batch.sizes.back() == d) {
          batch.sizes.back() += static_cast<size_t>(r[6]);
        } else {
          batch.add(d, s, static_cast<size_t>(r[6]));
        }
      }
    }
    check_launch(dma_flush(batch, stream), "copy_chunk_blocks DMA");
    return;
  }

  at::Tensor on_device;  // the table where the kernel reads it: the caller's copy, else shipped with this call
  if (table_dev.has_value() && table_dev->defined()) {
    TORCH_CHECK(table_dev->device() == device && table_dev->scalar_type() == at::kLong && table_dev->is_contiguous() &&
                    table_dev->sizes() == table.sizes(),
                msg("copy_chunk_blocks: table_dev must be a contiguous int64 copy of table on ", device.str()));
    on_device = *table_dev;
  } else {
    on_device = to_device_pinned(std::vector<int64_t>(row, row + 7 * chunks), device);
  }
  std::vector<int64_t> bases = kernel_bases(dst, src, 2 * static_cast<size_t>(pairs));
  const size_t nb = static_cast<size_t>(ns + nd);
  for (size_t i = 0; i < nb; ++i) vec16 = vec16 && (bases[i] & 15) == 0;
  const ChunkCopyGeometry g{pairs, chunks, (largest + kSegmentBytes - 1) / kSegmentBytes, ns, vec16, via_host};
  const int64_t* tab = on_device.data_ptr<int64_t>();
  with_host_meta(
      std::move(bases), nb, src_blocks.data(), dst_blocks.data(), static_cast<size_t>(pairs), device, stream,
      [&](const auto& meta) {
        check_launch(launch_copy_chunk_blocks_inline(g, tab, meta, stream), "copy_chunk_blocks kernel launch");
      },
      [&](const int64_t* b, const int64_t* s, const int64_t* d) {
        check_launch(launch_copy_chunk_blocks(g, tab, b, s, d, stream), "copy_chunk_blocks kernel launch");
      });
}

}  // namespace

TORCH_LIBRARY_IMPL(tiered_kv, CUDA, m) {
  m.impl("copy_chunks", &copy_chunks_cuda);
  m.impl("copy_chunk_blocks", &copy_chunk_blocks_cuda);
}

}  // namespace tiered_kv
