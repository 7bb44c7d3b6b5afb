"""Serving with a real model: decode speed with the cache, a batch of mixed requests, GPU memory beyond the KV.

``python -m tiered_kv.tools.bench.serving [--quick] [--device auto|cpu|cuda] [--json F]`` (also
``tiered-kv bench --only serving``).

The model is the one of :mod:`.model` (an 8B-shaped bf16 Llama with random weights on CUDA, a tiny fp32 one
for ``--quick`` or the emulated device). Rows:

* ``decode``, per ``path``: decode tokens per second after a prefix of ``tokens`` tokens held on the GPU,
  greedy, timed from the first generated token to the last (``new_tokens`` of them); the paths take turns,
  request by request. ``tokens_per_s`` is the median over a row's turns; ``vs_plain`` the median over turns of its
  rate over plain transformers' in the same turn (``vs_plain_turns``: each turn's), so a drift of the host's speed
  between turns (a step at batch 1 is bound by the host's kernel launches) falls on both sides of each ratio.

  - ``plain``: plain transformers with the prefix's KV in a ``DynamicCache`` (no tiered_kv): the baseline.
  - ``cache``: :class:`~tiered_kv.integrations.hf.CachedGenerator` reusing the prefix from the GPU tier; every
    generated token's KV is written into its block, committed, and each block that fills is checksummed on the
    device (integrity on, the default). Target: ``vs_plain >= 0.95``.
  - ``no_integrity``: the same with ``TieredKVCache(integrity=False)``; its ``integrity_cost`` = 1 - the median
    over turns of the ``cache`` row's rate over this row's, the share of decode throughput the checksums take. Target:
    ``integrity_cost <= 0.02``.
  - ``inline``: the ``cache`` path with the forwards on the event loop's thread (``offload_compute=False``): what
    handing each step to the model thread costs. Context, no target.

  Each row also splits a step: ``ms_per_step``, ``model_ms_per_step`` (the decode forward, its KV write and the
  synchronize after it, as the generator times them; for ``plain`` the whole step) and ``outside_model_ms`` (the
  rest: appending the token to its sequence, committing, choosing the token, the hop to the model thread).

* ``batch``: ``requests`` prompts submitted at once (``asyncio.gather`` of ``generate``): a third reuse a prefix
  on the GPU, a third one in host memory, the rest are misses; TTFT p50 and p99 against the same prompts
  recomputed one after another by plain transformers (a first-come-first-served server without a cache).
  Context, no target.

* ``memory``: the GPU memory one request allocates at its peak beyond what was allocated before it
  (``torch.cuda.max_memory_allocated``), less its own KV where the KV is part of that (plain transformers holds
  it in the ``DynamicCache``; the cache's blocks are allocated before any request). ``beyond_kv`` is that over the
  request's KV bytes. Target for a host hit through the cache: ``beyond_kv <= 0.10``. NaN on the emulated device.

Rows of the emulated device are CPU figures, not comparable to the targets.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ...cache import TieredKVCache
from ...pools import Tier
from .common import bench_main, machine_info

__all__ = ["main", "run"]

SUFFIX = 32  # new prompt tokens after a reused prefix


def _setup(quick: bool, device: str) -> tuple[Any, int, int, int, bool]:
    """``(model, prefix tokens, new tokens, repeats, emulated)``."""
    from .model import bench_model

    model, full, emulated = bench_model(quick, device)
    return (model, 8192, 32, 5, False) if full else (model, 512, 24, 2, emulated)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


async def _decode_rows(model: Any, length: int, new: int, repeats: int) -> list[dict[str, Any]]:
    """Decode tokens/s: plain transformers, the cache with integrity on, and off."""
    from ...integrations.hf import CachedGenerator, layout_for, reference_generate
    from .model import _prefix_kv

    device = next(model.parameters()).device
    layout = layout_for(model, 16)
    vocab = int(model.config.vocab_size)
    rng = np.random.default_rng(1)
    prefix = [int(t) for t in rng.integers(0, vocab, length)]

    def prompt() -> list[int]:
        return prefix + [int(t) for t in rng.integers(0, vocab, SUFFIX)]

    rates: dict[str, list[float]] = {"plain": [], "cache": [], "no_integrity": [], "inline": []}
    model_s: dict[str, list[float]] = {path: [] for path in rates}  # model seconds per step (generator paths)
    past = _prefix_kv(model, prefix)
    blocks = -(-(length + SUFFIX + new) // 16) * 2 + 8
    gens: dict[str, CachedGenerator] = {}
    async with contextlib.AsyncExitStack() as stack:
        for path in ("cache", "no_integrity", "inline"):
            cache = await stack.enter_async_context(
                TieredKVCache(
                    layout,
                    gpu_blocks=blocks,
                    host_blocks=blocks,
                    device=_cache_device(device),
                    model_id=f"bench-serving-{path}",
                    integrity=path != "no_integrity",
                )
            )
            gen = gens[path] = CachedGenerator(model, cache, offload_compute=path != "inline")
            stack.callback(gen.close)
            await gen.generate(prompt(), max_new_tokens=2)  # the prefix, computed once; warms up
        reference_generate(model, prompt(), max_new_tokens=2, past=past)
        for _ in range(repeats):  # the paths take turns: a slow spell of the machine falls on all of them
            _sync(device)
            t0 = time.perf_counter()
            tokens, _, ttft = reference_generate(model, prompt(), max_new_tokens=new, past=past)
            _sync(device)
            rates["plain"].append((len(tokens) - 1) / (time.perf_counter() - t0 - ttft))
            for path, gen in gens.items():
                before = gen.statistics().decode_seconds
                out = await gen.generate(prompt(), max_new_tokens=new)
                if out.tokens_reused < length - 16:
                    raise RuntimeError(f"the prefix was not reused: {out.tokens_reused} tokens")
                rates[path].append((len(out.tokens) - 1) / (out.seconds - out.ttft_s))
                model_s[path].append((gen.statistics().decode_seconds - before) / (len(out.tokens) - 1))
    del past
    rows = []
    for path, values in rates.items():
        rate = statistics.median(values)
        model_ms = 1e3 / rate if path == "plain" else statistics.median(model_s[path]) * 1e3
        # each turn against plain transformers' request of the same turn: the host's speed drifts between turns
        turns = [r / p for r, p in zip(values, rates["plain"], strict=True)]
        row: dict[str, Any] = {
            "bench": "decode",
            "tokens": length,
            "path": path,
            "new_tokens": new,
            "tokens_per_s": rate,
            "vs_plain": statistics.median(turns),
            "vs_plain_turns": [round(t, 3) for t in turns],
            "ms_per_step": 1e3 / rate,
            "model_ms_per_step": model_ms,
            "outside_model_ms": 1e3 / rate - model_ms,
        }
        rows.append(row)
    off_row = rows[2]
    # the same turn's cache and integrity-off requests ran one after the other
    off_row["integrity_cost"] = 1.0 - statistics.median(
        c / o for c, o in zip(rates["cache"], rates["no_integrity"], strict=True)
    )
    return rows


async def _batch_row(model: Any, length: int, repeats: int, requests: int = 8) -> dict[str, Any]:
    """TTFT p50/p99 of ``requests`` concurrent prompts with mixed hits, against plain transformers one by one."""
    from ...integrations.hf import CachedGenerator, layout_for, reference_generate

    device = next(model.parameters()).device
    layout = layout_for(model, 16)
    vocab = int(model.config.vocab_size)
    rng = np.random.default_rng(2)
    on_gpu = [int(t) for t in rng.integers(0, vocab, length)]
    in_host = [int(t) for t in rng.integers(0, vocab, length)]

    def tail() -> list[int]:
        return [int(t) for t in rng.integers(0, vocab, SUFFIX)]

    per_request = -(-(length + SUFFIX + 1) // 16)
    blocks = per_request * (requests + 2) + 8
    ttfts: list[float] = []
    plain: list[float] = []
    kinds = ["gpu", "host", "miss"]
    async with TieredKVCache(
        layout, gpu_blocks=blocks, host_blocks=blocks, device=_cache_device(device), model_id="bench-serving-batch"
    ) as cache:
        gen = CachedGenerator(model, cache)
        try:
            for _ in range(repeats):
                await gen.generate(in_host + tail(), max_new_tokens=1)
                await cache.evict(Tier.GPU, cache.blocks.capacity[Tier.GPU])  # the host prefix leaves the GPU
                await gen.generate(on_gpu + tail(), max_new_tokens=1)
                prompts = []
                for i in range(requests):
                    kind = kinds[i % 3]
                    if kind == "miss":
                        prompts.append([int(t) for t in rng.integers(0, vocab, length)] + tail())
                    else:
                        prompts.append((on_gpu if kind == "gpu" else in_host) + tail())
                _sync(device)
                outs = await asyncio.gather(*(gen.generate(p, max_new_tokens=1) for p in prompts))
                ttfts.extend(o.ttft_s for o in outs)
                _sync(device)
                t0 = time.perf_counter()
                for p in prompts:  # first come, first served: each waits for the ones before it
                    reference_generate(model, p, max_new_tokens=1)
                    plain.append(time.perf_counter() - t0)
        finally:
            gen.close()
    p50, p99 = _percentile(ttfts, 50), _percentile(ttfts, 99)
    plain50, plain99 = _percentile(plain, 50), _percentile(plain, 99)
    return {
        "bench": "batch",
        "tokens": length,
        "requests": f"{requests} (gpu/host/miss)",
        "ttft_p50_ms": p50 * 1e3,
        "ttft_p99_ms": p99 * 1e3,
        "plain_p50_ms": plain50 * 1e3,
        "plain_p99_ms": plain99 * 1e3,
        "vs_plain_p50": plain50 / p50,
        "vs_plain_p99": plain99 / p99,
    }


async def _memory_rows(model: Any, length: int) -> list[dict[str, Any]]:
    """Peak GPU memory a request takes beyond its own KV: plain transformers, and a host hit through the cache."""
    from ...integrations.hf import CachedGenerator, layout_for, reference_generate

    device = next(model.parameters()).device
    layout = layout_for(model, 16)
    vocab = int(model.config.vocab_size)
    rng = np.random.default_rng(3)
    prompt = [int(t) for t in rng.integers(0, vocab, length + SUFFIX)]
    kv_bytes = (length + SUFFIX) * layout.bytes_per_block // layout.tokens_per_block
    rows = []
    peak = _PeakMemory(device)
    reference_generate(model, prompt[length:], max_new_tokens=1)  # warm up the allocator
    peak.start()
    reference_generate(model, prompt, max_new_tokens=1)
    extra = peak.extra()
    rows.append(
        {
            "bench": "memory",
            "tokens": length,
            "path": "plain",
            "extra_MB": extra / 1e6,
            "kv_MB": kv_bytes / 1e6,
            "beyond_kv": (extra - kv_bytes) / kv_bytes,
        }
    )
    blocks = -(-(length + SUFFIX + 1) // 16) + 8
    async with TieredKVCache(
        layout, gpu_blocks=blocks, host_blocks=blocks, device=_cache_device(device), model_id="bench-serving-memory"
    ) as cache:
        gen = CachedGenerator(model, cache, offload_compute=False)  # measured on this thread
        try:
            await gen.generate(prompt, max_new_tokens=1)
            await cache.evict(Tier.GPU, cache.blocks.capacity[Tier.GPU])
            follow = prompt[:length] + [int(t) for t in rng.integers(0, vocab, SUFFIX)]
            peak.start()
            out = await gen.generate(follow, max_new_tokens=1)
            extra = peak.extra()
            if out.blocks_from.get("host", 0) * 16 < length - 16:
                raise RuntimeError(f"the prefix was not found in host memory: {out.blocks_from}")
        finally:
            gen.close()
    rows.append(
        {
            "bench": "memory",
            "tokens": length,
            "path": "host",
            "extra_MB": extra / 1e6,
            "kv_MB": kv_bytes / 1e6,
            "beyond_kv": extra / kv_bytes,
        }
    )
    return rows


class _PeakMemory:
    """GPU memory allocated at the peak since :meth:`start`, beyond what was allocated then (NaN off CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.before = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def extra(self) -> float:
        if self.device.type != "cuda":
            return math.nan
        torch.cuda.synchronize(self.device)
        return float(torch.cuda.max_memory_allocated(self.device) - self.before)


def _cache_device(device: torch.device) -> str:
    return str(device) if device.type == "cuda" else "cpu"


def run(quick: bool = False, device: str = "auto") -> dict[str, Any]:
    """Measure every row (see the module docstring); returns the benchmark dict of :mod:`.common`."""
    if importlib.util.find_spec("transformers") is None:
        return {
            "name": "serving",
            "machine": machine_info(device),
            "rows": [],
            "notes": ["not run: transformers is not installed (pip install 'tiered-kv[hf]')"],
        }
    model, length, new, repeats, emulated = _setup(quick, device)

    async def measure() -> list[dict[str, Any]]:
        rows = await _decode_rows(model, length, new, repeats)
        rows.append(await _batch_row(model, length, repeats))
        rows.extend(await _memory_rows(model, length))
        return rows

    rows = asyncio.run(measure())
    params = sum(p.numel() for p in model.parameters())
    notes = [
        f"model: random Llama, {model.config.num_hidden_layers} layers, {params / 1e6:,.0f}M parameters, "
        f"{next(model.parameters()).dtype}; median of {repeats} runs",
    ]
    if emulated:
        notes.append("emulated device: CPU figures, not comparable to the targets; no GPU memory figures")
    return {"name": "serving", "machine": machine_info(device), "rows": rows, "notes": notes}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tiered_kv.tools.bench.serving``: run, print the table, write the JSON."""
    return bench_main("serving", run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
