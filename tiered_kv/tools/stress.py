"""The adversarial stress of the prefix cache: every reused token checked against its prefix.

Tiny pools, file faults, timeouts that cancel admissions and appends, an evictor beside the tasks.

Primitives:

* :class:`StressConfig` -- sizes, rates and how long one run lasts.
* :func:`stress` -- one seeded run on one loop; returns a :class:`StressReport` (wrong tokens are counted, not
  raised, so a run shows how far a corruption spread).
* :func:`run_many` -- many seeds in side-by-side processes (``python -m tiered_kv.tools.stress``, ``tiered-kv
  stress``); a table and a JSON record.

One run: a :class:`~tiered_kv.TieredKVCache` over a few GPU, host and file blocks whose file backend fails a share
of its writes and reads. Conversations start from a few shared system prompts; tasks on one loop take any
conversation, admit its whole history (a third of the time under ``asyncio.wait_for`` with a timeout of 0, 0.1 ms or
1 ms), check every reused token on the device, write the rest the way a model does (a plain tensor assignment on
the current stream, then a device synchronize), sometimes block the loop for 1-3 ms, commit, sometimes append and
write 1-4 generated tokens (the conversation grows: its next turn, from any task, resends the whole history), and
free. Beside them a task evicts 1-3 blocks of the GPU or host tier every few milliseconds. The oracle is per token:
the KV of token ``j`` is a function of the prefix that ends at ``j`` (:func:`~tiered_kv.tools.workload.
expected_tokens`), so a block in the wrong place, stale bytes or a torn copy are all caught.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import faulthandler
import functools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..backends.posix import PosixBackend
from ..blocks import CacheFullError
from ..cache import TieredKVCache
from ..engine import TransferEngine
from ..errors import TransferError
from ..faults import FaultyBackend, RandomFaults
from ..file import FileTierConfig
from ..layerwise import LayerLoad
from ..layout import KVLayout
from ..pools import Tier
from .shadow import Shadow
from .stress_diagnostics import Guards, Trace, block_truth
from .workload import expected_tokens

__all__ = ["StressConfig", "StressReport", "run_many", "stress"]


@dataclasses.dataclass(frozen=True, slots=True)
class StressConfig:
    """What one stress run does.

    Attributes:
        seed: seeds prompts, timeouts, faults and the evictor.
        seconds: how long the tasks loop.
        device: ``"cpu"`` (emulated) or ``"cuda[:N]"``.
        gpu_blocks / host_blocks / file_blocks: tier sizes (tiny: blocks cascade and slots are reused all the time).
        tasks: concurrent tasks on the loop.
        conversations / system_prompts: conversations in all, and the shared system prompts they start from.
        max_history: a conversation longer than this (tokens) starts over from its system prompt.
        write_faults / read_faults: share of the file tier's writes / reads that fail (EIO, ENOSPC, short).
        timeout_prob: share of admissions run under ``asyncio.wait_for`` (timeout 0, 0.1 ms or 1 ms).
        append_prob: share of turns that append 1-4 generated tokens.
        block_prob: share of turns that block the loop for 1-3 ms between writing and committing.
        evict_every: mean seconds between two evictions of 1-3 blocks (0: no evictor).
        layerwise_prob: share of admissions through ``add_sequences_layerwise`` (1 or 2 layers a group): each layer
            is read, right after its wait, into a copy made on the compute stream, and that copy is what is checked
            once the load has settled.
        integrity: the cache's integrity checks (``TieredKVCache(integrity=...)``); off shows what reaches the
            model without them.
        trace: on a wrong token, print where its bytes came from and the history of its block and slots.
        shadow: check each copy's destination against the issue-order model when it completes
            (:class:`~tiered_kv.tools.shadow.Shadow`); a mismatch is printed and counted.
        guard_blocks: allocate the GPU pool with this many guard blocks of a fixed pattern on each side (0: the
            engine allocates it); the guards are checked after every model write and at the end, and a changed
            guard byte fails the run. Large guards also move the pool out of the small-allocation pool of the CUDA
            caching allocator (a 20-block pool otherwise shares a segment with small temporaries).
        layout: block geometry (4 tokens per block, 3 layers x 2 KV heads x 8, fp32).
    """

    seed: int = 0
    seconds: float = 15.0
    device: str = "cpu"
    gpu_blocks: int = 20
    host_blocks: int = 12
    file_blocks: int = 16
    tasks: int = 8
    conversations: int = 24
    system_prompts: int = 3
    max_history: int = 40
    write_faults: float = 0.05
    read_faults: float = 0.02
    timeout_prob: float = 1 / 3
    append_prob: float = 0.3
    block_prob: float = 0.1
    evict_every: float = 0.003
    layerwise_prob: float = 0.3
    integrity: bool = True
    trace: bool = False
    shadow: bool = False
    guard_blocks: int = 0
    layout: KVLayout = dataclasses.field(
        default_factory=lambda: KVLayout(
            num_layers=3, num_kv_heads=2, head_dim=8, tokens_per_block=4, dtype=torch.float32
        )
    )

    def __post_init__(self) -> None:
        for name in ("gpu_blocks", "tasks", "conversations", "system_prompts", "max_history"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"StressConfig.{name} must be a positive int, got {value!r}")
        if isinstance(self.guard_blocks, bool) or not isinstance(self.guard_blocks, int) or self.guard_blocks < 0:
            raise ValueError(f"StressConfig.guard_blocks must be an int >= 0, got {self.guard_blocks!r}")
        for name in ("write_faults", "read_faults", "timeout_prob", "append_prob", "block_prob", "layerwise_prob"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"StressConfig.{name} must be in [0, 1], got {getattr(self, name)!r}")
        if self.seconds <= 0 or self.evict_every < 0:
            raise ValueError("StressConfig.seconds must be > 0 and evict_every >= 0")


@dataclasses.dataclass(frozen=True, slots=True)
class StressReport:
    """What one run saw.

    Attributes:
        seed, device, seconds: the run.
        admissions: admissions that returned; ``verified_tokens``: reused tokens checked; ``wrong_tokens``: of them,
            wrong (the only figure that must be 0).
        hits: reused full blocks per tier; ``partial_hits``: partial-block reuses.
        timeouts: admissions or appends cut by their timeout; ``transfer_errors``: admissions failed by a fault
            surfacing; ``cache_full``: admissions or appends that did not fit; ``faults``: file I/O calls failed.
        evicted: blocks the evictor moved down; ``appended``: tokens appended and committed.
        integrity_errors: reuses the cache refused because a block's checksum did not match (recomputed instead).
        shadow_mismatches: copies whose destination differed from the issue-order model (``shadow`` runs only).
        layerwise: admissions whose blocks landed layer by layer (checked as read after each layer's wait).
        failures: the first few wrong reuses, each a sentence naming the sequence, positions and blocks.
    """

    seed: int
    device: str
    seconds: float
    admissions: int
    verified_tokens: int
    wrong_tokens: int
    hits: dict[str, int]
    partial_hits: int
    timeouts: int
    transfer_errors: int
    cache_full: int
    faults: int
    evicted: int
    appended: int
    integrity_errors: int
    failures: list[str]
    shadow_mismatches: int = 0
    layerwise: int = 0


def _faulty_file_config(directory: str, config: StressConfig, backends: list[FaultyBackend]) -> FileTierConfig:
    def factory(path: str) -> FaultyBackend:
        w, r, s = config.write_faults / 3, config.read_faults / 2, config.seed
        backend = FaultyBackend(
            PosixBackend(path, direct=False),
            eio_on_write=RandomFaults(s, w, "eio-w"),
            enospc_on_write=RandomFaults(s, w, "enospc-w"),
            short_write_on=RandomFaults(s, w, "short-w"),
            eio_on_read=RandomFaults(s, r, "eio-r"),
            short_read_on=RandomFaults(s, r, "short-r"),
        )
        backends.append(backend)
        return backend

    return FileTierConfig(directory, config.file_blocks, backend_factory=factory, io_threads=2)


async def stress(config: StressConfig) -> StressReport:
    """One run; wrong tokens are counted in the report (never raised).

    Cancellation: cancels the run; the cache and engine are closed (their copies complete) before this returns.
    """
    rng = random.Random(config.seed)
    layout = config.layout
    tpb = layout.tokens_per_block
    systems = [[rng.randrange(1, 2**40) for _ in range(rng.randint(4, 12))] for _ in range(config.system_prompts)]

    def fresh() -> list[int]:
        return [*rng.choice(systems), *(rng.randrange(1, 2**40) for _ in range(rng.randint(1, 8)))]

    history = [fresh() for _ in range(config.conversations)]
    counts = dict.fromkeys(("admissions", "verified", "wrong", "timeouts", "transfer_errors", "cache_full",
                            "evicted", "appended", "layerwise"), 0)
    hits = {"gpu": 0, "host": 0, "file": 0}
    failures: list[str] = []
    backends: list[FaultyBackend] = []
    cuda = torch.device(config.device).type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()
    t0 = time.perf_counter()
    deadline = t0 + config.seconds

    with contextlib.ExitStack() as stack:
        directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="tiered-kv-stress-"))
        file_config = _faulty_file_config(directory, config, backends) if config.file_blocks else None
        guards = None
        if config.guard_blocks:
            guards = Guards(layout, config.gpu_blocks, config.guard_blocks, config.device)
        engine = TransferEngine(layout, gpu_blocks=config.gpu_blocks, host_blocks=config.host_blocks,
                                device=config.device, file_config=file_config,
                                gpu_pool=None if guards is None else guards.pool)
        cache = TieredKVCache(layout, gpu_blocks=config.gpu_blocks, host_blocks=config.host_blocks,
                              file_blocks=config.file_blocks, engine=engine, max_seqs=32,
                              integrity=config.integrity)
        pool = engine.pool(Tier.GPU).tensor
        trace = Trace(cache, t0) if config.trace else None
        shadow = Shadow(cache, functools.partial(print, flush=True), block_truth(cache)) if config.shadow else None

        def blocks_of(seq_id: int, start: int, stop: int) -> list[tuple[int, int, int]]:
            """``(slot, first, stop)`` per block of token positions ``[start, stop)``."""
            table = cache.page_table(seq_id)
            out, pos = [], start
            while pos < stop:
                end = min(stop, (pos // tpb + 1) * tpb)
                out.append((table[pos // tpb], pos, end))
                pos = end
            return out

        def write(seq_id: int, start: int, stop: int) -> None:
            """Play the model: plain assignments on the current stream, then a device synchronize."""
            tokens = cache.blocks.sequence_tokens(seq_id)
            written: list[tuple[int, int, torch.Tensor]] = []
            if shadow is not None and cuda and torch.cuda.current_stream() != torch.cuda.default_stream():
                print(f"SHADOW STREAM the model writes on {torch.cuda.current_stream()}, not the default stream",
                      flush=True)
            for slot, a, b in blocks_of(seq_id, start, stop):
                content = expected_tokens(cache.hasher, tokens, a, b)
                # the device copy of the KV is a temporary, freed as the statement ends (what a model's forward does)
                pool[slot, :, :, :, a % tpb : a % tpb + (b - a), :] = content.to(pool.device)
                if shadow is not None:
                    shadow.wrote(slot, a % tpb, content)
                    written.append((slot, a % tpb, content))
                if trace is not None:
                    trace.wrote_tokens(seq_id, cache.blocks.sequence_blocks(seq_id)[a // tpb].id, slot, a, content)
            sync()
            if shadow is not None:
                shadow.landed(written)
            if guards is not None:
                guards.check("a model write", counts, failures)

        def invariants(when: str) -> None:
            try:
                cache.blocks.check()
            except AssertionError as exc:
                counts["wrong"] += 1  # a broken invariant fails the run like a wrong token
                if len(failures) < 8:
                    failures.append(f"after {when}: block manager invariant broken: {exc}")

        def check(seq_id: int, reused: int, what: str, seen: torch.Tensor | None = None) -> None:
            """Check the reused tokens' KV in the pool, or in ``seen``: per layer, the blocks as read after its wait."""
            sync()
            tokens = cache.blocks.sequence_tokens(seq_id)
            bad: list[int] = []
            bad_slots: list[int] = []
            for j, (slot, a, b) in enumerate(blocks_of(seq_id, 0, reused)):
                expected = expected_tokens(cache.hasher, tokens, a, b)
                source = pool[slot] if seen is None else seen[:, j]
                actual = source[:, :, :, a % tpb : a % tpb + (b - a), :].cpu().contiguous()
                ok = (actual.view(torch.uint8) == expected.view(torch.uint8)).movedim(3, 0).reshape(b - a, -1)
                wrong = [a + int(i) for i in torch.nonzero(~ok.all(dim=1)).flatten()]
                if wrong:
                    bad.extend(wrong)
                    bad_slots.append(slot)
                    if trace is not None and len(failures) < 3:
                        trace.dump(what, cache.blocks.sequence_blocks(seq_id)[a // tpb].id, slot, actual, wrong, a)
                    if shadow is not None and len(failures) < 3:
                        shadow.explain_served(slot, cache.blocks.sequence_blocks(seq_id)[a // tpb], what)
            counts["verified"] += reused
            if bad:
                counts["wrong"] += len(bad)
                if len(failures) < 8:
                    failures.append(f"{what}: {len(bad)} of {reused} reused tokens wrong (positions {bad[:12]}, GPU "
                                    f"slots {bad_slots}) in a {len(tokens)}-token prompt")

        async def admit(prompt: list[int], local: random.Random) -> tuple[int, int] | None:
            timeout = local.choice((0.0, 1e-4, 1e-3)) if local.random() < config.timeout_prob else None
            load: LayerLoad | None = None
            try:
                if local.random() < config.layerwise_prob:
                    layered = cache.add_sequences_layerwise([prompt], group_layers=local.choice((1, 2)))
                    [adm], load = await (layered if timeout is None else asyncio.wait_for(layered, timeout))
                else:
                    call = cache.add_sequences([prompt])
                    [adm] = await (call if timeout is None else asyncio.wait_for(call, timeout))
            except TimeoutError:
                counts["timeouts"] += 1
                return None
            except CacheFullError:
                counts["cache_full"] += 1
                await asyncio.sleep(0.001)
                return None
            except TransferError:
                counts["transfer_errors"] += 1
                return None
            counts["admissions"] += 1
            invariants("admission")
            for tier, n in adm.blocks_from.items():
                hits[tier] = hits.get(tier, 0) + n
            if trace is not None:
                ids = [b.id for b in cache.blocks.sequence_blocks(adm.seq_id)]
                trace.note(f"admit seq {adm.seq_id} blocks {ids} gpu{list(adm.page_table)} reused {adm.tokens_reused}")
            served = ", ".join(f"{t} {n}" for t, n in adm.blocks_from.items() if n)
            seen = None
            if load is not None:  # the model's reads: each layer after its wait, on the compute stream
                counts["layerwise"] += 1
                slots = torch.tensor([s for s, _, _ in blocks_of(adm.seq_id, 0, adm.tokens_reused)], device=pool.device)
                stream = torch.cuda.current_stream() if cuda else None
                layers = []
                for layer in range(layout.num_layers):
                    load.wait_layer(layer, stream)
                    layers.append(pool[slots, layer].clone())
                seen = torch.stack(layers)  # [layers, blocks, 2, heads, tokens, dim]
                try:
                    await load.settle()
                except TransferError:  # the batch was freed: nothing read is used
                    counts["transfer_errors"] += 1
                    return None
            check(adm.seq_id, adm.tokens_reused,
                  f"seed {config.seed}: seq {adm.seq_id} (blocks from {served or 'none'}, partial "
                  f"{adm.partial_tokens}{', layer by layer' if load is not None else ''})", seen)
            return adm.seq_id, adm.tokens_reused

        async def worker(w: int) -> None:
            local = random.Random(config.seed * 1_000_003 + w)
            while time.perf_counter() < deadline:
                c = local.randrange(config.conversations)
                prompt = list(history[c])
                admitted = await admit(prompt, local)
                if admitted is None:
                    await asyncio.sleep(0)
                    continue
                seq_id, reused = admitted
                try:
                    write(seq_id, reused, len(prompt))
                    if local.random() < config.block_prob:
                        time.sleep(local.uniform(1e-3, 3e-3))  # noqa: ASYNC251  # a long step of the loop's own work
                    cache.commit(seq_id)
                    if local.random() < config.append_prob:
                        extra = [local.randrange(1, 2**40) for _ in range(local.randint(1, 4))]
                        call = cache.append_tokens(seq_id, extra)
                        try:
                            await (asyncio.wait_for(call, 1e-4) if local.random() < 0.3 else call)
                        except TimeoutError:
                            counts["timeouts"] += 1
                        except CacheFullError:
                            counts["cache_full"] += 1
                        else:
                            write(seq_id, len(prompt), len(prompt) + len(extra))
                            cache.commit(seq_id)
                            counts["appended"] += len(extra)
                            grown = prompt + extra
                            history[c] = grown if len(grown) <= config.max_history else fresh()
                finally:
                    cache.free(seq_id)
                    invariants("free")

        async def evictor() -> None:
            local = random.Random(config.seed * 7 + 3)
            while time.perf_counter() < deadline:
                await asyncio.sleep(local.uniform(0, 2 * config.evict_every))
                tier = local.choice((Tier.GPU, Tier.HOST))
                with contextlib.suppress(TransferError):
                    counts["evicted"] += await cache.evict(tier, local.randint(1, 3))
                invariants("evict")

        try:
            async with engine, cache:
                jobs = [worker(w) for w in range(config.tasks)]
                if config.evict_every > 0:
                    jobs.append(evictor())
                await asyncio.gather(*jobs)
                await engine.drain()
                invariants("the end")
                if guards is not None:
                    guards.check("the end", counts, failures)
                stats = cache.statistics()
        finally:
            await engine.close()
    return StressReport(
        config.seed, config.device, round(time.perf_counter() - t0, 2), counts["admissions"], counts["verified"],
        counts["wrong"], hits, stats.partial_hits, counts["timeouts"], counts["transfer_errors"], counts["cache_full"],
        sum(b.faults for b in backends), counts["evicted"], counts["appended"], stats.integrity_errors, failures,
        0 if shadow is None else shadow.mismatches + shadow.plan_mismatches + shadow.scan_mismatches,
        counts["layerwise"],
    )


def _one(argv: Sequence[str]) -> int:
    """``--one``: a single run in this process; its report as one JSON line on stdout."""
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--trace", action="store_true")
    p.add_argument("--no-integrity", action="store_true")
    p.add_argument("--shadow", action="store_true")
    p.add_argument("--guard-blocks", type=int, default=0)
    args = p.parse_args(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # run_many asks for the stacks of a run it gives up on
    report = asyncio.run(stress(StressConfig(seed=args.seed, seconds=args.seconds, device=args.device,
                                             trace=args.trace, integrity=not args.no_integrity, shadow=args.shadow,
                                             guard_blocks=args.guard_blocks)))
    print(json.dumps(dataclasses.asdict(report)), flush=True)
    return 0


def run_many(
    seeds: Sequence[int], *, seconds: float, device: str, procs: int, trace: bool = False, integrity: bool = True,
    shadow: bool = False,
    guard_blocks: int = 0,
) -> list[dict[str, object]]:
    """Run each seed in a process of its own, ``procs`` at a time; one dict per run (``error`` if it crashed).

    Each run is given its seconds plus 60 s to close; a run that takes longer is reported as hung, with the stacks
    of its threads (it is asked for them, then killed).
    """
    results: list[dict[str, object]] = []
    pending = list(seeds)
    running: list[tuple[int, subprocess.Popen[str], float]] = []
    files: dict[int, tuple[Any, Any]] = {}
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    while pending or running:
        while pending and len(running) < procs:
            seed = pending.pop(0)
            cmd = [sys.executable, "-m", "tiered_kv.tools.stress", "--one", "--seed", str(seed),
                   "--seconds", str(seconds), "--device", device, *(["--trace"] if trace else []),
                   *([] if integrity else ["--no-integrity"]), *(["--shadow"] if shadow else []),
                   "--guard-blocks", str(guard_blocks)]
            # output to files, not pipes: a run that reports much would block on a full pipe nobody reads yet
            out_f, err_f = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            p = subprocess.Popen(cmd, stdout=out_f, stderr=err_f, text=True, env=env)
            files[seed] = (out_f, err_f)
            running.append((seed, p, time.monotonic()))
        time.sleep(0.2)
        for item in list(running):
            seed, p, started = item
            if p.poll() is None and time.monotonic() - started < seconds + 60:
                continue
            if p.poll() is None:  # hung: its threads' stacks to stderr, then stop it
                p.send_signal(signal.SIGUSR1)
                time.sleep(1.0)
                p.kill()
            p.wait()
            out_f, err_f = files.pop(seed)
            with out_f, err_f:
                out_f.seek(0)
                err_f.seek(0)
                out, err = out_f.read(), err_f.read()
            running.remove(item)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            if p.returncode == 0 and lines:
                results.append(json.loads(lines[-1]))
                traced = [line for line in out.splitlines() if line.startswith(("TRACE", "SHADOW"))]
                if traced:
                    results[-1]["trace"] = traced
            else:
                results.append({"seed": seed, "error": f"rc={p.returncode}: {err.strip()[-12000:]}"})
    return sorted(results, key=lambda r: int(r["seed"]))  # type: ignore[call-overload]


def main(argv: Sequence[str] | None = None) -> int:
    """Run many seeds side by side; print a table; exit 1 if any run served a wrong token or crashed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--one"]:
        return _one(argv[1:])
    p = argparse.ArgumentParser(prog="tiered-kv stress", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=8, help="runs (one seed each; default: %(default)s)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--seconds", type=float, default=15.0, help="seconds per run (default: %(default)s)")
    p.add_argument("--procs", type=int, default=max(1, (os.cpu_count() or 2) - 1), help="runs side by side")
    p.add_argument("--device", default="cpu", help="cpu (emulated) | cuda[:N]")
    p.add_argument("--json", help="write every run's report here")
    p.add_argument("--trace", action="store_true", help="on a wrong token, print the history of its block and slots")
    p.add_argument("--no-integrity", action="store_true", help="run the cache without its integrity checks")
    p.add_argument("--shadow", action="store_true", help="check each copy against the issue-order model as it ends")
    p.add_argument("--guard-blocks", type=int, default=0, help="guard blocks on each side of the GPU pool")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    results = run_many(range(args.first_seed, args.first_seed + args.runs), seconds=args.seconds, device=args.device,
                       procs=args.procs, trace=args.trace, integrity=not args.no_integrity, shadow=args.shadow,
                       guard_blocks=args.guard_blocks)
    print(f"{'seed':>6} {'admissions':>10} {'verified':>9} {'wrong':>6} {'timeouts':>8} {'faults':>6} "
          f"{'evicted':>7} {'integrity':>9}  hits")
    for r in results:
        if "error" in r:
            print(f"{r['seed']:>6} CRASHED {str(r['error'])[-300:]}")
            continue
        print(f"{r['seed']:>6} {r['admissions']:>10} {r['verified_tokens']:>9} {r['wrong_tokens']:>6} "
              f"{r['timeouts']:>8} {r['faults']:>6} {r['evicted']:>7} {r['integrity_errors']:>9}  {r['hits']}")
        for f in r["failures"]:  # type: ignore[attr-defined]
            print(f"       {f}")
    bad = [r for r in results if "error" in r or r.get("wrong_tokens")]
    verified = sum(int(r.get("verified_tokens", 0)) for r in results)  # type: ignore[call-overload]
    wrong = sum(int(r.get("wrong_tokens", 0)) for r in results)  # type: ignore[call-overload]
    mismatches = sum(int(r.get("shadow_mismatches", 0)) for r in results)  # type: ignore[call-overload]
    print(f"{len(results)} runs of {args.seconds:g} s on {args.device} in {time.perf_counter() - t0:.0f} s: "
          f"{verified} reused tokens verified, {wrong} wrong, {len(bad)} runs failed"
          + (f", {mismatches} copies off the issue-order model" if args.shadow else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": results, "verified": verified, "wrong": wrong, "failed_runs": len(bad)}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
