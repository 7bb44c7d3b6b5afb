"""Remote reads planned by admission: the ``"fetch"`` moves of a :class:`~tiered_kv.blocks.Plan`, and their outcome.

Primitives:

* :class:`RemoteFetch` -- the :class:`~tiered_kv.Transfer` of one group of ``remote->gpu`` or ``remote->host``
  fetch moves: it never fails (a missing or bad object, a store that is away or failing is a *miss*), and
  ``found`` says, per block, whether a verified object landed.
* :func:`issue_fetch` -- issue such a group through :meth:`RemoteTier.get <tiered_kv.remote.RemoteTier.get>`.
* :func:`fetched_prefixes` -- after the batch's copies completed: per admission, how many blocks after its reused
  prefix landed, in a row.

The remote tier is a tier of the plan like the others: admission (:meth:`BlockManager.admit
<tiered_kv.blocks.BlockManager.admit>`) allocates a GPU block for every block of a prompt that no local tier
holds, and plans for each one that could be reused a read of its object -- straight into that GPU block through
the tier's staging ring, or (a GPU pool the tier cannot write) into a ring of host slots and onboarded from
there. The cache issues these moves with the rest of the plan, in plan order, under the engine's fences; once they
completed, the blocks that landed, up to the first that did not, are reused (:meth:`BlockManager.fetched
<tiered_kv.blocks.BlockManager.fetched>`) and the rest are computed. So a prefix of any length is reused, however
small the host tier: the only bound is the GPU tier, which holds the sequence anyway.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

from ..blocks import Admission, Block, BlockManager, Move
from ..fences import Marker
from ..pools import Tier
from ..transfer import Transfer

__all__ = ["RemoteFetch", "fetched_prefixes", "issue_fetch"]


class _Getter(Protocol):
    def get(self, keys: Sequence[bytes], dst_tier: Tier | str, slots: Sequence[int]) -> Transfer: ...


class RemoteFetch(Transfer):
    """The reads of one group of fetch moves; completes without error, ``found[i]``: block ``i`` landed verified."""

    __slots__ = ("blocks", "found")

    def __init__(self, inner: Transfer, blocks: list[Block]) -> None:
        marker = Marker(None)
        super().__init__(marker, Tier.REMOTE, inner.dst_tier, inner.num_blocks, inner.nbytes)
        self.blocks = blocks
        self.found = [False] * len(blocks)

        def finished(t: Transfer) -> None:
            # a failed read serves nothing, even chunks of it that landed: those blocks are computed instead
            if t.exception() is None:
                self.found = list(getattr(t, "found", self.found))
            marker.complete()

        inner.add_done_callback(finished)


def issue_fetch(tier: _Getter, group: list[Move]) -> RemoteFetch:
    """Issue one group of fetch moves (same destination tier) as one remote read; returns at once.

    Raises:
        ValueError, TypeError, EngineClosedError: as :meth:`RemoteTier.get <tiered_kv.remote.RemoteTier.get>`,
            before anything is enqueued (the cache then fails the group like any copy it could not issue).
    """
    head = group[0]
    keys = [m.key for m in group]
    if any(k is None for k in keys) or head.src_tier is not Tier.REMOTE:
        raise ValueError("a remote fetch needs moves from the remote tier, each with its content key")
    inner = tier.get([k for k in keys if k is not None], head.dst_tier, [m.dst_slot for m in group])
    return RemoteFetch(inner, [m.block for m in group])


async def fetched_prefixes(blocks: BlockManager, admissions: list[Admission],
                           transfers: Sequence[Transfer]) -> tuple[list[Admission], list[Block]]:
    """Reuse what the batch's fetches brought: per admission, the blocks after its prefix that landed, in a row.

    Waits for the fetches (the caller has awaited the batch's GPU slots, so they are done or about to be), then,
    without another await, commits those blocks (:meth:`BlockManager.fetched`) and reports them in
    ``blocks_from["remote"]``. A block whose object landed after one that did not is computed, like the rest.
    Returns the admissions (each with a ``"remote"`` count) and the blocks now reused from the store.

    Cancellation: propagates before anything is committed; the sequences are the caller's to free.
    """
    fetches = [t for t in transfers if isinstance(t, RemoteFetch)]
    for t in fetches:
        await t
    landed = {b.id for t in fetches for b, ok in zip(t.blocks, t.found, strict=True) if ok}
    tpb = blocks.tokens_per_block
    out: list[Admission] = []
    reused: list[Block] = []
    for adm in admissions:
        seq_blocks = blocks.sequence_blocks(adm.seq_id)
        m = blocks.committed_tokens(adm.seq_id) // tpb
        k = 0
        while m + k < len(seq_blocks) and seq_blocks[m + k].id in landed:
            k += 1
        by = {**adm.blocks_from, "remote": k}
        if k:
            tokens = blocks.fetched(adm.seq_id, k)
            reused.extend(seq_blocks[m : m + k])
            adm = dataclasses.replace(
                adm, tokens_reused=tokens - adm.tokens_computed_first, blocks_from=by, partial_tokens=0
            )
        else:
            adm = dataclasses.replace(adm, blocks_from=by)
        out.append(adm)
    return out, reused
