"""A seeded soak of the transfer engine: random copies, stalls, cancellations; a shadow model checks every byte.

Primitives:

* :func:`soak` -- the seeded soak (:class:`SoakConfig` -> :class:`SoakReport`, or :class:`SoakFailure`).
* :func:`generate_ops` -- the seeded op sequence.
* :func:`load` -- many tasks awaiting copies at once (:class:`LoadReport`).

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

Size: a little over 500 lines: the op generator, the shadow model and the checker are one oracle.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from ..engine import Transfer, TransferEngine
from ..errors import TransferError
from ..layout import KVLayout
from ..pools import Tier
from ..testing import stall
from .soak_common import faulty_file_config, leaked_threads, left_in_flight, threads_now

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
        file_blocks: slots of a file tier (0: none). With one, copies take all 8 routes (every pair of GPU,
            host and file but file to file), and ``file_fault_rate`` of the file I/O calls fail (EIO, ENOSPC,
            short writes and reads). A failed copy's destination is undefined, and so is everything copied
            from it: the shadow tracks that (and checks the rest); a copy ordered after a failed copy of one of
            its sources fails too; a failed copy that touches no file slot and read nothing a failed copy
            wrote is a soak failure.
        file_fault_rate: share of file I/O calls that fail.
        pristine_blocks: with a file tier, extra host blocks that copies only read (never write): fresh, known
            content keeps flowing in while failed copies make blocks undefined (else, with faults on, every
            block would end up undefined and nothing would be checked).
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
    file_blocks: int = 0
    file_fault_rate: float = 0.01
    pristine_blocks: int = 8
    layout: KVLayout = dataclasses.field(
        default_factory=lambda: KVLayout(
            num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=4, dtype=torch.float16
        )
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
    failed: int = 0  # copies that failed (only copies touching the file tier may, when faults are injected)
    refused: int = 0  # reads of a file slot a failed write had emptied: refused by copy(), nothing enqueued


class SoakFailure(AssertionError):
    """A block differed from the shadow model (or something was left behind); carries the reproducer."""

    def __init__(self, message: str, seed: int, op_log: list[str]):
        super().__init__(
            f"{message}\n  seed={seed}; shortest failing op log ({len(op_log)} ops):\n    "
            + "\n    ".join(op_log[-40:])
        )
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
    keys: tuple[str, ...] | None = None  # content keys of a copy into the file tier

    def __str__(self) -> str:
        tok = f", num_tokens={self.num_tokens}" if self.num_tokens else ""
        keys = f", keys={list(self.keys)}" if self.keys else ""
        st = f"stall({self.stall[0]}, {self.stall[1] * 1e3:.2f} ms); " if self.stall else ""
        copy = f"copy({self.src.name}, {list(self.src_idx)}, {self.dst.name}, {list(self.dst_idx)}{tok}{keys})"
        return f"{st}{copy}  [{self.mode}]"


def generate_ops(config: SoakConfig) -> list[_Op]:
    """The op sequence of a seed: a pure function of ``config``."""
    rng = random.Random(config.seed)
    sizes = {Tier.GPU: config.gpu_blocks, Tier.HOST: config.host_blocks}
    if config.file_blocks:
        sizes[Tier.FILE] = config.file_blocks
    routes = [(a, b) for a in sizes for b in sizes if not (a is Tier.FILE and b is Tier.FILE)]
    tpb = config.layout.tokens_per_block
    written: list[int] = []  # file slots some generated copy writes (reads pick among them)
    ops = []
    for op_id in range(config.ops):
        src, dst = rng.choice(routes)
        if src is Tier.FILE and not written:
            src = Tier.HOST
        n = rng.randint(1, min(config.max_blocks, sizes[dst], sizes[src] // (2 if src is dst else 1)))
        dst_idx = rng.sample(range(sizes[dst]), n)
        if src is Tier.FILE:
            src_idx = [rng.choice(written) for _ in range(n)]
        elif src is Tier.HOST and config.file_blocks and rng.random() < 0.5:
            src_idx = [config.host_blocks + rng.randrange(config.pristine_blocks) for _ in range(n)]  # never written
        else:
            pool = [i for i in range(sizes[src]) if src is not dst or i not in dst_idx]
            src_idx = [rng.choice(pool) for _ in range(n)]  # sources may repeat
        keys = None
        if dst is Tier.FILE:
            keys = tuple(f"{config.seed}:{op_id}:{i}" for i in dst_idx)
            written.extend(i for i in dst_idx if i not in written)
        num_tokens = rng.randint(1, tpb - 1) if tpb > 1 and rng.random() < config.partial_prob else None
        if Tier.FILE in (src, dst):
            num_tokens = None  # file slots hold whole blocks
        stall_spec = None
        if rng.random() < config.stall_prob:
            stall_spec = (rng.choice(("offload", "onboard", "local")), rng.random() * config.stall_max)
        r = rng.random()
        mode = (
            "cancel" if r < config.cancel_prob else "forget" if r < config.cancel_prob + config.forget_prob else "await"
        )
        ops.append(_Op(src, tuple(src_idx), dst, tuple(dst_idx), num_tokens, stall_spec, mode, keys))
    return ops


class _Shadow:
    """CPU copies of every pool (and of the file tier's slots), updated in issue order.

    Also the last issued writer of each block, and the blocks whose content is undefined (a failed copy wrote
    them, or one copied from such a block), which are not checked.
    """

    def __init__(self, engine: TransferEngine, tiers: list[Tier], file_blocks: int):
        self.pools = {t: engine.pool(t).tensor.detach().cpu().clone() for t in tiers}
        if file_blocks:
            self.pools[Tier.FILE] = torch.zeros((file_blocks, *engine.layout.block_shape), dtype=engine.layout.dtype)
        self.last_writer: dict[tuple[Tier, int], int] = {}
        self.unknown: set[tuple[Tier, int]] = {(Tier.FILE, i) for i in range(file_blocks)}  # never written yet

    def apply(self, op_id: int, op: _Op) -> tuple[dict[int, torch.Tensor], dict[int, set[tuple[int, Tier, int]]]]:
        """The expected content of the op's destinations, and what each was made from: ``(writer op, tier, block)``."""
        src = self.pools[op.src][list(op.src_idx)]  # gathered first: same-pool copies read the old values
        dst = self.pools[op.dst]
        idx = list(op.dst_idx)
        made_of: dict[int, set[tuple[int, Tier, int]]] = {}
        unknown: set[int] = set()
        for s_i, d_i in zip(op.src_idx, idx, strict=True):
            parts = [(op.src, s_i)] + (
                [(op.dst, d_i)] if op.num_tokens is not None else []
            )  # a partial copy keeps the rest
            made_of[d_i] = {(self.last_writer[p], *p) for p in parts if p in self.last_writer}
            if any(p in self.unknown for p in parts):
                unknown.add(d_i)
        if op.num_tokens is None:
            dst[idx] = src
        else:
            n = op.num_tokens
            dst[idx, :, :, :, :n] = src[:, :, :, :, :n]
        for i in idx:
            self.last_writer[(op.dst, i)] = op_id
            if i in unknown:
                self.unknown.add((op.dst, i))
            else:
                self.unknown.discard((op.dst, i))
        return {i: dst[i].clone() for i in idx}, made_of

    def forget(self, op_id: int, tier: Tier, block: int) -> None:
        """What ``op_id`` wrote into ``block`` is undefined (it failed, or it copied something undefined)."""
        if self.last_writer.get((tier, block)) == op_id:
            self.unknown.add((tier, block))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


async def _run(config: SoakConfig, ops: list[_Op]) -> SoakReport:
    rng = random.Random(config.seed ^ 0x5EED)
    threads_before = threads_now()
    tmp = tempfile.TemporaryDirectory(prefix="tiered-kv-soak-") if config.file_blocks else None
    file_config = (
        None if tmp is None else faulty_file_config(tmp.name, config.file_blocks, config.seed, config.file_fault_rate)
    )
    host_blocks = config.host_blocks + (config.pristine_blocks if config.file_blocks else 0)
    engine = TransferEngine(
        config.layout,
        gpu_blocks=config.gpu_blocks,
        host_blocks=host_blocks,
        device=config.device,
        file_config=file_config,
    )
    tiers = [Tier.GPU, Tier.HOST]
    gen = torch.Generator().manual_seed(config.seed)
    for t in tiers:
        pool = engine.pool(t).tensor
        raw = torch.randint(0, 256, (pool.numel() * pool.element_size(),), dtype=torch.uint8, generator=gen)
        pool.view(-1).view(torch.uint8).copy_(raw.to(pool.device))
    if engine.device.is_cuda:
        torch.cuda.synchronize()
    shadow = _Shadow(engine, tiers, config.file_blocks)
    failures: list[str] = []
    counts = {
        "completed": 0,
        "awaited": 0,
        "cancelled": 0,
        "forgotten": 0,
        "stalls": 0,
        "checked": 0,
        "failed": 0,
        "refused": 0,
    }
    undefined: set[tuple[int, Tier, int]] = set()  # (op, tier, block): what that op wrote there is undefined
    next_op = 0
    t0 = time.perf_counter()

    def checker(
        op_id: int,
        op: _Op,
        applied: tuple[dict[int, torch.Tensor], dict[int, set[tuple[int, Tier, int]]]],
    ) -> Callable[[Transfer], None]:
        expected, made_of = applied

        def check(transfer: Transfer) -> None:
            counts["completed"] += 1
            failed = transfer.exception() is not None
            if failed:
                counts["failed"] += 1
                error = transfer.exception()
                # the engine fails a copy whose source a failed copy was writing: legitimate when one of its
                # sources is the undefined product of a failed copy (all of them have completed: fences)
                read_failed = "reads from failed" in str(error) and any(
                    (w, t, b) in undefined for parts in made_of.values() for w, t, b in parts if t is op.src
                )
                if Tier.FILE not in (op.src, op.dst) and not read_failed:
                    failures.append(f"op {op_id} failed: {error!r}")
                    return
            # every op this one read from has completed (fences), so whether what it read is defined is known
            for i, parts in made_of.items():
                if failed or parts & undefined:
                    undefined.add((op_id, op.dst, i))
                    shadow.forget(op_id, op.dst, i)
            if failed or op.dst is Tier.FILE:
                return  # a file slot is checked when read back
            pool = engine.pool(op.dst).tensor
            for i, want in expected.items():
                if shadow.last_writer[(op.dst, i)] != op_id or (op.dst, i) in shadow.unknown:
                    continue  # a later copy was issued to write it (its check covers it), or it is undefined
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
            try:
                transfer = engine.copy(op.src, op.src_idx, op.dst, op.dst_idx, num_tokens=op.num_tokens, keys=op.keys)
            except ValueError as exc:
                if op.src is not Tier.FILE or "holds no block" not in str(exc):
                    raise
                counts["refused"] += 1  # a failed write emptied the slot: refused before anything was enqueued
                await asyncio.sleep(0)
                continue
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
                except TransferError:
                    counts["awaited"] += 1  # judged by the checker (a file fault, or a real failure it reports)
                else:
                    counts["awaited"] += 1
            else:
                with contextlib.suppress(TransferError):  # judged by the checker
                    await transfer
                counts["awaited"] += 1

    try:
        await asyncio.gather(*(worker() for _ in range(config.tasks)))
        await engine.drain()
        if not failures:
            for t in tiers:
                actual = engine.pool(t).tensor.detach().cpu()
                failures.extend(
                    f"end: {t.name} block {i} differs from the shadow"
                    for i in range(actual.shape[0])
                    if (t, i) not in shadow.unknown and not _same(actual[i], shadow.pools[t][i])
                )
        stats = left_in_flight(engine)
        if stats is not None:
            failures.append(f"left behind after drain: {stats}")
    finally:
        c0 = time.perf_counter()
        await engine.close()
        close_seconds = time.perf_counter() - c0
        if tmp is not None:
            tmp.cleanup()
    leaked = await leaked_threads(threads_before)
    if leaked:
        failures.append(f"threads left after close(): {leaked}")
    if close_seconds > 5:
        failures.append(f"close() took {close_seconds:.1f} s")
    if failures:
        raise _Failed(failures[0], next_op)
    return SoakReport(
        config.seed,
        len(ops),
        counts["completed"],
        counts["awaited"],
        counts["cancelled"],
        counts["forgotten"],
        counts["stalls"],
        counts["checked"],
        time.perf_counter() - t0,
        close_seconds,
        counts["failed"],
        counts["refused"],
    )


async def _await(transfer: Transfer) -> Any:
    return await transfer


class _Failed(Exception):
    def __init__(self, message: str, issued: int):
        super().__init__(message)
        self.message = message
        self.issued = issued


async def soak(
    config: SoakConfig, *, minimize: bool = True, progress: Callable[[int], None] | None = None
) -> SoakReport:
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
        sum(r.failed for r in reports),
        sum(r.refused for r in reports),
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
