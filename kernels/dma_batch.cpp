// Batched DMA issue (see dma_batch.h) and the op tiered_kv::dma_batch_mode that tests use to compare the batch
// call with the per-copy loop.
#include "dma_batch.h"

#include <torch/library.h>

#include <algorithm>
#include <atomic>

#include "tkv_torch.h"

namespace tiered_kv {
namespace {

std::atomic<bool> g_enabled{true};
std::atomic<bool> g_refused{false};  // the runtime answered cudaErrorNotSupported once: never try again
std::atomic<int64_t> g_batches{0};   // batch calls the runtime accepted (tests check the batch path ran)
constexpr size_t kSplitFrom = 16;    // batches of at least this many copies go as several calls:
constexpr size_t kHead = 4;          // a first call the copy engines start on at once,
constexpr size_t kMaxCall = 256;     // then calls that double in size up to this many copies

#if defined(CUDART_VERSION) && CUDART_VERSION >= 12080
constexpr bool kBuiltWithBatch = true;

// copies [first, first + count) of b as one batch call
cudaError_t batch_call(const DmaBatch& b, size_t first, size_t count, cudaStream_t stream) {
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;  // sources read in stream order, like cudaMemcpyAsync
  attr.flags = cudaMemcpyFlagDefault;
  size_t attr_index = 0;
  void* const* dsts = b.dsts.data() + first;
  const void* const* srcs = b.srcs.data() + first;
  size_t* sizes = const_cast<size_t*>(b.sizes.data()) + first;
#if CUDART_VERSION >= 13000
  return cudaMemcpyBatchAsync(dsts, srcs, sizes, count, &attr, &attr_index, 1, stream);
#else
  size_t fail_index = 0;
  return cudaMemcpyBatchAsync(const_cast<void**>(dsts), const_cast<void**>(srcs), sizes, count, &attr, &attr_index, 1,
                              &fail_index, stream);
#endif
}
#else
constexpr bool kBuiltWithBatch = false;

cudaError_t batch_call(const DmaBatch&, size_t, size_t, cudaStream_t) { return cudaErrorNotSupported; }
#endif

cudaError_t per_copy(const DmaBatch& b, size_t first, cudaStream_t stream) {
  for (size_t i = first; i < b.sizes.size(); ++i) {
    const cudaError_t err = cudaMemcpyAsync(b.dsts[i], b.srcs[i], b.sizes[i], cudaMemcpyDefault, stream);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// mode: -1 query, 0 off, 1 on: returns 1 when the batch call is available (after the change), else 0.
// mode 2: returns how many batch calls the runtime has accepted in this process.
int64_t dma_batch_mode(int64_t mode) {
  TORCH_CHECK(mode >= -1 && mode <= 2,
              msg("dma_batch_mode: mode must be -1 (query), 0 (off), 1 (on) or 2 (count), got ", mode));
  if (mode == 2) return g_batches.load();
  if (mode >= 0) dma_batch_set_enabled(mode == 1);
  return dma_batch_available() ? 1 : 0;
}

}  // namespace

bool dma_batch_available() { return kBuiltWithBatch && g_enabled.load() && !g_refused.load(); }

bool dma_batch_set_enabled(bool enabled) { return g_enabled.exchange(enabled); }

cudaError_t dma_flush(const DmaBatch& batch, cudaStream_t stream) {
  const size_t n = batch.sizes.size();
  if (n == 0) return cudaSuccess;
  // The batch call does not take the legacy default stream (cudaErrorInvalidValue): the loop serves it.
  const bool legacy = stream == nullptr || stream == cudaStreamLegacy;
  if (n > 1 && !legacy && dma_batch_available()) {
    // The runtime starts a batch only once the whole call has returned (~1 us of host time per copy): a long
    // batch goes as a short head, which the copy engines start on at once, then calls that double in size, so
    // each call is issued while the copies of the calls before it run (a call of k copies takes ~k us to issue,
    // the k/2 copies before it at least k/2 x 1.2 us at 64 KiB each). Measured on an H100, 256 scattered 2 MiB
    // copies: one call 10.47 ms issue-to-done, head of 4 + rest 10.28 ms, one contiguous copy of the same bytes
    // 10.21 ms (kernels/probes/pcie_probe.cu, dma_issue). A head and one long rest leave the engines idle while
    // the rest is issued, for as long as that takes.
    size_t done = 0, call = n >= kSplitFrom ? kHead : n;
    while (done < n) {
      const size_t count = std::min(call, n - done);
      call = std::min(2 * call, kMaxCall);
      const cudaError_t err = batch_call(batch, done, count, stream);
      if (err != cudaSuccess) {
        (void)cudaGetLastError();  // neither error is sticky: clear it so the loop starts clean
        if (err == cudaErrorNotSupported) g_refused.store(true);
        // Any refusal: the loop issues the copies not yet issued and reports the error that is really there,
        // if any (the batch call validates before it enqueues anything).
        return per_copy(batch, done, stream);
      }
      g_batches.fetch_add(1);
      done += count;
    }
    return cudaSuccess;
  }
  return per_copy(batch, 0, stream);
}

}  // namespace tiered_kv

// Schema in tiered_kv/opdefs.py; no tensor argument: one kernel for every device
TORCH_LIBRARY_IMPL(tiered_kv, CompositeExplicitAutograd, m) { m.impl("dma_batch_mode", &tiered_kv::dma_batch_mode); }
