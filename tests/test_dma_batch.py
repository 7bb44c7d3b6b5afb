"""Scattered block DMA as one ``cudaMemcpyBatchAsync`` (CUDA >= 12.8) vs the per-block loop vs the reference.

``torch.ops.tiered_kv.dma_batch_mode`` (kernels/dma_batch.cpp) turns the batch call on and off, so the same
copies run both ways in one process; each result must equal the reference, element for element.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from tiered_kv import _ext, ops
from tiered_kv.testing import assert_blocks_equal, fill_random

pytestmark = pytest.mark.gpu

L, KV, H, T, D = 3, 2, 4, 16, 64  # a block of 3 layers x K/V x 4 heads x 16 tokens x 64


def _side(kind: str, n: int, where: str) -> list[torch.Tensor]:
    """A block-major (``block``) or layer-major (``layer``: one tensor per layer) pool of ``n`` blocks."""
    pin = where == "pinned"
    dev = "cuda" if where == "cuda" else "cpu"
    shapes: list[tuple[int, ...]] = [(n, L, KV, H, T, D)] if kind == "block" else [(n, KV, H, T, D)] * L
    return [fill_random(torch.empty(s, dtype=torch.float16, device=dev, pin_memory=pin)) for s in shapes]


def _logical(kind: str, side: list[torch.Tensor]) -> torch.Tensor:
    cpu = [t.cpu() for t in side]
    return cpu[0].clone() if kind == "block" else torch.stack(cpu, dim=1)


@pytest.fixture(scope="module")
def batch_mode() -> Iterator[Callable[[int], int]]:
    assert _ext.load(), f"the CUDA extension must build on a CUDA machine: {_ext.status()['error']}"
    previous = torch.ops.tiered_kv.dma_batch_mode(-1)
    yield torch.ops.tiered_kv.dma_batch_mode
    torch.ops.tiered_kv.dma_batch_mode(1 if previous else 0)


@pytest.mark.parametrize("stream", ["default", "side"])
@pytest.mark.parametrize(("src_at", "dst_at"), [("cuda", "pinned"), ("pinned", "cuda"), ("cuda", "cuda")])
@pytest.mark.parametrize("kind", ["block", "layer"])
@pytest.mark.parametrize("indices", ["scattered", "contiguous", "mixed"])
@pytest.mark.parametrize("num_tokens", [None, 5])
def test_batch_and_per_block_dma_match_the_reference(
    batch_mode: Callable[[int], int],
    stream: str,
    src_at: str,
    dst_at: str,
    kind: str,
    indices: str,
    num_tokens: int | None,
) -> None:
    """On the legacy default stream (which the batch call refuses) and on a side stream, batch on and off."""
    n = 24
    pairs = {
        "scattered": ([7, 2, 19, 11, 4, 15, 0, 22], [3, 9, 1, 17, 12, 6, 20, 14]),
        "contiguous": (list(range(4, 12)), list(range(10, 18))),
        "mixed": ([0, 1, 2, 9, 5, 6, 20], [13, 14, 15, 2, 7, 8, 22]),
    }[indices]
    s, d = (torch.tensor(x, dtype=torch.int64) for x in pairs)
    src = _side(kind, n, src_at)
    src_log = _logical(kind, src)
    base = _side(kind, n, dst_at)  # both modes start from the same destination bytes
    t = T if num_tokens is None else num_tokens
    expected = _logical(kind, base)
    for a, b in zip(s.tolist(), d.tolist(), strict=True):
        expected[b, :, :, :, :t] = src_log[a, :, :, :, :t]
    side = torch.cuda.Stream() if stream == "side" else torch.cuda.default_stream()
    for mode in (1, 0):
        available = bool(batch_mode(mode))
        assert available == bool(mode) or mode == 1  # off means off; on may be refused by an old runtime
        dst = [x.clone().pin_memory() if dst_at == "pinned" else x.clone() for x in base]
        torch.cuda.synchronize()
        before = batch_mode(2)
        with torch.cuda.stream(side):
            ops.copy_blocks(dst, src, s, d, num_tokens=num_tokens, method=ops.METHOD_DMA)
        torch.cuda.synchronize()
        assert_blocks_equal(_logical(kind, dst), expected, f"{kind} {indices} tokens={num_tokens} batch={mode}")
        batched = batch_mode(2) - before
        if not (available and stream == "side"):
            assert batched == 0, "the batch call ran while off or on the legacy default stream"
        elif indices == "scattered" and num_tokens is None:
            # 8 copies (block-major) in one batch call; 24 (8 blocks x 3 layers) as calls of 4, 8 and 12
            copies = 8 if kind == "block" else 8 * L
            assert batched == batch_calls(copies), f"{copies} scattered whole-chunk copies: batch calls"


def test_batch_call_is_used_where_the_runtime_has_it(batch_mode: Callable[[int], int]) -> None:
    """Built with CUDA >= 12.8: after a scattered copy the batch call is still in use (the runtime accepted it)."""
    built = tuple(int(x) for x in (torch.version.cuda or "0.0").split(".")[:2]) >= (12, 8)
    batch_mode(1)
    src, dst = _side("block", 8, "cuda"), _side("block", 8, "pinned")
    s, d = torch.tensor([5, 1, 3], dtype=torch.int64), torch.tensor([0, 6, 2], dtype=torch.int64)
    before = batch_mode(2)
    with torch.cuda.stream(torch.cuda.Stream()):  # the legacy default stream never takes the batch call
        ops.copy_blocks(dst, src, s, d, method=ops.METHOD_DMA)
    torch.cuda.synchronize()
    assert batch_mode(2) - before == (1 if built else 0)
    assert bool(batch_mode(-1)) == built, "the batch call was refused (cudaErrorNotSupported): the loop is in use"


def batch_calls(copies: int) -> int:
    """The batch calls kernels/dma_batch.cpp makes for ``copies`` copies: one below 16; else 4, 8, 16, ... 256."""
    if copies < 16:
        return 1
    calls, call, done = 0, 4, 0
    while done < copies:
        done, call, calls = done + min(call, copies - done), min(2 * call, 256), calls + 1
    return calls


def test_batch_calls_model() -> None:
    assert [batch_calls(n) for n in (1, 15, 16, 24, 40, 60, 61, 1020, 1021, 1276)] == [1, 1, 3, 3, 4, 4, 5, 9, 10, 10]


@pytest.mark.parametrize(("src_at", "dst_at"), [("cuda", "pinned"), ("pinned", "cuda")])
def test_a_long_batch_goes_as_calls_that_double(batch_mode: Callable[[int], int], src_at: str, dst_at: str) -> None:
    """A long batch goes as a short head the copy engines start on at once, then calls that double in size (each
    issued while the ones before it run): 40 copies are calls of 4, 8, 16 and 12, 300 copies seven calls; every
    block lands where the reference puts it; 15 copies stay one call."""
    built = tuple(int(x) for x in (torch.version.cuda or "0.0").split(".")[:2]) >= (12, 8)
    batch_mode(1)
    n = 320
    gen = torch.Generator().manual_seed(3)
    for pairs, calls in ((40, 4), (300, 7), (15, 1)):
        s = torch.randperm(n, generator=gen)[:pairs]
        d = torch.randperm(n, generator=gen)[:pairs]
        src, dst = _side("block", n, src_at), _side("block", n, dst_at)
        expected = _logical("block", dst)
        expected[d] = _logical("block", src)[s]
        before = batch_mode(2)
        with torch.cuda.stream(torch.cuda.Stream()):
            ops.copy_blocks(dst, src, s, d, method=ops.METHOD_DMA)
        torch.cuda.synchronize()
        assert_blocks_equal(_logical("block", dst), expected, f"{pairs} scattered copies")
        assert batch_mode(2) - before == (calls if built else 0)
