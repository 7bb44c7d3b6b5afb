"""Layer-by-layer copies: ``copy(..., layers=)``, ``copy_layerwise`` and stream-side waits per layer."""

from __future__ import annotations

import pathlib
import time
from typing import Any

import numpy as np
import pytest
import torch
from helpers import fill_pool, same, snapshot

from tiered_kv import KVLayout, LayerMajorPool, Tier, TransferEngine, copy_layerwise
from tiered_kv.layerwise import layer_groups, tapered_groups
from tiered_kv.testing import stall


def test_tapered_groups_split_the_last_group_in_halves_down_to_one_layer() -> None:
    assert tapered_groups(32, 4)[-4:] == [(24, 28), (28, 30), (30, 31), (31, 32)]
    assert tapered_groups(32, 4)[:7] == layer_groups(32, 4)[:7]
    assert tapered_groups(5, 2) == [(0, 2), (2, 4), (4, 5)]
    assert tapered_groups(9, 3) == [(0, 3), (3, 6), (6, 8), (8, 9)]
    assert tapered_groups(7, 3) == [(0, 3), (3, 6), (6, 7)]  # the last group is one layer already
    assert tapered_groups(3, 8) == [(0, 3)]  # one copy asked for
    for n in range(1, 40):
        for g in range(1, 10):
            groups = tapered_groups(n, g)
            assert [a for a, _ in groups[1:]] == [b for _, b in groups[:-1]]  # consecutive
            assert groups[0][0] == 0 and groups[-1][1] == n
            assert len(layer_groups(n, g)) == 1 or groups[-1][1] - groups[-1][0] == 1


def test_layer_groups_cover_every_layer() -> None:
    assert layer_groups(5, 2) == [(0, 2), (2, 4), (4, 5)]
    assert layer_groups(3, 1) == [(0, 1), (1, 2), (2, 3)]
    assert layer_groups(3, 8) == [(0, 3)]
    with pytest.raises(ValueError, match="group_layers"):
        layer_groups(3, 0)


async def test_layers_copies_only_that_range(device: str, layout: KVLayout) -> None:
    async with TransferEngine(layout, gpu_blocks=4, host_blocks=4, device=device) as engine:
        g = fill_pool(engine, "gpu", 1)
        h = fill_pool(engine, "host", 2)
        t = engine.copy(Tier.GPU, [2, 0], Tier.HOST, [1, 3], layers=(1, 3))
        result = await t
        assert result.nbytes == 2 * layout.bytes_per_block * 2 // 3
        for dst, src in ((1, 2), (3, 0)):
            got = snapshot(engine, "host", dst)
            assert same(got[0], h[dst][0]), "layer 0 is outside the range: untouched"
            assert same(got[1:], g[src][1:])
        assert same(snapshot(engine, "host", 0), h[0])


@pytest.mark.parametrize("split_kv", [False, True])
@pytest.mark.parametrize("num_tokens", [None, 3])
async def test_copy_layerwise_equals_a_whole_copy(device: str, split_kv: bool, num_tokens: int | None) -> None:
    layout = KVLayout(num_layers=5, num_kv_heads=2, head_dim=16, tokens_per_block=8, dtype=torch.float16)
    dev = "cuda" if device == "cuda" else "cpu"
    pool = LayerMajorPool.allocate(layout, 6, dev, split_kv=split_kv)
    async with TransferEngine(layout, gpu_pool=pool, host_blocks=6, device=device) as engine:
        h = fill_pool(engine, "host", 3)
        for t in pool.tensors:
            t.fill_(0)
        if device == "cuda":
            torch.cuda.synchronize()  # the fill ran on the default stream; the copies run on the engine's
        lw = copy_layerwise(engine, Tier.HOST, np.array([4, 1, 0]), Tier.GPU, [0, 2, 5], group_layers=2,
                            num_tokens=num_tokens)
        assert lw.groups == [(0, 2), (2, 4), (4, 5)] and len(lw.transfers) == 3
        if device == "cuda":  # every group but the last signals beside the copy stream, never holding it up (or
            # has no host function at all: a native copy naming its bytes is polled by the waiter alone)
            onboard = engine.stream("onboard")
            polled = onboard._wait_done is not None and engine.copier.native  # type: ignore[attr-defined]
            assert onboard.completion != "hostfunc" or onboard._side is not None or polled  # type: ignore[attr-defined]
        results = await lw
        assert lw.done() and [r.num_blocks for r in results] == [3, 3, 3]
        n = layout.tokens_per_block if num_tokens is None else num_tokens
        for src, dst in ((4, 0), (1, 2), (0, 5)):
            got = engine.block(Tier.GPU, dst).cpu()
            assert same(got[..., :n, :], h[src][..., :n, :]), (src, dst)
            if n < layout.tokens_per_block:
                assert not got[..., n:, :].any()


async def test_wait_layer_orders_compute_after_that_layer_only(device: str, layout: KVLayout) -> None:
    """Compute waits stream-side for layer 0's group, not for the whole load."""
    async with TransferEngine(layout, gpu_blocks=2, host_blocks=2, device=device) as engine:
        h = fill_pool(engine, "host", 4)
        engine.pool(Tier.GPU).tensor.zero_()
        if device == "cuda":
            torch.cuda.synchronize()
        onboard = engine.stream("onboard")
        stall(onboard, 0.2)  # the load starts late: compute that did not wait would see zeros
        lw = copy_layerwise(engine, Tier.HOST, [1], Tier.GPU, [0])
        compute = engine.device.new_stream("compute")
        seen: dict[str, torch.Tensor] = {}
        lw.wait_layer(0, compute)
        compute.submit(lambda: seen.__setitem__("layer0", engine.pool(Tier.GPU).tensor[0, 0].clone()))
        done = compute.record()
        await asyncio_to_thread(done.synchronize)
        assert same(seen["layer0"].cpu(), h[1][0])
        await lw
        assert same(snapshot(engine, "gpu", 0), h[1])
        compute.close()
        with pytest.raises(ValueError, match="no group"):
            lw.wait_layer(7, compute)


async def asyncio_to_thread(fn) -> None:
    import asyncio

    await asyncio.to_thread(fn)


async def test_layers_bad_input(layout: KVLayout, tmp_path: pathlib.Path) -> None:
    async with TransferEngine(
        layout, gpu_blocks=2, host_blocks=2, device="cpu", file_dir=tmp_path, file_blocks=2
    ) as engine:
        for bad, err in (((0, 0), ValueError), ((2, 9), ValueError), ((-1, 1), ValueError), ([0, 1], TypeError),
                         ((0.0, 1), TypeError), ((True, 2), TypeError)):
            with pytest.raises(err):
                engine.copy(Tier.GPU, [0], Tier.HOST, [1], layers=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="only supported between GPU and host pools"):
            engine.copy(Tier.HOST, [0], Tier.FILE, [0], keys=[b"k"], layers=(0, 1))
        assert engine.statistics().submitted == 0


async def test_readme_layerwise_snippet_runs_in_order(layout: KVLayout) -> None:
    """docs/api.md's layer-by-layer fragment, run in a server's context: each layer's compute sees that layer loaded.

    The fragment needs the server's engine, compute stream and per-layer compute, so the page fences it as text
    (tests/test_docs_snippets.py runs only complete programs); they are supplied here.
    """
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()  # noqa: ASYNC240
    block = re.search(r"<!-- layerwise -->\s*```text\n(.*?)```", text, re.S)
    assert block, "docs/api.md must hold the layerwise fragment in a ```text block right after <!-- layerwise -->"
    async with TransferEngine(layout, gpu_blocks=3, host_blocks=3, device="cpu") as engine:
        h = fill_pool(engine, "host", 6)
        gpu = engine.pool(Tier.GPU).tensor
        gpu.zero_()
        stall(engine.stream("onboard"), 0.1)
        compute_stream = engine.device.new_stream("compute")
        seen: dict[int, torch.Tensor] = {}

        def run_layer(i: int) -> None:
            compute_stream.submit(lambda: seen.__setitem__(i, gpu[[0, 1], i].clone()))

        code = "async def _snippet():\n" + "".join(f"    {line}\n" for line in block.group(1).splitlines())
        namespace: dict[str, Any] = {
            "copy_layerwise": copy_layerwise, "engine": engine, "Tier": Tier,
            "host_blocks": [2, 0], "gpu_blocks": [0, 1],
            "layout": layout, "compute_stream": compute_stream, "run_layer": run_layer,
        }
        exec(code, namespace)
        await namespace["_snippet"]()
        compute_stream.synchronize()
        compute_stream.close()
        for i in range(layout.num_layers):
            assert same(seen[i][0], h[2][i]) and same(seen[i][1], h[0][i]), i


async def test_layer_slice_runs_count_as_one_piece(layout: KVLayout) -> None:
    """A run of consecutive blocks of one layer range is one piece (one 2-D DMA call on CUDA); scattered is not."""
    async with TransferEngine(layout, gpu_blocks=8, host_blocks=8, device="cpu") as engine:
        copier = engine.copier
        host, gpu = copier.layer_slice(engine.pool(Tier.HOST), 1, 2), copier.layer_slice(engine.pool(Tier.GPU), 1, 2)
        assert copier.layer_slice(engine.pool(Tier.HOST), 1, 2) is host  # made once per range
        layer_bytes = layout.bytes_per_block // layout.num_layers
        run = copier.plan(host, np.arange(8), gpu, np.arange(8), None)
        assert (run.runs, run.piece_bytes) == (1, 8 * layer_bytes)
        scattered = copier.plan(host, np.array([0, 2, 4, 6]), gpu, np.array([1, 3, 5, 7]), None)
        assert (scattered.runs, scattered.piece_bytes) == (4, layer_bytes)
        whole = copier.plan(engine.pool(Tier.HOST), np.arange(8), engine.pool(Tier.GPU), np.arange(8), None)
        assert whole.piece_bytes == 8 * layout.bytes_per_block


async def layerwise_then_offload(engine: TransferEngine) -> bool:
    """A layer-by-layer load whose groups land 50 ms apart, then an offload of the loaded GPU blocks (another
    stream): True when the offload saw every layer of the load (the fence entry of the whole load is its last
    group). Emulated device: each piece of work on the onboard stream sleeps after it runs."""
    h = fill_pool(engine, "host", 11)
    engine.pool(Tier.GPU).tensor.zero_()
    onboard = engine.stream("onboard")
    submit = onboard.submit

    def slow_submit(fn: Any, *, explicit: bool = False) -> None:
        def run() -> None:
            fn()
            time.sleep(0.05)

        submit(run, explicit=explicit)

    onboard.submit = slow_submit  # type: ignore[method-assign]
    lw = copy_layerwise(engine, Tier.HOST, [3, 1], Tier.GPU, [0, 2], group_layers=1)
    out = engine.copy(Tier.GPU, [0, 2], Tier.HOST, [5, 4])
    await lw
    await out
    return same(snapshot(engine, "host", 5), h[3]) and same(snapshot(engine, "host", 4), h[1])


async def test_a_later_copy_waits_for_every_group(layout: KVLayout) -> None:
    async with TransferEngine(layout, gpu_blocks=4, host_blocks=6, device="cpu") as engine:
        assert await layerwise_then_offload(engine)
        assert engine.fences.stream_waits >= 1 and not engine.fences
        assert engine.statistics().submitted == layout.num_layers + 1


async def test_a_later_copy_without_fences_is_corrupted(layout: KVLayout, monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers import disable_fences

    disable_fences(monkeypatch)
    async with TransferEngine(layout, gpu_blocks=4, host_blocks=6, device="cpu") as engine:
        assert not await layerwise_then_offload(engine)


async def test_layerwise_waits_for_a_pending_write_of_its_sources(device: str, layout: KVLayout) -> None:
    """The dependencies of the whole copy hold for every group: each layer reads the offload's bytes."""
    async with TransferEngine(layout, gpu_blocks=4, host_blocks=4, device=device) as engine:
        g = fill_pool(engine, "gpu", 12)
        stall(engine.stream("offload"), 0.2)
        first = engine.copy(Tier.GPU, [1], Tier.HOST, [2])
        lw = copy_layerwise(engine, Tier.HOST, [2], Tier.GPU, [3], group_layers=1)
        await first
        await lw
        assert same(snapshot(engine, "gpu", 3), g[1])


async def test_a_bad_group_enqueues_nothing(layout: KVLayout) -> None:
    async with TransferEngine(layout, gpu_blocks=2, host_blocks=2, device="cpu") as engine:
        for groups, err in (([(0, 1), (1, 9)], ValueError), ([], ValueError), ([(0, 1), [1, 2]], TypeError)):
            with pytest.raises(err):
                engine.copy_layer_groups(Tier.HOST, [0], Tier.GPU, [1], groups)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="duplicates"):
            engine.copy_layer_groups(Tier.HOST, [0, 1], Tier.GPU, [1, 1], [(0, 1)])
        assert engine.statistics().submitted == 0 and not engine.fences


async def test_host_to_host_groups_are_separate_copies(layout: KVLayout) -> None:
    """Host-to-host groups run on host threads side by side: each is fenced as a copy of its own."""
    async with TransferEngine(layout, gpu_blocks=2, host_blocks=6, device="cpu") as engine:
        h = fill_pool(engine, "host", 13)
        lw = copy_layerwise(engine, Tier.HOST, [0, 1], Tier.HOST, [4, 5], group_layers=1)
        after = engine.copy(Tier.HOST, [4], Tier.HOST, [3])
        await lw
        await after
        assert same(snapshot(engine, "host", 4), h[0]) and same(snapshot(engine, "host", 5), h[1])
        assert same(snapshot(engine, "host", 3), h[0])


async def test_layer_groups_of_an_owned_engine_are_refused(layout: KVLayout) -> None:
    from tiered_kv.errors import OwnedEngineError

    async with TransferEngine(layout, gpu_blocks=2, host_blocks=2, device="cpu") as engine:
        engine.claim("a cache")
        with pytest.raises(OwnedEngineError, match="a cache"):
            copy_layerwise(engine, Tier.HOST, [0], Tier.GPU, [1])
        assert engine.statistics().submitted == 0
