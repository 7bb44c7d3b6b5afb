"""Layer-by-layer transfers: load (or store) blocks one layer group at a time, overlapped with compute.

Primitives:

* :class:`~tiered_kv.layer_major.LayerSlice` -- layers ``[start, stop)`` of a pool (re-exported from
  :mod:`tiered_kv.layer_major`, where the pools live).
* :func:`layer_groups` -- split ``num_layers`` into consecutive groups of ``group_layers``.
* :class:`LayerwiseTransfer` -- one :class:`~tiered_kv.engine.Transfer` per layer group;
  :meth:`LayerwiseTransfer.wait_layer` makes a compute stream wait, stream-side, for the group holding one
  layer (vLLM's ``wait_for_layer_load``); awaiting it awaits every group.
* :func:`copy_layerwise` -- issue a copy as per-group ``engine.copy(..., layers=(start, stop))`` calls.

A model that computes layer by layer then runs layer ``i`` as soon as layer ``i`` has landed instead of after
the whole load: the copy of layer ``i + 1`` overlaps the compute of layer ``i``. A store of layer ``i``
(``engine.copy(Tier.GPU, ..., Tier.HOST, ..., layers=(i, i + 1))`` after ``engine.sync_with_compute``) starts
as soon as that layer is written. Fences stay per block: groups of one copy touch the same blocks and run
in order on one copy stream, so they never wait for each other beyond that FIFO.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .layer_major import LayerSlice
from .pools import Tier

if TYPE_CHECKING:
    from .engine import Transfer, TransferEngine, TransferResult

__all__ = ["LayerSlice", "LayerwiseTransfer", "copy_layerwise", "layer_groups"]


def layer_groups(num_layers: int, group_layers: int) -> list[tuple[int, int]]:
    """``[(0, g), (g, 2g), ...]`` covering ``num_layers`` (the last group may be shorter).

    Raises:
        ValueError: ``group_layers`` < 1.
    """
    if isinstance(group_layers, bool) or not isinstance(group_layers, int) or group_layers < 1:
        raise ValueError(f"group_layers must be a positive int, got {group_layers!r}")
    return [(i, min(i + group_layers, num_layers)) for i in range(0, num_layers, group_layers)]


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
