"""Time to first token with a real model: a long prefix reused from GPU, host or file vs recomputed, same run.

``python -m tiered_kv.tools.bench.model [--quick] [--device auto|cpu|cuda] [--json F]`` (also
``tiered-kv bench --only model``).

A randomly initialised Llama (8B-shaped in bf16 on CUDA: 32 layers, 32 heads, 8 KV heads, head_dim 128;
weights made on the ``meta`` device and filled on the GPU, nothing downloaded; a tiny fp32 one for
``--quick`` or the emulated device) answers a prompt made of a long prefix (8k and 32k tokens; 512 and 2048
in ``--quick``) plus 32 new tokens. Rows, per prefix length:

Rows are labelled ``tokens`` (the prefix length) and ``path``:

* ``recompute``: the baseline -- plain transformers runs the whole prompt (no tiered_kv), first token.
* ``resident``: plain transformers with the prefix's KV already in a contiguous ``DynamicCache`` in GPU memory:
  only the new tokens run. The floor of any hit (no copy at all).
* ``cold``: a prompt whose prefix was never seen, through :class:`~tiered_kv.integrations.hf.CachedGenerator`,
  with room in the cache and nothing in flight (every earlier move awaited): the cost of a miss, i.e. of
  writing every computed token's KV into the cache's blocks. Target: at most 1.05x the recompute time.
* ``gpu`` / ``host`` / ``file``: the prefix cached in that tier (evicted there just before), so its KV is
  brought back (host: pinned DMA; file: read and verified) and only the 32 new tokens are run. The ``file`` row is
  hybrid prefill: the generator's cost model splits the prefix, the model computes its head while the tail is read
  (``tokens_computed_first`` + ``tokens_reused`` = the prefix).

The generator's cost model is trained as a server's would be: before the rows, warm-up requests of three other
prefix sizes are computed, then loaded from the file tier and from host memory, so the prefill rate and each tier's
read rate are fitted from the run's own admissions and prefills (``fitted_file_GBps``, ``fitted_prefill_tok_s``
in the ``file`` row); nothing is given to it.

Each cached row carries ``phases_ms``: the median split of its TTFT into admission (with the copies bringing the
prefix), gathering the reused KV, the forward, the KV writes within it, committing and sampling
(:attr:`~tiered_kv.integrations.hf.Generation.phases`), and ``dirty_mb``: the page cache not yet on disk as its
requests start (the kernel writes earlier spills back beside them).

TTFT is the median of ``repeats`` runs (each from the call to the first token on the host: admission,
onboarding, prefill, sampling). Targets: a miss at most 1.05x the recompute time; with the prefix in host, TTFT
at most 1.25x its floor, max(prefix bytes at the pinned host->GPU rate measured in the same run, the ``resident``
TTFT) (``floor_ms``, ``vs_floor``). With the prefix in
the file tier, TTFT at most 1.15x its floor and never slower than recomputing: the floor is
``T_recompute * T_load / (T_recompute + T_load)`` (computing and loading at once, meeting where both finish), with
``T_load`` the prefix's bytes at the cold file read rate measured in the same run, in the same directory
(``file_read_GBps``: O_DIRECT reads where the file system allows them, else reads after dropping the file's pages).
Rows of the emulated device are CPU figures, not comparable to the targets.
"""

from __future__ import annotations

import asyncio
import collections
import importlib.util
import math
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ...cache import TieredKVCache
from ...cost_model import CostModel
from ...device import resolve_device
from ...pools import Tier
from .common import bench_main, machine_info

__all__ = ["main", "run"]

SUFFIX = 32  # new tokens after the cached prefix


def bench_model(quick: bool, device: str) -> tuple[Any, bool, bool]:
    """``(model, full size, emulated)`` of the TTFT and serving benchmarks (random weights, nothing downloaded).

    The 8B-shaped bf16 Llama on CUDA; a tiny fp32 one for ``--quick`` or the emulated device.
    """
    from ...integrations.hf import llama_8b_config, random_causal_lm, tiny_llama_config

    dev = resolve_device(device)
    if dev.is_cuda and not quick:
        return random_causal_lm(llama_8b_config(), dtype=torch.bfloat16, device=dev.torch_device, seed=0), True, False
    config = tiny_llama_config(layers=4, hidden=256, heads=4, kv_heads=2, intermediate=512, vocab=4096)
    return random_causal_lm(config, dtype=torch.float32, device=dev.torch_device, seed=0), False, not dev.is_cuda


def _setup(quick: bool, device: str) -> tuple[Any, list[int], int, bool]:
    """``(model, prefix lengths, repeats, emulated)``."""
    model, full, emulated = bench_model(quick, device)
    return (model, [8192, 32768], 3, False) if full else (model, [512, 2048], 2, emulated)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def _measure(model: Any, lengths: list[int], repeats: int, directory: str) -> list[dict[str, Any]]:
    from ...integrations.hf import CachedGenerator, layout_for, reference_generate

    device = next(model.parameters()).device
    layout = layout_for(model, 16)
    vocab = int(model.config.vocab_size)
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    for length in lengths:
        blocks = -(-(length + SUFFIX + 16) // 16)
        prefix = rng.integers(0, vocab, length).tolist()

        def fresh(prefix: list[int] = prefix) -> list[int]:  # new tokens after the prefix: only it can be reused
            return prefix + [int(t) for t in rng.integers(0, vocab, SUFFIX)]

        def unseen(length: int = length) -> list[int]:  # a prompt of this length whose prefix nothing has seen
            return [int(t) for t in rng.integers(0, vocab, length + SUFFIX)]

        warm = rng.integers(0, vocab, 64).tolist()
        times: dict[str, list[float]] = {k: [] for k in ("recompute", "resident", "cold", "gpu", "host", "file")}
        phases: dict[str, list[dict[str, float]]] = {k: [] for k in times}
        dirty: dict[str, list[float]] = {k: [] for k in times}  # page cache not yet on disk as each request starts
        reused: dict[str, int] = {}
        computed_first: dict[str, int] = {}
        async with TieredKVCache(
            layout,
            gpu_blocks=blocks + 8,
            host_blocks=blocks + 8,
            file_blocks=blocks + 8,
            file_dir=directory,
            device=str(device) if device.type == "cuda" else "cpu",
            model_id=f"bench-model-{length}",
        ) as cache:
            cost = _RecordedCostModel(cache)  # unattached: fed by the generator, asked for hybrid splits
            gen = CachedGenerator(model, cache, cost_model=cost)
            try:
                await gen.generate(warm, max_new_tokens=1)  # warm up kernels and the model thread
                reference_generate(model, warm, max_new_tokens=1)
                await _train(gen, cache, length, vocab, rng)
                for _ in range(repeats):
                    _sync(device)
                    _, _, ttft = reference_generate(model, fresh(), max_new_tokens=1)
                    times["recompute"].append(ttft)
                past = _prefix_kv(model, prefix)
                for _ in range(repeats):
                    _sync(device)
                    _, _, ttft = reference_generate(model, fresh(), max_new_tokens=1, past=past)
                    times["resident"].append(ttft)
                del past
                prefix_bytes = -(-length // 16) * layout.bytes_per_block
                h2d_gbps = _pinned_h2d_gbps(prefix_bytes, device)
                file_gbps = _file_read_gbps(prefix_bytes, directory)
                # cold: a prefix never seen, with room (the earlier prompts evicted and every move awaited first)
                for _ in range(repeats):
                    await _drop_everything(cache)
                    dirty["cold"].append(_dirty_mb())
                    out = await gen.generate(unseen(), max_new_tokens=1)
                    if out.tokens_reused:
                        raise RuntimeError(f"a cold request reused {out.tokens_reused} tokens: {out.blocks_from}")
                    times["cold"].append(out.ttft_s)
                    phases["cold"].append(out.phases)
                await gen.generate(fresh(), max_new_tokens=1)  # the prefix the tier rows reuse, computed once
                # gpu first: a hybrid file request leaves the prefix's head in the file tier (its copies stay there)
                for tier in ("gpu", "host", "file"):
                    for _ in range(repeats):
                        await _place(cache, tier)
                        dirty[tier].append(_dirty_mb())
                        out = await gen.generate(fresh(), max_new_tokens=1)
                        times[tier].append(out.ttft_s)
                        phases[tier].append(out.phases)
                        reused[tier] = out.tokens_reused
                        computed_first[tier] = out.tokens_computed_first
                        if out.blocks_from.get(tier, 0) * 16 + out.tokens_computed_first < length - 16:
                            raise RuntimeError(f"the prefix was not found in the {tier} tier: {out.blocks_from}")
                fit = cost.statistics()
                estimate = cost.prefill_seconds(length + SUFFIX)  # the fitted prefill's view of a recompute
                overhead = cost.prefill_overhead_seconds()
            finally:
                gen.close()
        base = statistics.median(times["recompute"])
        for path, values in times.items():
            ttft = statistics.median(values)
            row: dict[str, Any] = {
                "bench": "ttft",
                "tokens": length,
                "path": path,
                "ttft_ms": ttft * 1e3,
                "vs_recompute": base / ttft,
                "tokens_reused": reused.get(path, 0),
            }
            if phases[path]:  # where the time went: the median of each phase over the repeats
                names = sorted({name for p in phases[path] for name in p})
                row["phases_ms"] = {
                    name: round(statistics.median(p.get(name, 0.0) for p in phases[path]) * 1e3, 3) for name in names
                }
            if dirty[path] and not math.isnan(dirty[path][0]):
                row["dirty_mb"] = round(statistics.median(dirty[path]), 1)
            if path == "host":
                floor = max(prefix_bytes / (h2d_gbps * 1e9), statistics.median(times["resident"]))
                row["floor_ms"] = floor * 1e3
                row["vs_floor"] = ttft / floor
                row["h2d_GBps"] = h2d_gbps
            if path == "file":
                load = prefix_bytes / (file_gbps * 1e9)
                floor = base * load / (base + load)  # compute the head while the tail loads, both ending together
                row["tokens_computed_first"] = computed_first.get(path, 0)
                row["floor_ms"] = floor * 1e3
                row["vs_floor"] = ttft / floor
                row["file_read_GBps"] = file_gbps
                row["load_ms"] = load * 1e3
                row["at_least_recompute"] = bool(ttft <= base)
                row["fitted_file_GBps"] = fit.bandwidth.get("file", 0.0) / 1e9
                row["fitted_prefill_tok_s"] = 1 / fit.prefill_s_per_token if fit.prefill_s_per_token else 0.0
                row["fitted_recompute_ms"] = estimate * 1e3 if estimate is not None else math.nan
                row["fitted_overhead_ms"] = overhead * 1e3
                row["prefill_observations"] = list(cost.recorded)  # what that fit saw
            rows.append(row)
    return rows


class _RecordedCostModel(CostModel):
    """A cost model that also keeps the forwards its fit sees, ``[tokens, past, rows, ms]``, for the JSON."""

    def __init__(self, cache: TieredKVCache, window: int = 64) -> None:
        super().__init__(cache, window=window)
        self.recorded: collections.deque[list[float]] = collections.deque(maxlen=window)  # the fit's window

    def observe_prefill(self, tokens: int, seconds: float, past: int = 0, rows: int = 1) -> None:
        self.recorded.append([tokens, past, rows, round(seconds * 1e3, 3)])
        super().observe_prefill(tokens, seconds, past=past, rows=rows)


async def _train(gen: Any, cache: TieredKVCache, length: int, vocab: int, rng: np.random.Generator) -> None:
    """Warm-up requests that teach the generator's cost model the run's rates, as a server's traffic would.

    Three prefix sizes (an eighth, a quarter and half of ``length``): each computed (a prefill), then loaded from the
    file tier and from host memory (admissions with bytes from each tier). Their blocks are evicted afterwards.
    """
    for size in (length // 8, length // 4, length // 2):
        head = rng.integers(0, vocab, size).tolist()
        for tier in ("gpu", "file", "host"):
            await _place(cache, tier)
            await gen.generate(head + rng.integers(0, vocab, SUFFIX).tolist(), max_new_tokens=1)
    await _drop_everything(cache)


def _file_read_gbps(nbytes: int, directory: str, chunk: int = 8 << 20, threads: int = 4) -> float:
    """GB/s of a cold read of ``nbytes`` from a file in ``directory`` (``threads`` readers of ``chunk`` bytes).

    O_DIRECT where the file system allows it (no page cache); otherwise the file's pages are dropped first
    (``posix_fadvise(DONTNEED)`` after an fsync). The file is removed afterwards.
    """
    import concurrent.futures
    import mmap

    path = os.path.join(directory, "read-rate.bin")
    pattern = np.random.default_rng(1).integers(0, 256, chunk, dtype=np.uint8).tobytes()
    try:
        with open(path, "wb") as f:
            for offset in range(0, nbytes, chunk):
                f.write(pattern[: min(chunk, nbytes - offset)])
            f.flush()
            os.fsync(f.fileno())
        direct = getattr(os, "O_DIRECT", 0)
        try:
            fd = os.open(path, os.O_RDONLY | direct)
        except OSError:
            direct, fd = 0, os.open(path, os.O_RDONLY)
        try:
            if not direct and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            buffers = [mmap.mmap(-1, chunk) for _ in range(threads)]  # page-aligned, as O_DIRECT needs

            def read(i: int) -> None:
                buf = buffers[i]
                for offset in range(i * chunk, nbytes, threads * chunk):
                    os.preadv(fd, [buf], offset)

            t = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(threads) as pool:
                list(pool.map(read, range(threads)))
            seconds = time.perf_counter() - t
        finally:
            os.close(fd)
    finally:
        try:
            os.remove(path)
        except OSError:
            pass
    return nbytes / seconds / 1e9


def _dirty_mb() -> float:
    """Megabytes of the page cache not yet on disk (``Dirty`` + ``Writeback`` of ``/proc/meminfo``; NaN without it).

    What the kernel still has to write back while a request runs.
    """
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return sum(int(fields[k].split()[0]) for k in ("Dirty", "Writeback")) / 1024
    except (OSError, KeyError, ValueError):
        return math.nan


def _prefix_kv(model: Any, prefix: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(keys, values)`` of ``prefix``, from one plain forward (the ``resident`` row's past)."""
    from transformers.cache_utils import DynamicCache

    from ...integrations.hf.model import cache_kwargs

    device = next(model.parameters()).device
    kv = DynamicCache()
    with torch.inference_mode():
        model(
            input_ids=torch.tensor([prefix], device=device), **cache_kwargs(model, kv), use_cache=True, logits_to_keep=1
        )
    layers: list[Any] = list(kv.layers)
    return [(layer.keys, layer.values) for layer in layers]


def _pinned_h2d_gbps(nbytes: int, device: torch.device, turns: int = 3) -> float:
    """The pinned host->device rate of one copy of ``nbytes`` (best of ``turns``); a memcpy rate on the CPU."""
    cuda = device.type == "cuda"
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(turns):
        _sync(device)
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


async def _drop_everything(cache: TieredKVCache) -> None:
    """Evict every unused cached block out of every tier (GPU -> host -> file -> dropped)."""
    for tier in (Tier.GPU, Tier.HOST, Tier.FILE):
        capacity = cache.blocks.capacity[tier]
        if capacity:
            await cache.evict(tier, capacity)
    for tier in (Tier.GPU, Tier.HOST, Tier.FILE):
        if cache.blocks.capacity[tier]:
            await cache.evict(tier, cache.blocks.capacity[tier])


async def _place(cache: TieredKVCache, tier: str) -> None:
    """Move the cached prefix down to ``tier`` (it is on the GPU after the previous request)."""
    if tier in ("host", "file"):
        await cache.evict(Tier.GPU, cache.blocks.capacity[Tier.GPU])
    if tier == "file":
        await cache.evict(Tier.HOST, cache.blocks.capacity[Tier.HOST])


def run(quick: bool = False, device: str = "auto") -> dict[str, Any]:
    """Measure every row (see the module docstring); returns the benchmark dict of :mod:`.common`."""
    if importlib.util.find_spec("transformers") is None:
        return {
            "name": "model",
            "machine": machine_info(device),
            "rows": [],
            "notes": ["not run: transformers is not installed (pip install 'tiered-kv[hf]')"],
        }
    t0 = time.perf_counter()
    model, lengths, repeats, emulated = _setup(quick, device)
    built = time.perf_counter() - t0
    directory = os.environ.get("TIERED_KV_BENCH_DIR") or None
    with tempfile.TemporaryDirectory(prefix="tiered-kv-bench-model-", dir=directory) as tmp:
        rows = asyncio.run(_measure(model, lengths, repeats, tmp))
    layers = model.config.num_hidden_layers
    params = sum(p.numel() for p in model.parameters())
    notes = [
        f"model: random Llama, {layers} layers, {params / 1e6:,.0f}M parameters, {next(model.parameters()).dtype}, "
        f"built in {built:.1f} s; {SUFFIX} new tokens after each prefix; median of {repeats} runs",
    ]
    if emulated:
        notes.append("emulated device: CPU figures, not comparable to the targets")
    return {"name": "model", "machine": machine_info(device), "rows": rows, "notes": notes}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tiered_kv.tools.bench.model``: run, print the table, write the JSON."""
    return bench_main("model", run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
