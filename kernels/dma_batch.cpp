// Batched DMA issue (see dma_batch.h) and the op tiered_kv::dma_batch_mode that tests use to compare the batch
// call with the per-copy loop.
#include "dma_batch.h"

#include <torch/library.h>

#include <atomic>

namespace tiered_kv {
namespace {

std::atomic<bool> g_enabled{true};
std::atomic<bool> g_refused{false};  // the runtime answered cudaErrorNotSupported once: never try again

#if defined(CUDART_VERSION) && CUDART_VERSION >= 12080
constexpr bool kBuiltWithBatch = true;

cudaError_t batch_call(const DmaBatch& b, cudaStream_t stream) {
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;  // sources read in stream order, like cudaMemcpyAsync
  attr.flags = cudaMemcpyFlagDefault;
  size_t attr_index = 0;
  void* const* dsts = b.dsts.data();
  const void* const* srcs = b.srcs.data();
  size_t* sizes = const_cast<size_t*>(b.sizes.data());
#if CUDART_VERSION >= 13000
  return cudaMemcpyBatchAsync(dsts, srcs, sizes, b.sizes.size(), &attr, &attr_index, 1, stream);
#else
  size_t fail_index = 0;
  return cudaMemcpyBatchAsync(const_cast<void**>(dsts), const_cast<void**>(srcs), sizes, b.sizes.size(), &attr,
                              &attr_index, 1, &fail_index, stream);
#endif
}
#else
constexpr bool kBuiltWithBatch = false;

cudaError_t batch_call(const DmaBatch&, cudaStream_t) { return cudaErrorNotSupported; }
#endif

cudaError_t per_copy(const DmaBatch& b, cudaStream_t stream) {
  for (size_t i = 0; i < b.sizes.size(); ++i) {
    const cudaError_t err = cudaMemcpyAsync(b.dsts[i], b.srcs[i], b.sizes[i], cudaMemcpyDefault, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// mode: -1 query, 0 off, 1 on. Returns 1 when the batch call is available (after the change), else 0.
int64_t dma_batch_mode(int64_t mode) {
  TORCH_CHECK(mode >= -1 && mode <= 1, "dma_batch_mode: mode must be -1 (query), 0 (off) or 1 (on), got ", mode);
  if (mode >= 0) dma_batch_set_enabled(mode == 1);
  return dma_batch_available() ? 1 : 0;
}

}  // namespace

bool dma_batch_available() { return kBuiltWithBatch && g_enabled.load() && !g_refused.load(); }

bool dma_batch_set_enabled(bool enabled) { return g_enabled.exchange(enabled); }

cudaError_t dma_flush(const DmaBatch& batch, cudaStream_t stream) {
  if (batch.sizes.empty()) return cudaSuccess;
  if (batch.sizes.size() > 1 && dma_batch_available()) {
    const cudaError_t err = batch_call(batch, stream);
    if (err != cudaErrorNotSupported) return err;
    (void)cudaGetLastError();  // clear the sticky-free error so the fallback starts clean
    g_refused.store(true);
  }
  return per_copy(batch, stream);
}

}  // namespace tiered_kv

TORCH_LIBRARY_FRAGMENT(tiered_kv, m) { m.def("dma_batch_mode(int mode) -> int", &tiered_kv::dma_batch_mode); }
