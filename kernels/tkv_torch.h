// Helpers shared by the torch bindings of the tiered_kv kernels (host code only).
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace tiered_kv {

// The address a kernel on the current device uses for `t`: its data pointer for device memory, the
// device view of a pinned host allocation (unified addressing) for host memory.
inline void* device_view(const at::Tensor& t, const char* what) {
  void* p = t.data_ptr();
  if (t.is_cuda() || p == nullptr) return p;
  TORCH_CHECK(t.device().is_cpu(), what, " must be on a CUDA device or in pinned host memory");
  // cudaPointerGetAttributes resolves any address inside a pinned allocation (a view's offset included);
  // pageable memory reports cudaMemoryTypeUnregistered and has no device address. On a thread that has
  // made no CUDA call yet (the engine's stream waiters, the file tier's I/O threads) the lookup was seen
  // (H200, CUDA 13) to report pinned memory without a device pointer: make the device's primary context
  // current first, and fall back to the host address itself, which under unified virtual addressing (every
  // 64-bit platform CUDA 13 supports) is also the device address of page-locked host memory.
  thread_local bool context_current = false;
  if (!context_current) {
    int dev = 0;
    if (cudaGetDevice(&dev) == cudaSuccess && cudaSetDevice(dev) == cudaSuccess) context_current = true;
    cudaGetLastError();
  }
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, p);
  if (err != cudaSuccess) cudaGetLastError();  // clear it so later launches do not report it
  TORCH_CHECK(err == cudaSuccess && attr.type == cudaMemoryTypeHost, what,
              " is in pageable host memory; a kernel can only reach pinned host memory (cudaPointerGetAttributes: ",
              cudaGetErrorString(err), ", type ", static_cast<int>(attr.type), ")");
  return attr.devicePointer != nullptr ? attr.devicePointer : p;
}

// The values of a 1-D int32/int64 CPU tensor of indices, as int64.
inline std::vector<int64_t> indices_on_host(const at::Tensor& t) {
  std::vector<int64_t> out(static_cast<size_t>(t.numel()));
  const at::Tensor c = t.contiguous();
  if (c.scalar_type() == at::kLong) {
    std::copy_n(c.data_ptr<int64_t>(), out.size(), out.begin());
  } else {
    std::copy_n(c.data_ptr<int32_t>(), out.size(), out.begin());
  }
  return out;
}

// Ship `values` to `device` through a fresh pinned buffer. The caching host allocator records the copy's
// stream, so the buffer is not reused before the copy has executed (the seed-000 staging rule).
inline at::Tensor to_device_pinned(const std::vector<int64_t>& values, const at::Device& device) {
  at::Tensor host = at::empty({static_cast<int64_t>(values.size())},
                              at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::copy(values.begin(), values.end(), host.data_ptr<int64_t>());
  return host.to(device, /*non_blocking=*/true);
}

// A check's message from strings and integers, for TORCH_CHECK(cond, msg(...)). TORCH_CHECK formats extra
// arguments through an ostringstream; on the GPU machine (torch 2.11+cu130) a refused call whose message held
// an integer crashed the process (SIGSEGV) instead of raising, while messages of strings raised: integers are
// turned into text with std::to_string here, so TORCH_CHECK only ever sees one string.
inline std::string msg_piece(const char* s) { return s; }
inline std::string msg_piece(const std::string& s) { return s; }
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
std::string msg_piece(T v) {
  return std::to_string(v);
}
template <typename... Args>
std::string msg(const Args&... args) {
  return (std::string{} + ... + msg_piece(args));
}

inline void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, " failed: ", cudaGetErrorString(err));
}

}  // namespace tiered_kv
