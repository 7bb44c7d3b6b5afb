"""An engine's memory pools: the GPU and host pools it adopts from the caller or allocates.

Primitives:

* :func:`make_pools` -- the pools of :class:`~tiered_kv.engine.TransferEngine`, by tier.

An adopted pool is used in place (the engine copies into the caller's memory): a GPU pool as a block-major tensor
``[blocks, *layout.block_shape]``, a :class:`~tiered_kv.layer_major.LayerMajorPool` (or a
:mod:`~tiered_kv.pool_kinds` pool), or a list of per-layer tensors as inference engines keep them
(:func:`~tiered_kv.pool_kinds.as_gpu_pool`); a host pool as a tensor of the same block-major shape (pinned on CUDA).
An allocated pool is sized ``blocks * layout.bytes_per_block``; a size no machine has, or an allocation the device
refuses, is a descriptive error before the engine starts anything.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .device import Device
from .layer_major import LayerMajorPool
from .layout import KVLayout
from .pool_kinds import as_gpu_pool
from .pools import BlockPool, Tier

__all__ = ["make_pools"]


def _allocate(
    empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor], what: str, blocks: int, layout: KVLayout
) -> torch.Tensor:
    """A ``[blocks, *layout.block_shape]`` tensor from ``empty``; a size no machine has, or a refused one, raises."""
    nbytes = blocks * layout.bytes_per_block
    if nbytes >= 2**62:
        raise ValueError(f"{what} pool of {blocks} blocks ({nbytes} bytes) is larger than any machine's memory")
    try:
        return empty((blocks, *layout.block_shape), layout.dtype)
    except (RuntimeError, MemoryError) as exc:  # torch reports allocation failures as RuntimeError
        raise MemoryError(
            f"cannot allocate the {what} pool: {blocks} blocks x {layout.bytes_per_block} bytes = "
            f"{nbytes / 2**30:.1f} GiB ({exc})"
        ) from exc


def make_pools(
    layout: KVLayout,
    device: Device,
    gpu_blocks: int,
    host_blocks: int,
    gpu_pool: torch.Tensor | LayerMajorPool | list[torch.Tensor] | tuple[torch.Tensor, ...] | None,
    host_pool: torch.Tensor | None,
) -> dict[Tier, BlockPool | LayerMajorPool]:
    """The GPU and host pools of an engine on ``device``: ``gpu_pool`` / ``host_pool`` if given, else allocated.

    A tier with neither a pool nor blocks has no pool.

    Raises:
        TypeError: ``gpu_pool`` of another type.
        ValueError: ``gpu_pool`` on another device, or a :class:`LayerMajorPool` of another layout or tier; a pool
            larger than any machine's memory.
        MemoryError: the device could not allocate a pool.
    """
    pools: dict[Tier, BlockPool | LayerMajorPool] = {}
    if gpu_pool is not None:
        if isinstance(gpu_pool, (list, tuple)):
            gpu_pool = as_gpu_pool(layout, gpu_pool)  # classic layer-major, or an engine's layout kind
        if not isinstance(gpu_pool, (torch.Tensor, LayerMajorPool)):
            raise TypeError(
                f"gpu_pool must be a torch.Tensor, a LayerMajorPool or a list of tensors, got {type(gpu_pool).__name__}"
            )
        if gpu_pool.device.type != device.torch_device.type:
            raise ValueError(f"gpu_pool is on {gpu_pool.device}, but the engine's device is {device.torch_device}")
        if isinstance(gpu_pool, LayerMajorPool):
            if gpu_pool.layout != layout or gpu_pool.tier is not Tier.GPU:
                raise ValueError("the LayerMajorPool must be a GPU pool with the engine's layout")
            pools[Tier.GPU] = gpu_pool
        else:
            pools[Tier.GPU] = BlockPool(Tier.GPU, layout, gpu_pool)
    elif gpu_blocks:
        pools[Tier.GPU] = BlockPool(Tier.GPU, layout, _allocate(device.empty, "GPU", gpu_blocks, layout))
    if host_pool is not None:  # caller's memory (e.g. shared with another process); pinned on CUDA
        pools[Tier.HOST] = BlockPool(Tier.HOST, layout, host_pool)
    elif host_blocks:
        pools[Tier.HOST] = BlockPool(Tier.HOST, layout, _allocate(device.empty_host, "host", host_blocks, layout))
    return pools
