"""Staging: ship block-offset tables (page tables) to the device without races.

An asynchronous copy, or a kernel that reads pinned host memory, reads its host inputs when the stream
*executes* it, not when it is enqueued. A scheduler that runs an iteration ahead and refills a host table
in place therefore ships the *next* batch's offsets, and attention reads another request's blocks. This
module makes that impossible by construction:

* :class:`BlockOffsetTable` -- the persistent host table ``[pools, max_seqs, kv, max_blocks_per_seq]``
  (int32, :data:`NO_BLOCK` in unused entries) that the block manager fills per sequence slot
  (:meth:`~BlockOffsetTable.set_row`, :meth:`~BlockOffsetTable.append`, :meth:`~BlockOffsetTable.clear_row`).
* :meth:`BlockOffsetTable.copy_batch_block_offsets` (and the function :func:`copy_batch_block_offsets`)
  -- ships a batch of slots to a device table, in *copy* mode (snapshot the rows into a fresh pinned
  buffer, one async H2D) or *gather* mode (the gather op reads a :class:`~tiered_kv.rowversions.RowVersions`
  copy of the table whose rows are replaced copy-on-write, never in place, while an op may read them, the
  batch's row numbers from a staging buffer no pending op reads, and the per-pool scale and V offset from
  cached tensors never written after they are made; all in place, through unified addressing on CUDA, so
  nothing is copied per call). Gather mode copies only the batch's rows written since they were last
  shipped, not the whole batch; its per-call host path is a few numpy calls, the op and the event.
* :func:`gather_block_offsets` -- the one adapter between the table and the gather op.

The snapshot buffers come from a :class:`~tiered_kv.staging_pool.StagingPool` (:mod:`tiered_kv.staging_pool`;
it and :class:`~tiered_kv.staging_pool.StagingStatistics` are importable from here too), which keeps each one
until the event recorded after its consuming op has completed. The table's arguments are checked by
:class:`~tiered_kv.offset_checks.TableChecks` before anything is written or enqueued.

Everything runs on the :mod:`tiered_kv.device` stream abstraction, so the same code (and the same race
tests) runs on the emulated device, where a stream op executes when the worker thread reaches it, and on
CUDA.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from typing import Final, Literal, NamedTuple

import numpy as np
import torch

from . import ops
from .device import CudaStream, Device, EmulatedStream, Event, Stream, resolve_device
from .offset_checks import TableChecks
from .rowversions import RowVersions, RowVersionStatistics
from .staging_pool import StagingPool, StagingStatistics

__all__ = [
    "NO_BLOCK",
    "BlockOffsetStatistics",
    "BlockOffsetTable",
    "StagingPool",
    "StagingStatistics",
    "copy_batch_block_offsets",
    "gather_block_offsets",
]

log = logging.getLogger(__name__)

NO_BLOCK: Final[int] = -1
"""The "no block" sentinel of unused page-table entries; the gather passes it through unchanged."""

Mode = Literal["copy", "gather"]
_MODES: Final = ("copy", "gather")


# --------------------------------------------------------------------------------------------- gather op


def gather_block_offsets(
    dst: torch.Tensor,
    src: torch.Tensor,
    idx: torch.Tensor,
    scale: torch.Tensor | None,
    v_offset: torch.Tensor | None,
    max_blocks: int,
    sentinel: int = NO_BLOCK,
) -> None:
    """``dst[p, s, k, j] = scale[p] * src[p, idx[s], k, j] + (k == 1 ? v_offset[p] : 0)`` for ``j < max_blocks``.

    The one adapter between staging and :func:`tiered_kv.ops.gather_block_offsets` (on CUDA a kernel that
    reads ``src``, ``idx``, ``scale`` and ``v_offset`` from pinned host memory when it *executes*; the CPU
    reference on the emulated device, inside the stream op). Call it from inside a stream op.

    Args:
        dst: ``[pools, seqs, kv, >= max_blocks]`` int32 on the device (may be a view of a larger table).
        src: ``[pools, rows, kv, >= max_blocks]`` int32 host table (contiguous).
        idx: ``[seqs]`` int32/int64: the row of ``src`` for each output sequence.
        scale: ``[pools]`` int32 multiplier per pool (``None``: 1).
        v_offset: ``[pools]`` int32 added to the V entries (``k == 1``) per pool (``None``: 0).
        max_blocks: columns to write; the rest of ``dst`` is untouched.
        sentinel: the "no block" value, written unchanged (not scaled or offset).
    """
    if dst.is_contiguous():
        ops.gather_block_offsets(
            dst, src, idx, scale=scale, v_offset=v_offset, max_blocks=max_blocks, sentinel=sentinel
        )
    else:
        # The op wants a contiguous dst; a batch smaller than the device table is a strided view of it.
        tmp = torch.empty((*dst.shape[:3], max_blocks), dtype=dst.dtype, device=dst.device)
        ops.gather_block_offsets(
            tmp, src, idx, scale=scale, v_offset=v_offset, max_blocks=max_blocks, sentinel=sentinel
        )
        dst[..., :max_blocks].copy_(tmp)


# --------------------------------------------------------------------------------------------- block-offset table


@dataclasses.dataclass(frozen=True, slots=True)
class BlockOffsetStatistics:
    """A snapshot of a :class:`BlockOffsetTable`.

    Attributes:
        calls: ``copy_batch_block_offsets`` calls, by mode (``copy`` / ``gather``).
        sequences: sequence rows shipped.
        bytes_shipped: table bytes shipped to the device.
        staging: the staging pool.
        versions: gather mode's row versions (``None`` before the first gather).
    """

    calls: dict[str, int]
    sequences: int
    bytes_shipped: int
    staging: StagingStatistics
    versions: RowVersionStatistics | None = None


class BlockOffsetTable:
    """The persistent host page table ``[pools, max_seqs, kv, max_blocks_per_seq]`` (int32) and its shipping.

    The block manager fills one row per sequence *slot* (slots in ``[0, max_seqs)`` are reused by new
    requests); every entry past a row's allocated blocks holds ``sentinel``. Each forward step ships the
    batch's rows to a device table with :meth:`copy_batch_block_offsets`, which snapshots them first, so
    the host table may be refilled at once, while the device has not executed the copy yet.

    Args:
        num_pools: memory pools (e.g. one per window size / layer group).
        max_seqs: sequence slots.
        max_blocks_per_seq: columns per row.
        kv_factor: 2 (K and V rows) or 1 (MLA).
        device: ``"auto"``, ``"cpu"`` (emulated), ``"cuda[:N]"`` or a :class:`~tiered_kv.Device`.
        depth: staging buffers in flight at most (the scheduler's overlap depth plus a margin); the call
            that would exceed it waits for the oldest one.
        sentinel: the "no block" value (default :data:`NO_BLOCK`).
        spare_rows: gather mode's copy-on-write rows (default ``max_seqs``): a row refilled while an earlier
            gather may still read it goes to a spare row; when none is free the call waits for the oldest
            gather. Memory: one more table's worth of rows, made at the first gather.

    Attributes:
        host: the table (pinned on CUDA). Write it only through the methods below (gather mode ships the rows
            those methods marked changed); readers may read it freely.

    Example::

        table = BlockOffsetTable(num_pools=1, max_seqs=256, max_blocks_per_seq=128, device="cuda")
        dev = torch.empty(table.device_shape(256), dtype=torch.int32, device="cuda")
        table.set_row(slot=3, pool=0, block_ids=[7, 8, 9])
        table.copy_batch_block_offsets(dev, [3, 5], stream=compute_stream)          # copy mode
        table.set_row(slot=3, pool=0, block_ids=[1, 2])                             # safe right away
        table.copy_batch_block_offsets(dev, [3], stream=compute_stream, mode="gather", scale=[2], v_offset=[1])

    Notes:
        Ordering: the device table is written on ``stream`` in enqueue order; work that reads it should be
        on the same stream (the usual case: the compute stream) or wait for the returned event.
        Thread safety: the writers and ``copy_batch_block_offsets`` are meant for one scheduler thread.
    """

    def __init__(
        self,
        num_pools: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        *,
        kv_factor: int = 2,
        device: Device | str = "auto",
        depth: int = 4,
        sentinel: int = NO_BLOCK,
        spare_rows: int | None = None,
    ) -> None:
        for name, value in (
            ("num_pools", num_pools),
            ("max_seqs", max_seqs),
            ("max_blocks_per_seq", max_blocks_per_seq),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if kv_factor not in (1, 2) or isinstance(kv_factor, bool):
            raise ValueError(f"kv_factor must be 1 (MLA) or 2 (K and V), got {kv_factor!r}")
        if isinstance(sentinel, bool) or not isinstance(sentinel, int) or not -(2**31) <= sentinel < 2**31:
            raise ValueError(f"sentinel must be an int32 value, got {sentinel!r}")
        if spare_rows is not None and (
            isinstance(spare_rows, bool) or not isinstance(spare_rows, int) or spare_rows < 1
        ):
            raise ValueError(f"spare_rows must be a positive int or None, got {spare_rows!r}")
        self.device = device if isinstance(device, Device) else resolve_device(device)
        self.num_pools = num_pools
        self.max_seqs = max_seqs
        self.kv_factor = kv_factor
        self.max_blocks_per_seq = max_blocks_per_seq
        self.sentinel = sentinel
        self._checks = TableChecks(self.device, num_pools, max_seqs, kv_factor, max_blocks_per_seq, sentinel)
        self.host = self.device.empty_host((num_pools, max_seqs, kv_factor, max_blocks_per_seq), torch.int32)
        self.host.fill_(sentinel)
        self._counts = np.zeros((num_pools, max_seqs), dtype=np.int64)  # (pool, slot) -> allocated blocks
        self.staging = StagingPool(self.device, depth=depth, dtype=torch.int32)
        self._wrapped: dict[object, Stream] = {}  # torch.cuda.Stream -> our wrapper (made once)
        self._calls: dict[str, int] = {"copy": 0, "gather": 0}
        self._sequences = self._bytes = 0
        self._last_event: Event | None = None
        # Gather mode reads this copy (made at the first gather), never `host`: see RowVersions.
        self._spare_rows = max_seqs if spare_rows is None else spare_rows
        self._versions: RowVersions | None = None
        self._coeff_cache: dict[tuple[tuple[int, ...], tuple[int, ...]], _Coefficients] = {}
        self._gather_op: ops.GatherFn | None = None  # the unchecked op for this device, resolved at the first gather

    # ------------------------------------------------------------------------------------ writers

    def device_shape(self, batch: int | None = None, max_blocks: int | None = None) -> tuple[int, int, int, int]:
        """Shape of a device table for ``batch`` sequences (default ``max_seqs``) and ``max_blocks`` columns."""
        return (
            self.num_pools,
            self.max_seqs if batch is None else batch,
            self.kv_factor,
            self.max_blocks_per_seq if max_blocks is None else max_blocks,
        )

    def set_row(
        self,
        slot: int,
        pool: int,
        block_ids: Iterable[int] | np.ndarray | torch.Tensor,
        v_block_ids: Iterable[int] | np.ndarray | torch.Tensor | None = None,
    ) -> None:
        """Make ``block_ids`` the blocks of sequence ``slot`` in ``pool``; the rest of the row becomes the sentinel.

        Args:
            slot: sequence slot in ``[0, max_seqs)``.
            pool: pool in ``[0, num_pools)``.
            block_ids: the sequence's blocks in order (written to the K row, and to the V row unless
                ``v_block_ids`` is given). Gather mode turns them into offsets with its scale and V offset;
                copy mode ships them as they are.
            v_block_ids: different values for the V row (copy mode with precomputed offsets), same length.

        Raises:
            ValueError: slot or pool out of range, too many blocks, a value equal to the sentinel or
                outside int32, or ``v_block_ids`` of another length.
        """
        self._checks.check_slot_pool(slot, pool)
        ids = self._checks.block_ids(block_ids, "block_ids")
        v_ids = None
        if v_block_ids is not None:
            if self.kv_factor == 1:
                raise ValueError("v_block_ids needs kv_factor=2; this table has no V rows")
            v_ids = self._checks.block_ids(v_block_ids, "v_block_ids")
            if v_ids.numel() != ids.numel():
                raise ValueError(f"v_block_ids has {v_ids.numel()} entries but block_ids has {ids.numel()}")
        n = ids.numel()
        row = self.host[pool, slot]
        row[:, :n] = ids
        if v_ids is not None:
            row[1, :n] = v_ids
        row[:, n:] = self.sentinel
        self._counts[pool, slot] = n
        self._changed(slot)

    def append(self, slot: int, pool: int, block_ids: Iterable[int] | np.ndarray | torch.Tensor) -> None:
        """Add blocks at the end of ``slot``'s row in ``pool`` (the sequence grew during generation).

        Raises:
            ValueError: as :meth:`set_row`, or the row would exceed ``max_blocks_per_seq``.
        """
        self._checks.check_slot_pool(slot, pool)
        ids = self._checks.block_ids(block_ids, "block_ids", start=int(self._counts[pool, slot]))
        start = int(self._counts[pool, slot])
        self.host[pool, slot, :, start : start + ids.numel()] = ids
        self._counts[pool, slot] = start + ids.numel()
        self._changed(slot)

    def clear_row(self, slot: int, pool: int | None = None) -> None:
        """Forget ``slot``'s blocks (in ``pool``, or in every pool): the row becomes the sentinel.

        Call it when a sequence is freed; the slot may then be given to a new request.
        """
        self._checks.check_slot_pool(slot, 0 if pool is None else pool)
        if pool is None:
            self.host[:, slot] = self.sentinel
            self._counts[:, slot] = 0
        else:
            self.host[pool, slot] = self.sentinel
            self._counts[pool, slot] = 0
        self._changed(slot)

    def _changed(self, slot: int) -> None:
        if self._versions is not None:
            self._versions.mark(slot)

    def on_page_table(self, slot: int, page_table: Sequence[int] | None, pool: int = 0) -> None:
        """The block manager's page-table hook: ``(slot, blocks)`` sets the row, ``(slot, None)`` clears it.

        Pass the bound method as ``on_page_table=`` to ``BlockManager`` / ``TieredKVCache`` (GPU pool 0);
        for several pools, ``functools.partial(table.on_page_table, pool=p)`` per pool's manager.
        """
        if page_table is None:
            self.clear_row(slot, pool)
        else:
            self.set_row(slot, pool, page_table)

    def num_blocks(self, slot: int, pool: int = 0) -> int:
        """Blocks allocated to ``slot`` in ``pool``."""
        self._checks.check_slot_pool(slot, pool)
        return int(self._counts[pool, slot])

    def row(self, slot: int, pool: int = 0) -> torch.Tensor:
        """A copy of ``slot``'s allocated entries in ``pool``: ``[kv, num_blocks]``."""
        self._checks.check_slot_pool(slot, pool)
        return self.host[pool, slot, :, : int(self._counts[pool, slot])].clone()

    # ------------------------------------------------------------------------------------ shipping

    def copy_batch_block_offsets(
        self,
        dst: torch.Tensor,
        slots: Sequence[int] | np.ndarray | torch.Tensor,
        *,
        stream: object,
        mode: Mode = "copy",
        max_blocks: int | None = None,
        scale: Sequence[int] | torch.Tensor | None = None,
        v_offset: Sequence[int] | torch.Tensor | None = None,
    ) -> Event:
        """Ship the rows of ``slots`` to ``dst[:, :len(slots), :, :width]`` on ``stream``, race-free.

        Args:
            dst: device table ``[num_pools, >= len(slots), kv_factor, >= width]`` int32 on this table's
                device (``device_shape()`` gives the full size). Columns past ``width`` are not written.
            slots: the batch's sequence slots, in batch order (row ``i`` of ``dst`` gets ``slots[i]``).
            stream: where the copy or gather runs (usually the compute stream): a tiered_kv stream or a
                ``torch.cuda.Stream``.
            mode: ``"copy"`` (snapshot + one async H2D, values shipped as stored) or ``"gather"`` (gather op
                over the row versions, ``scale[p] * id + (V ? v_offset[p] : 0)``, sentinel kept).
            max_blocks: ``width``: write only the first ``max_blocks`` columns; ``None`` writes every
                allocated block (the most any sequence of the batch has, in any pool).
            scale: gather mode only, one int per pool (default 1).
            v_offset: gather mode only, one int per pool added to the V row (default 0).

        Returns:
            An event recorded after the op; the host snapshot is kept until it completes. Work on
            ``stream`` needs no wait; work on another stream waits for this event.

        Raises:
            ValueError / TypeError: bad arguments; raised before anything is enqueued.

        Notes:
            Copy mode writes the batch's rows into one fresh staging buffer before this returns and the op
            reads only that buffer. Gather mode writes the batch's physical row numbers into a fresh staging
            buffer; the op reads it, the cached tensor of the scale and V offset values (never written) and
            the row versions, whose rows it reads are never overwritten before its event completes (a row
            refilled meanwhile is written to a spare row). So the caller may refill the host table, reuse the
            slots, or mutate ``slots``/``scale``/``v_offset`` as soon as this returns, even if the device runs
            the op much later. The buffer (and ``dst``, kept alive with it) is released only after the
            returned event completes (FIFO); at most ``depth`` are in flight (this call waits for the oldest
            beyond that).
        """
        if mode == "gather":
            return self._gather(dst, slots, stream, max_blocks, scale, v_offset)
        target, index, width, _ = self._prepare(dst, slots, stream, mode, max_blocks, scale, v_offset)
        n = index.numel()
        pools, kv = self.num_pools, self.kv_factor
        self._calls[mode] += 1
        if n == 0 or width == 0:
            event = target.record()  # nothing to write; keep the return type uniform
            self._last_event = event
            return event
        self._sequences += n
        self._bytes += pools * n * kv * width * 4

        snap_numel = pools * n * kv * width
        buf = self.staging.acquire(snap_numel)
        try:
            snap = buf[:snap_numel].view(pools, n, kv, width)
            # Snapshot: the only host memory the op will read. Taken now, so later refills cannot reach it.
            torch.index_select(self.host[..., :width], 1, index, out=snap)
            out = dst[:, :n, :, :width]

            def op() -> None:
                out.copy_(snap, non_blocking=True)

            target.submit(op)
        except BaseException:
            self.staging.release(buf)
            raise
        event = target.record()
        # dst too: freeing it while the op is pending would let the allocator hand its memory to someone
        # else on another stream, and the late write would land there.
        self.staging.retire(buf, event, keep=dst)
        self._last_event = event
        return event

    def _gather(
        self,
        dst: torch.Tensor,
        slots: Sequence[int] | np.ndarray | torch.Tensor,
        stream: object,
        max_blocks: int | None,
        scale: Sequence[int] | torch.Tensor | None,
        v_offset: Sequence[int] | torch.Tensor | None,
    ) -> Event:
        """Gather mode: refresh the batch's changed rows in the row versions, write its row numbers, enqueue.

        The per-call path is kept to what the race-free protocol needs: the row numbers are
        written by numpy straight into a staging buffer that the op reads where it is (pinned memory on
        CUDA, read through unified addressing: no copy), the scale and V offset are the cached pinned
        tensors of their values (never written after they are made), and the op is called without the
        checks of :func:`tiered_kv.ops.gather_block_offsets`, which the arguments it gets here satisfy by
        construction. Torch calls per call: the op, the event, and ``torch.from_numpy`` of the row numbers
        (plus ``dst[:, :n]`` when ``dst`` has more rows than the batch).
        """
        target = self._stream(stream)
        rows = self._checks.slot_array(slots)
        n = rows.size
        width = self._width(rows, max_blocks)
        self._checks.check_dst(dst, n, width)
        coeffs = self._coefficients(scale, v_offset)
        self._calls["gather"] += 1
        if n == 0 or width == 0:
            event = target.record()  # nothing to write; keep the return type uniform
            self._last_event = event
            return event
        self._sequences += n
        self._bytes += self.num_pools * n * self.kv_factor * width * 4
        versions, gather = self._versions, self._gather_op
        if versions is None or gather is None:
            versions = self._versions = RowVersions(self.host, self.device, spare_rows=self._spare_rows)
            gather = self._gather_op = ops.unchecked_gather(self.device.torch_device)
        staging = self.staging
        buf = staging.acquire(n)
        try:
            # The batch's physical rows, written where the op reads them: a buffer no pending op reads.
            phys = versions.prepare(rows, out=staging.host_view(buf)[:n])
            ids = torch.from_numpy(phys)
            out = dst if dst.shape[1] == n else dst[:, :n]  # full columns: contiguous when the batch fills dst
            src, s_view, v_view, sentinel = versions.table, coeffs.scale, coeffs.v_offset, self.sentinel

            def op() -> None:
                if out.is_contiguous():
                    gather(out, src, ids, s_view, v_view, width, sentinel)
                else:  # a batch smaller than a multi-pool device table: through a contiguous temporary
                    gather_block_offsets(out, src, ids, s_view, v_view, width, sentinel)

            target.submit(op)
        except BaseException:
            staging.release(buf)
            raise
        event = target.record()
        versions.commit(phys, event)
        # dst too: freeing it while the op is pending would let the allocator hand its memory to someone
        # else on another stream, and the late write would land there. The coefficients: the cache may
        # drop them meanwhile.
        staging.retire(buf, event, keep=(dst, coeffs))
        self._last_event = event
        return event

    def _prepare(
        self,
        dst: torch.Tensor,
        slots: Sequence[int] | np.ndarray | torch.Tensor,
        stream: object,
        mode: str,
        max_blocks: int | None,
        scale: Sequence[int] | torch.Tensor | None,
        v_offset: Sequence[int] | torch.Tensor | None,
    ) -> tuple[Stream, torch.Tensor, int, torch.Tensor | None]:
        """Validate one ship call: (stream, slot index, width, gather coefficients or ``None``)."""
        target = self._stream(stream)
        index = self._checks.slots(slots)
        if mode not in _MODES:
            raise ValueError(f"mode must be 'copy' or 'gather', got {mode!r}")
        if mode == "copy" and (scale is not None or v_offset is not None):
            raise ValueError("scale and v_offset apply only in gather mode; copy mode ships the stored values")
        width = self._width(index, max_blocks)
        self._checks.check_dst(dst, index.numel(), width)
        # [scale..., v_offset...] int32 (gather mode)
        coeffs = self._coefficients(scale, v_offset).packed if mode == "gather" else None
        return target, index, width, coeffs

    def synchronize(self) -> None:
        """Wait until every shipped table has landed, and reclaim all staging buffers."""
        if self._last_event is not None:
            self._last_event.synchronize()
        self.staging.drain()
        if self._versions is not None:
            self._versions.drain()

    def statistics(self) -> BlockOffsetStatistics:
        """A snapshot: calls per mode, sequences and bytes shipped, the snapshot pool."""
        versions = None if self._versions is None else self._versions.statistics()
        return BlockOffsetStatistics(
            dict(self._calls), self._sequences, self._bytes, self.staging.statistics(), versions
        )

    def __repr__(self) -> str:
        live = int((self._counts > 0).any(axis=0).sum())
        return (
            f"<BlockOffsetTable {self.device.kind} [pools:{self.num_pools} slots:{live}/{self.max_seqs} "
            f"kv:{self.kv_factor} "
            f"max_blocks:{self.max_blocks_per_seq}] {self.staging!r}>"
        )

    # ------------------------------------------------------------------------------------ checks

    def _width(self, index: torch.Tensor | np.ndarray, max_blocks: int | None) -> int:
        if max_blocks is None:
            if len(index) == 0:
                return 0
            rows = index if isinstance(index, np.ndarray) else index.numpy()
            return int(self._counts[:, rows].max())
        if isinstance(max_blocks, bool) or not isinstance(max_blocks, (int, np.integer)):
            raise TypeError(f"max_blocks must be an int or None, got {type(max_blocks).__name__}")
        if not 0 <= max_blocks <= self.max_blocks_per_seq:
            raise ValueError(f"max_blocks must be in [0, {self.max_blocks_per_seq}], got {max_blocks}")
        return int(max_blocks)

    def _coefficients(
        self, scale: Sequence[int] | torch.Tensor | None, v_offset: Sequence[int] | torch.Tensor | None
    ) -> _Coefficients:
        """``[scale..., v_offset...]`` as int32 host memory, validated; cached by value.

        A scheduler passes the same ones every step. Never written once made, so an op may read them where
        they are (pinned on CUDA).
        """
        key = (self._checks.per_pool(scale, "scale", 1), self._checks.per_pool(v_offset, "v_offset", 0))
        cached = self._coeff_cache.get(key)
        if cached is None:
            if len(self._coeff_cache) >= 64:
                self._coeff_cache.clear()  # a pending op keeps its own (retired with its staging buffer)
            pools = self.num_pools
            packed = self.device.empty_host((2 * pools,), torch.int32)
            packed.copy_(torch.tensor(key[0] + key[1], dtype=torch.int32))
            cached = self._coeff_cache[key] = _Coefficients(packed, packed[:pools], packed[pools:])
        return cached

    def _stream(self, stream: object) -> Stream:
        if isinstance(stream, (EmulatedStream, CudaStream)):
            if isinstance(stream, CudaStream) != self.device.is_cuda:
                raise TypeError(f"stream {stream!r} does not belong to this table's {self.device.kind} device")
            return stream
        if isinstance(stream, torch.cuda.Stream):
            wrapped = self._wrapped.get(stream)
            if wrapped is None:
                wrapped = self._wrapped[stream] = self.device.wrap_stream(stream)
            return wrapped
        raise TypeError(f"stream must be a tiered_kv stream or torch.cuda.Stream, got {type(stream).__name__}")


def copy_batch_block_offsets(
    table: BlockOffsetTable,
    dst: torch.Tensor,
    slots: Sequence[int] | np.ndarray | torch.Tensor,
    *,
    stream: object,
    mode: Mode = "copy",
    max_blocks: int | None = None,
    scale: Sequence[int] | torch.Tensor | None = None,
    v_offset: Sequence[int] | torch.Tensor | None = None,
) -> Event:
    """Ship a batch's block-offset rows from ``table`` to ``dst``.

    See :meth:`BlockOffsetTable.copy_batch_block_offsets`.
    """
    if not isinstance(table, BlockOffsetTable):
        raise TypeError(f"table must be a BlockOffsetTable, got {type(table).__name__}")
    return table.copy_batch_block_offsets(
        dst, slots, stream=stream, mode=mode, max_blocks=max_blocks, scale=scale, v_offset=v_offset
    )


class _Coefficients(NamedTuple):
    """Gather mode's per-pool coefficients: ``packed`` = ``[scale..., v_offset...]`` and its two halves."""

    packed: torch.Tensor
    scale: torch.Tensor
    v_offset: torch.Tensor
