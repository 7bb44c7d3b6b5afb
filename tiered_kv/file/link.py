"""The host<->device leg of the file tier's GPU copies: one stream op that moves a group of blocks.

A group of GPU blocks crosses to or from its staging blocks (:mod:`~tiered_kv.file.ring`) in one op:

* on CUDA, or for a pool that is not block-major (a layer-major block is not one region): through the engine's
  copier (one kernel or DMA batch call), or, without one (a :class:`~tiered_kv.file.pipeline.FileCopy` made by
  hand), one ``copy_`` per pair;
* on the emulated device, for a block-major pool in host memory: one memcpy per pair through numpy rows.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ..copyops import Copier
from ..device import Device, Stream
from ..layer_major import LayerMajorPool
from ..pools import BlockPool
from .ring import StagingRing

__all__ = ["group_copy_op"]


def group_copy_op(
    *,
    device: Device,
    ring: StagingRing,
    pool: torch.Tensor,
    side: BlockPool | LayerMajorPool | None,
    copier: Copier | None,
    stream: Stream | None,
    blocks: list[int],
    bufs: list[int],
    to_staging: bool,
) -> tuple[Callable[[], None], bool]:
    """The op copying ``blocks`` of the GPU pool to/from staging ``bufs``, and whether it names its stream.

    Args:
        device: the engine's device.
        ring: the staging ring ``bufs`` belong to.
        pool: the block-major GPU pool's tensor (one row per block).
        side: the GPU pool as the copier takes it (``None``: none, the copier is not used).
        copier: the engine's copier (``None``: a copy per pair).
        stream: the stream the op runs on (the copier's op may name it).
        blocks: GPU blocks, in order.
        bufs: their staging blocks.
        to_staging: GPU -> staging (else staging -> GPU).
    """
    if device.is_cuda or (side is not None and not isinstance(side, BlockPool)):
        if copier is not None and side is not None:  # the engine's copier: one kernel / DMA batch call
            if to_staging:
                op = copier.build(side, blocks, ring.pool, bufs, None, stream=stream)
            else:
                op = copier.build(ring.pool, bufs, side, blocks, None, stream=stream)
            return op, bool(getattr(op, "explicit_stream", False))
        gpu_t = pool.reshape(pool.shape[0], -1).view(torch.uint8)
        staging_t = ring.tensor

        def copy_each() -> None:  # no copier (a FileCopy made by hand): one copy_ per pair, one stream op
            for b, s in zip(blocks, bufs, strict=True):
                if to_staging:
                    staging_t[s].copy_(gpu_t[b], non_blocking=True)
                else:
                    gpu_t[b].copy_(staging_t[s], non_blocking=True)

        return copy_each, False
    # The emulated device (block-major pool in host memory): a memcpy per pair through numpy rows. The
    # copier's CPU reference gathers into a fresh temporary first (two copies and an allocation per op),
    # which would make the emulated link leg, not the pipeline, what a CPU run measures.
    gpu_np = pool.reshape(pool.shape[0], -1).view(torch.uint8).numpy()
    staging_np = ring.array

    def copy_rows() -> None:
        for b, s in zip(blocks, bufs, strict=True):
            if to_staging:
                np.copyto(staging_np[s], gpu_np[b])
            else:
                np.copyto(gpu_np[b], staging_np[s])

    return copy_rows, False
