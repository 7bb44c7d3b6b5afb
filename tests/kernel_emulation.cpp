// Runs the CUDA kernels of kernels/*.cu on the CPU, one lane at a time, so CI checks their indexing and
// alignment logic without a GPU. Valid because no kernel uses shared memory, barriers or warp intrinsics:
// every lane reads and writes its own bytes, so running lanes one after another gives the GPU's result.
// Built and driven by tests/test_kernel_emulation.py (ctypes).
#include <cuda_runtime.h>

#include <type_traits>
#include <vector>

static uint3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;

// Lanes run one after another, so an atomic add is a plain one.
static unsigned atomicAdd(unsigned* address, unsigned value) {
  const unsigned old = *address;
  *address = old + value;
  return old;
}

#define TKV_HOST_EMULATION 1
#include "../kernels/checksum.cu"
#include "../kernels/copy_blocks.cu"
#include "../kernels/gather_block_offsets.cu"

namespace {

template <typename F>
void run_grid(unsigned grid, unsigned threads, F body) {
  gridDim = dim3(grid);
  blockDim = dim3(threads);
  for (unsigned b = 0; b < grid; ++b) {
    blockIdx.x = b;
    for (unsigned t = 0; t < threads; ++t) {
      threadIdx.x = t;
      body();
    }
  }
}

unsigned capped(unsigned grid, int max_grid) { return max_grid > 0 && grid > unsigned(max_grid) ? unsigned(max_grid) : grid; }

}  // namespace

extern "C" {

// geometry: num_pairs, groups, rows, row_pitch, width, group_bytes, src_tensors, dst_tensors,
// src_block_stride, dst_block_stride (the BlockCopyGeometry fields, in order)
// use_inline: 1 passes bases and indices as an InlineMeta (the kernel's parameters), 2 as an InlineMetaLarge, 3 as
// the runs of a RunMeta; returns without copying when they do not fit (the caller checks with emu_inline_slots /
// _large, or emu_runs_fit)
void emu_copy_blocks(const int64_t* geometry, const int64_t* bases, const int64_t* src_blocks, const int64_t* dst_blocks,
                     int max_grid, int index64, int force_unaligned, int use_inline) {
  tiered_kv::BlockCopyGeometry g{geometry[0], geometry[1], geometry[2], geometry[3], geometry[4],
                                 geometry[5], geometry[6], geometry[7], geometry[8], geometry[9]};
  if (g.num_pairs == 0 || g.width == 0) return;
  bool aligned16 = true;  // what kernels/copy_blocks.cpp computes from the host view of the bases
  for (int64_t i = 0; i < g.src_tensors + g.dst_tensors; ++i) aligned16 = aligned16 && (bases[i] & 15) == 0;
  // the launcher's work items (item_bytes: this geometry is between GPU buffers)
  const tiered_kv::CopyWork w = tiered_kv::plan_copy_work(g, aligned16 && !force_unaligned, tiered_kv::item_bytes(g));
  const tiered_kv::PtrMeta ptrs{bases, src_blocks, dst_blocks};
  tiered_kv::InlineMeta inline_meta{};
  static tiered_kv::InlineMetaLarge large_meta;  // 5 KiB: static, as the launcher's is on its own stack frame
  const int64_t nb = g.src_tensors + g.dst_tensors;
  auto fill = [&](auto& meta, int64_t slots) {  // what kernels/copy_blocks.cpp does when they fit the parameters
    if (nb + 2 * g.num_pairs > slots) return false;
    for (int64_t i = 0; i < nb; ++i) meta.v[i] = bases[i];
    for (int64_t p = 0; p < g.num_pairs; ++p) {
      meta.v[nb + p] = src_blocks[p];
      meta.v[nb + g.num_pairs + p] = dst_blocks[p];
    }
    meta.src_index = nb;
    meta.dst_index = nb + g.num_pairs;
    return true;
  };
  static tiered_kv::RunMeta run_meta;
  if (use_inline == 1 && !fill(inline_meta, tiered_kv::kInlineSlots)) return;
  if (use_inline == 2 && !fill(large_meta, tiered_kv::kInlineSlotsLarge)) return;
  if (use_inline == 3 && !tiered_kv::fill_runs(run_meta, bases, size_t(nb), src_blocks, dst_blocks, size_t(g.num_pairs))) {
    return;
  }
  run_grid(capped(tiered_kv::grid_for(w.items), max_grid), tiered_kv::kThreads, [&] {
    if (use_inline == 3 && index64) {
      tiered_kv::copy_blocks_kernel<int64_t, tiered_kv::RunMeta>(g, run_meta, w);
    } else if (use_inline == 3) {
      tiered_kv::copy_blocks_kernel<uint32_t, tiered_kv::RunMeta>(g, run_meta, w);
    } else if (use_inline == 2 && index64) {
      tiered_kv::copy_blocks_kernel<int64_t, tiered_kv::InlineMetaLarge>(g, large_meta, w);
    } else if (use_inline == 2) {
      tiered_kv::copy_blocks_kernel<uint32_t, tiered_kv::InlineMetaLarge>(g, large_meta, w);
    } else if (use_inline && index64) {
      tiered_kv::copy_blocks_kernel<int64_t, tiered_kv::InlineMeta>(g, inline_meta, w);
    } else if (use_inline) {
      tiered_kv::copy_blocks_kernel<uint32_t, tiered_kv::InlineMeta>(g, inline_meta, w);
    } else if (index64) {
      tiered_kv::copy_blocks_kernel<int64_t, tiered_kv::PtrMeta>(g, ptrs, w);
    } else {
      tiered_kv::copy_blocks_kernel<uint32_t, tiered_kv::PtrMeta>(g, ptrs, w);
    }
  });
}

// 1 when the launcher would pass these pairs as runs (fill_runs), with `bases_count` bases; else 0
int emu_runs_fit(const int64_t* src_blocks, const int64_t* dst_blocks, int64_t pairs, int64_t bases_count) {
  static tiered_kv::RunMeta meta;
  const std::vector<int64_t> bases(size_t(bases_count > 0 ? bases_count : 0), 0);  // fill_runs copies them first
  return tiered_kv::fill_runs(meta, bases.data(), bases.size(), src_blocks, dst_blocks, size_t(pairs)) ? 1 : 0;
}

int emu_inline_slots() { return tiered_kv::kInlineSlots; }
int emu_inline_slots_large() { return tiered_kv::kInlineSlotsLarge; }

// table: [chunks, 7] rows (see ChunkCopyGeometry); bases: src_tensors source then destination bases.
// use_inline: 0 device-readable arrays (the staged path), 1 InlineMeta, 2 InlineMetaLarge, 3 RunMeta (returns
// without copying when they do not fit). vec16 as kernels/copy_chunks.cpp decides, unless force_unaligned.
void emu_copy_chunk_blocks(const int64_t* table, int64_t chunks, const int64_t* bases, int64_t src_tensors,
                           int64_t dst_tensors, const int64_t* src_blocks, const int64_t* dst_blocks, int64_t pairs,
                           int max_grid, int index64, int force_unaligned, int use_inline) {
  int64_t largest = 0;
  bool vec16 = !force_unaligned;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t* r = table + 7 * c;
    vec16 = vec16 && ((r[1] | r[2] | r[4] | r[5] | r[6]) & 15) == 0;
    if (r[6] > largest) largest = r[6];
  }
  const int64_t nb = src_tensors + dst_tensors;
  for (int64_t i = 0; i < nb; ++i) vec16 = vec16 && (bases[i] & 15) == 0;
  if (pairs == 0 || largest == 0) return;
  const tiered_kv::ChunkCopyGeometry g{pairs, chunks, (largest + tiered_kv::kSegmentBytes - 1) / tiered_kv::kSegmentBytes,
                                       src_tensors, vec16, false};
  const int64_t items = pairs * chunks * g.pieces;
  const tiered_kv::PtrMeta ptrs{bases, src_blocks, dst_blocks};
  tiered_kv::InlineMeta inline_meta{};
  static tiered_kv::InlineMetaLarge large_meta;
  auto fill = [&](auto& meta, int64_t slots) {
    if (nb + 2 * pairs > slots) return false;
    for (int64_t i = 0; i < nb; ++i) meta.v[i] = bases[i];
    for (int64_t p = 0; p < pairs; ++p) {
      meta.v[nb + p] = src_blocks[p];
      meta.v[nb + pairs + p] = dst_blocks[p];
    }
    meta.src_index = nb;
    meta.dst_index = nb + pairs;
    return true;
  };
  static tiered_kv::RunMeta run_meta;
  if (use_inline == 1 && !fill(inline_meta, tiered_kv::kInlineSlots)) return;
  if (use_inline == 2 && !fill(large_meta, tiered_kv::kInlineSlotsLarge)) return;
  if (use_inline == 3 && !tiered_kv::fill_runs(run_meta, bases, size_t(nb), src_blocks, dst_blocks, size_t(pairs))) return;
  run_grid(capped(tiered_kv::grid_for(items), max_grid), tiered_kv::kThreads, [&] {
    if (use_inline == 3) {
      tiered_kv::copy_chunk_blocks_kernel<uint32_t, tiered_kv::RunMeta>(g, run_meta, table, uint32_t(items));
    } else if (use_inline == 2) {
      tiered_kv::copy_chunk_blocks_kernel<uint32_t, tiered_kv::InlineMetaLarge>(g, large_meta, table, uint32_t(items));
    } else if (use_inline == 1) {
      tiered_kv::copy_chunk_blocks_kernel<uint32_t, tiered_kv::InlineMeta>(g, inline_meta, table, uint32_t(items));
    } else if (index64) {
      tiered_kv::copy_chunk_blocks_kernel<int64_t, tiered_kv::PtrMeta>(g, ptrs, table, items);
    } else {
      tiered_kv::copy_chunk_blocks_kernel<uint32_t, tiered_kv::PtrMeta>(g, ptrs, table, uint32_t(items));
    }
  });
}

void emu_copy_segments(const int64_t* segments, int64_t count, int max_grid) {
  if (count == 0) return;
  run_grid(capped(tiered_kv::grid_for(count), max_grid), tiered_kv::kThreads,
           [&] { tiered_kv::copy_segments_kernel(segments, count); });
}

void emu_gather(int32_t* dst, const int32_t* src, const void* idx, int idx_is_64, const int32_t* scale,
                const int32_t* v_offset, int64_t pools, int64_t seqs, int64_t kv, int64_t dst_cols, int64_t src_rows,
                int64_t src_cols, int64_t max_blocks, int32_t sentinel, int grid_x, int threads) {
  const bool vec4 = tiered_kv::gather_vec4(dst, src, dst_cols, src_cols, max_blocks);  // as the launcher decides
  for (unsigned p = 0; p < pools; ++p) {
    gridDim = dim3(grid_x, pools);
    blockDim = dim3(threads);
    blockIdx.y = p;
    for (int b = 0; b < grid_x; ++b) {
      blockIdx.x = b;
      for (int t = 0; t < threads; ++t) {
        threadIdx.x = t;
        if (idx_is_64) {
          tiered_kv::gather_block_offsets_kernel<int64_t>(dst, src, static_cast<const int64_t*>(idx), scale, v_offset, seqs,
                                                          kv, dst_cols, src_rows, src_cols, max_blocks, sentinel, vec4);
        } else {
          tiered_kv::gather_block_offsets_kernel<int32_t>(dst, src, static_cast<const int32_t*>(idx), scale, v_offset, seqs,
                                                          kv, dst_cols, src_rows, src_cols, max_blocks, sentinel, vec4);
        }
      }
    }
  }
}

// geometry: slots, rows, tokens, row_bytes, block_stride (the ChecksumGeometry fields, in order). out (slots x
// tokens) is zeroed first, as the launcher does. use_inline: the slots in the kernel's parameters (returns without
// summing when they do not fit); force_unaligned: plan as for a base that is not 16-byte aligned (one word per load).
void emu_token_checksums(uint32_t* out, const void* pool, const int64_t* geometry, const int64_t* slots, int use_inline,
                         int force_unaligned) {
  const tiered_kv::ChecksumGeometry g{geometry[0], geometry[1], geometry[2], geometry[3], geometry[4]};
  if (use_inline && g.slots > tiered_kv::kChecksumInlineSlots) return;
  for (int64_t i = 0; i < g.slots * g.tokens; ++i) out[i] = 0;
  const bool aligned16 = (reinterpret_cast<uintptr_t>(pool) & 15) == 0 && !force_unaligned;
  const tiered_kv::ChecksumWork w = tiered_kv::plan_checksums(g, aligned16);
  if (w.items == 0 || !tiered_kv::checksum_fits_32bit(w)) return;
  tiered_kv::ChecksumInlineSlots inline_slots{};
  if (use_inline) {
    for (int64_t i = 0; i < g.slots; ++i) inline_slots.v[i] = slots[i];
  }
  const tiered_kv::ChecksumSlotArray array{slots};
  const char* p = static_cast<const char*>(pool);
  const unsigned grid = unsigned((w.items + tiered_kv::kChecksumThreads - 1) / tiered_kv::kChecksumThreads);
  run_grid(grid, tiered_kv::kChecksumThreads, [&] {
    auto launch = [&](const auto& s) {
      using S = std::decay_t<decltype(s)>;
      switch (w.unit_bytes) {
        case 16: tiered_kv::token_checksums_kernel<16, S>(out, p, g, w, s); break;
        case 4: tiered_kv::token_checksums_kernel<4, S>(out, p, g, w, s); break;
        case 2: tiered_kv::token_checksums_kernel<2, S>(out, p, g, w, s); break;
        default: tiered_kv::token_checksums_kernel<1, S>(out, p, g, w, s); break;
      }
    };
    if (use_inline) {
      launch(inline_slots);
    } else {
      launch(array);
    }
  });
}

int emu_checksum_unit_bytes(const int64_t* geometry, int aligned16) {
  const tiered_kv::ChecksumGeometry g{geometry[0], geometry[1], geometry[2], geometry[3], geometry[4]};
  return tiered_kv::plan_checksums(g, aligned16 != 0).unit_bytes;
}

}  // extern "C"
