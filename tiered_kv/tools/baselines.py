"""Naive baselines that benchmarks and race tests measure against: the orders and buffers the library avoids.

Nothing in the library calls these; they exist so that a benchmark can show the naive figure in the same run
and a test can show that its check catches the race.

Primitives:

* :func:`add_sequences_one_phase` -- admission request by request (claim, onboard, allocate each in turn):
  onboarding for one request may evict host blocks a later request of the same batch was counted on, so
  that request reuses less than :meth:`~tiered_kv.TieredKVCache.match` promised.
* :class:`InplaceShipper` -- page tables shipped from one persistent host buffer (and, in gather mode, one
  persistent index buffer) refilled in place by every call: a copy still pending on the stream reads the
  next call's values, so attention would read another request's blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from ..blocks import Admission, Request
from ..cache import TieredKVCache
from ..device import Event
from ..staging import BlockOffsetTable, Mode, gather_block_offsets

__all__ = ["InplaceShipper", "add_sequences_one_phase"]


async def add_sequences_one_phase(
    cache: TieredKVCache, requests: Iterable[Request | Sequence[int] | np.ndarray]
) -> list[Admission]:
    """:meth:`TieredKVCache.add_sequences` with the one-phase admission order (see the module docstring).

    Cancellation: as :meth:`TieredKVCache.add_sequences`.
    """
    return await cache._add_sequences(requests, cache.blocks._admit_one_phase)


class InplaceShipper:
    """Ships ``table``'s rows like :meth:`BlockOffsetTable.copy_batch_block_offsets`, from buffers reused in place.

    Args:
        table: the host table to ship from.
    """

    def __init__(self, table: BlockOffsetTable) -> None:
        self.table = table
        self._buf: torch.Tensor | None = None
        self._idx: torch.Tensor | None = None
        self.calls = 0

    def ship(
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
        """Queue the racy copy or gather of ``slots``' rows on ``stream``; an event after it."""
        table = self.table
        target, index, width, coeffs = table._prepare(dst, slots, stream, mode, max_blocks, scale, v_offset)
        n = index.numel()
        self.calls += 1
        if n == 0 or width == 0:
            event = target.record()
            table._last_event = event
            return event
        pools, kv = table.num_pools, table.kv_factor
        if mode == "copy":
            out = dst[:, :n, :, :width]
            if self._buf is None:
                self._buf = table.device.empty_host((table.host.numel(),), torch.int32)
            # Refilled in place every call: a pending copy of the previous call reads these new values.
            snap = self._buf[: pools * n * kv * width].view(pools, n, kv, width)
            torch.index_select(table.host[..., :width], 1, index, out=snap)

            def op() -> None:
                out.copy_(snap, non_blocking=True)

        else:
            assert coeffs is not None
            max_seqs = table.max_seqs
            if self._idx is None:
                self._idx = table.device.empty_host((max_seqs + 2 * pools,), torch.int32)
            idx = self._idx[:n]
            idx.copy_(index)
            self._idx[max_seqs:].copy_(coeffs)
            s_view = self._idx[max_seqs : max_seqs + pools]
            v_view = self._idx[max_seqs + pools :]
            host, sentinel = table.host, table.sentinel
            rows = dst[:, :n]

            def op() -> None:
                # Reads the live host table through the persistent index buffer at execution time.
                gather_block_offsets(rows, host, idx, s_view, v_view, width, sentinel)

        target.submit(op)
        event = target.record()
        table._last_event = event  # table.synchronize() covers these copies too
        return event
