"""The copy ops under their module path: the copier, the native submission job and the DMA calibration.

The code is in :mod:`tiered_kv.copy` (:mod:`~tiered_kv.copy.copier`: :class:`Copier`, :class:`CopyPlan`,
:func:`choose_path`; :mod:`~tiered_kv.copy.native`: :class:`NativeCopy`; :mod:`~tiered_kv.copy.calibration`: the
``calibrated_dma_*`` thresholds and :func:`measured_dma_ratios`); this module names the same objects.
"""

from __future__ import annotations

from .copy.calibration import DEFAULT_DMA_MIN_CHUNK as DEFAULT_DMA_MIN_CHUNK
from .copy.calibration import MIN_RUN_BLOCKS as MIN_RUN_BLOCKS
from .copy.calibration import NEVER as NEVER
from .copy.calibration import STRIDED_PITCH as STRIDED_PITCH
from .copy.calibration import calibrated_dma_row_threshold, calibrated_dma_threshold
from .copy.calibration import calibrated_dma_strided_threshold as calibrated_dma_strided_threshold
from .copy.calibration import measured_dma_ratios as measured_dma_ratios
from .copy.copier import Copier, CopierStatistics, CopyPlan, Side, choose_path, pool_tensors
from .copy.copier import Op as Op
from .copy.copier import Pool as Pool
from .copy.native import NativeCopy

__all__ = [
    "Copier",
    "CopierStatistics",
    "CopyPlan",
    "NativeCopy",
    "Side",
    "calibrated_dma_row_threshold",
    "calibrated_dma_threshold",
    "choose_path",
    "pool_tensors",
]
