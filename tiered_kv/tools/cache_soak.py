"""A seeded soak of the prefix cache over all three tiers, with file faults; every reused token is checked.

Primitives:

* :class:`CacheSoakConfig` -- sizes, tasks, fault / stall / cancellation rates, how long to run.
* :func:`cache_soak` -- runs it; returns a :class:`CacheSoakReport` or raises :class:`CacheSoakFailure`.

Many tasks on one loop run ``add_sequences`` / ``commit`` / ``append_tokens`` / ``free`` on prompts that
share prefixes (a few families of base token sequences, each prompt a prefix of one plus a random tail), on
a :class:`~tiered_kv.TieredKVCache` over GPU, host and file tiers. Random stalls hold the engine's streams,
random faults hit the file tier (EIO and ENOSPC on writes, short writes, EIO and short reads), and random
cancellations interrupt ``add_sequences``. The oracle is per token: the KV a task writes for token ``j``
is a function of the key of the prefix that ends at ``j`` (:mod:`tiered_kv.tools.workload`), so every
reused token is checked against what its prefix must hold. A :class:`~tiered_kv.TransferError` (a failed
copy surfacing) is allowed and counted; a wrong token never is. At the end the block manager's invariants
hold, nothing is left in flight, and ``close()`` leaves no thread behind.

Run: ``tiered-kv soak --cache --ops 2000`` or ``await cache_soak(CacheSoakConfig(ops=2_000))``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import tempfile
import time
from collections.abc import Callable

import torch

from ..blocks import CacheFullError, Request
from ..cache import TieredKVCache
from ..device import stall_op
from ..engine import TransferEngine
from ..errors import TransferError
from ..faults import FaultyBackend
from ..layout import KVLayout
from .soak_common import faulty_file_config, leaked_threads, left_in_flight, threads_now
from .workload import verify_expected, write_expected

__all__ = ["CacheSoakConfig", "CacheSoakFailure", "CacheSoakReport", "cache_soak"]


@dataclasses.dataclass(frozen=True, slots=True)
class CacheSoakConfig:
    """What a cache soak does.

    Attributes:
        ops: admissions (``add_sequences`` calls) in all.
        min_verified_tokens: keep going past ``ops`` until this many reused tokens were verified (0: no floor).
        seed: seeds prompts, stalls, faults and cancellations.
        tasks: concurrent tasks.
        device: ``"cpu"`` (emulated) or ``"cuda[:N]"``.
        gpu_blocks / host_blocks / file_blocks: tier sizes (small, so blocks cascade down often).
        families: distinct base token sequences prompts share prefixes of.
        max_prompt: longest prompt (tokens).
        append_prob: chance a turn appends generated tokens before it frees.
        stall_prob / stall_max: chance, per turn, of stalling a random stream for up to ``stall_max`` seconds.
        fault_rate: share of file I/O calls that fail (split over EIO/ENOSPC/short writes, EIO/short reads).
        cancel_prob: chance that an ``add_sequences`` is cancelled mid-way.
        layout: block geometry (tiny by default: the oracle is per token).
        remote: a store URL (``redis://...``, ``mooncake://...``): the cache gets a remote tier, so blocks
            also come back from the store (verified) and are put to it; ``None``: no remote tier.
        remote_policy: the cache's ``remote_policy`` (``"commit"``, ``"evict"``, ``"off"``).
    """

    ops: int = 2_000
    min_verified_tokens: int = 0
    seed: int = 0
    tasks: int = 16
    device: str = "cpu"
    gpu_blocks: int = 64
    host_blocks: int = 24
    file_blocks: int = 96
    families: int = 6
    max_prompt: int = 40
    append_prob: float = 0.3
    stall_prob: float = 0.05
    stall_max: float = 0.002
    fault_rate: float = 0.03
    cancel_prob: float = 0.03
    layout: KVLayout = dataclasses.field(
        default_factory=lambda: KVLayout(
            num_layers=2, num_kv_heads=1, head_dim=8, tokens_per_block=4, dtype=torch.float16
        )
    )
    remote: str | None = None
    remote_policy: str = "commit"

    def __post_init__(self) -> None:
        for name in ("ops", "tasks", "gpu_blocks", "families", "max_prompt"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"CacheSoakConfig.{name} must be a positive int, got {value!r}")
        for name in ("append_prob", "stall_prob", "fault_rate", "cancel_prob"):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise ValueError(f"CacheSoakConfig.{name} must be in [0, 1], got {value!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class CacheSoakReport:
    """What a cache soak did.

    Attributes:
        admissions: ``add_sequences`` calls that returned.
        tokens_requested: prompt tokens admitted.
        verified_tokens: reused tokens whose content was checked (all of them).
        wrong_tokens: reused tokens with wrong content (always 0 in a report: a wrong token raises).
        hits: reused full blocks per tier.
        transfer_errors: admissions that failed with :class:`~tiered_kv.TransferError` (a fault surfacing).
        cache_full: admissions retried because the batch did not fit.
        cancelled: admissions cancelled mid-way.
        faults: file I/O calls that failed or came short.
        poisoned: blocks the cache dropped because a copy producing them failed.
        appended: tokens appended.
        seconds: wall time.
    """

    seed: int
    admissions: int
    tokens_requested: int
    verified_tokens: int
    wrong_tokens: int
    hits: dict[str, int]
    transfer_errors: int
    cache_full: int
    cancelled: int
    faults: int
    poisoned: int
    appended: int
    seconds: float


class CacheSoakFailure(AssertionError):
    """The cache served a wrong token (or left something behind); carries the seed that reproduces it."""

    def __init__(self, message: str, seed: int) -> None:
        super().__init__(f"{message}\n  reproduce with seed={seed}")
        self.seed = seed


async def cache_soak(config: CacheSoakConfig, *, progress: Callable[[int, int], None] | None = None) -> CacheSoakReport:
    """Run the soak; raise :class:`CacheSoakFailure` on a wrong token, a broken invariant or a leak.

    Args:
        config: what to run.
        progress: called with ``(admissions, verified tokens)`` every 100 admissions.

    Cancellation: cancels the run; the cache is closed (its copies complete) before this returns.
    """
    threads_before = threads_now()
    rng = random.Random(config.seed)
    layout = config.layout
    tpb = layout.tokens_per_block
    bases = [[rng.randrange(1, 2**40) for _ in range(config.max_prompt)] for _ in range(config.families)]
    backends: list[FaultyBackend] = []
    counts = {"admissions": 0, "requested": 0, "verified": 0, "transfer_errors": 0, "cache_full": 0, "cancelled": 0,
              "appended": 0, "started": 0}
    hits = {"gpu": 0, "host": 0, "file": 0, **({"remote": 0} if config.remote else {})}
    failures: list[str] = []
    t0 = time.perf_counter()

    def done() -> bool:
        return bool(failures) or (counts["started"] >= config.ops and counts["verified"] >= config.min_verified_tokens)

    with contextlib.ExitStack() as stack:
        directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="tiered-kv-cache-soak-"))
        file_config = (
            faulty_file_config(directory, config.file_blocks, config.seed, config.fault_rate, backends)
            if config.file_blocks
            else None
        )
        engine = TransferEngine(layout, gpu_blocks=config.gpu_blocks, host_blocks=config.host_blocks,
                                device=config.device, file_config=file_config)
        cache = TieredKVCache(layout, gpu_blocks=config.gpu_blocks, host_blocks=config.host_blocks,
                              file_blocks=config.file_blocks, engine=engine, max_seqs=config.tasks * 2,
                              remote=config.remote, remote_policy=config.remote_policy,
                              model_id=f"cache-soak/{config.seed}/{time.time_ns()}" if config.remote else "default")
        streams = [engine.stream(name) for name in ("offload", "onboard", "local")]

        def check(seq_id: int, reused: int, what: str) -> None:
            bad = verify_expected(cache, seq_id, 0, reused)
            counts["verified"] += reused
            if bad:
                tokens = cache.blocks.sequence_tokens(seq_id)
                failures.append(f"{what}: {len(bad)} of {reused} reused tokens have wrong KV (first at position "
                                f"{bad[0]} of a {len(tokens)}-token prompt)")

        async def admit(prompt: list[int], prio: int, cancel: bool) -> tuple[int, int] | None:
            """An admission's (sequence id, tokens reused), or None (cancelled, or a copy failed)."""
            while True:
                task = asyncio.ensure_future(cache.add_sequences([Request(prompt, prio)]))
                if cancel:
                    await asyncio.sleep(rng.random() * 1e-3)
                    task.cancel()
                try:
                    [adm] = await task
                except asyncio.CancelledError:
                    if not cancel:
                        raise
                    counts["cancelled"] += 1
                    return None
                except CacheFullError:
                    counts["cache_full"] += 1
                    await asyncio.sleep(0.001)
                    continue
                except TransferError:
                    counts["transfer_errors"] += 1
                    return None
                counts["admissions"] += 1
                counts["requested"] += len(prompt)
                for tier, n in adm.blocks_from.items():
                    hits[tier] += n
                served = ", ".join(f"{t} {n}" for t, n in adm.blocks_from.items() if n)
                what = f"admission of seed {config.seed} (blocks from {served or 'none'})"
                check(adm.seq_id, adm.tokens_reused, what)
                return adm.seq_id, adm.tokens_reused

        async def worker(w: int) -> None:
            local = random.Random(config.seed * 1_000_003 + w)
            while not done():
                counts["started"] += 1
                base = bases[local.randrange(config.families)]
                n = local.randint(1, config.max_prompt - tpb)
                prompt = base[:n] + [local.randrange(1, 2**40) for _ in range(local.randint(0, tpb))]
                if local.random() < config.stall_prob:
                    stream = local.choice(streams)
                    stream.submit(stall_op(stream, local.random() * config.stall_max))
                admitted = await admit(prompt, local.randint(0, 100), local.random() < config.cancel_prob)
                if admitted is None:
                    continue
                seq_id, reused = admitted
                try:
                    write_expected(cache, seq_id, reused)  # play the model: the tokens not reused
                    if local.random() < 0.5:
                        await asyncio.sleep(0)  # another task runs between compute and commit
                    cache.commit(seq_id)
                    if local.random() < config.append_prob:
                        extra = [local.randrange(1, 2**40) for _ in range(local.randint(1, 2 * tpb))]
                        before = len(prompt)
                        try:
                            await cache.append_tokens(seq_id, extra)
                        except CacheFullError:
                            counts["cache_full"] += 1
                        else:
                            write_expected(cache, seq_id, before, before + len(extra) - 1)
                            cache.commit(seq_id, before + len(extra) - 1)
                            counts["appended"] += len(extra)
                finally:
                    cache.free(seq_id)
                if progress is not None and counts["admissions"] % 100 == 0:
                    progress(counts["admissions"], counts["verified"])

        try:
            async with engine, cache:
                await asyncio.gather(*(worker(w) for w in range(config.tasks)))
                await cache.flush()  # the remote tier's background puts hold read fences until they are staged
                await engine.drain()
                try:
                    cache.blocks.check()
                except AssertionError as exc:
                    failures.append(f"block manager invariant broken: {exc}")
                stats = left_in_flight(engine)
                if stats is not None:
                    failures.append(f"left in flight after drain: {stats}")
                if cache.blocks.live_sequences:
                    failures.append(f"sequences left: {cache.blocks.live_sequences}")
                poisoned = cache.statistics().poisoned
        finally:
            await engine.close()
    leaked = await leaked_threads(threads_before, grace=5)
    if leaked:
        failures.append(f"threads left after close(): {leaked}")
    if failures:
        raise CacheSoakFailure(failures[0], config.seed)
    return CacheSoakReport(
        config.seed, counts["admissions"], counts["requested"], counts["verified"], 0, hits, counts["transfer_errors"],
        counts["cache_full"], counts["cancelled"], sum(b.faults for b in backends), poisoned, counts["appended"],
        time.perf_counter() - t0,
    )

