"""Layer-by-layer transfers: load (or store) blocks one layer group at a time, overlapped with compute.

Primitives:

* :class:`~tiered_kv.layer_major.LayerSlice` -- layers ``[start, stop)`` of a pool (re-exported from
  :mod:`tiered_kv.layer_major`, where the pools live).
* :func:`layer_groups` -- split ``num_layers`` into consecutive groups of ``group_layers``;
  :func:`tapered_groups` -- the same with the last group split in halves down to one layer.
* :class:`LayerwiseTransfer` -- one :class:`~tiered_kv.engine.Transfer` per layer group;
  :meth:`LayerwiseTransfer.wait_layer` makes a compute stream wait, stream-side, for the group holding one
  layer (vLLM's ``wait_for_layer_load``); awaiting it awaits every group.
* :func:`copy_layerwise` -- issue a copy as per-group ``engine.copy(..., layers=(start, stop))`` calls.
* :class:`LayerLoad` -- the reused blocks of a cache admission still landing one layer group at a time
  (:meth:`~tiered_kv.TieredKVCache.add_sequences_layerwise`): wait per layer, then settle.

A model that computes layer by layer then runs layer ``i`` as soon as layer ``i`` has landed instead of after
the whole load: the copy of layer ``i + 1`` overlaps the compute of layer ``i``. A store of layer ``i``
(``engine.copy(Tier.GPU, ..., Tier.HOST, ..., layers=(i, i + 1))`` after ``engine.sync_with_compute``) starts
as soon as that layer is written. Fences stay per block: groups of one copy touch the same blocks and run
in order on one copy stream, so they never wait for each other beyond that FIFO.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .layer_major import LayerSlice
from .pools import Tier

if TYPE_CHECKING:
    from .engine import Transfer, TransferEngine, TransferResult

__all__ = ["LayerLoad", "LayerSlice", "LayerwiseTransfer", "copy_layerwise", "layer_groups", "tapered_groups"]


def layer_groups(num_layers: int, group_layers: int) -> list[tuple[int, int]]:
    """``[(0, g), (g, 2g), ...]`` covering ``num_layers`` (the last group may be shorter).

    Raises:
        ValueError: ``group_layers`` < 1.
    """
    if isinstance(group_layers, bool) or not isinstance(group_layers, int) or group_layers < 1:
        raise ValueError(f"group_layers must be a positive int, got {group_layers!r}")
    return [(i, min(i + group_layers, num_layers)) for i in range(0, num_layers, group_layers)]


def tapered_groups(num_layers: int, group_layers: int) -> list[tuple[int, int]]:
    """:func:`layer_groups` with the last group split in halves down to one layer (unless there is one group).

    ``(32, 4)`` ends ``(24, 28), (28, 30), (30, 31), (31, 32)``.

    A load overlapped with compute leaves the last group's layers to compute once it lands; a last group of one
    layer leaves one (at 32k tokens of an 8B model, 4 layers are ~8 ms of compute after the last copy).

    Raises:
        ValueError: ``group_layers`` < 1.
    """
    groups = layer_groups(num_layers, group_layers)
    if len(groups) == 1:  # one copy asked for: nothing overlaps it
        return groups
    start, stop = groups.pop()
    while stop - start > 1:
        half = (stop - start + 1) // 2
        groups.append((start, start + half))
        start += half
    groups.append((start, stop))
    return groups


class LayerwiseTransfer:
    """The per-group transfers of one layer-by-layer copy.

    Attributes:
        groups: ``(start, stop)`` layer range of each transfer.
        transfers: one transfer per group, in layer order.

    Notes:
        Cancellation: cancelling a task that awaits it cancels only the wait; every group still completes.
    """

    __slots__ = ("_engine", "groups", "transfers")

    def __init__(
        self, engine: TransferEngine, groups: Sequence[tuple[int, int]], transfers: Sequence[Transfer]
    ) -> None:
        self._engine = engine
        self.groups = list(groups)
        self.transfers = list(transfers)

    def transfer_of(self, layer: int) -> Transfer:
        """The transfer that carries ``layer``.

        Raises:
            ValueError: no group holds ``layer``.
        """
        for (start, stop), t in zip(self.groups, self.transfers, strict=True):
            if start <= layer < stop:
                return t
        raise ValueError(f"layer {layer} is in no group of this transfer ({self.groups})")

    def wait_layer(self, layer: int, stream: object) -> None:
        """Make work queued on ``stream`` from now on wait for ``layer`` to have landed. Stream-side: nothing blocks.

        Args:
            layer: the layer about to be computed.
            stream: the compute stream (``torch.cuda.Stream`` or a tiered_kv stream).

        Raises:
            ValueError: no group holds ``layer``, or its copy is still deferred on the loop (it waits for a
                file-tier dependency): await that transfer instead.
        """
        self._engine.sync_transfer(self.transfer_of(layer), stream)

    def done(self) -> bool:
        """True once every group has completed."""
        return all(t.done() for t in self.transfers)

    def __await__(self) -> Generator[Any, None, list[TransferResult]]:
        results = []
        for t in self.transfers:
            result = yield from t.__await__()
            results.append(result)
        return results

    def __repr__(self) -> str:
        done = sum(t.done() for t in self.transfers)
        return f"<LayerwiseTransfer groups={len(self.groups)} done={done}>"


def copy_layerwise(
    engine: TransferEngine,
    src_tier: Tier | str,
    src_indices: Iterable[int] | np.ndarray | torch.Tensor,
    dst_tier: Tier | str,
    dst_indices: Iterable[int] | np.ndarray | torch.Tensor,
    *,
    group_layers: int = 1,
    num_tokens: int | None = None,
) -> LayerwiseTransfer:
    """Copy blocks one layer group at a time: one ``engine.copy(..., layers=group)`` per group, in layer order.

    Args:
        engine: the engine.
        src_tier: source tier (GPU or HOST).
        src_indices: source block indices.
        dst_tier: destination tier (GPU or HOST).
        dst_indices: destination block indices.
        group_layers: layers per group (1: one transfer per layer).
        num_tokens: as for :meth:`~tiered_kv.engine.TransferEngine.copy`.

    Raises:
        ValueError / TypeError: as ``engine.copy``; nothing is enqueued when the first group is rejected.
    """
    if isinstance(src_indices, (np.ndarray, torch.Tensor)) or isinstance(src_indices, list):
        s: Any = src_indices
    else:
        s = list(src_indices)  # an iterator is consumed once; every group needs the indices
    d: Any = dst_indices if isinstance(dst_indices, (np.ndarray, torch.Tensor, list)) else list(dst_indices)
    groups = layer_groups(engine.layout.num_layers, group_layers)
    transfers = engine.copy_layer_groups(src_tier, s, dst_tier, d, groups, num_tokens=num_tokens)
    return LayerwiseTransfer(engine, groups, transfers)


class LayerLoad:
    """Reused blocks of an admission still landing on the GPU, one layer group at a time.

    Rules: compute reads layer ``i`` of the reused blocks only after :meth:`wait_layer` ``(i, stream)``; nothing
    computed from them is used, and nothing is committed, before :meth:`settle` returned. :meth:`settle` waits
    for every copy, checks the reused blocks against their checksums and, when a copy failed or a block changed,
    frees the batch, drops the bad blocks and raises :class:`~tiered_kv.errors.TransferError`: the caller admits
    the prompts again (they then recompute what was dropped) and discards what it computed meanwhile.

    Attributes:
        groups: ``(start, stop)`` layer range of each group, in layer order.
        transfers: per group, its copies (one per batch of blocks the plan moved).
    """

    __slots__ = ("_engine", "_settle", "_settled", "groups", "transfers")

    def __init__(
        self,
        engine: TransferEngine,
        groups: Sequence[tuple[int, int]],
        transfers: Sequence[Sequence[Transfer]],
        settle: Callable[[], Awaitable[None]],
    ) -> None:
        self._engine = engine
        self.groups = list(groups)
        self.transfers = [list(t) for t in transfers]
        self._settle = settle
        self._settled = False

    def wait_layer(self, layer: int, stream: object | None) -> None:
        """Make compute queued on ``stream`` from now on wait for ``layer`` to have landed (stream-side).

        ``stream=None``: the compute runs on the calling thread (the emulated device): this blocks until then.

        Raises:
            ValueError: no group holds ``layer``.
        """
        for (start, stop), copies in zip(self.groups, self.transfers, strict=True):
            if start <= layer < stop:
                for t in copies:
                    self._engine.sync_transfer(t, stream)
                return
        raise ValueError(f"layer {layer} is in no group of this load ({self.groups})")

    def wait_all(self, stream: object | None) -> None:
        """:meth:`wait_layer` for every layer."""
        for copies in self.transfers:
            for t in copies:
                self._engine.sync_transfer(t, stream)

    async def settle(self) -> None:
        """Wait for every copy and check the blocks (see the class); idempotent once it returned.

        Raises:
            TransferError: a copy failed or a reused block changed since its commit; the batch was freed.
        """
        if not self._settled:
            await self._settle()
            self._settled = True

    def __repr__(self) -> str:
        done = sum(all(t.done() for t in copies) for copies in self.transfers)
        return f"<LayerLoad groups={len(self.groups)} landed={done} settled={self._settled}>"
