// Batched DMA issue: a scattered set of 1-D copies as one cudaMemcpyBatchAsync where the runtime has it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <vector>

namespace tiered_kv {

// 1-D copies gathered by a caller (e.g. copy_blocks' DMA path), issued by dma_flush.
struct DmaBatch {
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;

  void add(void* d, const void* s, size_t n) {
    dsts.push_back(d);
    srcs.push_back(s);
    sizes.push_back(n);
  }
};

// Issue every copy of `batch` on `stream` in stream order: one cudaMemcpyBatchAsync when the runtime has it
// (CUDA >= 12.8, decided at build time with CUDART_VERSION), it is enabled (dma_batch_set_enabled), the
// stream is not the legacy default stream (the batch call refuses it) and the batch holds more than one
// copy; else, or when the call refuses the batch (cudaErrorNotSupported is remembered for the process), one
// cudaMemcpyAsync per copy. Returns the first error, cudaSuccess otherwise.
cudaError_t dma_flush(const DmaBatch& batch, cudaStream_t stream);

// Whether dma_flush may use the batch call (built with it, enabled, not refused by the runtime so far).
bool dma_batch_available();

// Turn the batch call on or off (tests compare both ways); returns the previous setting.
bool dma_batch_set_enabled(bool enabled);

}  // namespace tiered_kv
