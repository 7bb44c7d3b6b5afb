"""A seeded soak of the transfer engine: random copies, stalls, cancellations; a shadow model checks every byte.

Many tasks issue random copies among the engine's tiers (full and partial), with random stalls on every
stream and random cancellation of awaiting tasks. Because the fences order each block's accesses by the
order ``copy()`` was called, the content every block must hold is the result of applying the copies in
issue order: a CPU *shadow* of every pool is updated at each ``copy()`` call. When a copy completes, each
destination block that no later copy has been issued to write must equal the shadow's value as of that
copy; at the end every block of every pool must equal the shadow. Then no fence, deferred op or engine
thread may be left, and ``close()`` must return promptly.

The op sequence is a pure function of the seed (timing only changes the interleaving), so a failure
prints the seed and the shortest prefix of the op log that still fails, found by replaying prefixes.

Run: ``tiered-kv soak --ops 1000000 --seed 7`` or ``await soak(SoakConfig(ops=20_000))`` from a test.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ..engine import Transfer, TransferEngine
from ..layout import KVLayout
from ..pools import Tier
from ..testing import stall

__all__ = ["LoadReport", "SoakConfig", "SoakFailure", "SoakReport", "generate_ops", "load", "soak"]


@dataclasses.dataclass(frozen=True, slots=True)
class SoakConfig:
    """What a soak run does.

    Attributes:
        ops: copies to issue in all.
        seed: seeds the op sequence, stalls and cancellations.
        tasks: concurrent tasks issuing copies.
        device: ``"cpu"`` (emulated) or ``"cuda"``.
        gpu_blocks / host_blocks: pool sizes (small, so copies collide often).
        max_blocks: most blocks in one copy.
        partial_prob: share of copies that move only the first ``num_tokens`` tokens.
        stall_prob: chance, before a copy, of stalling a random stream for up to ``stall_max`` seconds.
        cancel_prob: chance that the task awaiting a copy is cancelled mid-wait.
        forget_prob: chance that a copy is not awaited at all (fire and forget).
        layout: block geometry (small by default, so the shadow checks are cheap).
    """

    ops: int = 20_000
    seed: int = 0
    tasks: int = 16
    device: str = "cpu"
    gpu_blocks: int = 24
    host_blocks: int = 24
    max_blocks: int = 6
    partial_prob: float = 0.25
    stall_prob: float = 0.02
    stall_max: float = 0.002
    cancel_prob: float = 0.05
    forget_prob: float = 0.1
    layout: KVLayout = dataclasses.field(
        default_factory=lambda: KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=4, dtype=torch.float16)
    )


@dataclasses.dataclass(frozen=True, slots=True)
class SoakReport:
    """What a soak run did (every count is of the run as a whole)."""

    seed: int
    ops: int
    completed: int
    awaited: int
    cancelled: int
    forgotten: int
    stalls: int
    checked_blocks: int
    seconds: float
    close_seconds: float


class SoakFailure(AssertionError):
    """A block differed from the shadow model (or something was left behind); carries the reproducer."""

    def __init__(self, message: str, seed: int, op_log: list[str]):
        super().__init__(f"{message}\n  seed={seed}; shortest failing op log ({len(op_log)} ops):\n    " + "\n    ".join(op_log[-40:]))
        self.seed = seed
        self.op_log = op_log


@dataclasses.dataclass(frozen=True, slots=True)
class _Op:
    src: Tier
    src_idx: tuple[int, ...]
    dst: Tier
    dst_idx: tuple[int, ...]
    num_tokens: int | None
    stall: tuple[str, float] | None
    mode: str  # "await", "cancel", "forget"

    def __str__(self) -> str:
        tok = f", num_tokens={self.num_tokens}" if self.num_tokens else ""
        st = f"stall({self.stall[0]}, {self.stall[1] * 1e3:.2f} ms); " if self.stall else ""
        return f"{st}copy({self.src.name}, {list(self.src_idx)}, {self.dst.name}, {list(self.dst_idx)}{tok})  [{self.mode}]"


def generate_ops(config: SoakConfig) -> list[_Op]:
    """The op sequence of a seed: a pure function of ``config``."""
    rng = random.Random(config.seed)
    sizes = {Tier.GPU: config.gpu_blocks, Tier.HOST: config.host_blocks}
    routes = [(a, b) for a in sizes for b in sizes]
    tpb = config.layout.tokens_per_block
    ops = []
    for _ in range(config.ops):
        src, dst = rng.choice(routes)
        n = rng.randint(1, min(config.max_blocks, sizes[dst], sizes[src] // (2 if src is dst else 1)))
        dst_idx = rng.sample(range(sizes[dst]), n)
        pool = [i for i in range(sizes[src]) if src is not dst or i not in dst_idx]
        src_idx = [rng.choice(pool) for _ in range(n)]  # sources may repeat
        num_tokens = rng.randint(1, tpb - 1) if tpb > 1 and rng.random() < config.partial_prob else None
        stall_spec = None
        if rng.random() < config.stall_prob:
            stall_spec = (rng.choice(("offload", "onboard", "local")), rng.random() * config.stall_max)
        r = rng.random()
        mode = "cancel" if r < config.cancel_prob else "forget" if r < config.cancel_prob + config.forget_prob else "await"
        ops.append(_Op(src, tuple(src_idx), dst, tuple(dst_idx), num_tokens, stall_spec, mode))
    return ops


class _Shadow:
    """CPU copies of every pool, updated in issue order, plus the last issued writer of each block."""

    def __init__(self, engine: TransferEngine, tiers: list[Tier]):
        self.pools = {t: engine.pool(t).tensor.detach().cpu().clone() for t in tiers}
        self.last_writer: dict[tuple[Tier, int], int] = {}

    def apply(self, op_id: int, op: _Op) -> dict[int, torch.Tensor]:
        src = self.pools[op.src][list(op.src_idx)]  # gathered first: same-pool copies read the old values
        dst = self.pools[op.dst]
        idx = list(op.dst_idx)
        if op.num_tokens is None:
            dst[idx] = src
        else:
            n = op.num_tokens
            dst[idx, :, :, :, :n] = src[:, :, :, :, :n]
        for i in idx:
            self.last_writer[(op.dst, i)] = op_id
        return {i: dst[i].clone() for i in idx}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


async def _run(config: SoakConfig, ops: list[_Op]) -> SoakReport:
    rng = random.Random(config.seed ^ 0x5EED)
    threads_before = {t.ident for t in threading.enumerate()}
    engine = TransferEngine(config.layout, gpu_blocks=config.gpu_blocks, host_blocks=config.host_blocks, device=config.device)
    tiers = [Tier.GPU, Tier.HOST]
    gen = torch.Generator().manual_seed(config.seed)
    for t in tiers:
        pool = engine.pool(t).tensor
        raw = torch.randint(0, 256, (pool.numel() * pool.element_size(),), dtype=torch.uint8, generator=gen)
        pool.view(-1).view(torch.uint8).copy_(raw.to(pool.device))
    if engine.device.is_cuda:
        torch.cuda.synchronize()
    shadow = _Shadow(engine, tiers)
    failures: list[str] = []
    counts = {"completed": 0, "awaited": 0, "cancelled": 0, "forgotten": 0, "stalls": 0, "checked": 0}
    next_op = 0
    t0 = time.perf_counter()

    def checker(op_id: int, op: _Op, expected: dict[int, torch.Tensor]) -> Callable[[Transfer], None]:
        def check(transfer: Transfer) -> None:
            counts["completed"] += 1
            if transfer.exception() is not None:
                failures.append(f"op {op_id} failed: {transfer.exception()!r}")
                return
            pool = engine.pool(op.dst).tensor
            for i, want in expected.items():
                if shadow.last_writer[(op.dst, i)] != op_id:
                    continue  # a later copy was issued to write it; that one's check covers it
                counts["checked"] += 1
                if not _same(pool[i].cpu(), want):
                    failures.append(f"op {op_id}: {op.dst.name} block {i} differs from the shadow after completion")

        return check

    async def worker() -> None:
        nonlocal next_op
        while next_op < len(ops) and not failures:
            op_id, op = next_op, ops[next_op]
            next_op += 1
            if op.stall is not None:
                stall(engine.stream(op.stall[0]), op.stall[1])
                counts["stalls"] += 1
            transfer = engine.copy(op.src, op.src_idx, op.dst, op.dst_idx, num_tokens=op.num_tokens)
            transfer.add_done_callback(checker(op_id, op, shadow.apply(op_id, op)))
            if op.mode == "forget":
                counts["forgotten"] += 1
                await asyncio.sleep(0)
            elif op.mode == "cancel":
                waiter = asyncio.ensure_future(_await(transfer))
                await asyncio.sleep(rng.random() * 1e-4)
                waiter.cancel()
                try:
                    await waiter
                except asyncio.CancelledError:
                    counts["cancelled"] += 1
                else:
                    counts["awaited"] += 1
            else:
                await transfer
                counts["awaited"] += 1

    try:
        await asyncio.gather(*(worker() for _ in range(config.tasks)))
        await engine.drain()
        if not failures:
            for t in tiers:
                actual = engine.pool(t).tensor.detach().cpu()
                failures.extend(
                    f"end: {t.name} block {i} differs from the shadow" for i in range(actual.shape[0]) if not _same(actual[i], shadow.pools[t][i])
                )
        stats = engine.statistics()
        if stats.fences.fenced_blocks or stats.in_flight or stats.deferred:
            failures.append(f"left behind after drain: {stats}")
    finally:
        c0 = time.perf_counter()
        await engine.close()
        close_seconds = time.perf_counter() - c0
    leaked = [t.name for t in threading.enumerate() if t.ident not in threads_before and t.name.startswith("tiered_kv")]
    if leaked:
        failures.append(f"threads left after close(): {leaked}")
    if close_seconds > 5:
        failures.append(f"close() took {close_seconds:.1f} s")
    if failures:
        raise _Failed(failures[0], next_op)
    return SoakReport(config.seed, len(ops), counts["completed"], counts["awaited"], counts["cancelled"], counts["forgotten"],
                      counts["stalls"], counts["checked"], time.perf_counter() - t0, close_seconds)


async def _await(transfer: Transfer) -> Any:
    return await transfer


class _Failed(Exception):
    def __init__(self, message: str, issued: int):
        super().__init__(message)
        self.message = message
        self.issued = issued


async def soak(config: SoakConfig, *, minimize: bool = True, progress: Callable[[int], None] | None = None) -> SoakReport:
    """Run the soak; raise :class:`SoakFailure` (with seed and shortest failing op log) on any mismatch.

    Args:
        config: what to run.
        minimize: on failure, replay shorter prefixes of the op sequence to find the shortest that fails.
        progress: called with the number of ops done after each chunk (for progress bars).

    Cancellation: cancels the run; the engine is closed (its copies complete) before this returns.
    """
    ops = generate_ops(config)
    chunk = 5_000
    reports = []
    done = 0
    # Long runs go in chunks of fresh engines (same seed stream), so memory stays bounded.
    while done < len(ops):
        part = ops[done : done + chunk]
        sub = dataclasses.replace(config, ops=len(part), seed=config.seed + done)
        try:
            reports.append(await _run(sub, part))
        except _Failed as failure:
            log = [str(op) for op in part[: failure.issued]]
            if minimize:
                log = await _shortest(sub, part[: failure.issued]) or log
            raise SoakFailure(failure.message, sub.seed, log) from None
        done += len(part)
        if progress is not None:
            progress(done)
    return SoakReport(
        config.seed,
        sum(r.ops for r in reports),
        sum(r.completed for r in reports),
        sum(r.awaited for r in reports),
        sum(r.cancelled for r in reports),
        sum(r.forgotten for r in reports),
        sum(r.stalls for r in reports),
        sum(r.checked_blocks for r in reports),
        sum(r.seconds for r in reports),
        max(r.close_seconds for r in reports),
    )


async def _shortest(config: SoakConfig, ops: list[_Op]) -> list[str] | None:
    """Binary-search the shortest failing prefix (timing-dependent failures may not replay: then None)."""
    lo, hi, best = 1, len(ops), None
    while lo <= hi:
        mid = (lo + hi) // 2
        try:
            await _run(dataclasses.replace(config, ops=mid), ops[:mid])
            lo = mid + 1
        except _Failed:
            best, hi = mid, mid - 1
    return None if best is None else [str(op) for op in ops[:best]]


@dataclasses.dataclass(frozen=True, slots=True)
class LoadReport:
    """Many tasks awaiting copies at once on one loop."""

    tasks: int
    seconds: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    first_tenth_last_rank: float
    peak_traced_mib: float


async def load(tasks: int = 10_000, *, device: str = "cpu", blocks: int = 256, seed: int = 0) -> LoadReport:
    """``tasks`` tasks each issue one single-block copy and await it, all at once, on the running loop.

    Every copy lands on one of the engine's lanes; the report gives the latency percentiles (issue to
    resume), how far down the resume order the first tenth of the issued copies got (1.0 would mean an
    early copy was overtaken by every later one: starvation), and the peak Python memory traced while
    they were in flight (``tracemalloc``).
    """
    import tracemalloc

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, tokens_per_block=4)
    rng = random.Random(seed)
    latencies: list[float] = []
    issued: list[int] = []  # issue position -> resume rank
    routes = [(Tier.GPU, Tier.HOST), (Tier.HOST, Tier.GPU), (Tier.GPU, Tier.GPU), (Tier.HOST, Tier.HOST)]
    tracemalloc.start()
    try:
        async with TransferEngine(layout, gpu_blocks=blocks, host_blocks=blocks, device=device) as engine:
            start = asyncio.Event()

            async def one(i: int) -> None:
                src, dst = routes[i % len(routes)]
                a, b = rng.sample(range(blocks), 2)
                await start.wait()
                t0 = time.perf_counter()
                transfer = engine.copy(src, [a], dst, [b])
                position = len(issued)
                issued.append(-1)
                await transfer
                issued[position] = len(latencies)
                latencies.append(time.perf_counter() - t0)

            runners = [asyncio.ensure_future(one(i)) for i in range(tasks)]
            await asyncio.sleep(0)
            t0 = time.perf_counter()
            start.set()
            await asyncio.gather(*runners)
            seconds = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    latencies.sort()
    def pick(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1e3

    # Fairness: how far down the resume order the first tenth of the issued copies got (0..1).
    first_tenth = max(issued[: max(1, tasks // 10)]) / tasks
    return LoadReport(tasks, seconds, pick(0.5), pick(0.99), latencies[-1] * 1e3, first_tenth, peak / 2**20)
