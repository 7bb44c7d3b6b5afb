"""Crash consistency of the file tier: SIGKILL a process while it spills, reopen the slab, check every block.

A child process (``python -m tiered_kv.tools.crash --child ...``) runs a :class:`~tiered_kv.TransferEngine` on the
emulated device with a file tier and spills blocks HOST->FILE and GPU->FILE, a few transfers at a time, with
content keys. Each block's content is a pure function of its key (:func:`block_content`), so the parent can
check it without the writer. Before issuing a copy the child reports ``BEGIN`` (the slots it claims and their
keys) on its stdout; after the copy is awaited it reports ``DONE``. The parent kills it with ``SIGKILL`` after a
random number of ``DONE`` lines plus a random delay, optionally *tears* some slots (overwrites part of a
header or payload, as a power cut may do to unsynced pages), then reopens the slab in-process and reads every
indexed block back through the engine (FILE->HOST, one block per transfer) and compares it with its key's
content.

What each durability policy promises (:class:`~tiered_kv.file.Durability`):

* A ``SIGKILL`` loses the process, not the page cache. Under every policy (``none``, ``flush``, ``fsync``),
  every block whose spill completed (``DONE``) and whose slot no later spill claimed (``BEGIN``) is
  recovered after a kill. That is what :func:`run_crash_test` checks for every policy.
* A power cut may lose unsynced pages: only ``flush`` / ``fsync`` promise completed spills then. A power cut
  cannot be produced here; tearing slots (``tear=``) models its damage. Torn slots are not promised under any
  policy -- they must be counted bad (at open, or when read) and never served.
* Under every policy, every block served has its key's content; slots of spills in flight at the kill may
  hold the old block, the new one, or be bad -- never a mix.

Primitives: :func:`run_crash_test` (many seeds) -> :class:`CrashReport`; :func:`crash_once` (one seed) ->
:class:`CrashRun`; :func:`verify_reopen` (reopen a directory and check it against the child's log);
:func:`block_content`.

Size: a little over 500 lines: the child that spills, the kill schedule and the verifying reopen are one
harness whose parts share the log format.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence

import numpy as np
import torch
import xxhash

from ..errors import TransferError
from ..layout import KVLayout
from ..pools import Tier

__all__ = ["CRASH_LAYOUT", "CrashReport", "CrashRun", "block_content", "crash_once", "run_crash_test", "verify_reopen"]

#: The geometry the harness uses: 3072-byte blocks (not a multiple of 4096, so slot padding is exercised).
CRASH_LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=48, tokens_per_block=8, dtype=torch.uint8)


def block_content(layout: KVLayout, key: str) -> np.ndarray:
    """The bytes a block with content key ``key`` holds in this harness (a pure function of the key)."""
    rng = np.random.default_rng(xxhash.xxh64_intdigest(key.encode()))
    return rng.integers(0, 256, size=layout.bytes_per_block, dtype=np.uint8)


@dataclasses.dataclass(frozen=True, slots=True)
class CrashRun:
    """What one kill-and-reopen found.

    Attributes:
        seed, durability, verify_on_open: the run's parameters.
        kill_after: ``DONE`` lines the parent waited for before killing (the child may have done more).
        begun / completed: spills (blocks) the child started / finished before it died.
        promised: keys held by a slot whose last spill completed and that was not torn: must be recovered.
        torn: promised slots the parent tore after the kill (it also tears as many slots whose write was in
            flight at the kill; those are not counted here, an unwritten one reads as empty).
        indexed: blocks the reopened tier indexed. bad_at_open: slots the open scan refused.
        bad_on_read: indexed blocks whose read failed verification (dropped, not served).
        served: blocks read back and equal to their key's content.
        mismatched: blocks read back whose bytes differ from their key's content (must be 0).
        unknown: blocks served under a key the child never wrote (must be 0).
        missing: promised blocks not served (must be 0).
        torn_served: torn slots whose read passed verification (must be 0). A torn slot is either refused at
            open, or fails its read, or is never indexed (an older duplicate of a key whose newer copy is intact).
        seconds: wall time of the run.
    """

    seed: int
    durability: str
    verify_on_open: str
    kill_after: int
    begun: int
    completed: int
    promised: int
    torn: int
    indexed: int
    bad_at_open: int
    bad_on_read: int
    served: int
    mismatched: int
    unknown: int
    missing: int
    torn_served: int
    seconds: float

    @property
    def ok(self) -> bool:
        """No wrong byte served, nothing promised lost, every torn slot detected."""
        return self.mismatched == 0 and self.unknown == 0 and self.missing == 0 and self.torn_served == 0


@dataclasses.dataclass(frozen=True, slots=True)
class CrashReport:
    """All runs of :func:`run_crash_test`."""

    runs: tuple[CrashRun, ...]

    @property
    def ok(self) -> bool:
        """Every run passed."""
        return all(r.ok for r in self.runs)

    def totals(self) -> dict[str, int]:
        """Sums of the counting fields over all runs."""
        names = ("begun", "completed", "promised", "torn", "indexed", "bad_at_open", "bad_on_read", "served",
                 "mismatched", "unknown", "missing", "torn_served")
        return {n: sum(getattr(r, n) for r in self.runs) for n in names}

    def __str__(self) -> str:
        lines = [f"crash test: {len(self.runs)} runs, {'OK' if self.ok else 'FAILED'}; totals {self.totals()}"]
        lines.extend(
                f"  seed {r.seed} {r.durability}/{r.verify_on_open}: kill after {r.kill_after} done; begun {r.begun}, "
                f"completed {r.completed}, promised {r.promised}, torn {r.torn}; indexed {r.indexed}, bad at open "
                f"{r.bad_at_open}, bad on read {r.bad_on_read}, served {r.served}, mismatched {r.mismatched}, "
                f"unknown {r.unknown}, missing {r.missing}, torn served {r.torn_served} {'ok' if r.ok else 'FAILED'}"
                for r in self.runs)
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------- the child


async def _child(directory: str, seed: int, durability: str, file_blocks: int, max_steps: int) -> None:
    from ..engine import TransferEngine
    from ..file import FileTierConfig

    layout = CRASH_LAYOUT
    rng = random.Random(seed)
    cfg = FileTierConfig(directory, file_blocks, durability=durability, io_threads=2, staging_blocks=2)
    out = sys.stdout
    counter = 0
    written: list[str] = []  # keys spilled so far, in order
    written_set: set[str] = set()
    async with TransferEngine(layout, gpu_blocks=12, host_blocks=12, device="cpu", file_config=cfg) as engine:
        out.write("READY\n")
        out.flush()
        for _ in range(max_steps):
            # 1-3 concurrent transfers of 1-3 blocks each, on disjoint slots and disjoint source blocks
            sizes = [rng.randint(1, 3) for _ in range(rng.randint(1, 3))]
            slots = rng.sample(range(file_blocks), sum(sizes))
            free = {Tier.GPU: list(range(12)), Tier.HOST: list(range(12))}  # 9 blocks a step at most
            pending: list[tuple[int, asyncio.Task[object]]] = []
            step_keys: set[str] = set()
            for tid, n in enumerate(sizes):
                src = rng.choice((Tier.GPU, Tier.HOST))
                blocks = [free[src].pop(rng.randrange(len(free[src]))) for _ in range(n)]
                mine, slots = slots[:n], slots[n:]
                keys = []
                for b in blocks:
                    if written and rng.random() < 0.25:
                        # a key spilled before, again into another slot (what a cache does when a block it
                        # read back is evicted again): the file then holds two generations of one key
                        key = rng.choice(written)
                        if key in step_keys:
                            key = f"k{seed}-{counter}"
                            counter += 1
                    else:
                        key = f"k{seed}-{counter}"
                        counter += 1
                    step_keys.add(key)
                    keys.append(key)
                    content = torch.from_numpy(block_content(layout, key))
                    engine.block(src, b).reshape(-1).view(torch.uint8).copy_(content)
                # BEGIN is on the pipe before the copy can touch the file
                out.write(f"BEGIN {tid} " + " ".join(f"{s}:{k}" for s, k in zip(mine, keys, strict=True)) + "\n")
                out.flush()
                t = engine.copy(src, blocks, Tier.FILE, mine, keys=keys)
                pending.append((tid, asyncio.ensure_future(_awaited(t))))
            written.extend(k for k in step_keys if k not in written_set)
            written_set.update(step_keys)
            for tid, task in pending:
                await task
                out.write(f"DONE {tid}\n")
                out.flush()


async def _awaited(t: object) -> object:
    return await t  # type: ignore[misc]


# ------------------------------------------------------------------------------------------- the parent


class _Log:
    """The child's reports: which spill (key -> slot) began and completed, in order.

    A key may be spilled more than once (to another slot): its content is the same every time.
    """

    def __init__(self) -> None:
        self.spills: list[tuple[str, int]] = []  # spill id -> (key, slot)
        self.completed: set[int] = set()  # spill ids
        self.last: dict[int, int] = {}  # slot -> id of the last spill that claimed it
        self._open: dict[int, list[int]] = {}  # transfer id (within a step) -> spill ids
        self.done_lines = 0

    @property
    def begun(self) -> set[str]:
        return {k for k, _ in self.spills}

    @property
    def completed_keys(self) -> set[str]:
        return {self.spills[i][0] for i in self.completed}

    def feed(self, line: str) -> None:
        parts = line.split()
        if not parts:
            return
        if parts[0] == "BEGIN":
            ids = []
            for item in parts[2:]:
                slot_text, key = item.split(":", 1)
                slot = int(slot_text)
                self.last[slot] = len(self.spills)
                ids.append(len(self.spills))
                self.spills.append((key, slot))
            self._open[int(parts[1])] = ids
        elif parts[0] == "DONE":
            self.completed.update(self._open.pop(int(parts[1])))
            self.done_lines += 1

    def promised_slots(self) -> dict[int, str]:
        """Slot -> key, for every slot whose last spill completed: those blocks must be recovered."""
        return {slot: self.spills[i][0] for slot, i in self.last.items() if i in self.completed}

    def in_flight_slots(self) -> list[int]:
        """Slots whose last spill had begun but not completed at the kill."""
        return sorted(slot for slot, i in self.last.items() if i not in self.completed)

    def promised(self) -> set[str]:
        return set(self.promised_slots().values())


def _tear(path: str, slot_size: int, slots: Iterable[int], rng: random.Random) -> None:
    """Overwrite part of each slot's header or payload with random bytes (a torn / half-lost write)."""
    from ..slab import HEADER_SIZE

    with open(path, "r+b") as f:
        for slot in slots:
            base = HEADER_SIZE + slot * slot_size
            if rng.random() < 0.3:
                off, n = base + rng.randrange(0, 64), rng.randint(1, 8)  # the header's fields
            else:
                off = base + HEADER_SIZE + rng.randrange(0, CRASH_LAYOUT.bytes_per_block - 1)
                n = rng.randint(1, min(512, base + HEADER_SIZE + CRASH_LAYOUT.bytes_per_block - off))
            f.seek(off)
            old = f.read(n)
            new = bytes(rng.randrange(256) for _ in range(n))
            if new == old:
                new = bytes((b + 1) & 0xFF for b in old)
            f.seek(off)
            f.write(new)


async def verify_reopen(
    directory: str,
    file_blocks: int,
    log_begun: set[str],
    promised: set[str],
    *,
    verify_on_open: str = "header",
    torn_slots: Iterable[int] = (),
) -> dict[str, int]:
    """Reopen the slab in ``directory`` and read every indexed block back through the engine.

    Args:
        directory: where the slab is.
        file_blocks: its slots.
        log_begun: every key the writer spilled (a block under another key is ``unknown``).
        promised: keys that must be recovered.
        verify_on_open: ``"header"`` (torn payloads are caught when read) or ``"full"`` (at open).
        torn_slots: slots damaged after the kill: a read of one that passes verification is ``torn_served``.

    Returns:
        counts: ``indexed``, ``bad_at_open``, ``bad_on_read``, ``served``, ``mismatched``, ``unknown``, ``missing``,
        ``torn_served``.

    Cancellation: the engine is closed; nothing is left.
    """
    from ..engine import TransferEngine
    from ..file import FileTierConfig

    layout = CRASH_LAYOUT
    cfg = FileTierConfig(directory, file_blocks, verify_on_open=verify_on_open, io_threads=2, staging_blocks=2)
    c = dict.fromkeys(
        ("indexed", "bad_at_open", "bad_on_read", "served", "mismatched", "unknown", "missing", "torn_served"), 0
    )
    torn = set(torn_slots)
    served: set[str] = set()
    async with TransferEngine(layout, host_blocks=1, device="cpu", file_config=cfg) as engine:
        tier = engine.file_tier
        entries = tier.entries()
        c["indexed"] = len(entries)
        c["bad_at_open"] = tier.open_report.bad
        host = engine.block(Tier.HOST, 0).reshape(-1).view(torch.uint8)
        for key, slot in sorted(entries.items(), key=lambda kv: kv[1]):
            host.fill_(0)
            try:
                await engine.copy(Tier.FILE, [slot], Tier.HOST, [0], keys=[key])
            except TransferError:
                c["bad_on_read"] += 1
                continue
            c["torn_served"] += slot in torn
            if not isinstance(key, str) or key not in log_begun:
                c["unknown"] += 1
                continue
            if np.array_equal(host.numpy(), block_content(layout, key)):
                c["served"] += 1
                served.add(key)
            else:
                c["mismatched"] += 1
    c["missing"] = len(promised - served)
    return c


def crash_once(
    directory: str | os.PathLike[str],
    seed: int,
    *,
    durability: str = "none",
    file_blocks: int = 24,
    max_kill_after: int = 12,
    tear: int = 0,
    verify_on_open: str = "header",
    timeout: float = 60.0,
) -> CrashRun:
    """Spill in a child, SIGKILL it at a seeded random point, tear ``tear`` slots, reopen and verify.

    Args:
        directory: a fresh (or empty) directory for the slab.
        seed: picks the child's spills, the kill point and the torn slots.
        durability: the child's :class:`~tiered_kv.file.Durability` (``"none"``, ``"flush"``, ``"fsync"``).
        file_blocks: slots in the slab (few, so slots are overwritten often).
        max_kill_after: the kill comes after 0..max_kill_after completed transfers (plus 0-20 ms).
        tear: promised slots to tear after the kill (at most as many as there are).
        verify_on_open: how the reopened tier scans (``"header"`` or ``"full"``).
        timeout: seconds to wait for the child's reports before failing.

    Raises:
        RuntimeError: the child died on its own or never reported (its stderr is in the message).
    """
    t0 = time.perf_counter()
    directory = os.fspath(directory)
    rng = random.Random(seed * 7919 + 17)
    kill_after = rng.randint(0, max_kill_after)
    delay = rng.uniform(0.0, 0.02)
    cmd = [
        sys.executable,
        "-m",
        "tiered_kv.tools.crash",
        "--child",
        directory,
        "--seed",
        str(seed),
        "--durability",
        durability,
        "--file-blocks",
        str(file_blocks),
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    log = _Log()
    deadline = time.monotonic() + timeout
    try:
        assert proc.stdout is not None
        ready = False
        while not ready or log.done_lines < kill_after:
            if time.monotonic() > deadline:
                raise RuntimeError(f"crash child (seed {seed}) reported nothing for {timeout} s")
            line = proc.stdout.readline()
            if not line:
                err = proc.stderr.read() if proc.stderr is not None else ""
                raise RuntimeError(f"crash child (seed {seed}) exited with {proc.wait()} before the kill:\n{err}")
            if line.startswith("READY"):
                ready = True
            log.feed(line)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        # whatever it reported before it died is in the pipe: read to EOF
        for line in proc.stdout:
            log.feed(line)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()

    owned = log.promised_slots()
    torn_slots: list[int] = []
    torn_in_flight: list[int] = []
    if tear:
        from ..slab import HEADER_SIZE, slot_payload_size

        torn_slots = rng.sample(sorted(owned), min(tear, len(owned)))
        # and the writes in flight at the kill: a torn one may carry a new header over an old payload
        in_flight = log.in_flight_slots()
        torn_in_flight = rng.sample(in_flight, min(tear, len(in_flight)))
        _tear(
            os.path.join(directory, "kv.slab"),
            HEADER_SIZE + slot_payload_size(CRASH_LAYOUT),
            torn_slots + torn_in_flight,
            rng,
        )
        for slot in torn_slots:
            del owned[slot]
    promised = set(owned.values())  # a key spilled twice stays promised while one intact slot holds it
    counts = asyncio.run(
        verify_reopen(
            directory,
            file_blocks,
            log.begun,
            promised,
            verify_on_open=verify_on_open,
            torn_slots=torn_slots + torn_in_flight,
        )
    )
    return CrashRun(
        seed,
        durability,
        verify_on_open,
        kill_after,
        len(log.spills),
        len(log.completed),
        len(promised),
        len(torn_slots),
        counts["indexed"],
        counts["bad_at_open"],
        counts["bad_on_read"],
        counts["served"],
        counts["mismatched"],
        counts["unknown"],
        counts["missing"],
        counts["torn_served"],
        time.perf_counter() - t0,
    )


def run_crash_test(
    directory: str | os.PathLike[str],
    seeds: Sequence[int] | int = 4,
    *,
    durabilities: Sequence[str] = ("none", "flush", "fsync"),
    tear: int = 2,
    file_blocks: int = 24,
    max_kill_after: int = 12,
) -> CrashReport:
    """Kill-and-reopen runs, one per seed, cycling through ``durabilities`` and the two open-scan modes.

    Args:
        directory: parent directory; each run gets ``<directory>/run-<seed>``.
        seeds: the seeds, or a count (seeds ``0..n-1``).
        durabilities: policies to cycle through (run ``i`` uses ``durabilities[i % len]``).
        tear: slots torn after each kill (see :func:`crash_once`); 0 for pure SIGKILL runs.
        file_blocks: slots of each run's tier (see :func:`crash_once`).
        max_kill_after: latest kill point (see :func:`crash_once`).

    Returns:
        the report; ``report.ok`` is the verdict and ``str(report)`` the table.

    Notes:
        Runs are sequential (one child at a time); each costs a Python + torch start-up (about 2 s).
    """
    if isinstance(seeds, int):
        seeds = range(seeds)
    if not durabilities:
        raise ValueError("durabilities must name at least one policy")
    runs = []
    for i, seed in enumerate(seeds):
        sub = os.path.join(os.fspath(directory), f"run-{seed}")
        os.makedirs(sub, exist_ok=True)
        runs.append(
            crash_once(
                sub,
                seed,
                durability=durabilities[i % len(durabilities)],
                file_blocks=file_blocks,
                max_kill_after=max_kill_after,
                tear=tear,
                verify_on_open=("header", "full")[(i // len(durabilities)) % 2],
            )
        )
    return CrashReport(tuple(runs))


def _main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m tiered_kv.tools.crash")
    p.add_argument("--child", metavar="DIR", help="(internal) run the spilling child in DIR")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--durability", default="none")
    p.add_argument("--file-blocks", type=int, default=24)
    p.add_argument("--max-steps", type=int, default=1_000_000)
    p.add_argument("--dir", help="parent directory of a crash test (default: a temporary one)")
    p.add_argument("--seeds", type=int, default=6)
    p.add_argument("--tear", type=int, default=2)
    a = p.parse_args(argv)
    if a.child:
        asyncio.run(_child(a.child, a.seed, a.durability, a.file_blocks, a.max_steps))
        return 0
    import tempfile

    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        report = run_crash_test(d, a.seeds, tear=a.tear, file_blocks=a.file_blocks)
    print(report)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
