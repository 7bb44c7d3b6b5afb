// tiered_kv CUDA kernels: torch-free launchers (raw pointers + a stream), shared by the torch bindings.
//
// Every pointer may be device memory or pinned host memory addressed through unified addressing (the
// binding passes the device view of a host pointer from cudaHostGetDevicePointer). Launchers return the
// launch error; they never synchronize.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace tiered_kv {

// dst[p, s, k, j] = src[p, idx[s], k, j] == sentinel ? sentinel
//                 : scale[p] * src[p, idx[s], k, j] + (k == 1 ? v_offset[p] : 0),   for j < max_blocks.
// scale / v_offset may be null (1 / 0). idx is int32 or int64 (idx_is_64).
cudaError_t launch_gather_block_offsets(int32_t* dst, const int32_t* src, const void* idx, bool idx_is_64,
                                        const int32_t* scale, const int32_t* v_offset, int64_t pools, int64_t seqs,
                                        int64_t kv, int64_t dst_cols, int64_t src_rows, int64_t src_cols,
                                        int64_t max_blocks, int32_t sentinel, cudaStream_t stream);

// Geometry of a structured block copy (see tiered_kv/ops.py copy_blocks). A side has `tensors` base
// pointers; group g of a block lives in tensor g / (groups / tensors) at byte offset
// (g % (groups / tensors)) * group_bytes + block * block_stride. Each group is `rows` rows `row_pitch`
// bytes apart, of which the first `width` bytes are copied.
struct BlockCopyGeometry {
  int64_t num_pairs;
  int64_t groups;
  int64_t rows;
  int64_t row_pitch;
  int64_t width;
  int64_t group_bytes;
  int64_t src_tensors, dst_tensors;
  int64_t src_block_stride, dst_block_stride;
  bool via_host;  // a side is pinned host memory: the copy is bound by PCIe and runs on a small grid
};

// How a launch splits a BlockCopyGeometry into warp work items (plan_copy_work in copy_blocks.cu).
struct CopyWork {
  int64_t pieces;       // pieces of at most kSegmentBytes per row
  int64_t batch;        // rows per item (> 1 only when a row is one piece)
  int64_t row_batches;  // ceil(rows / batch)
  int64_t items;        // num_pairs * groups * row_batches * pieces
  bool vec16;           // every row start and piece 16-byte aligned on both sides: the unrolled 16-byte path
};

// bases: src_tensors source base pointers then dst_tensors destination base pointers (device-readable).
// src_blocks / dst_blocks: num_pairs block indices each (device-readable int64). bases_aligned16: every
// base pointer is a multiple of 16 (the caller knows them on the host; the kernel reads them on the device).
cudaError_t launch_copy_blocks(const BlockCopyGeometry& g, const int64_t* bases, const int64_t* src_blocks,
                               const int64_t* dst_blocks, bool bases_aligned16, cudaStream_t stream);

// Bases and block indices passed by value in the kernel's parameters (the small-call path: no allocation,
// no H2D copy): v[0, src_tensors + dst_tensors) are the bases, v[src_index + p] / v[dst_index + p] the
// block indices of pair p. Two sizes: 96 slots keep the parameters under 1 KiB (every launch of a few
// blocks); kInlineSlotsLarge (640 slots, 5 KiB) holds the bases and indices of every engine small call (up to
// 256 pairs) where the runtime takes parameters above 4 KiB (CUDA 12.1 and later: 32,764 bytes on Volta and
// newer), so a call of 48..256 blocks needs no pinned staging buffer and no metadata copy either.
template <int Slots>
struct InlineMetaN {
  int64_t v[Slots];
  int64_t src_index;
  int64_t dst_index;
};
constexpr int kInlineSlots = 96;
using InlineMeta = InlineMetaN<kInlineSlots>;
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010
constexpr int kInlineSlotsLarge = 640;
#else
constexpr int kInlineSlotsLarge = 0;  // parameters are limited to 4 KiB: larger calls stage their metadata
#endif
using InlineMetaLarge = InlineMetaN<(kInlineSlotsLarge > 0 ? kInlineSlotsLarge : 1)>;

// Bases and block indices as runs, by value in the kernel's parameters: pairs p in [first, next run's first) copy
// block src + (p - first) to block dst + (p - first). A copy of many blocks in a few runs consecutive on both sides
// (an in-order load or store) passes under 1 KiB of parameters instead of 16 bytes per pair: the launch of a 5 KiB
// parameter block costs the host several microseconds more, and a staged one a pinned H2D copy ahead of the kernel.
// v[0, run_index) are the bases; run r is v[run_index + 3r + {0, 1, 2}] = (first pair, src block, dst block), the
// runs in pair order, the first at pair 0.
template <int Slots>
struct RunMetaN {
  int64_t v[Slots];
  int64_t run_index;
  int64_t runs;
};
using RunMeta = RunMetaN<kInlineSlots>;

// Fills `meta` with the bases and the runs of pairs (sb[i], db[i]), i < pairs, when they fit in its slots and take
// fewer slots than the pairs themselves would (3 per run, 2 per pair); false otherwise (`meta` is then unspecified).
template <int Slots>
inline bool fill_runs(RunMetaN<Slots>& meta, const int64_t* bases, size_t nb, const int64_t* sb, const int64_t* db,
                      size_t pairs) {
  if (pairs == 0 || nb + 3 > static_cast<size_t>(Slots)) return false;
  for (size_t i = 0; i < nb; ++i) meta.v[i] = bases[i];
  size_t slot = nb;
  for (size_t p = 0; p < pairs; ++p) {
    if (p > 0 && sb[p] == sb[p - 1] + 1 && db[p] == db[p - 1] + 1) continue;  // the run goes on
    if (slot + 3 > static_cast<size_t>(Slots)) return false;
    meta.v[slot] = static_cast<int64_t>(p);
    meta.v[slot + 1] = sb[p];
    meta.v[slot + 2] = db[p];
    slot += 3;
  }
  meta.run_index = static_cast<int64_t>(nb);
  meta.runs = static_cast<int64_t>((slot - nb) / 3);
  return 3 * meta.runs < 2 * static_cast<int64_t>(pairs);
}

cudaError_t launch_copy_blocks_inline(const BlockCopyGeometry& g, const InlineMeta& meta, bool bases_aligned16,
                                      cudaStream_t stream);
cudaError_t launch_copy_blocks_inline(const BlockCopyGeometry& g, const InlineMetaLarge& meta, bool bases_aligned16,
                                      cudaStream_t stream);
cudaError_t launch_copy_blocks_inline(const BlockCopyGeometry& g, const RunMeta& meta, bool bases_aligned16,
                                      cudaStream_t stream);

// A copy of whole blocks between pools whose blocks are lists of chunks (engine layouts: one chunk per
// (layer, K/V) or per layer, anywhere in a buffer). table: [chunks, 7] int64 rows, device-readable:
// (src tensor, src offset of block 0, src block stride, dst tensor, dst offset of block 0, dst block stride,
// bytes); block b's chunk c is at base[tensor] + offset + b * stride on each side. The table is fixed for a
// pair of pools (made once, kept on the device); a call passes only the tensors' bases and the block indices
// (bases: src_tensors source bases then the destination bases, as for copy_blocks). vec16: every base,
// offset, stride and size is a multiple of 16 (checked on the host).
struct ChunkCopyGeometry {
  int64_t num_pairs;
  int64_t chunks;
  int64_t pieces;  // pieces of at most kSegmentBytes of the largest chunk
  int64_t src_tensors;
  bool vec16;
  bool via_host;  // a side is pinned host memory: the small grid of PCIe copies
};

cudaError_t launch_copy_chunk_blocks(const ChunkCopyGeometry& g, const int64_t* table, const int64_t* bases,
                                     const int64_t* src_blocks, const int64_t* dst_blocks, cudaStream_t stream);
cudaError_t launch_copy_chunk_blocks_inline(const ChunkCopyGeometry& g, const int64_t* table, const InlineMeta& meta,
                                            cudaStream_t stream);
cudaError_t launch_copy_chunk_blocks_inline(const ChunkCopyGeometry& g, const int64_t* table,
                                            const InlineMetaLarge& meta, cudaStream_t stream);
cudaError_t launch_copy_chunk_blocks_inline(const ChunkCopyGeometry& g, const int64_t* table, const RunMeta& meta,
                                            cudaStream_t stream);

// segments: [count, 3] int64 rows (src address, dst address, nbytes), device-readable; any alignment.
// via_host: a segment touches pinned host memory (the copy is bound by PCIe and runs on a small grid).
cudaError_t launch_copy_segments(const int64_t* segments, int64_t count, bool via_host, cudaStream_t stream);

// Largest piece one warp copies; longer chunks are split so that big chunks use many warps.
constexpr int64_t kSegmentBytes = 16 * 1024;

// Per-token checksums of blocks of a block-major pool [blocks, L, kv, H, T, D] (see tiered_kv/opdefs.py,
// token_checksums_ref): out[i, t] = sum over the words of token t of block slots[i] of word * weight, modulo 2**32.
// A block is dense and starts at base + slot * block_stride bytes; its row (r, t), r over (layer, kv, head), lies at
// (r * tokens + t) * row_bytes. A row is read as words of 4 bytes when row_bytes % 4 == 0, else of 2 bytes
// (sign-extended) when row_bytes % 2 == 0, else of 1 byte (zero-extended); word w of row r has the flat index
// f = r * (row_bytes / word bytes) + w and the weight ((f + 1) * 0x9E3779B9) | 1.
struct ChecksumGeometry {
  int64_t slots;
  int64_t rows;  // L * kv * H
  int64_t tokens;
  int64_t row_bytes;
  int64_t block_stride;
};

// How a launch splits a ChecksumGeometry into lanes (plan_checksums in checksum.cu): a token's units (16-byte
// vectors, or words) are shared by `lanes` lanes, lane l taking units l, l + lanes, ...; one thread per lane.
struct ChecksumWork {
  int word_bytes;     // 4, 2 or 1
  int unit_bytes;     // 16 (vec16) or word_bytes
  int64_t per_row;    // units per row
  int64_t units;      // units per token: rows * per_row
  int64_t lanes;      // lanes per token
  int64_t items;      // slots * tokens * lanes
};

// Slot indices by value in the kernel's parameters (a launch of few blocks: no allocation, no H2D copy).
constexpr int kChecksumInlineSlots = 128;
struct ChecksumInlineSlots {
  int64_t v[kChecksumInlineSlots];
};

// out: slots * tokens uint32, zeroed here (cudaMemsetAsync) before the sums are added into it. pool: the block
// base (device-readable), aligned to the word size as block_stride is (else cudaErrorInvalidValue). slots:
// g.slots device-readable int64 block indices, each in range.
cudaError_t launch_token_checksums(uint32_t* out, const void* pool, const ChecksumGeometry& g, const int64_t* slots,
                                   cudaStream_t stream);
// The same, with g.slots <= kChecksumInlineSlots indices in the kernel's parameters.
cudaError_t launch_token_checksums_inline(uint32_t* out, const void* pool, const ChecksumGeometry& g,
                                          const ChecksumInlineSlots& slots, cudaStream_t stream);

}  // namespace tiered_kv
