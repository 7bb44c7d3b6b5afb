"""Checksums of vLLM's canonical KV pages, taken on the device: at a store, and again when a load lands.

Primitives (no vLLM import: the worker, :mod:`.worker`, drives them):

* :class:`PageChecksums` -- one 32-bit checksum per vLLM block over every canonical tensor's page of it
  (:meth:`~PageChecksums.of`), a table of the checksum each host block must hold (:meth:`~PageChecksums.record` at a
  store), and the check of a load's destination blocks against it (:meth:`~PageChecksums.plan` at submission,
  :meth:`~PageChecksums.check` once the copy landed).
* :class:`LoadCheck` -- the pending result of one load's check (a pinned host mask and an event on CUDA).
* :class:`LoadVerification` -- what the worker verified since it started.

Rules:

* A block's checksum is :func:`tiered_kv.integrity.token_checksums` of each canonical tensor's page (a block-major
  view ``[rows, 1, 1, 1, 1, page_bytes]``), combined over the tensors with odd, distinct per-tensor weights modulo
  2**32 (pages swapped between tensors change it too). Tensors that are rows of one allocation at one block stride
  (vLLM 0.32 puts every layer in one buffer) are one view: one checksum call per job covers all of them.
* Which host blocks hold what the worker checksummed is decided by generations: the manager gives every host entry a
  new generation when it is stored or staged, and each store / load spec carries them. A store records the block's
  checksum and generation; a load whose generation matches is *verified* against it. A load of a generation the
  worker never stored (a block the manager staged from the file tier, where it was verified by xxh3 against the
  bytes written) *adopts* what it loaded as the block's checksum: later loads of that entry are verified.
* Every rank's worker sees the same specs, so every rank verifies (or adopts) the same blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from ...integrity import token_checksums

__all__ = ["LoadCheck", "LoadVerification", "PageChecksums"]

_M32 = 0xFFFFFFFF


@dataclasses.dataclass(frozen=True, slots=True)
class LoadVerification:
    """What a worker's load verification did since it started.

    Attributes:
        verified_blocks: loaded blocks compared with the checksum taken when they were stored.
        mismatches: of them, blocks whose bytes on the device differed (never served with ``TieredKVConnector``).
        adopted_blocks: loaded blocks staged from the file tier (verified by xxh3 there) whose checksum was taken
            on this load, for their later loads.
        failed_loads: load jobs whose copy failed.
        reported_blocks: GPU blocks reported to vLLM as failed loads (``get_block_ids_with_load_errors``).
    """

    verified_blocks: int
    mismatches: int
    adopted_blocks: int
    failed_loads: int
    reported_blocks: int


@dataclasses.dataclass(frozen=True, slots=True)
class _Group:
    """Tensors that are rows of one view: the view, each tensor's first row in it and its weight."""

    view: torch.Tensor  # [rows, 1, 1, 1, 1, page_bytes]
    offsets: np.ndarray  # int64 [tensors]
    weights: torch.Tensor  # int64 [tensors, 1] on the device


def _weight(i: int) -> int:
    """The odd weight of canonical tensor ``i`` (distinct for every ``i`` below 2**31)."""
    return (((i + 1) * 0x9E3779B1) & 0x7FFFFFFF) | 1


def _groups(tensors: Sequence[torch.Tensor]) -> list[_Group]:
    """The canonical ``(num_blocks, page_bytes)`` views as few block-major 6-D views as their memory allows."""
    by_memory: dict[tuple[int, int, int, int], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.dim() != 2 or t.element_size() != 1 or (t.shape[0] > 1 and t.stride(1) != 1):
            raise ValueError(f"canonical pages must be (num_blocks, page_bytes) byte views, got {list(t.shape)}")
        stride = int(t.stride(0)) if t.shape[0] > 1 else int(t.shape[1])
        key = (t.untyped_storage().data_ptr(), int(t.shape[1]), stride, int(t.shape[0]))
        by_memory.setdefault(key, []).append(i)
    groups: list[_Group] = []
    for (_ptr, page, stride, blocks), members in by_memory.items():
        starts = [int(tensors[i].storage_offset()) for i in members]
        first = min(starts)
        if any((s - first) % stride for s in starts):  # not rows of one view: one view per tensor
            parts = [[i] for i in members]
        else:
            parts = [members]
        for part in parts:
            base = min(int(tensors[i].storage_offset()) for i in part)
            offsets = np.array([(int(tensors[i].storage_offset()) - base) // stride for i in part], dtype=np.int64)
            rows = int(offsets.max()) + blocks
            t0 = tensors[part[0]]
            flat = torch.empty(0, dtype=torch.uint8, device=t0.device).set_(
                t0.untyped_storage(), base, (rows, page), (stride, 1)
            )
            weights = torch.tensor([[_weight(i)] for i in part], dtype=torch.int64, device=t0.device)
            groups.append(_Group(flat.view(rows, 1, 1, 1, 1, page), offsets, weights))
    return groups


class LoadCheck:
    """The pending result of one load's check: which of its blocks did not match.

    Args:
        bad: ``bool [n]`` (on the host, or in pinned memory that ``event`` completes).
        compared: how many of the job's blocks were compared (the rest adopted).
        event: a CUDA event recorded after the copy into ``bad``; ``None`` on the CPU.
    """

    def __init__(self, bad: torch.Tensor, compared: int, event: torch.cuda.Event | None = None) -> None:
        self._bad = bad
        self.compared = compared
        self.adopted = bad.numel() - compared
        self._event = event

    def done(self) -> bool:
        """Whether the result is ready (never blocks)."""
        return self._event is None or bool(self._event.query())

    def wait(self) -> None:
        """Block until the result is ready."""
        if self._event is not None:
            self._event.synchronize()

    def mismatched(self) -> list[int]:
        """Positions (within the job) of the blocks that did not match (call once :meth:`done`)."""
        return [i for i, b in enumerate(self._bad.tolist()) if b]


class PageChecksums:
    """Per-block checksums of vLLM's canonical pages, and the checksum each host block must hold.

    Args:
        tensors: vLLM's canonical ``(num_blocks, page_bytes)`` int8 views (``CanonicalKVCaches.tensors``).
        host_blocks: the rank's host blocks.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], host_blocks: int) -> None:
        if not tensors:
            raise ValueError("no canonical KV tensors")
        self.device = tensors[0].device
        self.cuda = self.device.type == "cuda"
        self._groups = _groups(tensors)
        #: the checksum each host block holds (valid where :attr:`generations` says so), in ``[0, 2**32)``
        self.sums = torch.zeros(host_blocks, dtype=torch.int64, device=self.device)
        #: the manager's generation of each host block's entry whose checksum :attr:`sums` holds (-1: none)
        self.generations = np.full(host_blocks, -1, dtype=np.int64)

    @property
    def calls_per_job(self) -> int:
        """Checksum calls one job makes (one per group of tensors that share a view; 1 on vLLM 0.32)."""
        return len(self._groups)

    def _index(self, values: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        host = torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
        if not self.cuda:
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def of(self, blocks: np.ndarray) -> torch.Tensor:
        """``int64 [n]`` checksums (in ``[0, 2**32)``) of GPU blocks ``blocks``, enqueued on the current stream."""
        b = np.asarray(blocks, dtype=np.int64)
        total: torch.Tensor | None = None
        for g in self._groups:
            slots = (g.offsets[:, None] + b[None, :]).reshape(-1).tolist()
            per = token_checksums(g.view, slots).view(len(g.offsets), len(b)).to(torch.int64) & _M32
            part = ((per * g.weights) & _M32).sum(dim=0)
            total = part if total is None else total + part
        assert total is not None
        return total & _M32

    def record(self, host: np.ndarray, gpu: np.ndarray, generations: np.ndarray | None) -> None:
        """A store: host blocks ``host`` will hold GPU blocks ``gpu`` (checksummed now, on the current stream)."""
        h = np.asarray(host, dtype=np.int64)
        if h.size == 0:
            return
        self.sums[self._index(h)] = self.of(gpu)
        self.generations[h] = -1 if generations is None else np.asarray(generations, dtype=np.int64)

    def plan(self, host: np.ndarray, generations: np.ndarray | None) -> np.ndarray:
        """A load's submission: ``bool [n]``, True where host block ``host[i]`` holds what this worker checksummed.

        The others are adopted by :meth:`check`; from now on their generation is the one the worker holds. Call in
        submission order (host bookkeeping only).
        """
        h = np.asarray(host, dtype=np.int64)
        if generations is None:  # a spec not made by the TieredKV manager: nothing to compare with
            self.generations[h] = -1
            return np.zeros(h.size, dtype=bool)
        g = np.asarray(generations, dtype=np.int64)
        compare: np.ndarray = self.generations[h] == g
        self.generations[h] = g
        return compare

    def check(self, gpu: np.ndarray, host: np.ndarray, compare: np.ndarray) -> torch.Tensor:
        """``bool [n]`` on the device: GPU block ``gpu[i]`` differs from host block ``host[i]``'s checksum.

        Enqueued on the current stream (after the copy into ``gpu`` must have completed). Blocks not to compare are
        adopted: their checksum becomes the host block's.
        """
        now = self.of(gpu)
        idx = self._index(np.asarray(host, dtype=np.int64))
        cmp = self._index(np.asarray(compare, dtype=np.bool_), torch.bool)
        expected = self.sums[idx]
        bad = (now != expected) & cmp
        self.sums[idx] = torch.where(cmp, expected, now)
        return bad

    def finish(self, bad: torch.Tensor, compared: int) -> LoadCheck:
        """The pending result of :meth:`check`'s ``bad``: a pinned copy and an event on CUDA (current stream)."""
        if not self.cuda:
            return LoadCheck(bad, compared)
        host = torch.empty(bad.shape, dtype=torch.bool, pin_memory=True)
        host.copy_(bad, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return LoadCheck(host, compared, event)
