"""Layer-by-layer overlap benchmark: prefill of a model-shaped workload whose prefix KV comes back from host.

A 32-layer model (8 KV heads of 128, 32 query heads, hidden 4096, MLP 14336, bf16) prefills ``new`` tokens
on top of an 8k-token prefix whose KV blocks are reused from the host tier. Per layer, compute reads that
layer's K/V of the whole prefix from the GPU pool (attention over prefix tokens) and runs the projections and
the MLP of the new tokens. Two ways, same run, same data:

* ``serial``: ``await engine.copy(HOST -> GPU)`` of every block, then the 32 layers (the load blocks prefill);
* ``overlap``: :func:`tiered_kv.layerwise.copy_layerwise` (one transfer per layer group), and before layer ``i``
  the compute stream waits stream-side for layer ``i``'s group only (``wait_layer``): the load of layer
  ``i + 1`` runs under the compute of layer ``i``.

Both with the engine's own path choice (a per-layer load of consecutive blocks is one 2-D DMA call, leaving the
SMs to compute) and with the copy kernel forced (``copy_path="kernel"``), to show what the choice buys.

Each trial poisons (zeroes) the GPU pool first and both ways must produce the same output (max |diff| < 0.05
on tanh-bounded bf16 activations: a layer computed before its KV landed attends over zeros and is off by
O(0.1..1); equal kernels on equal data normally agree bit for bit). Also measured alone: the load and the
compute, whose maximum is the best an overlap can do when the two do not slow each other; and side by side with
no wait between them (``side_by_side``): how much a load slows the compute it runs beside (``contention``), which
no ordering can undo (the forced copy kernel takes SMs from the compute; DMA does not). TTFT here = from the start
of the load to the last layer's output.
Target: ``overlap`` within 15% of ``max(load, compute)``; ``ttft_ratio`` = overlap / serial is reported.

Run: ``python -m tiered_kv.tools.bench.overlap [--quick] [--device cpu|cuda] [--json F]``.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ...config import EngineConfig
from ...device import Stream
from ...engine import TransferEngine
from ...layerwise import copy_layerwise
from ...layout import KVLayout
from ...pools import BlockPool, Tier
from ...testing import fill_random
from .common import bench_main, machine_info

__all__ = ["main", "run"]


class _Model:
    """Weights shared by every layer (the compute's cost is what matters, not distinct weights)."""

    def __init__(self, layout: KVLayout, hidden: int, ff: int, heads: int, new: int, device: torch.device) -> None:
        g = torch.Generator(device="cpu").manual_seed(0)

        def w(rows: int, cols: int) -> torch.Tensor:
            out: torch.Tensor = (torch.randn(rows, cols, generator=g) / rows**0.5).to(device=device, dtype=layout.dtype)
            return out

        self.layout = layout
        self.heads = heads
        self.hidden = hidden
        self.wq, self.wo = w(hidden, heads * layout.head_dim), w(heads * layout.head_dim, hidden)
        self.wg, self.wu, self.wd = w(hidden, ff), w(hidden, ff), w(ff, hidden)
        self.x0 = torch.randn(new, hidden, generator=g).to(device=device, dtype=layout.dtype)

    def layer(self, x: torch.Tensor, gpu: torch.Tensor, i: int) -> torch.Tensor:
        """One layer for the new tokens, attending over the prefix K/V of layer ``i`` in ``gpu`` (block-major)."""
        lay = self.layout
        kvh, d = lay.num_kv_heads, lay.head_dim
        k = gpu[:, i, 0].permute(1, 0, 2, 3).reshape(1, kvh, -1, d)  # [1, kv heads, prefix tokens, d]
        v = gpu[:, i, 1].permute(1, 0, 2, 3).reshape(1, kvh, -1, d)
        q = (x @ self.wq).view(x.shape[0], self.heads, d).transpose(0, 1).unsqueeze(0)
        a = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        x = torch.tanh(x + a.squeeze(0).transpose(0, 1).reshape(x.shape[0], -1) @ self.wo)
        return torch.tanh(x + (F.silu(x @ self.wg) * (x @ self.wu)) @ self.wd)


async def _wait(stream: Stream) -> None:
    event = stream.record()
    await asyncio.to_thread(event.synchronize)


async def _overlap(
    device: str,
    path: str,
    layers: int,
    prefix: int,
    new: int,
    hidden: int,
    ff: int,
    heads: int,
    group_layers: Sequence[int],
    repeat: int,
) -> list[dict[str, Any]]:
    cuda = device.startswith("cuda")
    layout = KVLayout(
        num_layers=layers, num_kv_heads=8, head_dim=128 if cuda else 16, tokens_per_block=16, dtype=torch.bfloat16
    )
    blocks = prefix // layout.tokens_per_block
    rows = []
    config = EngineConfig.from_env(copy_path=path)
    async with TransferEngine(layout, gpu_blocks=blocks, host_blocks=blocks, device=device, config=config) as engine:
        gpu_pool = engine.pool(Tier.GPU)
        host_pool = engine.pool(Tier.HOST)
        assert isinstance(gpu_pool, BlockPool) and isinstance(host_pool, BlockPool)
        gpu, host = gpu_pool.tensor, host_pool.tensor
        fill_random(host)
        host.view(torch.int16).bitwise_and_(0x3FFF)  # finite bf16 values of moderate size (no NaN/inf bits)
        model = _Model(layout, hidden, ff, heads, new, engine.device.torch_device)
        compute = engine.device.new_stream("compute")
        order = np.arange(blocks)
        out: dict[str, torch.Tensor] = {}

        def run_layers(key: str, before: Callable[[int], None] | None) -> tuple[float, Any, Any]:
            """Enqueue the layers on the compute stream; ``before(i)`` adds layer i's stream-side wait.

            Returns the host seconds the enqueue took and, on CUDA, timing events recorded on the compute stream
            before layer 0's compute and after the last layer's (``None`` on the emulated device).
            """
            state = {"x": model.x0}
            t0 = time.perf_counter()
            first = last = None
            for i in range(layers):
                if before is not None:
                    before(i)

                def step(i: int = i) -> None:
                    nonlocal first, last
                    if cuda and i == 0:
                        first = torch.cuda.Event(enable_timing=True)
                        first.record()
                    state["x"] = model.layer(state["x"], gpu, i)
                    if i == layers - 1:
                        out[key] = state["x"]
                        if cuda:
                            last = torch.cuda.Event(enable_timing=True)
                            last.record()

                compute.submit(step)
            return time.perf_counter() - t0, first, last

        def device_ms(first: Any, last: Any) -> float:
            return float(first.elapsed_time(last)) if first is not None else float("nan")

        def poison() -> None:
            gpu.zero_()
            if cuda:
                torch.cuda.synchronize()

        async def load_only() -> float:
            poison()
            t0 = time.perf_counter()
            await engine.copy(Tier.HOST, order, Tier.GPU, order)
            return time.perf_counter() - t0

        async def compute_only() -> tuple[float, float, float]:  # the prefix is in place (left by the previous trial)
            t0 = time.perf_counter()
            enqueue, first, last = run_layers("compute", None)
            await _wait(compute)
            return time.perf_counter() - t0, device_ms(first, last), enqueue

        async def serial() -> float:
            poison()
            t0 = time.perf_counter()
            await engine.copy(Tier.HOST, order, Tier.GPU, order)
            engine.sync_transfers(compute)
            run_layers("serial", None)
            await _wait(compute)
            return time.perf_counter() - t0

        async def overlapped(g: int) -> float:
            poison()
            t0 = time.perf_counter()
            lw = copy_layerwise(engine, Tier.HOST, order, Tier.GPU, order, group_layers=g)
            run_layers(f"overlap{g}", lambda i: lw.wait_layer(i, compute))
            await _wait(compute)
            dt = time.perf_counter() - t0
            await lw
            return dt

        async def side_by_side(g: int) -> tuple[float, float, float, float]:
            # the same load and compute with no wait between them (the compute reads whatever has landed; its
            # output is not used): what the two take when they share the GPU, the bound an overlap can reach
            poison()
            t0 = time.perf_counter()
            lw = copy_layerwise(engine, Tier.HOST, order, Tier.GPU, order, group_layers=g)
            enqueue, first, last = run_layers("side_by_side", None)
            await _wait(compute)
            compute_done = time.perf_counter() - t0
            await lw
            return compute_done, time.perf_counter() - t0, device_ms(first, last), enqueue

        async def layer_load_only(g: int) -> float:
            poison()
            t0 = time.perf_counter()
            await copy_layerwise(engine, Tier.HOST, order, Tier.GPU, order, group_layers=g)
            return time.perf_counter() - t0

        def median(samples: list[float]) -> float:
            return statistics.median(samples[1:]) if len(samples) > 1 else samples[0]

        load = median([await load_only() for _ in range(repeat + 1)])
        alone = [await compute_only() for _ in range(repeat + 1)]
        comp = median([a[0] for a in alone])
        comp_dev = median([a[1] for a in alone])
        comp_enqueue = median([a[2] for a in alone])
        ser = median([await serial() for _ in range(repeat + 1)])
        for g in group_layers:
            layer_load = median([await layer_load_only(g) for _ in range(repeat + 1)])
            ovl = median([await overlapped(g) for _ in range(repeat + 1)])
            pairs = [await side_by_side(g) for _ in range(repeat + 1)]
            comp_beside = median([p[0] for p in pairs])
            both = median([max(p[0], p[1]) for p in pairs])
            beside_dev = median([p[2] for p in pairs])
            beside_enqueue = median([p[3] for p in pairs])
            layer_path = engine.copier.plan(
                engine.copier.layer_slice(host_pool, 0, g),
                order,
                engine.copier.layer_slice(gpu_pool, 0, g),
                order,
                None,
            ).path
            diff = float((out[f"overlap{g}"].float() - out["serial"].float()).abs().max().cpu())
            rows.append(
                {
                    "bench": "overlap",
                    "device": engine.device.kind,
                    "layers": layers,
                    "tokens": prefix,
                    "new_tokens": new,
                    "group_layers": f"{g}",
                    "copy_path": path,
                    "layer_path": layer_path,
                    "prefix_MiB": blocks * layout.bytes_per_block / 2**20,
                    "load_ms": load * 1e3,
                    "layerwise_load_ms": layer_load * 1e3,
                    "compute_ms": comp * 1e3,
                    "serial_ms": ser * 1e3,
                    "overlap_ms": ovl * 1e3,
                    "ttft_ratio": ovl / ser,
                    "vs_bound": ovl / max(load, comp),
                    "compute_beside_load_ms": comp_beside * 1e3,
                    "contention": comp_beside / comp,
                    "compute_dev_ms": comp_dev,
                    "beside_dev_ms": beside_dev,
                    "dev_contention": beside_dev / comp_dev,
                    "enqueue_ms": comp_enqueue * 1e3,
                    "enqueue_beside_ms": beside_enqueue * 1e3,
                    "side_by_side_ms": both * 1e3,
                    "vs_side_by_side": ovl / both,
                    "max_abs_diff": diff,
                    "same_output": diff < 0.05,
                }
            )
        compute.close()
    return rows


def run(quick: bool = False, device: str = "auto") -> dict[str, Any]:
    """Run every row; return ``{"name", "machine", "rows", "notes"}``."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device.startswith("cuda")
    rows: list[dict[str, Any]] = []
    for path in ("auto", "kernel") if cuda else ("auto",):  # auto: per-layer loads by DMA; kernel: forced, to compare
        if cuda:
            coro = _overlap(device, path, 32, 8192, 512, 4096, 14336, 32, (1, 4), 3 if quick else 5)
        else:
            coro = _overlap(device, path, 4, 256, 16, 64, 128, 8, (1, 2), 1)
        rows += asyncio.run(coro)
    notes = [
        "overlap: 32 layers x 8k prefix tokens reused from host (bf16, 8 KV heads x 128), new tokens computed with "
        "attention over the prefix + MLP; serial = load all then compute; overlap = per-layer-group loads, compute "
        "waits stream-side per layer; vs_bound = overlap / max(load alone, compute alone); "
        "same_output: max |diff| < 0.05; "
        "copy_path = the engine's EngineConfig.copy_path (auto: its choice; kernel: forced); layer_path = what a "
        "per-layer load took; layerwise_load_ms = the per-layer loads alone; "
        "side_by_side = the same per-layer loads and compute with no wait between them (both sharing the GPU: "
        "the bound an overlap can reach), compute_beside_load = when its compute ended, contention = that over "
        "compute alone (> 1: the load took SMs or memory bandwidth from the compute, or the host's enqueue of the "
        "compute fell behind), vs_side_by_side = overlap / side_by_side; compute_dev_ms / beside_dev_ms = the "
        "compute's device time (CUDA events on the compute stream from layer 0 to the last layer) alone / beside "
        "the load, dev_contention = their ratio (what the GPU's sharing costs); enqueue_ms / enqueue_beside_ms = host "
        "time to enqueue the 32 layers alone / beside the load",
    ]
    if not cuda:
        notes.append("emulated: a tiny model on CPU threads; it proves the program and the ordering, not the overlap")
    return {"name": "overlap", "machine": machine_info(device), "rows": rows, "notes": notes}


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: run, print the table, write the JSON."""
    return bench_main("overlap", run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
