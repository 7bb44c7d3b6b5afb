"""The KV bridge between a transformers forward and a tiered_kv GPU pool (past KV in, new KV out).

Primitives:

* :func:`pool_views` -- per layer, ``(K, V)`` views ``[num_blocks, heads, tokens, head_dim]`` of a GPU pool.
* :class:`RowTargets` -- a forward's rows: per batch row, the sequence's page table; where the new KV goes and
  which blocks hold the past.
* :func:`cache_classes` -- ``(PoolLayer, PoolCache)``: a transformers ``DynamicCache`` whose layers write the KV
  the model computes into the sequences' blocks and read the past KV from those blocks (built on the installed
  transformers, imported lazily).
* :func:`gather_past` -- one layer's KV of positions ``[0, length)`` of every row, read from its blocks.
* :class:`PhaseTimer` -- named time spans of a forward (CUDA events, or the host clock on the CPU).

Rules:

* A pooled layer keeps no KV between forwards: the sequences' blocks are the only copy. A prompt's forward reads
  one layer's past at a time from the blocks (a copy freed after the layer's attention), so it holds at most one
  layer's past beyond the blocks; no reused prefix is gathered for the whole model before it.
* The new positions' KV in what a layer attends to is the model's own (a held-back write is not in the blocks yet).
* Decode :meth:`materializes <PoolLayer.materialize>` the layers before its first step: each then holds its past
  as a ``DynamicLayer`` and appends a step's KV as transformers does (reading a growing past from the blocks at
  every step copies it twice per layer where ``torch.cat`` copies it once; only an attention kernel that reads
  the blocks in place would copy nothing). A row that stops being stored mid-reply needs nothing more.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ...layer_major import LayerMajorPool
from ...pools import BlockPool

if TYPE_CHECKING:
    from ...layerwise import LayerLoad

__all__ = ["PhaseTimer", "RowTargets", "block_index", "cache_classes", "gather_past", "pool_views"]


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
    """A forward's rows: per batch row, the sequence's page table (None: not stored).

    :meth:`prepare` computes, once per forward, where each new position's KV goes and (when every row is stored)
    :attr:`gather`, the blocks holding positions ``[0, start + length)`` of every row.

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
        "gather",
        "load",
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
        self.gather: torch.Tensor | None = None  # [rows * blocks] the blocks of every row's past and new positions
        self.load: LayerLoad | None = None  # the past's blocks still landing, one layer group at a time

    @staticmethod
    def compute_stream(device: torch.device) -> object | None:
        """Where the forward's kernels run: CUDA's current stream, or ``None`` (the host itself, emulated)."""
        return torch.cuda.current_stream(device) if device.type == "cuda" else None

    def prepare(self, start: int, length: int, device: torch.device, read_past: bool = True) -> None:
        """Index tensors for a forward over positions ``[start, start + length)`` (built once, used by every layer).

        ``read_past``: the layers read positions ``[0, start)`` from the blocks (:attr:`gather`); ``False`` when
        they hold the past themselves (materialized).
        """
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
        stored = len(kept) == len(self.page_tables)
        self.gather = None
        if read_past and start and stored:  # every row's blocks of positions [0, start + length)
            self.gather = block_index([pt for pt in self.page_tables if pt is not None], start + length, T, device)
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
    """``(PoolLayer, PoolCache)`` built on the installed transformers (imported lazily)."""
    global _CLASSES
    if _CLASSES is not None:
        return _CLASSES
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer
    except ImportError as exc:  # pragma: no cover - transformers is a dependency
        raise ImportError(
            "tiered_kv.integrations.hf.generator needs transformers>=5: pip install transformers"
        ) from exc

    class PoolLayer(DynamicLayer):  # type: ignore[no-untyped-call]
        """A cache layer over the sequences' blocks (see the module's rules); a ``DynamicLayer`` once materialized.

        Its past length is the forward's first position (:attr:`RowTargets.start`); ``update`` writes the new KV
        into the blocks and returns the past read from them followed by the new KV.
        """

        def __init__(self, views: tuple[torch.Tensor, torch.Tensor], rows: RowTargets, index: int) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self._views = views
            self._rows = rows
            self._index = index  # the model layer it holds
            self.pooled = True  # False once materialized: the past is held in ``keys``/``values``

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            rows = self._rows
            rows.write(self._views, key_states, value_states)
            if not self.pooled:
                return super().update(key_states, value_states, *args, **kwargs)
            start = rows.start
            if start == 0:
                return key_states, value_states
            if rows.gather is None:
                raise RuntimeError("a pooled layer reads its past from every row's blocks: materialize it first")
            if rows.load is not None:  # this layer's blocks may still be landing: the read waits for them
                rows.load.wait_layer(self._index, rows.compute_stream(key_states.device))
            out = []
            for view, new in zip(self._views, (key_states, value_states), strict=True):
                full = gather_past(view, rows.gather, new.shape[0], start + new.shape[2])
                full[:, :, start:] = new
                out.append(full)
            return out[0], out[1]

        def get_seq_length(self) -> int:
            return self._rows.start if self.pooled else int(super().get_seq_length())

        def past(self) -> tuple[torch.Tensor, torch.Tensor]:
            """The past ``[rows, heads, start, head_dim]`` a prepared prompt forward attends to, from the blocks."""
            index = self._rows.gather
            if not self.pooled or index is None:
                raise RuntimeError("no past to read from the blocks: prepare a pooled forward with a past first")
            rows, start = len(self._rows.page_tables), self._rows.start
            k, v = (gather_past(view, index, rows, start) for view in self._views)
            return k, v

        def materialize(self, page_tables: Sequence[Sequence[int]], length: int) -> None:
            """Hold the KV of positions ``[0, length)`` of each row (read from its blocks) from now on."""
            if not self.pooled:
                return
            index = block_index(page_tables, length, self._rows.tokens_per_block, self._views[0].device)
            keys, values = (gather_past(view, index, len(page_tables), length).contiguous() for view in self._views)
            self.lazy_initialization(keys, values)
            self.keys, self.values = keys, values
            self.pooled = False

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if not self.pooled:  # a pooled layer's rows are the next forward's page tables
                super().batch_select_indices(indices)

    class PoolCache(DynamicCache):
        """A ``DynamicCache`` of :class:`PoolLayer` s (one per model layer)."""

        def __init__(self, layers: list[Any]) -> None:  # not DynamicCache's init: it would build its own layers
            from transformers.cache_utils import Cache

            Cache.__init__(self, layers=layers)

    _CLASSES = (PoolLayer, PoolCache)
    return _CLASSES


_CLASSES: tuple[type[Any], type[Any]] | None = None


def block_index(
    page_tables: Sequence[Sequence[int]], length: int, tokens_per_block: int, device: torch.device
) -> torch.Tensor:
    """The blocks holding positions ``[0, length)`` of every row, row after row (``[rows * blocks]``)."""
    nb = -(-length // tokens_per_block)
    return torch.tensor([b for pt in page_tables for b in pt[:nb]], dtype=torch.long).to(device)


def gather_past(view: torch.Tensor, index: torch.Tensor, rows: int, length: int) -> torch.Tensor:
    """One layer's K or V of positions ``[0, length)`` of each row, ``[rows, heads, length, head_dim]``.

    Args:
        view: the layer's K or V view of the pool, ``[num_blocks, heads, tokens, head_dim]``.
        index: :func:`block_index` of the rows (at least ``length`` positions each).
        rows: the rows in ``index``.
        length: positions per row.

    Two copies, each of whole contiguous pieces: the blocks side by side, then heads before positions (one strided
    gather is several times slower on a CPU); the result is a view of the second (positions beyond ``length`` in
    the last block are sliced off).
    """
    blocks = view.index_select(0, index)  # [rows * blocks, heads, tokens, head_dim]
    _, heads, tokens, dim = blocks.shape
    per_row = blocks.view(rows, -1, heads, tokens, dim).transpose(1, 2)
    return per_row.reshape(rows, heads, -1, dim)[:, :, :length]
