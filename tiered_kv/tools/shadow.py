"""The issue-order model of a cache's tiers, checked against the device while the cache runs.

The fence rules promise that copies take effect in the order they are issued: a copy reads what the copies and model
writes issued before it left in its source, and nothing issued after it. :class:`Shadow` keeps that model for every
slot of every tier -- per token, the bytes the slot must hold -- by applying each copy of a cache when it is issued
and each model write when it is made. It then checks four things:

* **a copy** -- when it completes, every destination slot that nothing has written since is read back and compared
  token by token (copies that failed, and whatever was derived from them, are skipped: their products are poisoned);
* **a model write** -- after the device synchronize that ends it, the written tokens must be in the pool
  (:meth:`Shadow.landed`), and every other slot of both pools that no copy in flight writes must still hold what
  the model says (:meth:`Shadow.scan`: bytes that changed outside any copy are named with the window they changed in);
* **a plan** -- given the workload's oracle (``truth``), every move must read a slot that holds its block's tokens;
* **an integrity refusal** -- the device, the model and the oracle are compared for the refused block.

A mismatch is reported with the history of the slots involved (which op produced each version, and which of them
holds the bytes found), the engine's ordering decisions for each op (its dependencies, stream-side or on the loop,
and when it was enqueued and completed) and the ops issued around it. Used by the stress (``tiered-kv stress
--shadow``); it reads every destination back and keeps per-slot history, so it slows the cache it watches.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..blocks import Block, Move
from ..cache import TieredKVCache
from ..pools import Tier
from ..transfer import Transfer

__all__ = ["Shadow"]

_HISTORY = 12  # versions kept per slot for a report
_RECENT = 60  # ops kept for a report's context
_POISON_REPORTS = 3  # POISON reports printed in full per run (the rest are counted)
_SERVED = 4096  # moves that succeeded, kept for a copy that fails after them


@dataclasses.dataclass
class _Version:
    """One state of a slot: the op that produced it and its tokens."""

    op: int
    what: str
    tokens: np.ndarray  # [tokens per block, bytes per token] uint8
    known: np.ndarray  # [tokens per block] bool: the model knows the token's bytes


@dataclasses.dataclass
class _Slot:
    tokens: np.ndarray
    known: np.ndarray
    lineage: list[set[int]]  # per token: the copies not known to have succeeded whose bytes it holds
    writes: int = 0
    history: collections.deque[_Version] = dataclasses.field(default_factory=lambda: collections.deque(maxlen=_HISTORY))


_Expected = tuple[int, int, np.ndarray, np.ndarray, set[int]]  # (slot, its write count, tokens, known, lineage)


class Shadow:
    """Watches ``cache``'s copies; :meth:`wrote` and :meth:`landed` take the model's writes.

    Args:
        cache: the cache whose copies are watched (it must not have issued any yet).
        report: called with each mismatch's description (several lines, each starting ``SHADOW``).
        truth: ``truth(block) -> [tokens of the block, bytes per token]`` uint8, what the workload wrote for a block
            (enables the plan and refusal checks); ``None``: no oracle.

    Attributes:
        mismatches: copies and model writes whose result differed from the model; ``plan_mismatches``: moves that
            read a slot not holding their block; ``scan_mismatches``: slots found changed outside any copy;
            ``poisoned``: moves that succeeded although a copy that wrote what they read had failed (the engine does
            not fail such a copy; the cache must not use what it made); ``checked``: destination slots compared.
    """

    def __init__(
        self,
        cache: TieredKVCache,
        report: Callable[[str], None],
        truth: Callable[[Block], np.ndarray] | None = None,
    ) -> None:
        layout = cache.layout
        self._tpb = layout.tokens_per_block
        self._token_bytes = layout.bytes_per_block // self._tpb
        self._rows = layout.num_layers * layout.kv_factor * layout.num_kv_heads
        self._pools = {t.value: cache.engine.pool(t).tensor for t in (Tier.GPU, Tier.HOST)}
        self._cuda = self._pools["gpu"].is_cuda
        self._report = report
        self._truth = truth
        self._slots: dict[tuple[str, int], _Slot] = {}
        self._ops = itertools.count(1)
        self._last_op = 0
        self._failed: set[int] = set()
        self._ok: set[int] = set()
        self._t0 = time.perf_counter()
        self._recent: collections.deque[tuple[int, str]] = collections.deque(maxlen=_RECENT)
        self._op_of: dict[int, int] = {}  # id(marker) -> op
        self._story: dict[int, list[str]] = {}  # op -> the engine's decisions and completion, timed
        self._markers: list[object] = []  # every marker seen, kept alive so that its id() names it alone
        self._writing: collections.Counter[tuple[str, int]] = collections.Counter()  # slots copies in flight write
        self._scanned_at = 0.0  # when the last scan found the pools as the model says
        self._scanned_op = 0  # the last op issued before it
        self.scan_mismatches = 0
        self.poisoned = 0  # moves that succeeded reading a failed copy's bytes (reported, not counted as mismatches)
        self._served_reads: collections.deque[tuple[Move, set[int]]] = collections.deque(maxlen=_SERVED)
        self.mismatches = 0
        self.plan_mismatches = 0
        self.checked = 0
        self._watch_engine(cache.engine)
        copy, issue_group = cache._copy, cache._issue_group

        def watched_copy(src_tier: object, src: Any, dst_tier: object, dst: Any, **kwargs: Any) -> Transfer:
            transfer = copy(src_tier, src, dst_tier, dst, **kwargs)
            self._issued(transfer, Tier.coerce(src_tier).value, list(src), Tier.coerce(dst_tier).value, list(dst),
                         kwargs.get("num_tokens"))
            return transfer

        def checked_group(group: list[Move], layer_groups: Any = None) -> list[Transfer]:
            reads = [(m, self._check_move(m)) for m in group]
            transfers = issue_group(group, layer_groups)
            for m, read in reads:
                if read:
                    transfers[-1].add_done_callback(functools.partial(self._served, m, read))
            return transfers

        copy_groups = cache._copy_layer_groups

        def watched_groups(src_tier: object, src: Any, dst_tier: object, dst: Any, groups: Any, **kwargs: Any) -> Any:
            transfers = copy_groups(src_tier, src, dst_tier, dst, groups, **kwargs)  # modelled as one whole copy
            self._issued(transfers[-1], Tier.coerce(src_tier).value, list(src), Tier.coerce(dst_tier).value, list(dst),
                         kwargs.get("num_tokens"))
            return transfers

        cache._copy = watched_copy
        cache._copy_layer_groups = watched_groups
        cache._issue_group = checked_group  # type: ignore[method-assign]
        if cache._integrity is not None:
            refuse = cache._integrity.refuse

            def refused(manager: Any, admissions: Any, plan: Any, bad: Any) -> int:
                for block in bad:
                    self._explain_refusal(block)
                return refuse(manager, admissions, plan, bad)

            cache._integrity.refuse = refused  # type: ignore[method-assign]

    # ------------------------------------------------------------------------------------ the model's writes

    def wrote(self, slot: int, first: int, content: torch.Tensor) -> None:
        """The model wrote ``content`` (``[layers, kv, heads, n, dim]``) into tokens ``first..`` of GPU ``slot``."""
        op = next(self._ops)
        self._last_op = op
        n = content.shape[3]
        what = f"model write gpu[{slot}] tokens {first}..{first + n - 1} at {self._now()}"
        s = self._slot(Tier.GPU.value, slot)
        s.tokens[first : first + n] = _per_token(content)
        s.known[first : first + n] = True
        for j in range(first, first + n):
            s.lineage[j] = set()
        s.writes += 1
        s.history.append(_Version(op, what, s.tokens.copy(), s.known.copy()))
        self._recent.append((op, what))

    def landed(self, writes: list[tuple[int, int, torch.Tensor]]) -> None:
        """After the device synchronize ending the model's writes ``(slot, first token, content)``: they are there."""
        pool = self._pools["gpu"]
        for slot, first, content in writes:
            n = content.shape[3]
            real = _per_token(pool[slot])[first : first + n]
            want = _per_token(content)
            lost = [first + j for j in range(n) if not np.array_equal(real[j], want[j])]
            if lost:
                self.mismatches += 1
                self._report("\n".join([
                    f"SHADOW WRITE gpu[{slot}] tokens {lost} are not in the pool after the synchronize that ended "
                    f"their write (found {real[lost[0] - first][:8].tobytes().hex()})",
                    *self._context(),
                ]))
        self.scan()

    def scan(self) -> None:
        """Every slot that no copy in flight writes holds the model's known, unpoisoned tokens (after a synchronize).

        A slot found changed is reported once with the window since the last clean scan (the ops issued in it), and
        the model takes the device's bytes so that the next scan reports only new changes.
        """
        self._synchronize()
        now, last_op = time.perf_counter() - self._t0, self._last_op
        pools = {tier: _all_tokens(pool) for tier, pool in self._pools.items()}
        clean = True
        for (tier, index), slot in self._slots.items():
            real = pools.get(tier)
            if real is None or self._writing[tier, index]:
                continue
            bad = [j for j in range(self._tpb) if slot.known[j] and not (slot.lineage[j] & self._failed)
                   and not np.array_equal(real[index][j], slot.tokens[j])]
            if not bad:
                continue
            clean = False
            self.scan_mismatches += 1
            lines = [f"SHADOW SCAN {tier}[{index}] tokens {bad} changed outside any copy between "
                     f"{self._scanned_at:.6f} (after op {self._scanned_op}) and {now:.6f} (after op {last_op}); "
                     f"found {real[index][bad[0]][:8].tobytes().hex()}, "
                     f"model {slot.tokens[bad[0]][:8].tobytes().hex()}"]
            lines.extend(self._history(f"{tier}[{index}]", slot, (last_op + 1, real[index], bad), None))
            lines.extend(self._context())
            self._report("\n".join(lines))
            slot.tokens[bad] = real[index][bad]
        if clean:
            self._scanned_at, self._scanned_op = now, last_op

    # ------------------------------------------------------------------------------------ copies

    def _issued(self, transfer: Transfer, src_t: str, src: list[int], dst_t: str, dst: list[int],
                num_tokens: int | None) -> None:
        """Apply a copy to the model when it is issued; check its destinations when it completes."""
        if transfer.done() and transfer.exception() is not None:
            return  # refused whole, nothing enqueued: it changed nothing
        op = next(self._ops)
        self._last_op = op
        n = self._tpb if num_tokens is None else int(num_tokens)
        what = f"op {op}: {src_t}{src}->{dst_t}{dst} n={n}"
        marker = transfer._marker
        self._op_of[id(marker)] = op
        self._markers.append(marker)
        self._story.setdefault(op, []).extend(self._story.pop(-id(marker), []))  # decisions made inside copy()
        self._recent.append((op, what))
        ok = self._ok
        # every source is read before any destination is written (no slot is both in one copy)
        read = [(s.tokens.copy(), s.known.copy(), [{x for x in t if x not in ok} for t in s.lineage])
                for s in (self._slot(src_t, i) for i in src)]
        expected: list[_Expected] = []
        for d, (tokens, known, lineage) in zip(dst, read, strict=True):
            slot = self._slot(dst_t, d)
            slot.tokens[:n] = tokens[:n]
            slot.known[:n] = known[:n]
            slot.lineage[:n] = [t | {op} for t in lineage[:n]]
            slot.writes += 1
            slot.history.append(_Version(op, what, slot.tokens.copy(), slot.known.copy()))
            expected.append((d, slot.writes, slot.tokens.copy(), slot.known.copy(), set().union(*slot.lineage)))
            self._writing[dst_t, d] += 1
        transfer.add_done_callback(functools.partial(self._completed, op, what, src_t, src, dst_t, expected))

    def _completed(self, op: int, what: str, src_t: str, src: list[int], dst_t: str, expected: list[_Expected],
                   transfer: Transfer) -> None:
        done_at = (transfer.completed_at or self._t0) - self._t0
        self._story.setdefault(op, []).append(f"{self._now()} completed on the loop (device done at {done_at:.6f})")
        for d, *_ in expected:
            self._writing[dst_t, d] -= 1
        if transfer.exception() is not None:
            self._failed.add(op)
            for move, read in self._served_reads:  # moves that already succeeded reading its bytes
                if op in read:
                    self._poisoned(move, {op})
            return
        self._ok.add(op)
        pool = self._pools.get(dst_t)
        if pool is None:  # the file tier: checked when a copy reads it back
            return
        for k, (d, writes, tokens, known, lineage) in enumerate(expected):
            if lineage & self._failed:
                continue  # derived from a failed copy: poisoned (its moves are checked by _check_move)
            if self._slots[dst_t, d].writes != writes:
                continue  # written again since: its bytes may be a later op's by now
            real = _per_token(pool[d])
            bad = [j for j in range(self._tpb) if known[j] and not np.array_equal(real[j], tokens[j])]
            self.checked += 1
            if bad:
                self.mismatches += 1
                self._report(self._describe(op, what, (src_t, src[k]), (dst_t, d), tokens, real, bad))

    # ------------------------------------------------------------------------------------ plans and refusals

    def _check_move(self, move: Move) -> set[int]:
        """A move must read a slot whose tokens are its block's (in the model, with the workload's oracle).

        Returns the copies not known to have succeeded whose bytes the move reads (checked by :meth:`_served`).
        """
        slot = self._slots.get((move.src_tier.value, move.src_slot))
        if self._truth is None or slot is None:
            return set()
        block = move.source if move.source is not None else move.block
        truth = self._truth(block)
        n = min(len(truth), self._tpb if move.num_tokens is None else move.num_tokens)
        read = set().union(*slot.lineage[:n]) - self._ok
        bad = [j for j in range(n) if slot.known[j] and not np.array_equal(slot.tokens[j], truth[j])]
        if bad:
            self.plan_mismatches += 1
            self._report("\n".join([
                f"SHADOW PLAN {move.kind} #{move.block.id} {move.src_tier.value}[{move.src_slot}]->"
                f"{move.dst_tier.value}[{move.dst_slot}] n={move.num_tokens} reads block #{block.id} "
                f"({len(block.tokens)} tokens) but the slot's tokens {bad} hold other bytes",
                *self._history(f"{move.src_tier.value}[{move.src_slot}]", slot, None, truth),
            ]))
        return read

    def _served(self, move: Move, read: set[int], transfer: Transfer) -> None:
        """Moves that succeeded must not have read a failed copy's bytes (its failure must have reached them)."""
        if transfer.exception() is not None:
            return
        self._served_reads.append((move, read))
        self._poisoned(move, read & self._failed)

    def _poisoned(self, move: Move, failed: set[int]) -> None:
        if not failed:
            return
        self.poisoned += 1
        if self.poisoned > _POISON_REPORTS:
            return
        name = f"{move.src_tier.value}[{move.src_slot}]"
        slot = self._slots.get((move.src_tier.value, move.src_slot))
        block = move.source if move.source is not None else move.block
        self._report("\n".join([
            f"SHADOW POISON {move.kind} #{move.block.id} {name}->{move.dst_tier.value}[{move.dst_slot}] "
            f"n={move.num_tokens} succeeded, but read bytes of block #{block.id} that failed ops {sorted(failed)} "
            f"produced",
            *(self._history(name, slot, None, None if self._truth is None else self._truth(block))
              if slot is not None else []),
            *self._context(),
        ]))

    def _explain_refusal(self, block: Block) -> None:
        """Why the integrity check refused ``block``: the device, the model and the oracle, compared per token."""
        lines = [f"SHADOW REFUSED #{block.id} ({len(block.tokens)} tokens) in "
                 f"{getattr(block.tier, 'value', None)}[{block.slot}]"]
        pool = self._pools.get(getattr(block.tier, "value", ""))
        slot = self._slots.get((getattr(block.tier, "value", ""), block.slot))
        if pool is not None and slot is not None and self._truth is not None:
            self._synchronize()
            real, truth = _per_token(pool[block.slot]), self._truth(block)
            n = len(truth)
            lines.append(f"SHADOW   device==oracle {[bool(np.array_equal(real[j], truth[j])) for j in range(n)]} "
                         f"model==oracle {[bool(np.array_equal(slot.tokens[j], truth[j])) for j in range(n)]} "
                         f"model==device {[bool(np.array_equal(slot.tokens[j], real[j])) for j in range(n)]}")
            lines.extend(self._history(f"{block.tier.value}[{block.slot}]", slot, None, truth))  # type: ignore[union-attr]
        self._report("\n".join(lines))

    def explain_served(self, slot: int, block: Block, what: str) -> None:
        """The workload found ``block`` wrong in GPU ``slot``: the device, the model and the oracle, per token."""
        model = self._slots.get((Tier.GPU.value, slot))
        lines = [f"SHADOW SERVED {what}: block #{block.id} ({len(block.tokens)} tokens) in gpu[{slot}]"]
        if model is not None and self._truth is not None:
            self._synchronize()
            real, truth = _per_token(self._pools["gpu"][slot]), self._truth(block)
            n = len(truth)
            lines.append(f"SHADOW   device==oracle {[bool(np.array_equal(real[j], truth[j])) for j in range(n)]} "
                         f"model==oracle {[bool(np.array_equal(model.tokens[j], truth[j])) for j in range(n)]} "
                         f"model==device {[bool(np.array_equal(model.tokens[j], real[j])) for j in range(n)]} "
                         f"poisoned {[bool(model.lineage[j] & self._failed) for j in range(n)]}; found "
                         f"{real[0][:8].tobytes().hex()}")
            lines.extend(self._history(f"gpu[{slot}]", model, None, truth))
            for v in model.history:  # where the block came from: the slots its copies read, one level up
                for name, tier, index in _sources(v.what):
                    src = self._slots.get((tier, index))
                    if src is not None:
                        lines.extend(self._history(f"{name} (read by op {v.op})", src, None, truth))
        lines.extend(self._context())
        self._report("\n".join(lines))

    # ------------------------------------------------------------------------------------ reports

    def _describe(self, op: int, what: str, src: tuple[str, int], dst: tuple[str, int], tokens: np.ndarray,
                  real: np.ndarray, bad: list[int]) -> str:
        """A copy's destination differs from the model: histories, the device after a synchronize, the context."""
        lines = [f"SHADOW {what}: {dst[0]}[{dst[1]}] tokens {bad} differ from the issue-order model"]
        for name, key in ((f"source {src[0]}[{src[1]}]", src), (f"destination {dst[0]}[{dst[1]}]", dst)):
            slot = self._slots.get(key)
            if slot is not None:
                lines.extend(self._history(name, slot, (op, real, bad), None))
        self._synchronize()
        now = _per_token(self._pools[dst[0]][dst[1]])
        lines.append(f"SHADOW   after a synchronize: the destination holds the model's bytes "
                     f"{[bool(np.array_equal(now[j], tokens[j])) for j in bad]}")
        src_pool = self._pools.get(src[0])
        if src_pool is not None:
            now = _per_token(src_pool[src[1]])
            lines.append(f"SHADOW   after a synchronize: the source holds them "
                         f"{[bool(np.array_equal(now[j], tokens[j])) for j in bad]}")
        row = self._token_bytes // self._rows
        for j in bad[:2]:
            rows = [i // row for i in range(0, self._token_bytes, row)
                    if not np.array_equal(real[j][i : i + row], tokens[j][i : i + row])]
            lines.append(f"SHADOW   token {j}: {len(rows)} of {self._rows} (layer, kv, head) rows differ; found "
                         f"{real[j][:8].tobytes().hex()}, model {tokens[j][:8].tobytes().hex()}")
        lines.extend(self._context())
        return "\n".join(lines)

    def _history(self, name: str, slot: _Slot, found: tuple[int, np.ndarray, list[int]] | None,
                 truth: np.ndarray | None) -> list[str]:
        """A slot's versions, each with the engine's story of its op and which tokens match ``found`` or ``truth``."""
        lines = [f"SHADOW   {name} history:"]
        for v in slot.history:
            if found is not None:
                op, real, bad = found
                match = [j for j in bad if any(v.known[i] and np.array_equal(v.tokens[i], real[j])
                                               for i in range(self._tpb))]
                note = f"{' (issued AFTER the copy)' if v.op > op else ''}; holds the bytes found in tokens {match}"
            elif truth is not None:
                right = [j for j in range(len(truth)) if v.known[j] and np.array_equal(v.tokens[j], truth[j])]
                note = f"; right tokens {right}"
            else:
                note = ""
            lines.append(f"SHADOW     {v.what}{note}")
            lines.extend(f"SHADOW         {e}" for e in self._story.get(v.op, []))
        return lines

    def _context(self) -> list[str]:
        """The ops issued last, with the engine's story of each."""
        lines = ["SHADOW   the last ops issued:"]
        for op, what in self._recent:
            lines.append(f"SHADOW     {what}")
            lines.extend(f"SHADOW         {e}" for e in self._story.get(op, []))
        return lines

    # ------------------------------------------------------------------------------------ helpers

    def _watch_engine(self, engine: Any) -> None:
        """Record, per copy, how the engine ordered it: its dependencies (stream-side or on the loop) and when."""
        start, enqueue = engine._start, engine._enqueue

        def name(marker: Any) -> str:
            op = self._op_of.get(id(marker))
            return f"op {op}" if op is not None else "an op not from this cache"

        def note(marker: Any, what: str) -> None:
            op = self._op_of.get(id(marker))
            key = op if op is not None else -id(marker)  # inside copy(): its op is numbered once copy() returns
            self._markers.append(marker)
            self._story.setdefault(key, []).append(f"{self._now()} {what}")

        def started(loop: Any, marker: Any, job: Any, deps: Any) -> None:
            deps = list(deps)
            note(marker, f"lane {getattr(marker.lane, 'name', None)}, waits for " + (", ".join(
                f"{name(d)} (lane {getattr(d.lane, 'name', None)}, {'enqueued' if d.event is not None else 'deferred'})"
                for d in deps) or "nothing"))
            start(loop, marker, job, deps)

        def enqueued(marker: Any, job: Any, stream_deps: list[Any]) -> None:
            note(marker, f"enqueued, waiting stream-side for {[name(d) for d in stream_deps]}")
            enqueue(marker, job, stream_deps)

        engine._start = started
        engine._enqueue = enqueued

    def _slot(self, tier: str, index: int) -> _Slot:
        slot = self._slots.get((tier, index))
        if slot is None:
            slot = self._slots[tier, index] = _Slot(
                np.zeros((self._tpb, self._token_bytes), np.uint8), np.zeros(self._tpb, bool),
                [set() for _ in range(self._tpb)],
            )
        return slot

    def _synchronize(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()

    def _now(self) -> str:
        return f"{time.perf_counter() - self._t0:.6f}"


def _sources(what: str) -> list[tuple[str, str, int]]:
    """The source slots named in an op's description ``op N: tier[a, b]->tier[c, d] n=K`` (none for a model write)."""
    if not what.startswith("op ") or "->" not in what:
        return []
    src = what.split(": ", 1)[1].split("->", 1)[0]
    tier, indices = src.split("[", 1)
    return [(f"source {tier}[{i.strip()}]", tier, int(i)) for i in indices.rstrip("]").split(",")]


def _all_tokens(pool: torch.Tensor) -> np.ndarray:
    """``[blocks, layers, kv, heads, tokens, dim]`` -> ``[blocks, tokens, bytes]`` uint8 (a CPU copy)."""
    per_token = pool.detach().cpu().movedim(4, 1).contiguous().view(torch.uint8)
    return per_token.reshape(pool.shape[0], pool.shape[4], -1).numpy()


def _per_token(block: torch.Tensor) -> np.ndarray:
    """``[layers, kv, heads, tokens, dim]`` -> ``[tokens, bytes]`` uint8 (a CPU copy)."""
    return block.detach().cpu().movedim(3, 0).contiguous().view(torch.uint8).reshape(block.shape[3], -1).numpy()
