// PCIe copy probe (standalone, no torch): how fast can small scattered chunks move between pinned host memory
// and the GPU, per mechanism? Device time (CUDA events behind a spin kernel, host issue excluded), GB/s.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/pcie_probe kernels/probes/pcie_probe.cu && /tmp/pcie_probe [which]
//
// which: "loads" (SM load/store kernels), "dma" (contiguous, batched, multi-stream), "hybrid" (kernel + DMA
// on two streams at once), "tma" (Hopper bulk copies through shared memory). One JSON line per measurement.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#define CK(x)                                                                            \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #x); \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)

static constexpr size_t kTotal = size_t{512} << 20;

__global__ void spin(int64_t ns) {
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (static_cast<int64_t>(t - t0) < ns);
}

// ---- SM load/store kernels: one warp per piece (<= piece bytes of one chunk), U 16-byte loads per lane in flight
template <int U, int Hint>
__device__ __forceinline__ uint4 ld16(const uint4* p) {
  uint4 v;
  if (Hint == 1) {
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
  } else if (Hint == 2) {
    asm volatile("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
  } else {
    v = *p;
  }
  return v;
}

template <int Hint>
__device__ __forceinline__ void st16(uint4* p, uint4 v) {
  if (Hint != 0) {
    asm volatile("st.global.L1::no_allocate.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w)
                 : "memory");
  } else {
    *p = v;
  }
}

template <int U, int Hint>
__global__ void warp_kernel(char* dst, const char* src, const int64_t* dst_off, const int64_t* src_off, int64_t chunks,
                            int64_t chunk, int64_t piece) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x >> 5);
  const int64_t pieces = chunk / piece;
  const int64_t items = chunks * pieces;
  for (int64_t it = static_cast<int64_t>(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5); it < items; it += warps) {
    const int64_t c = it / pieces, p = it - c * pieces;
    const uint4* s = reinterpret_cast<const uint4*>(src + src_off[c] + p * piece);
    uint4* d = reinterpret_cast<uint4*>(dst + dst_off[c] + p * piece);
    const int n = static_cast<int>(piece >> 4);
    for (int b = 0; b < n; b += 32 * U) {
      uint4 v[U];
#pragma unroll
      for (int k = 0; k < U; ++k) {
        const int f = b + lane + 32 * k;
        if (f < n) v[k] = ld16<U, Hint>(s + f);
      }
#pragma unroll
      for (int k = 0; k < U; ++k) {
        const int f = b + lane + 32 * k;
        if (f < n) st16<Hint>(d + f, v[k]);
      }
    }
  }
}

// ---- Hopper bulk copies: global -> shared (mbarrier) -> global, one issuing thread per CTA, S stages of B bytes
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

template <int S>
__global__ void tma_kernel(char* dst, const char* src, const int64_t* dst_off, const int64_t* src_off, int64_t chunks,
                           int64_t chunk, int64_t piece) {
  extern __shared__ __align__(128) char buf[];
  __shared__ __align__(8) uint64_t bar[S];
  if (threadIdx.x != 0) return;
  for (int i = 0; i < S; ++i) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&bar[i])));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  const int64_t pieces = chunk / piece;
  const int64_t items = chunks * pieces;
  // this CTA's k-th item is blockIdx.x + k * gridDim.x
  const int64_t mine = items > blockIdx.x ? (items - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  auto addr = [&](int64_t k, const char** s, char** d) {
    const int64_t it = blockIdx.x + k * gridDim.x;
    const int64_t c = it / pieces, p = it - c * pieces;
    *s = src + src_off[c] + p * piece;
    *d = dst + dst_off[c] + p * piece;
  };
  auto load = [&](int64_t k) {
    const char* s;
    char* d;
    addr(k, &s, &d);
    const int st = static_cast<int>(k % S);
    const uint32_t b = smem_addr(&bar[st]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(static_cast<uint32_t>(piece))
                 : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            smem_addr(buf + st * piece)),
        "l"(s), "r"(static_cast<uint32_t>(piece)), "r"(b)
        : "memory");
  };
  for (int64_t k = 0; k < mine && k < S; ++k) load(k);
  for (int64_t k = 0; k < mine; ++k) {
    const int st = static_cast<int>(k % S);
    const uint32_t parity = static_cast<uint32_t>((k / S) & 1);
    const uint32_t b = smem_addr(&bar[st]);
    asm volatile(
        "{\n.reg .pred p;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT_%=;\n}" ::"r"(b),
        "r"(parity)
        : "memory");
    const char* s;
    char* d;
    addr(k, &s, &d);
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(d), "r"(smem_addr(buf + st * piece)),
                 "r"(static_cast<uint32_t>(piece))
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (k + S < mine) {
      // the store just issued reads this stage: wait until it has, then refill the stage
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      load(k + S);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

struct Ctx {
  char* host;
  char* dev;
  cudaStream_t s[4];
  cudaEvent_t e0, e1, ev[4];
  int sms;
};

struct Offsets {
  int64_t* host_d;  // device-readable offsets into the host buffer (scattered)
  int64_t* dev_d;   // offsets into the device buffer (identity)
  std::vector<int64_t> host_h, dev_h;
  int64_t chunks;
};

static Offsets make_offsets(int64_t chunk) {
  Offsets o{};
  o.chunks = static_cast<int64_t>(kTotal) / chunk;
  o.host_h.resize(o.chunks);
  o.dev_h.resize(o.chunks);
  std::vector<int64_t> perm(o.chunks);
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937_64 rng(1234);
  std::shuffle(perm.begin(), perm.end(), rng);
  for (int64_t i = 0; i < o.chunks; ++i) {
    o.host_h[i] = perm[i] * chunk;
    o.dev_h[i] = i * chunk;
  }
  CK(cudaMalloc(&o.host_d, o.chunks * 8));
  CK(cudaMalloc(&o.dev_d, o.chunks * 8));
  CK(cudaMemcpy(o.host_d, o.host_h.data(), o.chunks * 8, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(o.dev_d, o.dev_h.data(), o.chunks * 8, cudaMemcpyHostToDevice));
  return o;
}

static void free_offsets(Offsets& o) {
  CK(cudaFree(o.host_d));
  CK(cudaFree(o.dev_d));
}

// Median device seconds of issue(): a spin kernel first so the host has issued everything before e0 is reached.
template <typename F>
static double timed(Ctx& c, F issue, int64_t spin_ns = 20'000'000, int reps = 5) {
  std::vector<double> t;
  for (int r = 0; r < reps + 1; ++r) {
    CK(cudaDeviceSynchronize());
    spin<<<1, 1, 0, c.s[0]>>>(spin_ns);
    CK(cudaEventRecord(c.e0, c.s[0]));
    for (int i = 1; i < 4; ++i) CK(cudaStreamWaitEvent(c.s[i], c.e0, 0));
    issue();
    for (int i = 1; i < 4; ++i) {
      CK(cudaEventRecord(c.ev[i], c.s[i]));
      CK(cudaStreamWaitEvent(c.s[0], c.ev[i], 0));
    }
    CK(cudaEventRecord(c.e1, c.s[0]));
    CK(cudaEventSynchronize(c.e1));
    CK(cudaGetLastError());
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, c.e0, c.e1));
    if (r) t.push_back(ms / 1e3);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

static void emit(const char* what, const char* dir, int64_t chunk, const std::string& cfg, double bytes, double sec) {
  printf("{\"what\": \"%s\", \"dir\": \"%s\", \"chunk_KiB\": %lld, \"cfg\": \"%s\", \"GBps\": %.2f, \"seconds\": %.6f}\n", what, dir,
         static_cast<long long>(chunk >> 10), cfg.c_str(), bytes / sec / 1e9, sec);
  fflush(stdout);
}

// dir: 0 = host -> GPU (onboard, reads host), 1 = GPU -> host (offload, writes host)
template <int U, int Hint>
static void run_warp(Ctx& c, Offsets& o, int dir, int64_t chunk, int64_t piece, int ctas_per_sm, int threads,
                     cudaStream_t st, int64_t first, int64_t count, int grid = 0) {
  char* dst = dir == 0 ? c.dev : c.host;
  const char* src = dir == 0 ? c.host : c.dev;
  const int64_t* doff = (dir == 0 ? o.dev_d : o.host_d) + first;
  const int64_t* soff = (dir == 0 ? o.host_d : o.dev_d) + first;
  warp_kernel<U, Hint><<<grid > 0 ? grid : c.sms * ctas_per_sm, threads, 0, st>>>(dst, src, doff, soff, count, chunk,
                                                                                  std::min(piece, chunk));
}

// How few SMs can carry the link: a copy kernel on a small grid leaves the rest of the GPU to compute.
static void grid(Ctx& c) {
  const char* dirs[2] = {"h2d", "d2h"};
  for (int64_t chunk : {int64_t{8} << 10, int64_t{64} << 10}) {
    Offsets o = make_offsets(chunk);
    for (int dir = 0; dir < 2; ++dir) {
      for (int g : {4, 8, 16, 24, 32, 48, 66, 132}) {
        for (int threads : {512, 1024}) {
          emit("grid", dirs[dir], chunk, std::to_string(g) + " CTAs x " + std::to_string(threads), kTotal, timed(c, [&] {
                 run_warp<8, 0>(c, o, dir, chunk, 16 << 10, 0, threads, c.s[0], 0, o.chunks, g);
               }));
        }
      }
    }
    free_offsets(o);
  }
}

static void dma_batch(Ctx& c, Offsets& o, int dir, int64_t chunk, int64_t first, int64_t count, cudaStream_t st) {
  std::vector<void*> d(count), s(count);
  std::vector<size_t> n(count, static_cast<size_t>(chunk));
  for (int64_t i = 0; i < count; ++i) {
    const int64_t h = o.host_h[first + i], g = o.dev_h[first + i];
    d[i] = dir == 0 ? c.dev + g : c.host + h;
    s[i] = dir == 0 ? c.host + h : c.dev + g;
  }
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagDefault;
  size_t idx = 0;
  CK(cudaMemcpyBatchAsync(d.data(), s.data(), n.data(), count, &attr, &idx, 1, st));
}

static void loads(Ctx& c) {
  const char* dirs[2] = {"h2d", "d2h"};
  for (int64_t chunk : {int64_t{4} << 10, int64_t{8} << 10, int64_t{16} << 10, int64_t{64} << 10, int64_t{256} << 10}) {
    Offsets o = make_offsets(chunk);
    for (int dir = 0; dir < 2; ++dir) {
      auto go = [&](const char* name, auto fn) {
        emit("kernel", dirs[dir], chunk, name, kTotal, timed(c, fn));
      };
      go("u8 16K 16cta 256t (current)", [&] { run_warp<8, 0>(c, o, dir, chunk, 16 << 10, 16, 256, c.s[0], 0, o.chunks); });
      go("u8 16K 8cta 256t", [&] { run_warp<8, 0>(c, o, dir, chunk, 16 << 10, 8, 256, c.s[0], 0, o.chunks); });
      go("u8 16K 4cta 256t", [&] { run_warp<8, 0>(c, o, dir, chunk, 16 << 10, 4, 256, c.s[0], 0, o.chunks); });
      go("u8 16K 2cta 256t", [&] { run_warp<8, 0>(c, o, dir, chunk, 16 << 10, 2, 256, c.s[0], 0, o.chunks); });
      go("u4 16K 16cta 256t", [&] { run_warp<4, 0>(c, o, dir, chunk, 16 << 10, 16, 256, c.s[0], 0, o.chunks); });
      go("u16 16K 8cta 256t", [&] { run_warp<16, 0>(c, o, dir, chunk, 16 << 10, 8, 256, c.s[0], 0, o.chunks); });
      go("u8 4K 16cta 256t", [&] { run_warp<8, 0>(c, o, dir, chunk, 4 << 10, 16, 256, c.s[0], 0, o.chunks); });
      go("u8 64K 16cta 256t", [&] { run_warp<8, 0>(c, o, dir, chunk, 64 << 10, 16, 256, c.s[0], 0, o.chunks); });
      go("u8 16K 16cta 256t L2::256B", [&] { run_warp<8, 1>(c, o, dir, chunk, 16 << 10, 16, 256, c.s[0], 0, o.chunks); });
      go("u8 16K 16cta 256t L2::128B", [&] { run_warp<8, 2>(c, o, dir, chunk, 16 << 10, 16, 256, c.s[0], 0, o.chunks); });
      go("u8 16K 1cta 1024t", [&] { run_warp<8, 0>(c, o, dir, chunk, 16 << 10, 1, 1024, c.s[0], 0, o.chunks); });
    }
    free_offsets(o);
  }
}

static void dma(Ctx& c) {
  const char* dirs[2] = {"h2d", "d2h"};
  for (int dir = 0; dir < 2; ++dir) {
    emit("dma", dirs[dir], kTotal >> 10, "contiguous", kTotal, timed(c, [&] {
           CK(cudaMemcpyAsync(dir == 0 ? c.dev : c.host, dir == 0 ? c.host : c.dev, kTotal, cudaMemcpyDefault, c.s[0]));
         }));
  }
  for (int64_t chunk : {int64_t{8} << 10, int64_t{64} << 10, int64_t{256} << 10, int64_t{2} << 20}) {
    Offsets o = make_offsets(chunk);
    for (int dir = 0; dir < 2; ++dir) {
      for (int streams : {1, 2, 4}) {
        emit("dma", dirs[dir], chunk, "batch x" + std::to_string(streams) + " streams", kTotal,
             timed(
                 c,
                 [&] {
                   const int64_t per = (o.chunks + streams - 1) / streams;
                   for (int i = 0; i < streams; ++i) {
                     const int64_t f = i * per, n = std::min(per, o.chunks - f);
                     if (n > 0) dma_batch(c, o, dir, chunk, f, n, c.s[i]);
                   }
                 },
                 200'000'000, 3));
      }
    }
    free_offsets(o);
  }
}

// Wall time (host clock) from the first issue call to the stream finishing, no spin kernel: what a caller sees,
// for 256 scattered 2 MiB blocks, per way of issuing the DMAs (one batch call, one call per copy, batches of k).
static void dma_issue(Ctx& c) {
  const char* dirs[2] = {"h2d", "d2h"};
  const int64_t chunk = int64_t{2} << 20;
  Offsets o = make_offsets(chunk);
  for (int dir = 0; dir < 2; ++dir) {
    for (int64_t k : {int64_t{0}, int64_t{1}, int64_t{4}, int64_t{16}, int64_t{64}, int64_t{256}, int64_t{-4}}) {
      std::vector<double> wall, issue;
      for (int r = 0; r < 6; ++r) {
        CK(cudaDeviceSynchronize());
        const auto t0 = std::chrono::steady_clock::now();
        if (k == 0) {
          for (int64_t i = 0; i < o.chunks; ++i) {
            const int64_t h = o.host_h[i], g = o.dev_h[i];
            CK(cudaMemcpyAsync(dir == 0 ? c.dev + g : c.host + h, dir == 0 ? c.host + h : c.dev + g, chunk,
                               cudaMemcpyDefault, c.s[0]));
          }
        } else if (k > 0) {
          for (int64_t f = 0; f < o.chunks; f += k) dma_batch(c, o, dir, chunk, f, std::min(k, o.chunks - f), c.s[0]);
        } else {  // a small first batch so the engine starts at once, then the rest in one call
          dma_batch(c, o, dir, chunk, 0, -k, c.s[0]);
          dma_batch(c, o, dir, chunk, -k, o.chunks + k, c.s[0]);
        }
        const auto t1 = std::chrono::steady_clock::now();
        CK(cudaStreamSynchronize(c.s[0]));
        const auto t2 = std::chrono::steady_clock::now();
        if (r) {
          wall.push_back(std::chrono::duration<double>(t2 - t0).count());
          issue.push_back(std::chrono::duration<double>(t1 - t0).count());
        }
      }
      std::sort(wall.begin(), wall.end());
      std::sort(issue.begin(), issue.end());
      const std::string cfg = k == 0 ? "memcpyAsync loop" : (k > 0 ? "batches of " + std::to_string(k) : "first " + std::to_string(-k) + " then rest");
      printf("{\"what\": \"dma_issue\", \"dir\": \"%s\", \"cfg\": \"%s\", \"GBps\": %.2f, \"wall_us\": %.1f, \"issue_us\": %.1f}\n",
             dirs[dir], cfg.c_str(), kTotal / wall[wall.size() / 2] / 1e9, wall[wall.size() / 2] * 1e6, issue[issue.size() / 2] * 1e6);
      fflush(stdout);
    }
    // the same bytes as one contiguous copy, same clock
    std::vector<double> wall;
    for (int r = 0; r < 6; ++r) {
      CK(cudaDeviceSynchronize());
      const auto t0 = std::chrono::steady_clock::now();
      CK(cudaMemcpyAsync(dir == 0 ? c.dev : c.host, dir == 0 ? c.host : c.dev, kTotal, cudaMemcpyDefault, c.s[0]));
      CK(cudaStreamSynchronize(c.s[0]));
      if (r) wall.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(wall.begin(), wall.end());
    printf("{\"what\": \"dma_issue\", \"dir\": \"%s\", \"cfg\": \"contiguous\", \"GBps\": %.2f, \"wall_us\": %.1f}\n", dirs[dir],
           kTotal / wall[wall.size() / 2] / 1e9, wall[wall.size() / 2] * 1e6);
  }
  free_offsets(o);
}

static void hybrid(Ctx& c) {
  const char* dirs[2] = {"h2d", "d2h"};
  for (int64_t chunk : {int64_t{8} << 10, int64_t{64} << 10}) {
    Offsets o = make_offsets(chunk);
    for (int dir = 0; dir < 2; ++dir) {
      for (double frac : {1.0, 0.9, 0.8, 0.7, 0.6}) {
        for (int dstreams : {1, 2}) {
          const int64_t k = static_cast<int64_t>(frac * o.chunks);
          emit("hybrid", dirs[dir], chunk, "kernel " + std::to_string(frac) + " + dma x" + std::to_string(dstreams), kTotal,
               timed(
                   c,
                   [&] {
                     run_warp<8, 0>(c, o, dir, chunk, 16 << 10, 16, 256, c.s[0], 0, k);
                     const int64_t rest = o.chunks - k, per = (rest + dstreams - 1) / dstreams;
                     for (int i = 0; i < dstreams && rest > 0; ++i) {
                       const int64_t f = k + i * per, n = std::min(per, o.chunks - f);
                       if (n > 0) dma_batch(c, o, dir, chunk, f, n, c.s[1 + i]);
                     }
                   },
                   200'000'000, 3));
        }
      }
    }
    free_offsets(o);
  }
}

template <int S>
static void run_tma(Ctx& c, Offsets& o, int dir, int64_t chunk, int64_t piece, int ctas_per_sm) {
  char* dst = dir == 0 ? c.dev : c.host;
  const char* src = dir == 0 ? c.host : c.dev;
  const int64_t* doff = dir == 0 ? o.dev_d : o.host_d;
  const int64_t* soff = dir == 0 ? o.host_d : o.dev_d;
  const int smem = static_cast<int>(S * piece);
  CK(cudaFuncSetAttribute(tma_kernel<S>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  tma_kernel<S><<<c.sms * ctas_per_sm, 32, smem, c.s[0]>>>(dst, src, doff, soff, o.chunks, chunk, piece);
}

static void tma(Ctx& c, int dir) {
  const char* dirs[2] = {"h2d", "d2h"};
  for (int64_t chunk : {int64_t{4} << 10, int64_t{8} << 10, int64_t{16} << 10, int64_t{64} << 10, int64_t{256} << 10}) {
    Offsets o = make_offsets(chunk);
    const int64_t p16 = std::min<int64_t>(chunk, 16 << 10), p8 = std::min<int64_t>(chunk, 8 << 10);
    auto go = [&](std::string name, auto fn) { emit("tma", dirs[dir], chunk, name, kTotal, timed(c, fn)); };
    go("S4 16K 2cta", [&] { run_tma<4>(c, o, dir, chunk, p16, 2); });
    go("S4 16K 3cta", [&] { run_tma<4>(c, o, dir, chunk, p16, 3); });
    go("S8 8K 3cta", [&] { run_tma<8>(c, o, dir, chunk, p8, 3); });
    go("S4 8K 6cta", [&] { run_tma<4>(c, o, dir, chunk, p8, 6); });
    go("S2 16K 6cta", [&] { run_tma<2>(c, o, dir, chunk, p16, 6); });
    free_offsets(o);
  }
}

static void check(Ctx& c) {
  // correctness of the kernels used above on a scattered 8 KiB pattern (both directions, round trip)
  const int64_t chunk = 8 << 10;
  Offsets o = make_offsets(chunk);
  for (size_t i = 0; i < kTotal; i += 4096) c.host[i] = static_cast<char>(i * 2654435761u >> 13);
  run_warp<8, 1>(c, o, 0, chunk, 16 << 10, 16, 256, c.s[0], 0, o.chunks);
  CK(cudaStreamSynchronize(c.s[0]));
  std::vector<char> keep(c.host, c.host + kTotal);
  memset(c.host, 0, kTotal);
  run_warp<8, 0>(c, o, 1, chunk, 16 << 10, 16, 256, c.s[0], 0, o.chunks);
  CK(cudaStreamSynchronize(c.s[0]));
  printf("{\"what\": \"check\", \"warp_roundtrip_ok\": %s}\n", memcmp(keep.data(), c.host, kTotal) == 0 ? "true" : "false");
  free_offsets(o);
}

static void check_tma(Ctx& c) {
  const int64_t chunk = 8 << 10;
  Offsets o = make_offsets(chunk);
  for (size_t i = 0; i < kTotal; i += 4096) c.host[i] = static_cast<char>(i * 2654435761u >> 13);
  std::vector<char> keep(c.host, c.host + kTotal);
  CK(cudaMemset(c.dev, 0, kTotal));
  run_tma<4>(c, o, 0, chunk, chunk, 3);
  CK(cudaStreamSynchronize(c.s[0]));
  memset(c.host, 0, kTotal);
  run_tma<4>(c, o, 1, chunk, chunk, 3);
  CK(cudaStreamSynchronize(c.s[0]));
  printf("{\"what\": \"check\", \"tma_roundtrip_ok\": %s}\n", memcmp(keep.data(), c.host, kTotal) == 0 ? "true" : "false");
  free_offsets(o);
}

int main(int argc, char** argv) {
  const std::string which = argc > 1 ? argv[1] : "loads";
  Ctx c{};
  CK(cudaSetDevice(0));
  CK(cudaDeviceGetAttribute(&c.sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("{\"device\": \"%s\", \"sms\": %d, \"which\": \"%s\"}\n", prop.name, c.sms, which.c_str());
  CK(cudaHostAlloc(&c.host, kTotal, cudaHostAllocDefault));
  CK(cudaMalloc(&c.dev, kTotal));
  memset(c.host, 1, kTotal);
  for (auto& s : c.s) CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CK(cudaEventCreate(&c.e0));
  CK(cudaEventCreate(&c.e1));
  for (auto& e : c.ev) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  if (which == "loads") {
    check(c);
    loads(c);
  } else if (which == "dma") {
    dma(c);
  } else if (which == "grid") {
    grid(c);
  } else if (which == "dma_issue") {
    dma_issue(c);
  } else if (which == "hybrid") {
    hybrid(c);
  } else if (which == "tma") {
    check_tma(c);
    tma(c, 0);
    tma(c, 1);
  }
  return 0;
}
