"""The copies a cache issues for its plans, from issue until the cache has seen each one land or fail.

Primitives:

* :class:`CacheCopies` -- the base of :class:`~tiered_kv.cache.TieredKVCache` that issues a block-manager
  :class:`~tiered_kv.blocks.Plan` through the engine, records which copy produces each block, drops (poisons) the
  blocks a failed copy produced, and waits for the pending copies of the GPU slots the cache hands out.

A plan is issued without an await in between (its decision and its copies are one step of the loop), as a handful
of batched ``engine.copy`` calls (:func:`~tiered_kv.plan_batches.batch_moves`), whole or not at all: a group that
cannot be issued gets a failed transfer, so its blocks are poisoned like the products of any failed copy. Every
block keeps, as its ``sources``, the copies its data comes from that are not yet known to have succeeded (the cache
fails an admission, and drops the blocks, when a source of one of its blocks failed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from .blocks import Admission, Block, BlockManager, Move, Plan
from .engine import Transfer, TransferEngine
from .errors import EngineClosedError, TransferError
from .integrity import IntegrityChecks, PendingCheck
from .layerwise import LayerLoad
from .plan_batches import batch_moves, unissued_transfer
from .pools import Tier

__all__ = ["CacheCopies", "landed", "layered"]


class CacheCopies:
    """Issue a cache's plans and follow their copies: lineage, poisoning of failed products, settling of GPU slots.

    The cache holds the state this works on: ``blocks`` (the block manager), ``engine`` and ``_copy`` (the copy
    function its claim on the engine returned), ``remote`` (the remote tier's link, or ``None``), ``_unchecked``
    (issued copies not yet seen complete, each with the blocks it produces) and ``_poisoned`` (the count of cached
    blocks dropped).
    """

    blocks: BlockManager
    engine: TransferEngine
    remote: Any
    _copy: Callable[..., Transfer]
    _copy_layer_groups: Callable[..., list[Transfer]]
    _unchecked: list[tuple[Transfer, list[Block]]]
    _poisoned: int
    _integrity: IntegrityChecks | None
    _integrity_errors: int

    if TYPE_CHECKING:  # the cache's: it fails a batch whose blocks a failed copy produced

        async def _settle(self, seq_ids: list[int], page_tables: list[tuple[int, ...]]) -> None: ...

    def _issue(self, plan: Plan) -> list[Transfer]:
        """Enqueue the plan's copies (:meth:`_issue_plan`); returns one transfer per group (its last copy)."""
        return [copies[-1] for copies in self._issue_plan(plan)[1]]

    def _issue_plan(
        self, plan: Plan, layer_groups: Sequence[tuple[int, int]] | None = None
    ) -> tuple[list[list[Move]], list[list[Transfer]]]:
        """Enqueue the plan's copies as few batched ``engine.copy`` calls, without an await in between.

        The groups come from :func:`~tiered_kv.plan_batches.batch_moves` (plan order kept wherever two moves
        touch a common slot); every block records the copies producing it, so a failed copy poisons its products.
        With ``layer_groups`` (more than one range), whole blocks coming from host memory to the GPU are copied one
        layer range at a time: one copy per range, in order (:func:`layered`), issued after the plan's other copies
        where none of those touches their slots (a copy queued behind them on the same stream would wait for every
        layer). Returns the groups and their copies.
        """
        groups, placed = batch_moves(plan.moves)
        if self.remote is not None:
            self.remote._before_issue()  # evict policy: read the host victims before the plan reuses their slots
        issued = self._issue_groups(groups, layer_groups, _layered_last(groups, layer_groups))
        # Lineage in plan order: a block moved twice in one plan ends with both copies in its sources.
        products: list[list[Block]] = [[] for _ in groups]
        for move, g in zip(plan.moves, placed, strict=True):
            copies = issued[g]
            block = move.block
            if move.source is not None:
                # The new block's first tokens come from the source block's data: inherit its lineage.
                block.sources = [*(s for s in move.source.sources if not _succeeded(s)), *copies]
            else:
                block.sources = [s for s in block.sources if not _succeeded(s)]
                block.sources += copies
            products[g].append(block)
        # One entry per copy, not per block: a 32k-token prefix is 2,048 blocks, and entries living until the
        # batch settles would be promoted through the garbage collector's generations into full collections.
        for copies, blocks in zip(issued, products, strict=True):
            for t in copies:
                self._unchecked.append((t, blocks))
        return groups, issued

    def _issue_groups(
        self,
        groups: list[list[Move]],
        layer_groups: Sequence[tuple[int, int]] | None = None,
        order: Sequence[int] | None = None,
    ) -> list[list[Transfer]]:
        """Issue a plan's groups whole, or not at all; each group's copies (one, or one per layer range).

        ``order``: the order to issue the groups in (default: as listed); the result is in list order.

        Groups reading file slots are checked first (the slot must still hold its block): if one fails, none is
        issued. A copy that still raises stops the copies after it. A copy not issued is a failed
        :class:`Transfer`, so the blocks it was to produce are poisoned like those of any failed copy.
        """
        failure: BaseException | None = None
        index = self.engine.file_tier.index if self.blocks.capacity[Tier.FILE] else None
        if index is not None:
            for group in groups:
                head = group[0]
                if head.src_tier is Tier.FILE:
                    try:
                        index.check_readable([m.src_slot for m in group], [m.block.key for m in group])  # type: ignore[misc]
                    except (ValueError, TypeError) as exc:
                        failure = exc
                        break
        issued: list[list[Transfer]] = [[] for _ in groups]
        for g in range(len(groups)) if order is None else order:
            group = groups[g]
            ranges = layer_groups if layer_groups is not None and layered(group, layer_groups) else None
            if failure is None:
                try:
                    issued[g] = self._issue_group(group, ranges)
                    continue
                except EngineClosedError as exc:  # the plan is made: its blocks must be poisoned, not left half-moved
                    failure = TransferError(f"the engine closed while a plan was being issued ({exc})")
                except (ValueError, TypeError, TransferError) as exc:
                    failure = exc
            issued[g] = [unissued_transfer(group, failure)] * (1 if ranges is None else len(ranges))
        return issued

    def _issue_group(self, group: list[Move], layer_groups: Sequence[tuple[int, int]] | None = None) -> list[Transfer]:
        """A group's copies: one, or one per layer range (every range planned before any is enqueued)."""
        head = group[0]
        if head.src_tier is Tier.REMOTE and self.remote is not None:
            return [self.remote.fetch(group)]
        src = [m.src_slot for m in group]
        dst = [m.dst_slot for m in group]
        if layer_groups is not None:
            return self._copy_layer_groups(
                head.src_tier, src, head.dst_tier, dst, layer_groups, num_tokens=head.num_tokens
            )
        # Spills (HOST -> FILE) and read-backs (FILE -> GPU) carry the blocks' content keys: written into the
        # slot headers, checked on the way back. Cached blocks (the only ones that spill or come back) have keys.
        keys = [m.block.key for m in group] if Tier.FILE in (head.src_tier, head.dst_tier) else None
        return [self._copy(head.src_tier, src, head.dst_tier, dst, num_tokens=head.num_tokens, keys=keys)]

    def _layer_load(
        self, admissions: list[Admission], plan: Plan, ranges: list[tuple[int, int]], loads: list[list[Transfer]]
    ) -> LayerLoad:
        """The :class:`LayerLoad` of a layer-by-layer admission whose other copies have landed.

        ``loads``: per batch of blocks copied layer by layer, its copies (one per range of ``ranges``). The reused
        blocks' check is enqueued now behind every group, so it runs on the device as soon as the last one lands,
        while the forward runs; the load's settle reads its outcome.
        """
        # what the settle needs of the plan: its partial copies (a 32k-token hit's 2,048 moves would outlive the
        # forward for nothing; see _issue_plan on objects held until a batch settles)
        partials = Plan([m for m in plan.moves if m.kind == "partial"])
        pending: PendingCheck | None = None

        async def settle() -> None:
            _, bad = await self._finish(admissions, partials, [], pending)
            if bad:
                self._refuse(admissions, partials, bad)
                raise TransferError(
                    f"{len(bad)} reused blocks changed since their commit: dropped, not served; the batch was freed"
                )

        per_group = [[copies[i] for copies in loads] for i in range(len(ranges))]
        load = LayerLoad(self.engine, ranges, per_group, settle)
        if self._integrity is not None:  # behind every group: the checker stream waits as compute would
            pending = self._integrity.start_reuse(self.blocks, admissions, partials, load.wait_all)
        return load

    async def _finish(
        self, admissions: list[Admission], plan: Plan, transfers: list[Transfer], pending: PendingCheck | None = None
    ) -> tuple[list[Admission], list[Block]]:
        """Wait for the batch's copies and check its reused blocks: ``(admissions, blocks that changed)``.

        ``pending``: the check already enqueued behind the copies (:meth:`IntegrityChecks.start_reuse`), read here.
        On an exception (a failed copy, a cancellation) the batch is freed first.
        """
        seq_ids = [a.seq_id for a in admissions]
        try:
            await self._settle(seq_ids, [a.page_table for a in admissions])
            if self.remote is not None:  # the blocks whose fetch landed, in a row, are reused
                admissions, _ = await self.remote.landed(admissions, transfers)
            checks = self._integrity
            if pending is not None:
                bad = await pending.changed()
            else:
                bad = [] if checks is None else await checks.check_reuse(self.blocks, admissions, plan)
        except BaseException:
            self._abandon(admissions, plan)
            raise
        return admissions, bad

    def _abandon(self, admissions: list[Admission], plan: Plan) -> None:
        """Free a batch whose admission failed; a partial copy not verified (maybe not landed) is never cached."""
        for a in admissions:
            if a.seq_id in self.blocks.live_sequences:
                self.blocks.free(a.seq_id)
        for move in plan.moves:
            if move.kind == "partial":
                self.blocks.invalidate(move.block)

    def _refuse(self, admissions: list[Admission], plan: Plan, bad: list[Block]) -> None:
        checks = self._integrity
        assert checks is not None
        self._integrity_errors += checks.refuse(self.blocks, admissions, plan, bad)

    def _sweep(self) -> None:
        """Drop blocks produced by copies that have failed since the last look (no await)."""
        if not self._unchecked:
            return
        keep: list[tuple[Transfer, list[Block]]] = []
        for t, blocks in self._unchecked:
            if not t.done():
                keep.append((t, blocks))
            elif t.exception() is not None:
                for block in blocks:
                    self._poison(block)
        self._unchecked = keep

    def _poison(self, block: Block) -> None:
        if block.cached:
            self._poisoned += 1
        self.blocks.invalidate(block)

    async def _settle_slots(self, slots: Iterable[int]) -> None:
        """Wait for every pending copy touching these GPU slots (the data is in place and no older read remains)."""
        fences = self.engine.fences
        pool = Tier.GPU.value
        if not fences.live(pool):  # no copy touching a GPU slot is still running: nothing to wait for
            return
        for slot in slots:
            write, reads = fences.pending(pool, slot)
            if write is not None:
                await write.wait()
            for r in reads:
                await r.wait()


async def landed(t: Transfer) -> None:
    """Wait for a transfer, whatever its outcome (the cache sees a failure through the blocks' sources)."""
    try:
        await t
    except Exception:
        pass


def _layered_last(groups: list[list[Move]], layer_groups: Sequence[tuple[int, int]] | None) -> list[int] | None:
    """An issue order with the layered groups after the others, when no group moved after one touches its slots."""
    if layer_groups is None:
        return None
    first: list[int] = []
    last: list[int] = []
    held: set[tuple[Tier, int]] = set()  # slots of the layered groups listed so far
    for g, group in enumerate(groups):
        slots = {(m.src_tier, m.src_slot) for m in group} | {(m.dst_tier, m.dst_slot) for m in group}
        if layered(group, layer_groups):
            last.append(g)
            held |= slots
        elif held & slots:
            return None  # it must follow a layered group it shares a slot with: keep the plan's order
        else:
            first.append(g)
    return first + last


def layered(group: list[Move], layer_groups: Sequence[tuple[int, int]]) -> bool:
    """Whether a group is copied one layer range at a time: whole blocks from host memory to the GPU."""
    head = group[0]
    return (
        len(layer_groups) > 1 and head.src_tier is Tier.HOST and head.dst_tier is Tier.GPU and head.num_tokens is None
    )


def _succeeded(t: Any) -> bool:
    return isinstance(t, Transfer) and t.done() and t.exception() is None
