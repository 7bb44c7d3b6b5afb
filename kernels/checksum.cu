// Per-token checksum kernel (torch-free): out[i, t] = sum of word * weight over the words of token t of block
// slots[i], modulo 2**32 (ChecksumGeometry in tkv_kernels.cuh; CPU reference: tiered_kv/opdefs.py). Each byte is read
// once: a token's words are split among `lanes` threads, each sums its share in a register and adds it to the
// token's output with one atomicAdd. Addition modulo 2**32 does not depend on the order of the terms, so the result
// is the reference's bit for bit whatever the grid, the interleaving of the atomics or the lane count.
#include "tkv_kernels.cuh"

namespace tiered_kv {
namespace {

constexpr int kChecksumThreads = 256;
// Loads a lane issues before it sums them (16-byte units: 128 bytes per lane, 32 KiB per CTA).
constexpr int kChecksumUnroll = 8;
// A token's bytes per lane: 16 loads of 16 bytes. One atomicAdd per lane, so a 64 MiB checksum makes 256 Ki atomics
// spread over its tokens' outputs; fewer bytes per lane would make more, more bytes fewer lanes to hide latency.
constexpr int64_t kChecksumBytesPerLane = 256;
constexpr int64_t kWarpLanes = 32;

// The weight of word f of a token (f over (layer, kv, head, word)): an odd Weyl sequence modulo 2**32.
__host__ __device__ __forceinline__ uint32_t checksum_weight(uint32_t f) { return ((f + 1u) * 0x9E3779B9u) | 1u; }

// What a lane loads at a time and how it adds to the sum: 16 bytes as four 32-bit words, or one word of the row's
// word size (int16 sign-extended and uint8 zero-extended to 32 bits, as the reference widens them to int32).
template <int UnitBytes>
struct ChecksumUnit;

template <>
struct ChecksumUnit<16> {
  using Raw = uint4;
  static constexpr uint32_t kWords = 4;
  __host__ __device__ __forceinline__ static uint32_t sum(const Raw& v, uint32_t f) {
    return v.x * checksum_weight(f) + v.y * checksum_weight(f + 1u) + v.z * checksum_weight(f + 2u) +
           v.w * checksum_weight(f + 3u);
  }
};

template <>
struct ChecksumUnit<4> {
  using Raw = uint32_t;
  static constexpr uint32_t kWords = 1;
  __host__ __device__ __forceinline__ static uint32_t sum(Raw v, uint32_t f) { return v * checksum_weight(f); }
};

template <>
struct ChecksumUnit<2> {
  using Raw = int16_t;
  static constexpr uint32_t kWords = 1;
  __host__ __device__ __forceinline__ static uint32_t sum(Raw v, uint32_t f) {
    return static_cast<uint32_t>(static_cast<int32_t>(v)) * checksum_weight(f);
  }
};

template <>
struct ChecksumUnit<1> {
  using Raw = uint8_t;
  static constexpr uint32_t kWords = 1;
  __host__ __device__ __forceinline__ static uint32_t sum(Raw v, uint32_t f) {
    return static_cast<uint32_t>(v) * checksum_weight(f);
  }
};

// Slot indices in a device-readable array (the other kind: ChecksumInlineSlots, in the kernel's parameters).
struct ChecksumSlotArray {
  const int64_t* __restrict__ v;
};

// The lanes of a launch. 16-byte units when every row start is 16-byte aligned (base, block stride and row size
// multiples of 16: 32-bit words, which 16 divides); else one word per unit. About kChecksumBytesPerLane bytes of a
// token per lane: a long token gets many lanes, a short one a few (at least one).
ChecksumWork plan_checksums(const ChecksumGeometry& g, bool base_aligned16) {
  ChecksumWork w{};
  w.word_bytes = g.row_bytes % 4 == 0 ? 4 : (g.row_bytes % 2 == 0 ? 2 : 1);
  const bool vec16 = w.word_bytes == 4 && base_aligned16 && ((g.row_bytes | g.block_stride) & 15) == 0;
  w.unit_bytes = vec16 ? 16 : w.word_bytes;
  w.per_row = g.row_bytes / w.unit_bytes;
  w.units = g.rows * w.per_row;
  const int64_t per_lane = kChecksumBytesPerLane / w.unit_bytes;
  w.lanes = w.units > 0 ? (w.units + per_lane - 1) / per_lane : 0;
  // a token of at least a warp's lanes gets a whole number of warps (the kernel then adds per warp, not per lane);
  // the lanes past its units sum nothing
  if (w.lanes > kWarpLanes) w.lanes = (w.lanes + kWarpLanes - 1) / kWarpLanes * kWarpLanes;
  w.items = g.slots * g.tokens * w.lanes;
  return w;
}

// The launch's 32-bit index arithmetic holds: lane ids, and unit indices up to units + kChecksumUnroll * lanes.
bool checksum_fits_32bit(const ChecksumWork& w) {
  return w.items < (int64_t{1} << 31) && w.units * (kChecksumUnroll + 1) < (int64_t{1} << 32);
}

// One thread per (slot, token, lane). The lane walks its token's units l, l + lanes, ...: unit e is unit e % per_row
// of row e / per_row, its words have the flat indices e * kWords + j. The row and the unit within it are stepped
// (no division per unit); kChecksumUnroll loads are issued before they are summed. Slots: ChecksumSlotArray (a
// device-readable array) or ChecksumInlineSlots (the kernel's own parameters, read in place).
template <int UnitBytes, typename Slots>
__global__ void token_checksums_kernel(uint32_t* __restrict__ out, const char* __restrict__ pool, ChecksumGeometry g,
                                       ChecksumWork w, const __grid_constant__ Slots slots) {
  using Unit = ChecksumUnit<UnitBytes>;
  using Raw = typename Unit::Raw;
  const uint32_t item = blockIdx.x * static_cast<uint32_t>(kChecksumThreads) + threadIdx.x;
  if (item >= static_cast<uint64_t>(w.items)) return;
  const uint32_t lanes = static_cast<uint32_t>(w.lanes), tokens = static_cast<uint32_t>(g.tokens);
  const uint32_t token = item / lanes;  // slot index * tokens + t: the output's element
  const uint32_t lane = item - token * lanes;
  const uint32_t i = token / tokens, t = token - i * tokens;
  const char* base = pool + slots.v[i] * g.block_stride + static_cast<int64_t>(t) * g.row_bytes;
  const int64_t pitch = g.tokens * g.row_bytes;  // from a row of the token to its next
  const uint32_t units = static_cast<uint32_t>(w.units), per_row = static_cast<uint32_t>(w.per_row);
  // where unit `lane` is, and how far the next of this lane's units (lanes on) lies from a unit
  uint32_t u = lane % per_row;
  int64_t off = static_cast<int64_t>(lane / per_row) * pitch + static_cast<int64_t>(u) * UnitBytes;
  const uint32_t du = lanes % per_row;
  const int64_t step = static_cast<int64_t>(lanes / per_row) * pitch + static_cast<int64_t>(du) * UnitBytes;
  const int64_t wrap = pitch - static_cast<int64_t>(per_row) * UnitBytes;  // one row on, back to its first unit
  auto next = [&] {  // to this lane's next unit
    off += step;
    u += du;
    if (u >= per_row) {
      u -= per_row;
      off += wrap;
    }
  };
  uint32_t acc = 0;
  uint32_t e = lane;
  // whole batches: kChecksumUnroll unconditional loads, then their sums (with a predicated load per unit the compiler
  // sums each load before issuing the next: one load in flight)
  for (; e + (kChecksumUnroll - 1) * lanes < units; e += kChecksumUnroll * lanes) {
    Raw v[kChecksumUnroll];
#pragma unroll
    for (int k = 0; k < kChecksumUnroll; ++k) {
      v[k] = *reinterpret_cast<const Raw*>(base + off);
      next();
    }
#pragma unroll
    for (int k = 0; k < kChecksumUnroll; ++k) acc += Unit::sum(v[k], (e + k * lanes) * Unit::kWords);
  }
  for (; e < units; e += lanes) {  // the last units, fewer than a batch
    acc += Unit::sum(*reinterpret_cast<const Raw*>(base + off), e * Unit::kWords);
    next();
  }
#ifndef TKV_HOST_EMULATION
  if (lanes % kWarpLanes == 0) {
    // the warp's lanes are all of this token (whole warps per token; a CTA is whole warps, and a warp is in range or
    // out of it whole): their sum, then one atomicAdd per warp instead of one per lane
#pragma unroll
    for (int d = kWarpLanes / 2; d > 0; d >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, d);
    if ((threadIdx.x & (kWarpLanes - 1)) == 0) atomicAdd(out + token, acc);
    return;
  }
#endif
  atomicAdd(out + token, acc);  // the emulation runs lanes one by one: each adds its own share, as above summed
}

}  // namespace

#ifndef TKV_HOST_EMULATION  // tests/kernel_emulation.cpp runs the kernel above on the CPU, lane by lane
namespace {

template <typename Slots>
cudaError_t launch_checksums_with(uint32_t* out, const void* pool, const ChecksumGeometry& g, const Slots& slots,
                                  cudaStream_t stream) {
  const int64_t outputs = g.slots * g.tokens;
  if (outputs == 0) return cudaSuccess;
  const ChecksumWork w = plan_checksums(g, (reinterpret_cast<uintptr_t>(pool) & 15) == 0);
  if (((reinterpret_cast<uintptr_t>(pool) | static_cast<uintptr_t>(g.block_stride)) % w.word_bytes) != 0 ||
      !checksum_fits_32bit(w)) {
    return cudaErrorInvalidValue;
  }
  const cudaError_t zeroed = cudaMemsetAsync(out, 0, static_cast<size_t>(outputs) * sizeof(uint32_t), stream);
  if (zeroed != cudaSuccess || w.items == 0) return zeroed;  // no bytes per token: every sum is 0
  const unsigned grid = static_cast<unsigned>((w.items + kChecksumThreads - 1) / kChecksumThreads);
  const char* p = static_cast<const char*>(pool);
  switch (w.unit_bytes) {
    case 16:
      token_checksums_kernel<16, Slots><<<grid, kChecksumThreads, 0, stream>>>(out, p, g, w, slots);
      break;
    case 4:
      token_checksums_kernel<4, Slots><<<grid, kChecksumThreads, 0, stream>>>(out, p, g, w, slots);
      break;
    case 2:
      token_checksums_kernel<2, Slots><<<grid, kChecksumThreads, 0, stream>>>(out, p, g, w, slots);
      break;
    default:
      token_checksums_kernel<1, Slots><<<grid, kChecksumThreads, 0, stream>>>(out, p, g, w, slots);
      break;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_token_checksums(uint32_t* out, const void* pool, const ChecksumGeometry& g, const int64_t* slots,
                                   cudaStream_t stream) {
  return launch_checksums_with(out, pool, g, ChecksumSlotArray{slots}, stream);
}

cudaError_t launch_token_checksums_inline(uint32_t* out, const void* pool, const ChecksumGeometry& g,
                                          const ChecksumInlineSlots& slots, cudaStream_t stream) {
  if (g.slots > kChecksumInlineSlots) return cudaErrorInvalidValue;
  return launch_checksums_with(out, pool, g, slots, stream);
}

#endif  // TKV_HOST_EMULATION

}  // namespace tiered_kv
