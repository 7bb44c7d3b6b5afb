"""End-to-end integrity of cached KV: checksums taken on the device at commit, checked there before every reuse.

A checksum per token is taken when a block is committed and checked on the device before the block is served again.

Primitives:

* :func:`token_checksums` -- ``int32 [blocks, tokens_per_block]`` checksums of some blocks of a block-major pool,
  one per token (across its layers, K/V and heads), computed where the pool lives: on CUDA one launch of the
  ``token_checksums`` kernel on the current stream (kernels/checksum.cu: every byte read once), on the CPU (and on
  CUDA without the compiled extension) its torch-ops reference, :func:`tiered_kv.opdefs.token_checksums_ref`.
* :class:`Checksum` -- what a committed block carries: its per-token checksums (a row of a device tensor) and how
  many of its tokens are valid.
* :class:`IntegrityChecks` -- :meth:`~IntegrityChecks.record` at commit, :meth:`~IntegrityChecks.verify` before a
  reuse is served; :meth:`~IntegrityChecks.start_reuse` enqueues the check of an admission's reused blocks behind
  copies still in flight (a :class:`PendingCheck`), so that it runs on the device as soon as they land.

Rules:

* A checksum is taken on the stream that wrote the block, after the compute that wrote it: :meth:`record` is
  called at ``commit``, when the writes have been issued, and enqueues on the current stream.
* Whatever tiers a block then passes through (host, file, a remote store; copies, staging, partial copies), its
  bytes are checked once more where they are read: on the GPU, after every copy that brought them there has
  completed, before anything computed from them is used (before ``add_sequences`` returns; for a layer-by-layer
  load, before its ``settle`` returns). A partial reuse checks the first ``n`` tokens of the new block against
  the first ``n`` checksums of the block it was copied from.
* A check runs on a stream of its own (the device's: CUDA, or the emulated device's worker thread), behind the
  copies it checks (stream-side waits) and, on CUDA, behind the compute stream's work queued so far (where the
  committed checksums were taken); the event loop polls its end and never blocks on it.
* The checksum is a weighted sum of the block's 32-bit words with odd position-dependent weights, modulo 2**32:
  any change of a single word changes it, and modular addition does not depend on the order of the sum, so the
  CPU reference and the CUDA kernel compute the same bits for the same bytes (a checksum taken by one is checked
  by the other).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from . import _ext
from .device import Device
from .opdefs import token_checksums_ref
from .pools import Tier

if TYPE_CHECKING:
    from .blocks import Admission, Block, BlockManager, Plan
    from .device import Event, Stream

__all__ = ["Checksum", "IntegrityChecks", "PendingCheck", "token_checksums"]

log = logging.getLogger(__name__)


def token_checksums(pool: torch.Tensor, slots: Sequence[int]) -> torch.Tensor:
    """Per-token checksums of blocks ``slots`` of a block-major pool ``[blocks, layers, kv, heads, tokens, dim]``.

    Returns:
        ``int32 [len(slots), tokens]`` on the pool's device. On CUDA the work is enqueued on the current stream.

    Raises:
        ValueError: the pool is not 6-D, or a slot is out of range.

    Notes:
        The sum of a token's words times odd weights, modulo 2**32 (a 32-bit word is summed as it is, a row of 16-
        or 8-bit elements as wider words where its size allows; :func:`tiered_kv.opdefs.token_checksums_ref` states
        the exact rule). Integer wrap-around makes the result independent of the order of the sum, so the CUDA kernel
        (a pool on CUDA whose blocks are dense, with the extension loaded) and the torch-ops reference (anywhere else)
        give the same bits.
    """
    if pool.dim() != 6:
        raise ValueError(f"token_checksums needs a block-major pool [blocks, L, kv, H, T, D], got {list(pool.shape)}")
    listed = list(slots)
    if listed and (min(listed) < 0 or max(listed) >= pool.shape[0]):
        bad = min(listed) if min(listed) < 0 else max(listed)
        raise ValueError(f"token_checksums: slot {bad} is out of range for a pool of {pool.shape[0]} blocks")
    index = torch.tensor(listed, dtype=torch.int64)
    if pool.is_cuda and _dense_blocks(pool) and _ext.load():
        out: torch.Tensor = torch.ops.tiered_kv.token_checksums(pool, index)
        return out
    return token_checksums_ref(pool, index.pin_memory() if pool.is_cuda else index)  # pinned: enqueued, not waited


def _dense_blocks(pool: torch.Tensor) -> bool:
    """Each block ``[L, kv, H, T, D]`` is dense (what the kernel reads; any other pool takes the reference)."""
    expected = 1
    for size, stride in zip(reversed(pool.shape[1:]), reversed(pool.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


@dataclasses.dataclass(slots=True, eq=False)
class Checksum:
    """A committed block's checksums: row ``row`` of ``sums`` (``[*, tokens_per_block]``), ``valid`` tokens of it.

    Read-only by rule, not frozen: one is made per block at every commit (2,048 for a 32k-token prompt), and a frozen
    dataclass costs ~6x as much to build.
    """

    sums: torch.Tensor
    row: int
    valid: int


class PendingCheck:
    """A check enqueued on the checker stream (:meth:`IntegrityChecks.start`); :meth:`mismatches` awaits its end.

    ``owners``: the block each check stands for (:meth:`changed` maps the mismatches to them).
    """

    __slots__ = ("_checks", "_event", "_result", "owners")

    def __init__(self, checks: IntegrityChecks, event: Event | None, result: list[torch.Tensor]) -> None:
        self._checks = checks
        self._event = event
        self._result = result  # filled by the stream when it reaches the check: the host copy of the mismatch mask
        self.owners: list[Block] = []

    async def mismatches(self) -> list[int]:
        """Indices of the checks whose block no longer holds what was committed (polls the stream's progress).

        Raises:
            RuntimeError: the check failed on its stream (logged there).

        Notes:
            Cancellation: only the wait is cancelled; the check still runs.
        """
        event = self._event
        if event is not None:
            spins = 0
            while not event.query():
                spins += 1
                await asyncio.sleep(0 if spins < 100 else 1e-4)
        if not self._result:
            raise RuntimeError("an integrity check did not run on its stream")
        flags: list[bool] = self._result[0].tolist()
        bad = [i for i, b in enumerate(flags) if b]
        self._checks.verified_blocks += len(flags)
        self._checks.mismatches += len(bad)
        return bad

    async def changed(self) -> list[Block]:
        """The :attr:`owners` of the mismatches."""
        return [self.owners[i] for i in await self.mismatches()]


class IntegrityChecks:
    """Checksums of one cache's GPU pool: taken at commit, checked before a reuse is served.

    Args:
        pool: the GPU pool's tensor (block-major).
        device: where the checks run (a stream of its own); default: a CUDA device for a pool on CUDA, else the
            emulated device.

    Attributes:
        verified_blocks: blocks checked so far; ``mismatches``: of them, found changed.
    """

    def __init__(self, pool: torch.Tensor, device: Device | None = None) -> None:
        self.pool = pool
        self.cuda = pool.is_cuda
        self.device = device if device is not None else Device(pool.device)
        self._stream: Stream | None = None
        self.verified_blocks = 0
        self.mismatches = 0

    def close(self) -> None:
        """Stop the checker stream (after the checks queued on it); idempotent."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def committed(self, blocks: Sequence[Block]) -> None:
        """Checksum the full blocks just committed (those cached and not checksummed yet), on the current stream."""
        fresh = [b for b in blocks if b.cached and b.checksum is None]
        if fresh:
            tpb = self.pool.shape[4]
            for b, c in zip(fresh, self.record([b.slot for b in fresh], [tpb] * len(fresh)), strict=True):
                b.checksum = c

    @staticmethod
    def tail(manager: BlockManager, seq_id: int) -> tuple[Block, int] | None:
        """A live sequence's partly committed last block and its committed tokens, or ``None``.

        That block is cached as a partial block when the sequence is freed (then :meth:`freed` checksums it).
        """
        tpb = manager.tokens_per_block
        n = manager.committed_tokens(seq_id)
        return (manager.sequence_blocks(seq_id)[n // tpb], n % tpb) if n % tpb else None

    def freed(self, block: Block, valid: int) -> None:
        """Checksum a partial block that :meth:`tail` named once its sequence was freed (if it is cached now)."""
        if block.cached and block.checksum is None and block.tier is Tier.GPU:
            [block.checksum] = self.record([block.slot], [valid])

    async def check_reuse(self, manager: BlockManager, admissions: Sequence[Admission], plan: Plan) -> list[Block]:
        """The blocks reused by ``admissions`` (whose copies have completed) that changed since their commit.

        Full blocks are checked where they now lie; a partial reuse checks the first tokens of the new block against
        the block they were copied from (the one returned when it fails). Blocks without a checksum (adopted from
        the file tier, fetched from a store: checked by their own headers on the way in) are not checked here.
        """
        return await self.start_reuse(manager, admissions, plan).changed()

    def start_reuse(
        self,
        manager: BlockManager,
        admissions: Sequence[Admission],
        plan: Plan,
        after: Callable[[Stream], None] | None = None,
    ) -> PendingCheck:
        """:meth:`check_reuse` enqueued now, behind what ``after(stream)`` makes the checker stream wait for.

        ``after``: stream-side waits for the copies still bringing the reused blocks (every other copy of the batch
        must have completed). Await :meth:`PendingCheck.changed` for the blocks that changed.
        """
        tpb = manager.tokens_per_block
        partial = {m.block.id: m.source for m in plan.moves if m.kind == "partial"}
        checks: list[tuple[int, Checksum, int]] = []
        owners: list[Block] = []
        for adm in admissions:
            blocks = manager.sequence_blocks(adm.seq_id)
            first = adm.tokens_computed_first // tpb  # fresh leading blocks the caller computes: nothing to check
            full = first + (adm.tokens_reused - adm.partial_tokens) // tpb
            for b in blocks[first:full]:
                if b.checksum is not None:
                    checks.append((b.slot, b.checksum, b.checksum.valid))
                    owners.append(b)
            source = partial.get(blocks[full].id) if adm.partial_tokens else None
            if source is not None and source.checksum is not None:
                checks.append((blocks[full].slot, source.checksum, adm.partial_tokens))
                owners.append(source)
        pending = self.start(checks, after)
        pending.owners = owners
        return pending

    @staticmethod
    def refuse(manager: BlockManager, admissions: Sequence[Admission], plan: Plan, bad: Sequence[Block]) -> int:
        """After :meth:`check_reuse` found ``bad``: free the batch, drop the bad blocks; returns how many failed.

        The batch's partial-copy targets are dropped too; each bad block gets one log line. The caller admits the
        batch again (without the dropped blocks: the request recomputes them).
        """
        for adm in admissions:
            if adm.seq_id in manager.live_sequences:
                manager.free(adm.seq_id)
        for block in bad:
            where = f"{block.tier.value} slot {block.slot}" if block.tier is not None else "no slot"
            key = block.key.hex()[:16] if isinstance(block.key, bytes) else block.key
            log.warning(
                "cached block %s (%s) changed since it was committed: dropped, not served; the request recomputes it",
                key,
                where,
            )
            manager.refuse(block)
        for move in plan.moves:
            if move.kind == "partial":
                manager.invalidate(move.block)
        return len({id(b) for b in bad})

    def record(self, slots: Sequence[int], valid: Sequence[int]) -> list[Checksum]:
        """Checksums of GPU blocks ``slots`` (``valid`` tokens each), enqueued on the current stream."""
        if not slots:
            return []
        sums = token_checksums(self.pool, slots)
        return [Checksum(sums, i, n) for i, n in enumerate(valid)]

    async def verify(self, checks: Sequence[tuple[int, Checksum, int]]) -> list[int]:
        """Indices into ``checks`` whose GPU block no longer holds what was committed.

        Args:
            checks: ``(GPU slot, the checksum it must match, tokens to compare)`` each; the copies that brought
                the blocks there must have completed.

        Notes:
            Cancellation: only the wait is cancelled.
        """
        return await self.start(checks).mismatches()

    def start(
        self, checks: Sequence[tuple[int, Checksum, int]], after: Callable[[Stream], None] | None = None
    ) -> PendingCheck:
        """Enqueue :meth:`verify` of ``checks`` on the checker stream, behind ``after(stream)``'s waits.

        On CUDA the checker stream also waits for the current stream's work queued so far (where the committed
        checksums were taken); the emulated device's compute is the calling thread, done by now.
        """
        if not checks:
            return PendingCheck(self, None, [torch.zeros(0, dtype=torch.bool)])
        stream = self._stream
        if stream is None:
            stream = self._stream = self.device.new_stream("integrity")
        if after is not None:
            after(stream)
        if self.cuda:
            compute = torch.cuda.Event()
            compute.record(torch.cuda.current_stream(self.pool.device))
            stream.wait(compute)
        slots = [c[0] for c in checks]
        counts = [c[2] for c in checks]
        expected = _Expected(checks)
        pool, cuda = self.pool, self.cuda
        result: list[torch.Tensor] = []

        def run() -> None:
            mask = self._mismatch_mask(token_checksums(pool, slots), expected, counts)
            if cuda:
                host = torch.empty(mask.shape, dtype=torch.bool, pin_memory=True)
                host.copy_(mask, non_blocking=True)
                mask = host
            result.append(mask)

        stream.submit(run)
        return PendingCheck(self, stream.record(), result)

    @staticmethod
    def _mismatch_mask(now: torch.Tensor, expected: _Expected, counts: list[int]) -> torch.Tensor:
        tokens = now.shape[1]
        want = expected.tensor()
        valid = _upload(counts, now.device)
        within = torch.arange(tokens, device=now.device).unsqueeze(0) < valid.unsqueeze(1)
        return ((now != want) & within).any(dim=1)


class _Expected:
    """The committed checksums of a list of checks, one row each, in order, as a few pieces to assemble.

    Blocks committed together share one ``sums`` tensor: each such run is read with one slice (its rows in a row)
    or one ``index_select``, not one slice per block (a 32k-token prefix reuses 2,048 blocks). It keeps a handful of
    objects, not one per check: a check enqueued behind a layer-by-layer load lives through the forward.
    """

    __slots__ = ("order", "parts")

    def __init__(self, checks: Sequence[tuple[int, Checksum, int]]) -> None:
        groups: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}  # id(sums) -> (sums, rows, check indices)
        for i, (_slot, c, _n) in enumerate(checks):
            group = groups.get(id(c.sums))
            if group is None:
                group = groups[id(c.sums)] = (c.sums, [], [])
            group[1].append(c.row)
            group[2].append(i)
        #: per commit: its sums and the rows read from it (a ``(first, count)`` run, or a list)
        self.parts: list[tuple[torch.Tensor, tuple[int, int] | list[int]]] = []
        order: list[int] = []
        for sums, rows, indices in groups.values():
            first = rows[0]
            run = rows == list(range(first, first + len(rows)))
            self.parts.append((sums, (first, len(rows)) if run else rows))
            order += indices
        #: rows of check ``order[j]`` come at ``j`` (``None``: in check order already)
        self.order: list[int] | None = None if order == list(range(len(order))) else order

    def tensor(self) -> torch.Tensor:
        """The rows, on the device of the sums, enqueued on the current stream."""
        pieces: list[torch.Tensor] = []
        for sums, rows in self.parts:
            if isinstance(rows, tuple):
                pieces.append(sums[rows[0] : rows[0] + rows[1]])
            else:
                pieces.append(sums.index_select(0, _upload(rows, sums.device)))
        expected = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        if self.order is not None:
            expected = expected.index_select(0, _upload(np.argsort(np.asarray(self.order)).tolist(), expected.device))
        return expected


def _upload(values: list[int], device: torch.device) -> torch.Tensor:
    """``int64`` ``values`` on ``device``, enqueued on the current stream without blocking the host.

    A copy from pageable memory would wait for the stream to reach it: on the checker stream, for the copies the check
    waits for (a whole layer-by-layer load).
    """
    host = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
