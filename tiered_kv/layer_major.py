"""Layer-major GPU pools: one tensor per layer (vLLM / SGLang style), or one per layer and K/V.

Primitives:

* :class:`LayerMajorPool` -- per-layer (or per-layer-and-K/V) GPU tensors seen as one pool of blocks:
  ``allocate``, ``block``, ``layer``, ``check``.
* :class:`LayerSlice` -- layers ``[start, stop)`` of a block-major or layer-major pool, as the copier sees
  them (a view).

A block of a layer-major pool is ``layers * kv`` chunks scattered over the per-layer tensors; the host and
file tiers still store it contiguously (block-major), so offload gathers and onboard scatters. The copies are
done by :mod:`tiered_kv.copyops` (one kernel launch, or DMA calls issued in C++).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from .layout import KVLayout
from .pools import BlockPool, Tier, check_indices

__all__ = ["LayerMajorPool", "LayerSlice"]


class LayerMajorPool:
    """A GPU pool kept as per-layer tensors.

    Args:
        layout: block geometry.
        tensors: either ``num_layers`` tensors ``[num_blocks, kv, heads, tokens, head_dim]`` or
            ``num_layers * kv`` tensors ``[num_blocks, heads, tokens, head_dim]`` ordered
            ``(layer 0 K, layer 0 V, layer 1 K, ...)``. All share shape, strides, dtype and device; each
            block's part of a tensor must be dense (the block stride may be larger, e.g. a view).
        tier: the tier the pool serves (only ``Tier.GPU`` is supported by the engine).

    Raises:
        ValueError: wrong count, shape, strides, device mix or a non-dense block.
        TypeError: dtype differs from the layout.

    Notes:
        :meth:`block` returns a *copy* in block-major order (a layer-major block is not one region);
        write through :meth:`layer` views.
    """

    def __init__(self, layout: KVLayout, tensors: Sequence[torch.Tensor], tier: Tier = Tier.GPU) -> None:
        tensors = list(tensors)
        L, kv, H, T, D = layout.block_shape
        if len(tensors) == L:
            inner: tuple[int, ...] = (kv, H, T, D)
            self.split_kv = False
        elif len(tensors) == L * kv and kv > 1:
            inner = (H, T, D)
            self.split_kv = True
        else:
            raise ValueError(
                f"a layer-major pool needs {L} per-layer tensors (or {L * kv} per layer and K/V), got {len(tensors)}"
            )
        first = tensors[0]
        if first.dim() != 1 + len(inner) or tuple(first.shape[1:]) != inner:
            raise ValueError(
                f"layer-major tensors must be [num_blocks, {', '.join(map(str, inner))}], got {list(first.shape)}"
            )
        for t in tensors:
            if t.dtype != layout.dtype:
                raise TypeError(f"layer-major tensor dtype {t.dtype} does not match the layout dtype {layout.dtype}")
            if t.shape != first.shape or t.stride() != first.stride() or t.device != first.device:
                raise ValueError("every layer-major tensor must share shape, strides and device")
            if t.shape[0] and not t[0].is_contiguous():
                raise ValueError("each block of a layer-major tensor must be dense (inner dimensions contiguous)")
        self.tier = tier
        self.name = tier.value
        self.layout = layout
        self.tensors = tensors
        self.num_blocks = first.shape[0]

    @classmethod
    def allocate(
        cls,
        layout: KVLayout,
        num_blocks: int,
        device: torch.device | str,
        *,
        split_kv: bool = False,
        tier: Tier = Tier.GPU,
    ) -> LayerMajorPool:
        """A new pool of ``num_blocks`` blocks on ``device`` (one tensor per layer, or per layer and K/V)."""
        L, kv, H, T, D = layout.block_shape
        shape = (num_blocks, H, T, D) if split_kv else (num_blocks, kv, H, T, D)
        count = L * kv if split_kv else L
        return cls(layout, [torch.empty(shape, dtype=layout.dtype, device=device) for _ in range(count)], tier)

    @property
    def tensor(self) -> torch.Tensor:
        """Not available: a layer-major pool has no single tensor (use :attr:`tensors` or :meth:`layer`).

        Raises:
            TypeError: always; the property exists so that code written for block-major pools fails with a
                sentence instead of an AttributeError.
        """
        raise TypeError("a layer-major pool has no single tensor; use pool.tensors or pool.layer(i)")

    @property
    def device(self) -> torch.device:
        """The device of the pool's tensors."""
        return self.tensors[0].device

    def layer(self, index: int) -> torch.Tensor:
        """The live tensor of one layer (``[N, kv, H, T, D]``), or of one (layer, K/V) when split."""
        return self.tensors[index]

    def block(self, index: int) -> torch.Tensor:
        """A block-major *copy* of one block, shape ``layout.block_shape``."""
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"block index must be an int, got {type(index).__name__}")
        if not 0 <= index < self.num_blocks:
            raise ValueError(
                f"block index {index} is out of range for the {self.name} pool of {self.num_blocks} blocks"
            )
        parts = torch.stack([t[index] for t in self.tensors])
        return parts.view(self.layout.block_shape)

    def check(self, indices: np.ndarray, what: str) -> None:
        """Raise ``ValueError`` unless every index is in ``[0, num_blocks)``."""
        check_indices(indices, self.num_blocks, what, f"the {self.name} pool of {self.num_blocks} blocks")

    def __repr__(self) -> str:
        kind = "layer+kv" if self.split_kv else "layer"
        return (
            f"<LayerMajorPool {self.name} blocks={self.num_blocks} tensors={len(self.tensors)} ({kind}-major)"
            f" device={self.device}>"
        )


class LayerSlice:
    """Layers ``[start, stop)`` of every block of a block-major or layer-major pool (a view).

    Args:
        pool: the whole pool.
        start: first layer.
        stop: one past the last layer.

    Attributes:
        pool: the whole pool (fences are kept on it, per block).
        layout: the pool's layout with ``num_layers = stop - start``.
        tensors: what the copy op takes: one strided block-major view, or the per-layer tensors of the range.
    """

    __slots__ = ("layout", "name", "num_blocks", "pool", "start", "stop", "tensors", "tier")

    def __init__(self, pool: BlockPool | LayerMajorPool, start: int, stop: int) -> None:
        layers = pool.layout.num_layers
        if not 0 <= start < stop <= layers:
            raise ValueError(
                f"layers must be a range (start, stop) with 0 <= start < stop <= {layers}, got ({start}, {stop})"
            )
        self.pool = pool
        self.start, self.stop = start, stop
        self.tier: Tier = pool.tier
        self.name = pool.name
        self.num_blocks = pool.num_blocks
        self.layout: KVLayout = dataclasses.replace(pool.layout, num_layers=stop - start)
        if isinstance(pool, LayerMajorPool):
            per = pool.layout.block_shape[1] if pool.split_kv else 1  # tensors per layer: K and V, or one
            self.tensors: list[torch.Tensor] = list(pool.tensors[start * per : stop * per])
        else:
            self.tensors = [pool.tensor[:, start:stop]]

    def __repr__(self) -> str:
        return f"<LayerSlice {self.name} layers [{self.start}, {self.stop}) of {self.pool.layout.num_layers}>"
