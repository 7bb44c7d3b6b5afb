"""``tiered-kv demo``: a real transformers model answers a seeded multi-turn chat through a three-tier cache.

Primitives:

* :class:`DemoConfig` -- sizes of the run (model, workload, tiers, device); sizes left unset take the device's
  defaults (:data:`CPU_SIZES`, :data:`GPU_SIZES`: on a GPU a larger model and longer shared prompts, where reuse
  pays as it does in a chat service).
* :func:`run_demo` -- replay the chat through :class:`~tiered_kv.integrations.hf.CachedGenerator`
  on a randomly initialised Llama (nothing downloaded): every turn resends the conversation so far (the
  model's own earlier replies included) after one of a few shared system prompts; every reused token's KV is
  checked against a recompute of the whole prompt without the cache, which also gives the TTFT without it.
* :class:`DemoReport` -- hit rate and hits per tier, bytes moved, TTFT with vs without, the check's figures,
  one sample per turn; ``to_json()``.
* :func:`ttft_by_source` -- TTFT with and without the cache per tier the reused prefix came from.
* :func:`print_report`, :func:`plot_report` (matplotlib), :func:`check_outputs` (``--plot``/``--json``
  paths and matplotlib are checked before the run, not after it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..cache import TieredKVCache
from ..cost_model import CostModel
from .bench.common import percentile, print_table
from .workload import ChatWorkload

__all__ = [
    "CPU_SIZES",
    "GPU_SIZES",
    "DemoConfig",
    "DemoReport",
    "DemoSizes",
    "check_outputs",
    "kv_difference",
    "plot_report",
    "print_report",
    "run_demo",
    "ttft_by_source",
]

#: A reused token's KV may differ from a recompute's by rounding, relative to the largest magnitude in its layer's K
#: or V: two plain forwards of one prompt at different lengths differ by up to ~5e-4 of it (the 16-layer fp32 GPU
#: model on an H200: matrix products of other shapes sum in another order, and the differences grow layer by
#: layer). KV from a wrong block or position is off by about that magnitude itself.
KV_TOLERANCE = 1e-2


def kv_difference(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Per position, the largest ``|got - want|`` over heads and dims, relative to ``want``'s largest magnitude.

    ``got`` and ``want`` are one layer's K (or V), ``[heads, positions, head_dim]``.
    """
    scale = want.abs().amax().clamp_min(torch.finfo(want.dtype).tiny)
    return (got - want).abs().amax(dim=(0, 2)) / scale


@dataclasses.dataclass(frozen=True, slots=True)
class DemoConfig:
    """Sizes of a demo run; a size left ``None`` takes the device's default (:data:`CPU_SIZES`, :data:`GPU_SIZES`).

    Attributes:
        device: ``"auto"`` (CUDA if present, else the emulated device), ``"cpu"`` or ``"cuda[:N]"``.
        seed: seeds the workload and the model's weights.
        conversations: conversations to replay.
        system_tokens: tokens of each shared system prompt.
        max_new_tokens: longest reply (the workload draws each reply's length up to this).
        gpu_blocks, host_blocks, file_blocks: tier sizes in blocks of 16 tokens (``file_blocks=0``: no file tier).
        directory: the file tier's directory (default: a temporary one, removed afterwards).
        remote: a store URL (``redis://...``, ``mooncake://...``): the cache's remote tier (none by default).
        layers, hidden, vocab: the model's shape (heads of 64 dims, half as many KV heads).
    """

    device: str = "auto"
    seed: int = 0
    conversations: int = 24
    system_tokens: int | None = None
    max_new_tokens: int = 24
    gpu_blocks: int | None = None
    host_blocks: int | None = None
    file_blocks: int | None = None
    directory: str | None = None
    remote: str | None = None
    layers: int | None = None
    hidden: int | None = None
    vocab: int | None = None

    def sizes(self, cuda: bool) -> DemoSizes:
        """This run's sizes: those set here, the rest from :data:`GPU_SIZES` (``cuda``) or :data:`CPU_SIZES`."""
        defaults = GPU_SIZES if cuda else CPU_SIZES
        chosen = {f.name: getattr(self, f.name) for f in dataclasses.fields(DemoSizes)}
        return dataclasses.replace(defaults, **{k: v for k, v in chosen.items() if v is not None})


@dataclasses.dataclass(frozen=True, slots=True)
class DemoSizes:
    """The sizes of a run (the fields of :class:`DemoConfig` that default per device)."""

    system_tokens: int
    gpu_blocks: int
    host_blocks: int
    file_blocks: int
    layers: int
    hidden: int
    vocab: int


#: The emulated device's sizes: a model small enough for about a minute on 2 CPU cores.
CPU_SIZES = DemoSizes(
    system_tokens=384, gpu_blocks=80, host_blocks=64, file_blocks=1024, layers=4, hidden=256, vocab=4096
)

#: A GPU's sizes: a ~0.75B-parameter model and 2,048-token system prompts, so a reused prefix is most of a prompt
#: (as in a chat service) and the tiers are smaller than the conversations (hits come from all three). A block
#: holds 2 MiB of fp32 KV: 512 MiB of GPU tier, 512 MiB of pinned host memory, up to 2 GiB of file tier.
GPU_SIZES = DemoSizes(
    system_tokens=2048, gpu_blocks=256, host_blocks=256, file_blocks=1024, layers=16, hidden=2048, vocab=32000
)


@dataclasses.dataclass(frozen=True, slots=True)
class DemoReport:
    """What a demo run measured.

    Attributes:
        device: where it ran (``"emulated (CPU)"`` or the GPU's name); ``emulated``: not a GPU.
        model: the model, in words.
        turns, prompt_tokens, reused_tokens, hit_rate: the replay's totals.
        hits: reused full blocks per tier; ``capacity``: blocks per tier; ``evictions``: moves and drops.
        bytes_moved: engine bytes per direction.
        verified_tokens, mismatched_tokens, max_kv_diff: the past each turn's model attended to (reused tokens,
            plus any head computed while the rest loaded) checked against a recompute, how many tokens differed by
            more than :data:`KV_TOLERANCE`, the largest difference seen (both as in :func:`kv_difference`).
        first_token_agree: turns whose first generated token equals the recompute's greedy token.
        ttft_with, ttft_without: seconds to the first token per turn, through the cache / recomputing it all.
        wall_s: seconds of the replay.
        reuse: the cost model's decisions (:class:`~tiered_kv.cost_model.ReuseStatistics` as a dict): blocks
            skipped per tier, estimated seconds saved, measured bandwidth per tier, prefill time per token.
        samples: one dict per turn (time, hits, occupancy per tier, TTFTs) for plots.
        remote: the remote tier's statistics (a dict), if the run had one.
    """

    device: str
    emulated: bool
    model: str
    turns: int
    prompt_tokens: int
    reused_tokens: int
    hit_rate: float
    hits: dict[str, int]
    capacity: dict[str, int]
    evictions: dict[str, int]
    bytes_moved: dict[str, int]
    verified_tokens: int
    mismatched_tokens: int
    max_kv_diff: float
    first_token_agree: int
    ttft_with: list[float]
    ttft_without: list[float]
    wall_s: float
    reuse: dict[str, Any]
    samples: list[dict[str, Any]]
    remote: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (every field, plus TTFT percentiles)."""
        out = dataclasses.asdict(self)
        for name in ("ttft_with", "ttft_without"):
            values = getattr(self, name)
            out[f"{name}_p50_s"] = percentile(values, 50)
            out[f"{name}_p90_s"] = percentile(values, 90)
        out["ttft_by_source"] = ttft_by_source(self.samples)
        return out


#: Where a turn's reused prefix came from: the slowest tier that supplied any of its blocks.
SOURCES = ("remote", "file", "host", "gpu")


def ttft_by_source(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """TTFT per source of the reused prefix: turns, p50 with and without the cache, the speed-up of the medians.

    A turn's source is ``"none"`` (nothing reused) or the slowest tier that supplied any of its blocks.
    """
    groups: dict[str, list[dict[str, Any]]] = {}
    for sample in samples:
        source = "none"
        if sample["tokens_reused"]:
            source = next((t for t in SOURCES if sample["blocks_from"].get(t)), "gpu")  # a partial block only: gpu
        groups.setdefault(source, []).append(sample)
    rows = []
    for source in ("none", *reversed(SOURCES)):
        if source in groups:
            w = percentile([d["ttft_with"] for d in groups[source]], 50)
            wo = percentile([d["ttft_without"] for d in groups[source]], 50)
            rows.append(
                {
                    "prefix from": source,
                    "turns": len(groups[source]),
                    "with_ms": w * 1e3,
                    "without_ms": wo * 1e3,
                    "speed_up": wo / w if w > 0 else float("nan"),
                }
            )
    return rows


def _model_config(cfg: DemoSizes) -> Any:
    from ..integrations.hf import tiny_llama_config

    heads = max(1, cfg.hidden // 64)
    return tiny_llama_config(
        layers=cfg.layers,
        hidden=cfg.hidden,
        heads=heads,
        kv_heads=max(1, heads // 2),
        intermediate=2 * cfg.hidden,
        vocab=cfg.vocab,
        max_positions=16384,
    )


def check_outputs(plot: str | None, json_path: str | None) -> None:
    """Fail now (``ValueError``, one sentence) if ``--plot``/``--json`` could not be written after the run."""
    for path, what in ((plot, "--plot"), (json_path, "--json")):
        if path is None:
            continue
        parent = os.path.dirname(os.path.abspath(path))
        if not (os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK)):
            raise ValueError(f"{what} {path}: directory {parent} does not exist or is not writable")
        if os.path.isdir(path):
            raise ValueError(f"{what} {path} is a directory; give a file name")
    if plot is not None:
        if os.path.splitext(plot)[1].lower() not in (".png", ".svg", ".pdf"):
            raise ValueError(f"--plot {plot}: use a .png, .svg or .pdf file name")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib: pip install 'tiered-kv[examples]'") from None


async def run_demo(cfg: DemoConfig, progress: Callable[[int, int], None] | None = None) -> DemoReport:
    """Replay the chat through a real model and the cache; check every reused token's KV against a recompute.

    Args:
        cfg: sizes.
        progress: ``callback(done, total)`` after every turn.

    Raises:
        ValueError: bad sizes or device (before the run starts).

    Notes:
        Cancellation: the turn in progress stops (its forward finishes first), the cache is closed and the
        temporary directory removed.
    """
    from ..device import resolve_device
    from ..integrations.hf import CachedGenerator, layout_for, random_causal_lm
    from ..integrations.hf.model import output_cache

    dev = resolve_device(cfg.device)
    torch_device = dev.torch_device
    size = cfg.sizes(dev.is_cuda)
    model = random_causal_lm(_model_config(size), dtype=torch.float32, device=torch_device, seed=cfg.seed)
    description = f"Llama, {size.layers} layers, hidden {size.hidden}, vocab {size.vocab}, fp32, random weights"
    workload = ChatWorkload(
        seed=cfg.seed,
        conversations=cfg.conversations,
        system_prompts=3,
        system_tokens=size.system_tokens,
        turns=(2, 5),
        user_tokens=(16, 96),
        output_tokens=(4, cfg.max_new_tokens),
        concurrency=8,
        vocab=size.vocab,
    )
    turns = list(workload)
    emulated = not dev.is_cuda
    device_name = "emulated (CPU)" if emulated else torch.cuda.get_device_name(torch_device)

    with torch.inference_mode():  # warm up (first-call allocations) so turn 0 is not charged for them
        model(input_ids=torch.zeros(1, 64, dtype=torch.long, device=torch_device))
    captured: list[list[tuple[torch.Tensor, torch.Tensor]]] = []

    def on_reuse(seq_ids: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        captured.append([(k[0].clone(), v[0].clone()) for k, v in kv])

    ttft_with: list[float] = []
    ttft_without: list[float] = []
    samples: list[dict[str, Any]] = []
    verified = mismatched = agree = 0
    max_diff = 0.0
    with tempfile.TemporaryDirectory(prefix="tiered-kv-demo-") as tmp:
        directory = cfg.directory or tmp
        async with TieredKVCache(
            layout_for(model, 16),
            gpu_blocks=size.gpu_blocks,
            host_blocks=size.host_blocks,
            file_blocks=size.file_blocks,
            file_dir=directory if size.file_blocks else None,
            device=str(torch_device) if dev.is_cuda else "cpu",
            model_id=f"tiered-kv-demo/{description}/seed={cfg.seed}",
            remote=cfg.remote,
        ) as cache:
            cost = CostModel(cache).attach()  # reuse a tier's blocks only where that beats recomputing them
            generator = CachedGenerator(model, cache, on_reuse=on_reuse, cost_model=cost)
            history: dict[int, np.ndarray] = {}  # conversation -> what the model has seen and said so far
            scripted: dict[int, int] = {}  # conversation -> length of the workload's own history
            t_start = time.perf_counter()
            try:
                for done, turn in enumerate(turns, 1):
                    user = turn.prompt[scripted.get(turn.conversation, 0) :]
                    scripted[turn.conversation] = len(turn.prompt) + len(turn.output)
                    prompt = np.concatenate((history.get(turn.conversation, np.zeros(0, np.int64)), user))
                    captured.clear()
                    out = await generator.generate(prompt, max_new_tokens=len(turn.output))
                    history[turn.conversation] = np.concatenate((prompt, np.asarray(out.tokens, dtype=np.int64)))
                    ttft_with.append(out.ttft_s)
                    # without the cache: the whole prompt recomputed (also the reference KV)
                    ids = torch.from_numpy(prompt).reshape(1, -1).to(torch_device)
                    t0 = time.perf_counter()
                    with torch.inference_mode():
                        ref = model(input_ids=ids, use_cache=True, logits_to_keep=1)
                        first = int(ref.logits[0, -1].argmax().item())
                    ttft_without.append(time.perf_counter() - t0)
                    agree += first == out.tokens[0]
                    # the past the model attended to: a head computed while the rest loaded, then the reused tokens
                    r = out.tokens_computed_first + out.tokens_reused
                    if r:
                        assert captured, "the generator reported reuse without showing the reused KV"
                        worst = torch.zeros(r, device=torch_device)
                        for (k, v), layer in zip(captured[0], output_cache(ref).layers, strict=True):
                            for got, want in ((k, layer.keys[0, :, :r]), (v, layer.values[0, :, :r])):
                                worst = torch.maximum(worst, kv_difference(got, want))
                        verified += r
                        mismatched += int((worst > KV_TOLERANCE).sum().item())
                        max_diff = max(max_diff, float(worst.max().item()))
                    s = cache.statistics()
                    samples.append(
                        {
                            "t": time.perf_counter() - t_start,
                            "turn": turn.index,
                            "prompt_tokens": len(prompt),
                            "tokens_reused": r,
                            "blocks_from": dict(out.blocks_from),
                            "hit_rate": s.hit_rate,
                            "hits": dict(s.hits),
                            "used": {t: s.blocks.capacity[t] - s.blocks.free[t] for t in s.blocks.capacity},
                            "ttft_with": out.ttft_s,
                            "ttft_without": ttft_without[-1],
                        }
                    )
                    if progress is not None:
                        progress(done, len(turns))
            finally:
                generator.close()
            wall = time.perf_counter() - t_start
            stats = cache.statistics()
            reuse = dataclasses.asdict(cost.statistics())
    capacity = {t: n for t, n in stats.blocks.capacity.items() if n}
    return DemoReport(
        device=device_name,
        emulated=emulated,
        model=description,
        turns=len(turns),
        prompt_tokens=stats.tokens_requested,
        reused_tokens=stats.tokens_reused,
        hit_rate=stats.hit_rate,
        hits={t: stats.hits.get(t, 0) for t in (*capacity, *(("remote",) if stats.remote else ()))},
        capacity=capacity,
        evictions=dict(stats.evictions),
        bytes_moved=dict(stats.bytes_moved),
        verified_tokens=verified,
        mismatched_tokens=mismatched,
        max_kv_diff=max_diff,
        first_token_agree=agree,
        ttft_with=ttft_with,
        ttft_without=ttft_without,
        wall_s=wall,
        reuse=reuse,
        samples=samples,
        remote=dataclasses.asdict(stats.remote) if stats.remote is not None else None,
    )


def print_report(report: DemoReport) -> None:
    """The tables a person reads: tiers, the KV check, TTFT with vs without, bytes per direction."""
    where = report.device + (" -- CPU figures, not comparable to GPU targets" if report.emulated else "")
    print(f"\n{report.model} on {where}")
    print_table(
        [
            {
                "tier": t,
                "capacity_blocks": c,
                "block_hits": report.hits.get(t, 0),
                "evicted_from": sum(v for k, v in report.evictions.items() if k.startswith(t + "->")),
            }
            for t, c in report.capacity.items()
        ],
        f"\n{report.turns} turns, {report.prompt_tokens} prompt tokens, {report.reused_tokens} reused "
        f"(hit rate {report.hit_rate:.0%})",
    )
    print(
        f"\nreused KV checked against a recompute without the cache: {report.verified_tokens} tokens, "
        f"{report.mismatched_tokens} wrong (largest difference {report.max_kv_diff:.1e} of the layer's largest "
        f"value, tolerance {KV_TOLERANCE:g}); "
        f"first token equal to the recompute's in {report.first_token_agree} of {report.turns} turns"
    )
    rows = []
    for q in (50, 90):
        w, wo = percentile(report.ttft_with, q), percentile(report.ttft_without, q)
        rows.append(
            {
                "TTFT": f"p{q}",
                "with the cache (ms)": w * 1e3,
                "recomputing the prompt (ms)": wo * 1e3,
                "speed-up": wo / w if w > 0 else float("nan"),
            }
        )
    print_table(rows, "\ntime to first token")
    print_table(ttft_by_source(report.samples), "\ntime to first token (p50, ms) by where the reused prefix came from")
    if report.emulated:
        print(
            "\nemulated device: the model and every copy ran on this CPU, so these times show what the cache does "
            "(hits per tier, the checks, the cost model's choices), not what it saves on a GPU; run it on a CUDA "
            "machine (--device cuda) for that"
        )
    print_table(
        [{"direction": d, "MiB": b / 2**20} for d, b in sorted(report.bytes_moved.items())],
        "\nbytes moved per direction",
    )
    r = report.reuse
    measured = ", ".join(f"{t}->gpu {bw / 1e9:.2f} GB/s" for t, bw in r["bandwidth"].items()) or "none yet"
    skipped = ", ".join(f"{t} {n}" for t, n in r["skipped_blocks"].items()) or "none"
    print(
        f"\ncost-aware reuse: {r['decisions']} admissions priced (measured {measured}; prefill "
        f"{r['prefill_s_per_token'] * 1e6:.1f} us/token); blocks left to recompute: {skipped}; estimated time saved "
        f"{r['saved_vs_reuse_all_s'] * 1e3:.1f} ms against reusing everything, {r['saved_vs_recompute_s']:.2f} s "
        "against recomputing everything"
    )
    if report.remote is not None:
        r = report.remote
        rows = [
            {
                "op": op,
                "round trips": r["batches"][op],
                "objects": r["blocks"][op],
                "MiB": r["bytes"][op] / 2**20,
                "mean ms per batch": r["seconds"][op] / r["batches"][op] * 1e3 if r["batches"][op] else 0.0,
            }
            for op in ("get", "put")
        ]
        print_table(
            rows,
            f"\nremote tier {r['url']} ({'available' if r['available'] else 'UNAVAILABLE'}): "
            f"{report.hits.get('remote', 0)} block hits, {r['blocks']['miss']} misses, "
            f"{r['blocks']['bad']} objects failed verification, {r['errors']} errors",
        )
    print(f"\nwall {report.wall_s:.1f} s")


def plot_report(report: DemoReport, path: str) -> None:
    """Hit rate and hits per tier over time, tier occupancy against capacity, TTFT with vs without."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = report.samples
    x = [d["turn"] for d in s]
    fig, (hits, occ, ttft) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    hits.plot(x, [d["hit_rate"] for d in s], color="black", label="hit rate (cumulative)")
    hits.set_ylim(0, 1)
    hits.set_ylabel("hit rate")
    per_tier = hits.twinx()
    for tier in report.capacity:
        per_tier.plot(x, [d["hits"].get(tier, 0) for d in s], label=f"{tier} block hits", alpha=0.7)
    per_tier.set_ylabel("block hits (cumulative)")
    hits.legend(loc="upper left")
    per_tier.legend(loc="lower right")
    for tier, cap in report.capacity.items():
        line = occ.plot(x, [d["used"].get(tier, 0) / cap for d in s], label=f"{tier} ({cap} blocks)")[0]
        line.set_drawstyle("steps-post")
    occ.set_ylim(0, 1.05)
    occ.set_ylabel("occupancy / capacity")
    occ.legend(loc="lower right")
    ttft.plot(x, [d["ttft_without"] * 1e3 for d in s], ".", label="recomputing the prompt")
    ttft.plot(x, [d["ttft_with"] * 1e3 for d in s], ".", label="with tiered_kv")
    ttft.set_yscale("log")
    ttft.set_ylabel("TTFT (ms)")
    ttft.set_xlabel("turn")
    ttft.legend()
    where = "the emulated device (CPU figures, not GPU figures)" if report.emulated else report.device
    fig.suptitle(f"tiered-kv demo on {where}\n{report.model}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(report: DemoReport, path: str) -> None:
    """Write :meth:`DemoReport.to_json` to ``path``."""
    with open(path, "w") as f:
        json.dump(report.to_json(), f, indent=2)
