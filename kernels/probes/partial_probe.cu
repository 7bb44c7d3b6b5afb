// Partial-copy probe (standalone, no torch): GPU->GPU copies of tokens [0, n) of every row of 128 blocks, the
// engine's partial-copy pattern (rows of n x 256 B every 4 KiB, 512 rows per 2 MiB block), per mechanism and launch
// shape. Device time from CUDA events behind a spin kernel (host issue excluded), as a fraction of one contiguous
// cudaMemcpyAsync of the same bytes; and the host time of a launch with small and large kernel parameters.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/partial_probe kernels/probes/partial_probe.cu && /tmp/partial_probe
//
// `partial_probe host`: the same pattern host<->GPU (pinned host pool): one contiguous copy, the 2-D copy-engine call
// for all blocks and per block, and the engine's kernel reading or writing the pinned side over UVA.
//
// One line per measurement.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define CK(x)                                                                                           \
  do {                                                                                                  \
    cudaError_t e_ = (x);                                                                               \
    if (e_ != cudaSuccess) {                                                                            \
      fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #x); \
      exit(1);                                                                                          \
    }                                                                                                   \
  } while (0)

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// The geometry: rows of tokens x kTokenBytes every kPitch bytes, kRows rows per 2 MiB block. The default is a block
// of [rows][16 tokens][256 B]; -DPITCH=32768 -DROWS=64 -DTOKEN_BYTES=2048 is the kernels bench's (32 layers x K/V
// groups of 16 tokens x 8 heads x 128 bf16).
#ifndef PITCH
#define PITCH 4096
#define ROWS 512
#define TOKEN_BYTES 256
#endif
constexpr int64_t kBlockBytes = 2 << 20, kPitch = PITCH, kRows = ROWS, kPairs = 128, kTokenBytes = TOKEN_BYTES;

struct Meta {
  int64_t v[640];
  int64_t src_index, dst_index;
};

__global__ void spin(int64_t cycles) {
  const int64_t t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

// the engine's kernel (copy_blocks_kernel, vec16 path, one group): warp items of `batch` rows
template <int kUnroll>
__global__ void warp_items(const __grid_constant__ Meta meta, uint32_t width, uint32_t batch, uint32_t items) {
  const int lane = threadIdx.x & 31;
  const uint32_t warps = gridDim.x * kWarps;
  const uint32_t batches = (kRows + batch - 1) / batch;
  for (uint32_t item = blockIdx.x * kWarps + (threadIdx.x >> 5); item < items; item += warps) {
    const uint32_t rb = item % batches, pair = item / batches;
    const int64_t row0 = int64_t(rb) * batch;
    const uint32_t nrows = uint32_t(kRows - row0 < batch ? kRows - row0 : batch);
    const char* s = reinterpret_cast<const char*>(meta.v[0]) + meta.v[meta.src_index + pair] * kBlockBytes + row0 * kPitch;
    char* d = reinterpret_cast<char*>(meta.v[1]) + meta.v[meta.dst_index + pair] * kBlockBytes + row0 * kPitch;
    const uint32_t nvec = width >> 4, count = nvec * nrows;
    for (uint32_t base = 0; base < count; base += 32 * kUnroll) {
      uint4 v[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const uint32_t f = base + lane + 32 * k;
        const uint32_t r = f / nvec;
        if (f < count) v[k] = *reinterpret_cast<const uint4*>(s + int64_t(r) * kPitch + (f - r * nvec) * 16ull);
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const uint32_t f = base + lane + 32 * k;
        const uint32_t r = f / nvec;
        if (f < count) *reinterpret_cast<uint4*>(d + int64_t(r) * kPitch + (f - r * nvec) * 16ull) = v[k];
      }
    }
  }
}

// rows cut into pieces of `piece` bytes (a multiple of 16), one warp per (pair, row, piece): what the engine does with
// rows wider than its item size (pieces of 16 KiB there)
template <int kUnroll>
__global__ void warp_pieces(const __grid_constant__ Meta meta, uint32_t width, uint32_t piece, uint32_t items) {
  const int lane = threadIdx.x & 31;
  const uint32_t warps = gridDim.x * kWarps;
  const uint32_t pieces = (width + piece - 1) / piece;
  for (uint32_t item = blockIdx.x * kWarps + (threadIdx.x >> 5); item < items; item += warps) {
    const uint32_t pc = item % pieces, rest = item / pieces, r = rest % kRows, pair = rest / kRows;
    const int64_t within = int64_t(r) * kPitch + int64_t(pc) * piece;
    const uint4* s = reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(meta.v[0]) +
                                                    meta.v[meta.src_index + pair] * kBlockBytes + within);
    uint4* d = reinterpret_cast<uint4*>(reinterpret_cast<char*>(meta.v[1]) + meta.v[meta.dst_index + pair] * kBlockBytes +
                                        within);
    const uint32_t len = width - pc * piece < piece ? width - pc * piece : piece, nvec = len >> 4;
    for (uint32_t base = 0; base < nvec; base += 32 * kUnroll) {
      uint4 v[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const uint32_t f = base + lane + 32 * k;
        if (f < nvec) v[k] = s[f];
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const uint32_t f = base + lane + 32 * k;
        if (f < nvec) d[f] = v[k];
      }
    }
  }
}

// flat: vector i of the whole copy -> (pair, row, vec); each thread kUnroll vectors a grid apart, loads first
template <int kUnroll>
__global__ void flat(const __grid_constant__ Meta meta, uint32_t nvec, uint32_t total) {
  const uint32_t stride = gridDim.x * blockDim.x;
  const uint32_t per_pair = nvec * kRows;
  for (uint32_t base = blockIdx.x * blockDim.x + threadIdx.x; base < total; base += stride * kUnroll) {
    uint4 v[kUnroll];
    int64_t so[kUnroll], dof[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const uint32_t f = base + k * stride;
      if (f < total) {
        const uint32_t pair = f / per_pair, rest = f - pair * per_pair, r = rest / nvec, c = rest - r * nvec;
        const int64_t within = int64_t(r) * kPitch + c * 16;
        so[k] = meta.v[meta.src_index + pair] * kBlockBytes + within;
        dof[k] = meta.v[meta.dst_index + pair] * kBlockBytes + within;
        v[k] = *reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(meta.v[0]) + so[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const uint32_t f = base + k * stride;
      if (f < total) *reinterpret_cast<uint4*>(reinterpret_cast<char*>(meta.v[1]) + dof[k]) = v[k];
    }
  }
}

// one CTA per (pair, row batch): threads stride over the batch's vectors, kUnroll loads in flight each
template <int kUnroll>
__global__ void cta_items(const __grid_constant__ Meta meta, uint32_t nvec, uint32_t batch, uint32_t items) {
  const uint32_t batches = kRows / batch;
  for (uint32_t item = blockIdx.x; item < items; item += gridDim.x) {
    const uint32_t rb = item % batches, pair = item / batches;
    const char* s = reinterpret_cast<const char*>(meta.v[0]) + meta.v[meta.src_index + pair] * kBlockBytes + int64_t(rb) * batch * kPitch;
    char* d = reinterpret_cast<char*>(meta.v[1]) + meta.v[meta.dst_index + pair] * kBlockBytes + int64_t(rb) * batch * kPitch;
    const uint32_t count = nvec * batch;
    for (uint32_t base = threadIdx.x; base < count; base += blockDim.x * kUnroll) {
      uint4 v[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const uint32_t f = base + k * blockDim.x, r = f / nvec;
        if (f < count) v[k] = *reinterpret_cast<const uint4*>(s + int64_t(r) * kPitch + (f - r * nvec) * 16ull);
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const uint32_t f = base + k * blockDim.x, r = f / nvec;
        if (f < count) *reinterpret_cast<uint4*>(d + int64_t(r) * kPitch + (f - r * nvec) * 16ull) = v[k];
      }
    }
  }
}

template <typename F>
double dev_us(cudaStream_t st, F&& fn, int repeat = 15) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> t;
  for (int i = 0; i <= repeat; ++i) {
    spin<<<1, 1, 0, st>>>(2000000);
    CK(cudaEventRecord(a, st));
    fn();
    CK(cudaEventRecord(b, st));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    if (i) t.push_back(ms * 1000);
  }
  std::sort(t.begin(), t.end());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return t[t.size() / 2];
}

// host<->GPU: the partial pattern between a pinned pool and a device pool, per mechanism
int host_main(int sms) {
  char *dev = nullptr, *host = nullptr;
  CK(cudaMalloc(&dev, 2 * kPairs * kBlockBytes));
  CK(cudaHostAlloc(&host, 2 * kPairs * kBlockBytes, cudaHostAllocDefault));
  memset(host, 1, 2 * kPairs * kBlockBytes);
  CK(cudaMemset(dev, 1, 2 * kPairs * kBlockBytes));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  for (int dir = 0; dir < 2; ++dir) {  // 0: host->GPU, 1: GPU->host
    char* src = dir == 0 ? host : dev;
    char* dst = dir == 0 ? dev : host;
    const char* dname = dir == 0 ? "h2d" : "d2h";
    Meta meta{};
    meta.v[0] = reinterpret_cast<int64_t>(src);
    meta.v[1] = reinterpret_cast<int64_t>(dst);
    meta.src_index = 2;
    meta.dst_index = 2 + kPairs;
    for (int p = 0; p < kPairs; ++p) meta.v[2 + p] = meta.v[2 + kPairs + p] = p;
    for (int tokens : {1, 2, 4, 12}) {
      const uint32_t width = tokens * kTokenBytes;
      const size_t nbytes = size_t(kPairs) * kRows * width;
      const double base = dev_us(st, [&] { CK(cudaMemcpyAsync(dst + kPairs * kBlockBytes, src, nbytes, cudaMemcpyDefault, st)); });
      auto line = [&](const char* name, double us) {
        printf("%s tokens=%2d %-40s %8.1f us  %6.2f GB/s  fraction %.3f\n", dname, tokens, name, us, nbytes / us / 1e3,
               base / us);
      };
      line("contiguous cudaMemcpyAsync", base);
      line("2-D, one call for all blocks", dev_us(st, [&] {
             CK(cudaMemcpy2DAsync(dst, kPitch, src, kPitch, width, kPairs * kRows, cudaMemcpyDefault, st));
           }));
      line("2-D, one call per block", dev_us(st, [&] {
             for (int p = 0; p < kPairs; ++p)
               CK(cudaMemcpy2DAsync(dst + p * kBlockBytes, kPitch, src + p * kBlockBytes, kPitch, width, kRows,
                                    cudaMemcpyDefault, st));
           }));
      for (int run : {2, 4, 8, 16, 32}) {  // runs of `run` blocks, issued last run first
        char name[64];
        snprintf(name, sizeof name, "2-D, one call per %d blocks, reversed", run);
        line(name, dev_us(st, [&] {
               for (int p = kPairs - run; p >= 0; p -= run)
                 CK(cudaMemcpy2DAsync(dst + p * kBlockBytes, kPitch, src + p * kBlockBytes, kPitch, width, run * kRows,
                                      cudaMemcpyDefault, st));
             }));
      }
      for (int ctas : {2, 4}) {
        for (uint32_t bb : {8192u, 16384u}) {
          const uint32_t batch = std::max<uint32_t>(1, bb / width);
          const uint32_t items = kPairs * ((kRows + batch - 1) / batch);
          const unsigned grid = std::min<int64_t>((items + kWarps - 1) / kWarps, int64_t(sms) * ctas);
          char name[64];
          snprintf(name, sizeof name, "kernel warp items ctas/sm=%d item=%uB u8", ctas, bb);
          line(name, dev_us(st, [&] { warp_items<8><<<grid, kThreads, 0, st>>>(meta, width, batch, items); }));
        }
      }
      // host time to issue 128 per-block 2-D calls (the engine's DMA path for a partial copy today)
      std::vector<double> t;
      for (int rep = 0; rep < 7; ++rep) {
        CK(cudaStreamSynchronize(st));
        const auto t0 = std::chrono::steady_clock::now();
        for (int p = 0; p < kPairs; ++p)
          CK(cudaMemcpy2DAsync(dst + p * kBlockBytes, kPitch, src + p * kBlockBytes, kPitch, width, kRows,
                               cudaMemcpyDefault, st));
        t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
      }
      CK(cudaStreamSynchronize(st));
      std::sort(t.begin(), t.end());
      printf("%s tokens=%2d host issue of 128 per-block 2-D calls p50 %.1f us\n", dname, tokens, t[t.size() / 2]);
    }
  }
  CK(cudaDeviceSynchronize());
  return 0;
}

int main(int argc, char** argv) {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  if (argc > 1 && std::string(argv[1]) == "host") return host_main(sms);
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("# %s, %d SMs; rows of tokens x %lld B every %lld B, %lld rows per block\n", prop.name, sms,
         (long long)kTokenBytes, (long long)kPitch, (long long)kRows);
  char* pool = nullptr;
  CK(cudaMalloc(&pool, 3 * kPairs * kBlockBytes));  // blocks 0..255, then room for the contiguous copies
  CK(cudaMemset(pool, 1, 3 * kPairs * kBlockBytes));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  Meta meta{};
  meta.v[0] = meta.v[1] = reinterpret_cast<int64_t>(pool);
  meta.src_index = 2;
  meta.dst_index = 2 + kPairs;
  for (int p = 0; p < kPairs; ++p) {
    meta.v[2 + p] = p;
    meta.v[2 + kPairs + p] = kPairs + p;
  }
  for (int tokens : {4, 8, 12}) {
    const uint32_t width = tokens * kTokenBytes, nvec = width / 16;
    const size_t nbytes = size_t(kPairs) * kRows * width;
    const double base = dev_us(st, [&] { CK(cudaMemcpyAsync(pool + 2 * nbytes, pool, nbytes, cudaMemcpyDeviceToDevice, st)); });
    auto line = [&](const char* name, double us) {
      printf("tokens=%2d %-40s %8.1f us  fraction %.3f\n", tokens, name, us, base / us);
    };
    line("contiguous cudaMemcpyAsync", base);
    line("cudaMemcpy2DAsync (one 2-D copy)", dev_us(st, [&] {
           CK(cudaMemcpy2DAsync(pool + kPairs * kBlockBytes, kPitch, pool, kPitch, width, kPairs * kRows,
                                cudaMemcpyDeviceToDevice, st));
         }));
    for (int ctas : {2, 4, 8, 16}) {
      for (uint32_t bb : {4096u, 8192u, 16384u, 32768u}) {
        const uint32_t batch = std::max<uint32_t>(1, bb / width);
        const uint32_t items = kPairs * ((kRows + batch - 1) / batch);
        const unsigned grid = std::min<int64_t>((items + kWarps - 1) / kWarps, int64_t(sms) * ctas);
        char name[64];
        snprintf(name, sizeof name, "warp items ctas/sm=%d item=%uB u8", ctas, bb);
        line(name, dev_us(st, [&] { warp_items<8><<<grid, kThreads, 0, st>>>(meta, width, batch, items); }));
        snprintf(name, sizeof name, "warp items ctas/sm=%d item=%uB u4", ctas, bb);
        line(name, dev_us(st, [&] { warp_items<4><<<grid, kThreads, 0, st>>>(meta, width, batch, items); }));
      }
    }
    for (int ctas : {4, 8, 16}) {
      for (uint32_t piece : {2048u, 4096u, 8192u}) {
        if (piece > width) continue;
        const uint32_t items = kPairs * kRows * ((width + piece - 1) / piece);
        const unsigned grid = std::min<int64_t>((items + kWarps - 1) / kWarps, int64_t(sms) * ctas);
        char name[64];
        snprintf(name, sizeof name, "warp pieces ctas/sm=%d piece=%uB u8", ctas, piece);
        line(name, dev_us(st, [&] { warp_pieces<8><<<grid, kThreads, 0, st>>>(meta, width, piece, items); }));
        snprintf(name, sizeof name, "warp pieces ctas/sm=%d piece=%uB u4", ctas, piece);
        line(name, dev_us(st, [&] { warp_pieces<4><<<grid, kThreads, 0, st>>>(meta, width, piece, items); }));
      }
    }
    const uint32_t total = kPairs * kRows * nvec;
    for (int per_sm : {1, 2, 4, 8}) {
      for (int threads : {256, 512, 1024}) {
        const unsigned grid = sms * per_sm * (1024 / threads);
        char name[64];
        snprintf(name, sizeof name, "flat %d thr x %d/SM u4", threads, per_sm * (1024 / threads));
        line(name, dev_us(st, [&] { flat<4><<<grid, threads, 0, st>>>(meta, nvec, total); }));
        snprintf(name, sizeof name, "flat %d thr x %d/SM u8", threads, per_sm * (1024 / threads));
        line(name, dev_us(st, [&] { flat<8><<<grid, threads, 0, st>>>(meta, nvec, total); }));
      }
    }
    for (uint32_t batch : {16u, 32u, 64u}) {
      for (int threads : {256, 512}) {
        const uint32_t items = kPairs * (kRows / batch);
        for (int per_sm : {2, 4, 0}) {
          const unsigned grid = per_sm ? std::min<uint32_t>(items, sms * per_sm) : items;
          char name[64];
          snprintf(name, sizeof name, "cta items rows=%u thr=%d grid=%u u4", batch, threads, grid);
          line(name, dev_us(st, [&] { cta_items<4><<<grid, threads, 0, st>>>(meta, nvec, batch, items); }));
        }
      }
    }
  }
  // host time of one launch: parameters of ~1 KiB and ~5 KiB (the engine's small and large inline metadata)
  struct Small {
    int64_t v[96];
    int64_t a, b;
  } small{};
  small.v[0] = small.v[1] = reinterpret_cast<int64_t>(pool);
  for (int rep = 0; rep < 3; ++rep) {
    for (int which = 0; which < 3; ++which) {
      CK(cudaStreamSynchronize(st));
      std::vector<double> t;
      for (int i = 0; i < 200; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        if (which == 0) {
          warp_items<8><<<1, kThreads, 0, st>>>(meta, 16, 1, 0);
        } else if (which == 1) {
          spin<<<1, 1, 0, st>>>(0);
        } else {
          cudaEvent_t e;
          CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
          const auto t1 = std::chrono::steady_clock::now();
          CK(cudaEventRecord(e, st));
          t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t1).count());
          cudaEventDestroy(e);
          continue;
        }
        t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
        if (i % 16 == 15) CK(cudaStreamSynchronize(st));
      }
      std::sort(t.begin(), t.end());
      const char* names[] = {"launch, 5 KiB params", "launch, 8 B params", "event record"};
      printf("host %-24s p50 %.2f us\n", names[which], t[t.size() / 2]);
    }
  }
  (void)small;
  CK(cudaDeviceSynchronize());
  return 0;
}
