"""Partial copies between pinned host memory and the GPU as 2-D DMA calls, one per run of consecutive blocks.

Over PCIe the copy engine moves partial-block rows (tokens ``[0, n)`` of every (layer, kv, head)) of 512 B and
more at the rate of one contiguous copy when a run of blocks is one ``cudaMemcpy2DAsync``, while the copy kernel's
accesses to pinned memory stop at ~0.93 of it; each call costs microseconds of its own. The copier takes DMA for
such a copy when its rows are at least the measured width and its calls move at least what the row calibration's
calls moved at its threshold (:meth:`tiered_kv.copyops.Copier.plan`). CPU tests: the rule and the calibration's
rule. GPU tests: the choice on real pools, the engine's bytes by that path (native and op paths), the calibration.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random

import numpy as np
import pytest
import torch

from tiered_kv import KVLayout, Tier, TransferEngine, _ext, copyops
from tiered_kv.config import EngineConfig
from tiered_kv.copy import calibration
from tiered_kv.copy.copier import _PairInfo
from tiered_kv.copyops import MIN_RUN_BLOCKS, NEVER, Copier
from tiered_kv.device import resolve_device
from tiered_kv.layer_major import LayerMajorPool
from tiered_kv.pools import BlockPool
from tiered_kv.testing import fill_random

KiB = 1 << 10
# 2 MiB blocks: 512 rows of 16 tokens x 256 B; 4 of 16 tokens = rows of 1 KiB, 512 KiB per block
BIG = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=16, dtype=torch.bfloat16)


def _cpu_copier_with(strided: int, row: int) -> tuple[Copier, _PairInfo]:
    """A copier deciding as a CUDA one would (kernels loaded), and a host->GPU partial pair of 4 of 16 tokens."""
    copier = Copier(resolve_device("cpu"), EngineConfig())
    host = BlockPool(Tier.HOST, BIG, torch.empty(2, *BIG.block_shape, dtype=BIG.dtype))
    gpu = BlockPool(Tier.GPU, BIG, torch.empty(2, *BIG.block_shape, dtype=BIG.dtype))
    info = dataclasses.replace(copier._pair(host, gpu, 4), on_cuda=True, strided_runs=True)
    copier._kernels = True
    copier.dma_min_chunk_bytes = 64 * KiB
    copier.dma_min_row_bytes = row
    copier.dma_min_strided_row_bytes = strided
    return copier, info


def test_partial_host_gpu_copies_in_long_runs_take_2d_dma_by_call_size() -> None:
    copier, info = _cpu_copier_with(strided=512, row=32 * KiB)
    assert info.width_bytes == 1 * KiB and info.block_bytes == 512 * KiB and info.groups == 1
    need = 2 * MIN_RUN_BLOCKS * 32 * KiB  # 2 MiB per call: what the row calibration's calls moved at 32 KiB rows
    assert copier._choose(info, 128, 1).path == "dma"  # one call of 64 MiB
    assert copier._choose(info, 128, 1).piece_bytes == 64 << 20
    assert copier._choose(info, 4, 1).path == "dma"  # 2 MiB per call: at the threshold
    assert copier._choose(info, 4, 1).piece_bytes == need
    assert copier._choose(info, 3, 1).path == "kernel"  # 1.5 MiB per call
    assert copier._choose(info, 128, 64).path == "kernel"  # runs of 2 blocks: 1 MiB calls
    assert copier._choose(info, 128, 128).path == "kernel"  # scattered: a call per block
    # rows narrower than the measured width: the kernel, however long the runs
    copier.dma_min_strided_row_bytes = 2 * KiB
    assert copier._choose(info, 128, 1).path == "kernel"
    copier.dma_min_strided_row_bytes = NEVER
    assert copier._choose(info, 128, 1).path == "kernel"
    # rows that do not go on from block to block, or both sides on the GPU (strided_runs False): the kernel
    copier.dma_min_strided_row_bytes = 512
    assert copier._choose(dataclasses.replace(info, strided_runs=False), 128, 1).path == "kernel"
    # a forced path stays forced
    copier.config = EngineConfig(copy_path="kernel")
    assert copier._choose(info, 128, 1).path == "kernel"
    copier.close()


def test_the_strided_calibration_rule() -> None:
    """The smallest width from which DMA wins by 2 % at every larger width; NEVER when it wins at none."""
    widths = calibration._STRIDED_WIDTHS
    assert widths == (256, 512, 1024, 2048)
    assert calibration._strided_threshold_of([0.5] * 4) == 256
    assert calibration._strided_threshold_of([1.12, 0.93, 0.93, 0.94]) == 512  # the H100 / H200 probe's shape
    assert calibration._strided_threshold_of([0.9, 0.99, 0.93, 0.94]) == 1024  # a loss above a win decides
    assert calibration._strided_threshold_of([0.9, 0.9, 0.9, 0.981]) == NEVER
    assert calibration._strided_threshold_of([0.9, 0.9, math.nan, 0.9]) == 2048  # NaN is no win
    assert calibration._strided_threshold_of([1.1] * 4) == NEVER


# ----------------------------------------------------------------------------------------------------- GPU


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.gpu
def test_the_choice_on_real_pools() -> None:
    """Host<->GPU block-major pools: rows go on from block to block (DMA in runs); GPU<->GPU: the kernel; a
    layer-major GPU pool against a host pool: the host's rows of a layer stop at the block's end (the kernel)."""
    assert _ext.load(), f"the CUDA extension must build on the GPU machine: {_ext.status()['error']}"
    copier = Copier(resolve_device("cuda"), EngineConfig(dma_min_chunk_bytes=64 * KiB))
    copier.dma_min_row_bytes = 32 * KiB
    copier.dma_min_strided_row_bytes = 512
    shape = BIG.block_shape
    host = BlockPool(Tier.HOST, BIG, torch.empty(8, *shape, dtype=BIG.dtype, pin_memory=True))
    gpu = BlockPool(Tier.GPU, BIG, torch.empty(8, *shape, dtype=BIG.dtype, device="cuda"))
    gpu2 = BlockPool(Tier.GPU, BIG, torch.empty(8, *shape, dtype=BIG.dtype, device="cuda"))
    # a layer-major GPU pool against a block-major host pool: a group per layer, and on the host side the rows of a
    # group stop at the end of its layer (the next block's rows of that layer are a block further)
    lm = LayerMajorPool.allocate(BIG, 8, "cuda", split_kv=False)
    run = np.arange(8)
    assert copier.plan(host, run, gpu, run, 4).path == "dma"
    assert copier.plan(gpu, run, host, run, 4).path == "dma"
    assert copier.plan(gpu, run, gpu2, run, 4).path == "kernel"
    assert not copier._pair(host, lm, 4).strided_runs
    assert copier.plan(host, run, lm, run, 4).path == "kernel"
    assert not copier._pair(host, LayerMajorPool.allocate(BIG, 8, "cuda", split_kv=True), 4).strided_runs
    assert copier.plan(host, run[::2], gpu, run[::2], 4).path == "kernel"  # scattered: a call per block
    assert copier.plan(host, run, gpu, run, 1).path == "kernel"  # rows of 256 B: below the width
    # rows 2 KiB apart (head_dim 64): a pitch the calibration did not measure
    narrow = dataclasses.replace(BIG, head_dim=64)
    nhost = BlockPool(Tier.HOST, narrow, torch.empty(8, *narrow.block_shape, dtype=BIG.dtype, pin_memory=True))
    ngpu = BlockPool(Tier.GPU, narrow, torch.empty(8, *narrow.block_shape, dtype=BIG.dtype, device="cuda"))
    assert copier._pair(nhost, ngpu, 8).width_bytes == 1024 and not copier._pair(nhost, ngpu, 8).strided_runs
    assert copier.plan(nhost, run, ngpu, run, 8).path == "kernel"
    copier.close()


@pytest.mark.gpu
@pytest.mark.parametrize("native", [True, False])
def test_partial_copies_by_2d_dma_runs_land_exactly(native: bool) -> None:
    """Through the engine (the native path, and the op path with ``native_submit=False``), partial host<->GPU copies
    in runs go by DMA with one 2-D call per run; every token of every block lands, the rest is untouched, and
    scattered blocks and the GPU->GPU copies beside them are unchanged by the choice."""
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=128, tokens_per_block=16, dtype=torch.float16)

    async def main() -> None:
        cfg = EngineConfig(dma_min_chunk_bytes=64 * KiB, native_submit=native)
        async with TransferEngine(layout, gpu_blocks=96, host_blocks=96, device="cuda", config=cfg) as engine:
            assert engine.copier.native is native
            engine.copier.dma_min_row_bytes = 256  # calls of 16 KiB and more (a block moves 8-60 KiB)
            engine.copier.dma_min_strided_row_bytes = 256
            engine.copier.forget_plans()
            gpu, host = engine.pool(Tier.GPU), engine.pool(Tier.HOST)
            assert isinstance(gpu, BlockPool) and isinstance(host, BlockPool)
            rng = random.Random(5)
            for step in range(24):
                fill_random(gpu.tensor)
                fill_random(host.tensor)
                torch.cuda.synchronize()
                n = rng.choice([2, 4, 9, 15])
                src_t, dst_t = rng.choice([(Tier.HOST, Tier.GPU), (Tier.GPU, Tier.HOST), (Tier.GPU, Tier.GPU)])
                # runs of consecutive blocks on both sides, of random lengths, at random places, in random order
                starts_s, starts_d = rng.sample(range(0, 96, 12), 4), rng.sample(range(0, 96, 12), 4)
                s: list[int] = []
                d: list[int] = []
                for a, b in zip(starts_s, starts_d, strict=True):
                    k = rng.randint(1, 12)
                    s += range(a, a + k)
                    d += range(b, b + k)
                if src_t is dst_t:  # GPU->GPU: disjoint blocks
                    d = [x for x in range(96) if x not in set(s)][: len(s)]
                src = (gpu if src_t is Tier.GPU else host).tensor.cpu()
                expected = (gpu if dst_t is Tier.GPU else host).tensor.cpu()
                for a, b in zip(s, d, strict=True):
                    expected[b, :, :, :, :n] = src[a, :, :, :, :n]
                plan = engine.copier.plan(engine.pool(src_t), np.array(s), engine.pool(dst_t), np.array(d), n)
                before = engine.copier.statistics().calls.get("dma", 0)
                await engine.copy(src_t, s, dst_t, d, num_tokens=n)
                got = (gpu if dst_t is Tier.GPU else host).tensor.cpu()
                assert _bits(got, expected), (step, src_t, dst_t, n, s, d)
                took_dma = engine.copier.statistics().calls.get("dma", 0) > before
                assert took_dma == (plan.path == "dma"), (step, plan)
                assert plan.path == ("kernel" if src_t is dst_t else plan.path)
            # the long runs of the host<->GPU steps took DMA at least once
            assert engine.copier.statistics().calls.get("dma", 0) > 0

    asyncio.run(main())


@pytest.mark.gpu
def test_the_strided_calibration_is_measured_once_and_follows_its_rule() -> None:
    assert _ext.load(), f"the CUDA extension must build on the GPU machine: {_ext.status()['error']}"
    copier = Copier(resolve_device("cuda"), EngineConfig())
    found = copier.dma_min_strided_row_bytes
    assert found in (*calibration._STRIDED_WIDTHS, NEVER), found
    assert copyops.calibrated_dma_strided_threshold(torch.device("cuda")) == found  # cached
    ratios = copyops.measured_dma_ratios(torch.device("cuda"))
    assert ratios is not None and "strided" in ratios
    medians = list(ratios["strided"].values())
    assert all(math.isfinite(r) and r > 0 for r in medians), medians
    assert calibration._strided_threshold_of(medians) == found
    # configured thresholds skip it: the configured piece size stands for rows too
    assert Copier(resolve_device("cuda"), EngineConfig(dma_min_chunk_bytes=123)).dma_min_strided_row_bytes == 123
    copier.close()
