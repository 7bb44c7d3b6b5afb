"""The KV bridge between a transformers forward and a tiered_kv GPU pool (past KV in, new KV out).

Primitives:

* :func:`pool_views` -- per layer, ``(K, V)`` views ``[num_blocks, heads, tokens, head_dim]`` of a GPU pool.
* :class:`RowTargets` -- where a forward's new KV goes: per batch row, the sequence's page table.
* :func:`cache_classes` -- ``(WriteThroughLayer, WriteThroughCache)``: a transformers ``DynamicCache`` whose
  layers also write the KV the model computes into the sequences' blocks (built on the installed
  transformers, imported lazily).
* :class:`PhaseTimer` -- named time spans of a forward (CUDA events, or the host clock on the CPU).
* :func:`preload_past` -- fill every layer of such a cache with the reused KV of each row, read from the blocks
  of the rows' page tables (the past key/values the model attends to).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from ...layer_major import LayerMajorPool
from ...pools import BlockPool

__all__ = ["PhaseTimer", "RowTargets", "cache_classes", "pool_views", "preload_past"]


def pool_views(pool: BlockPool | LayerMajorPool, layers: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, ``(K, V)`` views ``[num_blocks, heads, tokens, head_dim]`` of a GPU pool (no copy)."""
    if isinstance(pool, LayerMajorPool):
        if pool.split_kv:
            return [(pool.layer(2 * i), pool.layer(2 * i + 1)) for i in range(layers)]
        return [(pool.layer(i)[:, 0], pool.layer(i)[:, 1]) for i in range(layers)]
    t = pool.tensor
    return [(t[:, i, 0], t[:, i, 1]) for i in range(layers)]


#: A forward writing at most this many positions (rows x new tokens: a decode step) holds its layers' KV back and
#: writes every layer at once in :meth:`RowTargets.finish`; a longer one writes each layer as it comes.
BATCHED_WRITE_POSITIONS = 64


class RowTargets:
    """Where a forward's KV goes: per batch row, the sequence's page table (None: not stored).

    Args:
        tokens_per_block: the layout's block size.
        pool: the GPU pool's tensor ``[blocks, layers, 2, heads, tokens, head_dim]`` (a block-major pool), or
            ``None``. With it, a forward of at most :data:`BATCHED_WRITE_POSITIONS` positions writes every layer's
            KV in one copy when :meth:`finish` is called after it, instead of two copies per layer (a decode step is
            launch-bound: 64 copies of a few KiB cost more than the step's attention over the past).
    """

    __slots__ = (
        "_pending",
        "_rows_kept",
        "block_index",
        "offsets",
        "page_tables",
        "pool",
        "start",
        "timer",
        "tokens_per_block",
    )

    def __init__(self, tokens_per_block: int, pool: torch.Tensor | None = None) -> None:
        self.tokens_per_block = tokens_per_block
        self.pool = pool
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # layers' KV held back for finish()
        self.timer: PhaseTimer | None = None  # times the writes (``kv_write``) while set
        self.page_tables: list[tuple[int, ...] | None] = []
        self.start = 0  # position of the forward's first token
        self.block_index: torch.Tensor | None = None  # [rows stored * q] block per written position
        self.offsets: torch.Tensor | None = None  # [rows stored * q] token offset in its block
        self._rows_kept: torch.Tensor | None = None

    def prepare(self, start: int, length: int, device: torch.device) -> None:
        """Index tensors for a forward over positions ``[start, start + length)`` (built once, used by every layer)."""
        T = self.tokens_per_block
        self.start = start
        positions = np.arange(start, start + length)
        blocks, offsets, kept = [], [], []
        for row, pt in enumerate(self.page_tables):
            if pt is None:
                continue
            kept.append(row)
            table = np.asarray(pt, dtype=np.int64)
            blocks.append(table[positions // T])
            offsets.append(positions % T)
        self._pending = None
        if not kept:
            self.block_index = self.offsets = self._rows_kept = None
            return
        self.block_index = torch.from_numpy(np.concatenate(blocks)).to(device)
        self.offsets = torch.from_numpy(np.concatenate(offsets)).to(device)
        self._rows_kept = torch.tensor(kept, dtype=torch.long, device=device)
        if self.pool is not None and len(kept) * length <= BATCHED_WRITE_POSITIONS:
            self._pending = []

    def write(self, views: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write one layer's new ``[batch, heads, q, head_dim]`` keys and values into the blocks."""
        if self.block_index is None:
            return
        if self._pending is not None:
            self._pending.append((keys, values))
            return
        assert self._rows_kept is not None and self.offsets is not None
        timer = self.timer
        mark = timer.start() if timer is not None else None
        if self._rows_kept.numel() != keys.shape[0]:
            keys, values = keys.index_select(0, self._rows_kept), values.index_select(0, self._rows_kept)
        for view, new in zip(views, (keys, values), strict=True):
            # [rows, heads, q, dim] -> [rows * q, heads, dim], one row per written position
            flat = new.permute(0, 2, 1, 3).reshape(-1, new.shape[1], new.shape[3])
            view[self.block_index, :, self.offsets, :] = flat.to(view.dtype)
        if timer is not None:
            timer.stop("kv_write", mark)

    def finish(self) -> None:
        """Write the KV :meth:`write` held back (a short forward's, every layer at once); call after each forward.

        Raises:
            RuntimeError: the forward wrote another number of layers than the pool holds.
        """
        pending = self._pending
        if not pending:
            return
        self._pending = []
        pool = self.pool
        assert pool is not None and self._rows_kept is not None and self.offsets is not None
        if len(pending) != pool.shape[1]:
            raise RuntimeError(f"the forward wrote {len(pending)} layers, the pool holds {pool.shape[1]}")
        timer = self.timer
        mark = timer.start() if timer is not None else None
        parts: list[torch.Tensor] = []
        for keys, values in pending:
            if self._rows_kept.numel() != keys.shape[0]:
                keys, values = keys.index_select(0, self._rows_kept), values.index_select(0, self._rows_kept)
            parts += (keys, values)
        rows, heads, q, dim = parts[0].shape
        # [layers * 2, rows, heads, q, dim] -> [rows * q, layers, 2, heads, dim]: one row per written position,
        # the shape of pool[block_index, :, :, :, offsets, :]
        stacked = torch.stack(parts).view(len(pending), 2, rows, heads, q, dim)
        flat = stacked.permute(2, 4, 0, 1, 3, 5).reshape(rows * q, len(pending), 2, heads, dim)
        pool[self.block_index, :, :, :, self.offsets, :] = flat.to(pool.dtype)
        if timer is not None:
            timer.stop("kv_write", mark)


class PhaseTimer:
    """Time spans of a forward by name.

    CUDA events on the current stream (nothing synchronizes until :meth:`totals`), or the host clock on the CPU.
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._spans: list[tuple[str, Any, Any]] = []

    def start(self) -> Any:
        """A mark to pass to :meth:`stop`."""
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, name: str, mark: Any) -> None:
        """Add the span from ``mark`` to now to ``name``."""
        self._spans.append((name, mark, self.start()))

    def totals(self) -> dict[str, float]:
        """Seconds per name (synchronizes the events first on CUDA)."""
        out: dict[str, float] = {}
        for name, a, b in self._spans:
            seconds = a.elapsed_time(b) / 1e3 if self._cuda else b - a
            out[name] = out.get(name, 0.0) + seconds
        return out


def cache_classes() -> tuple[type[Any], type[Any]]:
    """``(WriteThroughLayer, WriteThroughCache)`` built on the installed transformers (imported lazily)."""
    global _CLASSES
    if _CLASSES is not None:
        return _CLASSES
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer
    except ImportError as exc:  # pragma: no cover - transformers is a dependency
        raise ImportError(
            "tiered_kv.integrations.hf.generator needs transformers>=5: pip install transformers"
        ) from exc

    class WriteThroughLayer(DynamicLayer):  # type: ignore[no-untyped-call]
        """A ``DynamicLayer`` whose ``update`` also writes the new KV into the sequences' blocks."""

        def __init__(self, views: tuple[torch.Tensor, torch.Tensor], rows: RowTargets) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self._views = views
            self._rows = rows

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self._rows.write(self._views, key_states, value_states)
            return super().update(key_states, value_states, *args, **kwargs)

        def preload(self, keys: torch.Tensor, values: torch.Tensor) -> None:
            """Start from reused KV ``[batch, heads, tokens, head_dim]`` without writing it back."""
            self.lazy_initialization(keys, values)
            self.keys, self.values = keys, values

    class WriteThroughCache(DynamicCache):
        """A ``DynamicCache`` of :class:`WriteThroughLayer` s (one per model layer)."""

        def __init__(self, layers: list[Any]) -> None:  # not DynamicCache's init: it would build its own layers
            from transformers.cache_utils import Cache

            Cache.__init__(self, layers=layers)

    _CLASSES = (WriteThroughLayer, WriteThroughCache)
    return _CLASSES


_CLASSES: tuple[type[Any], type[Any]] | None = None


def preload_past(
    kv: Any,
    views: list[tuple[torch.Tensor, torch.Tensor]],
    page_tables: list[tuple[int, ...]],
    reused: int,
    tokens_per_block: int,
    device: torch.device,
) -> None:
    """Fill every layer of ``kv`` with the reused KV of each row (positions ``[0, reused)``).

    Args:
        kv: a cache from :func:`cache_classes` (one layer per entry of ``views``).
        views: :func:`pool_views` of the GPU pool.
        page_tables: per row, the sequence's page table (its first ``ceil(reused / tokens_per_block)`` blocks
            hold the reused KV).
        reused: tokens reused (the same for every row).
        tokens_per_block: the layout's block size.
        device: the model's device.
    """
    nb = -(-reused // tokens_per_block)
    index = torch.tensor([pt[:nb] for pt in page_tables], dtype=torch.long, device=device)  # [rows, nb]
    flat = index.reshape(-1)
    rows = len(page_tables)
    for layer, (k_view, v_view) in zip(kv.layers, views, strict=True):
        parts = []
        for view in (k_view, v_view):
            blocks = view.index_select(0, flat)  # [rows * nb, heads, T, dim]
            _, heads, T, dim = blocks.shape
            x = blocks.view(rows, nb, heads, T, dim).permute(0, 2, 1, 3, 4).reshape(rows, heads, nb * T, dim)
            parts.append(x[:, :, :reused] if nb * T != reused else x)
        layer.preload(parts[0], parts[1])
