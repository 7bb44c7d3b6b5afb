"""The copy machinery of the memory pairs (GPU and pinned host): the engine reaches it through its handler.

Modules, bottom to top:

* :mod:`~tiered_kv.copy.calibration` -- from which sizes DMA copies as fast as the copy kernel on this GPU
  (measured once per process), and the sizes the path choice shares with it.
* :mod:`~tiered_kv.copy.native` -- :class:`NativeCopy`, the job of a small copy issued in one call into C++.
* :mod:`~tiered_kv.copy.torch_fallback` -- the op of CUDA without the extension (torch ``copy_`` calls).
* :mod:`~tiered_kv.copy.copier` -- :class:`Copier`: the path choice (DMA or kernel) per call and the op of each
  batch.
* :mod:`~tiered_kv.copy.handler` -- :class:`StreamCopier`, the :class:`~tiered_kv.handlers.TransferHandler` of
  the memory pairs: each batch's op (or native job) on its stream or a host thread.

The engine makes one :class:`Copier` and enters the machinery through :class:`StreamCopier`'s handler protocol
(``validate``, ``prepare``, the job's ``start``). :mod:`tiered_kv.copyops` and :mod:`tiered_kv.stream_copier` give
the same objects under those paths.
"""

from __future__ import annotations

from .calibration import (
    calibrated_dma_row_threshold,
    calibrated_dma_strided_threshold,
    calibrated_dma_threshold,
    measured_dma_ratios,
)
from .copier import Copier, CopierStatistics, CopyPlan, Pool, Side, choose_path, pool_tensors
from .handler import STREAM_ROUTES, StreamCopier
from .native import NativeCopy

__all__ = [
    "STREAM_ROUTES",
    "Copier",
    "CopierStatistics",
    "CopyPlan",
    "NativeCopy",
    "Pool",
    "Side",
    "StreamCopier",
    "calibrated_dma_row_threshold",
    "calibrated_dma_strided_threshold",
    "calibrated_dma_threshold",
    "choose_path",
    "measured_dma_ratios",
    "pool_tensors",
]
