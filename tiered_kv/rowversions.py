"""Row versions: a device-readable copy of a host table whose rows are replaced copy-on-write, never in place.

A gather op (a kernel reading pinned host memory, or the emulated stream's worker) reads its source rows
when it *executes*. Snapshotting every shipped row per call makes that race-free but costs a copy of the
whole batch each step. :class:`RowVersions` ships only what changed instead:

* it keeps a private table of *physical* rows (``slots + spare`` of them) and a map ``slot -> physical row``;
* writers of the source table only mark the slot dirty (:meth:`RowVersions.mark`);
* :meth:`RowVersions.prepare` refreshes the batch's dirty slots from the source: in place when no pending
  op reads the slot's physical row, otherwise into a free spare row (copy-on-write), the old row being
  retired to the op that reads it last; it returns the batch's physical rows (or writes them where the op
  will read them: ``out=``);
* :meth:`RowVersions.commit` records that an op reading those rows was enqueued, with an event after it.
  Rows retired to an op become free once its event has completed (FIFO, from the oldest op); when no
  spare row is free, ``prepare`` waits for the oldest op.

Primitives:

* :class:`RowVersions` -- the versioned copy and its protocol (``mark`` / ``prepare`` / ``commit``).
* :class:`RowVersionStatistics` -- its counters.

One scheduler thread drives it (as :class:`~tiered_kv.staging.BlockOffsetTable`, its user).
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import torch

from .device import Device, Event

__all__ = ["RowVersionStatistics", "RowVersions"]


@dataclasses.dataclass(frozen=True, slots=True)
class RowVersionStatistics:
    """A snapshot of a :class:`RowVersions`.

    Attributes:
        rows: physical rows (slots + spare).
        free: spare rows ready for a copy-on-write.
        in_flight: committed ops whose event has not been seen complete yet.
        refreshed: slot rows copied from the source (in place or copy-on-write).
        copied_on_write: refreshes that took a spare row because a pending op read the old one.
        waited: times ``prepare`` waited for the oldest op because no spare row was free.
    """

    rows: int
    free: int
    in_flight: int
    refreshed: int
    copied_on_write: int
    waited: int


@dataclasses.dataclass(slots=True)
class _Pending:
    """One committed op: its id, its event, and the rows that become free when it completes."""

    op_id: int
    event: Event
    retired: list[int]


class RowVersions:
    """A copy of ``source`` (``[pools, slots, kv, cols]``) whose rows a pending op reads are never overwritten.

    Args:
        source: the host table the writers change (dimension 1 is the slot).
        device: decides the memory of the copy (pinned on CUDA, so a kernel reads it where it is).
        spare_rows: physical rows beyond one per slot, for copy-on-write; at least 1. With ``slots`` spares a
            scheduler may refill every slot once per step while the previous step's op is pending without
            ever waiting.

    Attributes:
        table: the physical rows, ``[pools, slots + spare_rows, kv, cols]``: what an op reads.
    """

    def __init__(self, source: torch.Tensor, device: Device, *, spare_rows: int) -> None:
        if isinstance(spare_rows, bool) or not isinstance(spare_rows, int) or spare_rows < 1:
            raise ValueError(f"spare_rows must be a positive int, got {spare_rows!r}")
        if source.dim() != 4:
            raise ValueError(f"source must be [pools, slots, kv, cols], got shape {list(source.shape)}")
        pools, slots, kv, cols = source.shape
        self.source = source
        self.slots = slots
        self.table = device.empty_host((pools, slots + spare_rows, kv, cols), source.dtype)
        self.table[:, :slots].copy_(source)
        self.table[:, slots:].copy_(source[:, :1].expand(pools, spare_rows, kv, cols))  # any defined value
        self._table_np, self._source_np = self.table.numpy(), source.numpy()
        if slots + spare_rows >= 2**31:
            raise ValueError(f"{slots + spare_rows} physical rows do not fit int32 row numbers")
        self._phys = np.arange(slots, dtype=np.int32)  # slot -> physical row (int32: what the gather op reads)
        self._dirty = np.zeros(slots, dtype=np.bool_)  # slot changed in source since its row was refreshed
        self._last_use = np.zeros(slots + spare_rows, dtype=np.int64)  # physical row -> last op id reading it
        self._free: list[int] = list(range(slots, slots + spare_rows))
        self._pending: collections.deque[_Pending] = collections.deque()  # ids consecutive, oldest first
        self._done = 0  # every op with id <= _done has completed
        self._next_id = 1
        self._refreshed = self._cow = self._waited = 0

    def mark(self, slot: int | slice) -> None:
        """The writers' hook: ``slot``'s row of the source changed (a slice: several slots)."""
        self._dirty[slot] = True

    def prepare(self, slots: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Refresh the dirty rows among ``slots`` (1-D ints, in range); the physical row of each slot, in order.

        A dirty slot whose physical row a pending op may read gets a spare row (its old row is retired to
        the last op reading it); waits for the oldest op only when no spare row is free. ``out``: a 1-D
        int32 array of ``len(slots)`` to write the rows into (e.g. the pinned buffer the op reads them
        from), returned; ``None``: a new array.
        """
        if self._pending:
            self.reclaim()
        mask = self._dirty[slots]
        if np.count_nonzero(mask):  # a plain C loop; ndarray.any() goes through the ufunc reduction machinery
            dirty = slots[mask]
            if dirty.size > 1:
                dirty = np.unique(dirty)
            for slot in dirty.tolist():
                old = int(self._phys[slot])
                if self._last_use[old] <= self._done:  # no pending op reads it: refresh in place
                    continue
                self._phys[slot] = self._take_row()
                self._retire(old)
                self._cow += 1
            # numpy views of the tables: a fancy-index copy without torch's per-op overhead
            self._table_np[:, self._phys[dirty]] = self._source_np[:, dirty]
            self._dirty[dirty] = False
            self._refreshed += int(dirty.size)
        # slots are in range: "clip" only spares numpy the bounds-checked (buffered) take
        rows: np.ndarray = self._phys.take(slots, out=out, mode="clip")
        return rows

    def commit(self, rows: np.ndarray, event: Event) -> None:
        """An op reading physical ``rows`` (from :meth:`prepare`) was enqueued; ``event`` is recorded after it."""
        op_id = self._next_id
        self._next_id += 1
        self._last_use[rows] = op_id
        self._pending.append(_Pending(op_id, event, []))

    def reclaim(self) -> int:
        """Free the rows of completed ops (oldest first, stopping at the first pending one); ops still pending."""
        pending = self._pending
        while pending and pending[0].event.query():
            done = pending.popleft()
            self._done = done.op_id
            self._free.extend(done.retired)
        return len(pending)

    def drain(self) -> None:
        """Wait for every committed op, then free all retired rows."""
        for entry in list(self._pending):
            entry.event.synchronize()
        self.reclaim()

    def statistics(self) -> RowVersionStatistics:
        """A snapshot of the counters."""
        return RowVersionStatistics(
            rows=int(self._last_use.size),
            free=len(self._free),
            in_flight=len(self._pending),
            refreshed=self._refreshed,
            copied_on_write=self._cow,
            waited=self._waited,
        )

    def _take_row(self) -> int:
        while not self._free:
            # Every spare row is retired to a pending op (there is one: with none pending no row is busy).
            self._waited += 1
            self._pending[0].event.synchronize()
            self.reclaim()
        return self._free.pop()

    def _retire(self, row: int) -> None:
        last = int(self._last_use[row])
        if last <= self._done:
            self._free.append(row)
        else:  # op ids in the deque are consecutive from the oldest pending one
            self._pending[last - self._pending[0].op_id].retired.append(row)
