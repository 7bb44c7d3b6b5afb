"""The argument checks of a copy: block indices, ``num_tokens`` and ``layers``, with the descriptive errors.

Primitives:

* :data:`Indices` -- what a copy accepts as block indices: any iterable of ints, a numpy or a CPU torch integer array.
* :class:`CopyChecks` -- the base of :class:`~tiered_kv.engine.TransferEngine` that checks a copy's arguments
  against its layout and media.

Every check raises ``TypeError`` / ``ValueError`` before anything is enqueued or fenced, so a rejected copy leaves
the engine untouched. Small int lists between memory pools are checked on the per-call fast path instead
(:func:`~tiered_kv.pools.small_pairs`), which declines whatever it cannot judge and keeps these errors.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from .handlers import Medium
from .layout import KVLayout
from .pools import as_indices

__all__ = ["CopyChecks", "Indices"]

Indices = Iterable[int] | np.ndarray | torch.Tensor


class CopyChecks:
    """The checks of a copy's arguments, against ``layout`` (the engine's block geometry) and the media it names."""

    layout: KVLayout

    @staticmethod
    def _check_indices(
        src_pool: Medium, src_indices: Indices, dst_pool: Medium, dst_indices: Indices
    ) -> tuple[np.ndarray, np.ndarray]:
        """The general index checks (any iterable, numpy or CPU tensor), with the descriptive errors.

        Vectorized (a sort, no Python-level loop or set): a call of thousands of blocks is checked in tens of us.
        """
        s = as_indices(src_indices, "source indices")
        d = as_indices(dst_indices, "destination indices")
        if s.size != d.size:
            raise ValueError(f"got {s.size} source indices and {d.size} destination indices; they must pair up")
        src_pool.check(s, "source indices")
        dst_pool.check(d, "destination indices")
        if d.size > 1:
            # a count per block where the pool is not much larger than the call, else a sort
            n = dst_pool.num_blocks
            if n <= 8 * d.size:
                repeated = bool(np.bincount(d, minlength=n).max() > 1)
            else:
                ordered = np.sort(d)
                repeated = bool((ordered[1:] == ordered[:-1]).any())
            if repeated:
                values, counts = np.unique(d, return_counts=True)
                raise ValueError(f"destination indices contain duplicates: {values[counts > 1][:8].tolist()}")
        if src_pool is dst_pool and s.size:
            both = np.intersect1d(s, d)
            if both.size:
                raise ValueError(f"blocks {both[:8].tolist()} are both a source and a destination of one copy")
        return s, d

    def _check_layers(self, layers: object, memory: bool) -> tuple[int, int] | None:
        """``layers`` as a checked ``(start, stop)`` span (``None``: every layer); only between memory pools."""
        if layers is None:
            return None
        if not memory:
            raise ValueError("layers= is only supported between GPU and host pools (a file slot is one whole block)")
        if (
            not isinstance(layers, tuple)
            or len(layers) != 2
            or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in layers)
        ):
            raise TypeError(f"layers must be a (start, stop) tuple of ints, got {layers!r}")
        start, stop = int(layers[0]), int(layers[1])
        if not 0 <= start < stop <= self.layout.num_layers:
            raise ValueError(
                f"layers must be a range (start, stop) with 0 <= start < stop <= {self.layout.num_layers}, got {layers}"
            )
        return start, stop

    def _check_tokens(self, num_tokens: int | None) -> int | None:
        """``num_tokens`` checked: ``None`` for whole blocks (also when it is ``tokens_per_block``), else the int."""
        if num_tokens is None:
            return None
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)):
            raise TypeError(f"num_tokens must be an int or None, got {type(num_tokens).__name__}")
        tpb = self.layout.tokens_per_block
        if not 1 <= num_tokens <= tpb:
            raise ValueError(f"num_tokens must be in 1..{tpb} (tokens_per_block), got {num_tokens}")
        return None if num_tokens == tpb else int(num_tokens)
