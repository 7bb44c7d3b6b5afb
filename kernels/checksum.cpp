// CUDA implementation of tiered_kv::token_checksums (schema and CPU reference: tiered_kv/opdefs.py): one launch
// of the checksum kernel on the current stream, after the output is zeroed there. Slots on the CPU are checked
// against the pool and passed in the kernel's parameters when they fit (no allocation, no H2D copy), else shipped
// through a pinned buffer; slots on the device are read there as they are (not checked).
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "tkv_kernels.cuh"
#include "tkv_torch.h"

namespace tiered_kv {
namespace {

// Each block [L, kv, H, T, D] dense (the strides of a contiguous tensor; dimensions of size 1 have any stride).
bool blocks_dense(const at::Tensor& pool) {
  int64_t expected = 1;
  for (int64_t d = pool.dim() - 1; d >= 1; --d) {
    if (pool.size(d) != 1 && pool.stride(d) != expected) return false;
    expected *= pool.size(d);
  }
  return true;
}

at::Tensor token_checksums_cuda(const at::Tensor& pool, const at::Tensor& slots) {
  TORCH_CHECK(pool.is_cuda(), "token_checksums: the pool must be on a CUDA device (its checksums are taken where it lives)");
  TORCH_CHECK(pool.dim() == 6, "token_checksums: the pool must be block-major [blocks, L, kv, H, T, D]");
  TORCH_CHECK(slots.dim() == 1 && (slots.scalar_type() == at::kLong || slots.scalar_type() == at::kInt),
              "token_checksums: slots must be a 1-D int32/int64 tensor");
  TORCH_CHECK(slots.device().is_cpu() || slots.device() == pool.device(),
              "token_checksums: slots must be on the CPU or on the pool's device");
  TORCH_CHECK(blocks_dense(pool), "token_checksums: each block of the pool must be dense (a contiguous [L, kv, H, T, D])");
  const int64_t isz = static_cast<int64_t>(pool.element_size());
  ChecksumGeometry g{};
  g.slots = slots.numel();
  g.rows = pool.size(1) * pool.size(2) * pool.size(3);
  g.tokens = pool.size(4);
  g.row_bytes = pool.size(5) * isz;
  g.block_stride = pool.stride(0) * isz;
  const int64_t word = g.row_bytes % 4 == 0 ? 4 : (g.row_bytes % 2 == 0 ? 2 : 1);
  TORCH_CHECK((reinterpret_cast<uintptr_t>(pool.data_ptr()) % static_cast<uintptr_t>(word)) == 0 &&
                  g.block_stride % word == 0,
              msg("token_checksums: the pool's start and block stride must be multiples of its ", word,
                  "-byte words (the reference views its rows as them)"));

  const c10::cuda::CUDAGuard guard(pool.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor out = at::empty({g.slots, g.tokens}, pool.options().dtype(at::kInt));
  if (out.numel() == 0) return out;
  auto* sums = reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>());
  const void* base = pool.data_ptr();
  if (slots.device().is_cpu()) {
    const std::vector<int64_t> host = indices_on_host(slots);
    const int64_t blocks = pool.size(0);
    for (const int64_t s : host) {
      TORCH_CHECK(s >= 0 && s < blocks,
                  msg("token_checksums: slots holds ", s, ", out of range for a pool of ", blocks, " blocks"));
    }
    if (g.slots <= kChecksumInlineSlots) {
      ChecksumInlineSlots inline_slots;  // 1 KiB: filled up to what the call uses
      std::copy(host.begin(), host.end(), inline_slots.v);
      check_launch(launch_token_checksums_inline(sums, base, g, inline_slots, stream), "token_checksums kernel launch");
    } else {
      const at::Tensor dev = to_device_pinned(host, pool.device());
      check_launch(launch_token_checksums(sums, base, g, dev.data_ptr<int64_t>(), stream),
                   "token_checksums kernel launch");
    }
    return out;
  }
  const at::Tensor dev = slots.to(at::kLong).contiguous();
  check_launch(launch_token_checksums(sums, base, g, dev.data_ptr<int64_t>(), stream), "token_checksums kernel launch");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(tiered_kv, CUDA, m) { m.impl("token_checksums", &token_checksums_cuda); }

}  // namespace tiered_kv
