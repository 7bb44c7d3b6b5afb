"""The argument checks of a block-offset table: slots, pools, block ids, device tables, per-pool values.

Every check raises ``TypeError`` / ``ValueError`` before anything is written or enqueued, so a rejected call
leaves the table and the device untouched. Converted inputs are private copies (the caller may reuse its buffer
once the call returns), except :meth:`TableChecks.slot_array` of a numpy int array: it returns the caller's
array, for a caller that is done reading it before it returns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TypeGuard

import numpy as np
import torch

from .device import Device

__all__ = ["TableChecks"]


@dataclasses.dataclass(frozen=True, slots=True)
class TableChecks:
    """The checks of one :class:`~tiered_kv.staging.BlockOffsetTable`'s arguments, against its shape.

    Attributes:
        device: the device the table ships to (``dst`` must be on it).
        num_pools: memory pools.
        max_seqs: sequence slots.
        kv_factor: 2 (K and V rows) or 1 (MLA).
        max_blocks_per_seq: columns per row.
        sentinel: the "no block" value (never a block id).
    """

    device: Device
    num_pools: int
    max_seqs: int
    kv_factor: int
    max_blocks_per_seq: int
    sentinel: int

    def check_slot_pool(self, slot: int, pool: int) -> None:
        """Check that ``slot`` and ``pool`` are ints in ``[0, max_seqs)`` and ``[0, num_pools)``."""
        for name, value, limit in (("slot", slot, self.max_seqs), ("pool", pool, self.num_pools)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if not 0 <= value < limit:
                raise ValueError(f"{name} {value} is out of range [0, {limit})")

    def block_ids(self, values: Iterable[int] | np.ndarray | torch.Tensor, what: str, start: int = 0) -> torch.Tensor:
        """``values`` as 1-D int32 block ids: at most ``max_blocks_per_seq - start``, int32, never the sentinel."""
        ids = _as_int_tensor(values, what)
        if ids.dim() != 1:
            raise ValueError(f"{what} must be 1-D, got shape {list(ids.shape)}")
        if start + ids.numel() > self.max_blocks_per_seq:
            raise ValueError(f"{start + ids.numel()} blocks exceed max_blocks_per_seq={self.max_blocks_per_seq}")
        if ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < -(2**31) or hi >= 2**31:
                raise ValueError(f"{what} must fit in int32, got values in [{lo}, {hi}]")
            if bool((ids == self.sentinel).any()):
                raise ValueError(f"{what} contains the 'no block' sentinel {self.sentinel}")
        return ids.to(torch.int32)

    def slots(self, slots: Sequence[int] | np.ndarray | torch.Tensor) -> torch.Tensor:
        """The slots as a private 1-D int64 tensor, each in ``[0, max_seqs)``, at most ``max_seqs`` of them."""
        if _is_int_array(slots):
            # Fast path for the usual scheduler input; numpy reductions are cheaper than torch ones.
            self._check_slot_array(slots)
            return torch.from_numpy(slots.astype(np.int64, copy=True))  # private copy: the caller may mutate its own
        index = _as_int_tensor(slots, "slots")
        if index.dim() != 1:
            raise ValueError(f"slots must be 1-D, got shape {list(index.shape)}")
        if index.numel() > self.max_seqs:
            raise ValueError(f"{index.numel()} slots exceed max_seqs={self.max_seqs}")
        if index.numel():
            lo, hi = int(index.min()), int(index.max())
            if lo < 0 or hi >= self.max_seqs:
                raise ValueError(f"slots must be in [0, {self.max_seqs}), got values in [{lo}, {hi}]")
        # A private copy: the caller may mutate its index buffer once we return.
        return index.to(torch.int64, copy=True)

    def slot_array(self, slots: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
        """The slots as a validated 1-D numpy int array, read before the call returns (a caller's array as is)."""
        if _is_int_array(slots):
            self._check_slot_array(slots)
            return slots
        rows: np.ndarray = self.slots(slots).numpy()
        return rows

    def _check_slot_array(self, slots: np.ndarray) -> None:
        if slots.size and (int(slots.min()) < 0 or int(slots.max()) >= self.max_seqs):
            raise ValueError(
                f"slots must be in [0, {self.max_seqs}), got values in [{int(slots.min())}, {int(slots.max())}]"
            )
        if slots.size > self.max_seqs:
            raise ValueError(f"{slots.size} slots exceed max_seqs={self.max_seqs}")

    def check_dst(self, dst: torch.Tensor, n: int, width: int) -> None:
        """Check that ``dst`` is an int32 device table on this device with room for ``n`` rows x ``width`` columns."""
        if not isinstance(dst, torch.Tensor):
            raise TypeError(f"dst must be a torch.Tensor, got {type(dst).__name__}")
        if dst.dtype != torch.int32:
            raise TypeError(f"dst must be int32, got {dst.dtype}")
        if dst.device != self.device.torch_device:
            raise ValueError(f"dst is on {dst.device}, but this table ships to {self.device.torch_device}")
        if dst.dim() != 4 or dst.shape[0] != self.num_pools or dst.shape[2] != self.kv_factor:
            raise ValueError(
                f"dst must have shape [{self.num_pools}, seqs, {self.kv_factor}, blocks], got {list(dst.shape)}"
            )
        if dst.shape[1] < n or dst.shape[3] < width:
            raise ValueError(f"dst {list(dst.shape)} is too small for {n} sequences x {width} blocks")

    def per_pool(self, values: Sequence[int] | torch.Tensor | None, what: str, default: int) -> tuple[int, ...]:
        """One int32 value per pool (``None``: ``default`` for every pool)."""
        if values is None:
            return (default,) * self.num_pools
        if isinstance(values, torch.Tensor):
            t = _as_int_tensor(values, what)
            if t.dim() != 1:
                raise ValueError(f"{what} must be 1-D with one value per pool, got shape {list(t.shape)}")
            items: list[object] = t.tolist()
        elif isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise TypeError(f"{what} must be a sequence of ints or a tensor, got {type(values).__name__}")
        else:
            items = list(values)
        if len(items) != self.num_pools:
            raise ValueError(f"{what} must have one value per pool ({self.num_pools}), got {len(items)}")
        for v in items:
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TypeError(f"{what} must hold ints, got {type(v).__name__}")
            if not -(2**31) <= v < 2**31:
                raise ValueError(f"{what} must fit in int32, got {v}")
        return tuple(int(v) for v in items)  # type: ignore[call-overload]


def _is_int_array(values: object) -> TypeGuard[np.ndarray]:
    return isinstance(values, np.ndarray) and values.ndim == 1 and values.dtype.kind in "iu"


def _as_int_tensor(values: object, what: str) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        t = values.detach()
        if t.device.type != "cpu":
            raise ValueError(f"{what} must be on the host, got a tensor on {t.device}")
    elif isinstance(values, np.ndarray):
        t = torch.from_numpy(values)
    else:
        try:
            items = values if isinstance(values, (list, tuple)) else list(values)  # type: ignore[call-overload]
            t = torch.as_tensor(items) if len(items) else torch.empty(0, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(f"{what} must be a sequence of ints, got {type(values).__name__}") from exc
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise TypeError(f"{what} must hold integers, got {t.dtype}")
    return t
