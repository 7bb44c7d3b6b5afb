"""The copy op of CUDA without the extension (no toolkit, build failed): torch ``copy_`` calls, correct, not fast.

Primitives:

* :func:`torch_op` -- the op of the ``"torch"`` path (:mod:`tiered_kv.copy.copier`): ``copy_`` per run of blocks
  and per layer group, enqueued on the current stream.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .. import opdefs
from ..pools import merge_runs

__all__ = ["torch_op"]

Op = Callable[[], None]


def torch_op(src_t: list[torch.Tensor], s: np.ndarray, dst_t: list[torch.Tensor], d: np.ndarray, n: int) -> Op:
    """CUDA without the extension: ``copy_`` per run and per group, all enqueued on the current stream.

    A strided host read would run on the CPU at enqueue time (torch makes it contiguous first), racing
    pending writes; so a host side is always moved as whole contiguous blocks and sliced on the GPU (host
    pools are block-major; only GPU pools are layer-major).
    """
    tokens = src_t[0].shape[-2]
    groups, rows, _row, width = opdefs.block_geometry(dst_t, src_t, n)
    runs = merge_runs(s, d)
    src0, dst0 = src_t[0], dst_t[0]
    whole = n == tokens and groups == 1 and src0.is_contiguous() and dst0.is_contiguous()

    def groups_of(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return opdefs.normalize_groups(tensors, groups, rows)

    if whole or src0.device == dst0.device:

        def same_or_whole() -> None:
            if whole:
                for a, b, k in runs:
                    dst0[b : b + k].copy_(src0[a : a + k], non_blocking=True)
                return
            sg, dg = groups_of(src_t), groups_of(dst_t)
            for a, b, k in runs:
                for x, y in zip(sg, dg, strict=True):
                    y[b : b + k, :, :width].copy_(x[a : a + k, :, :width], non_blocking=True)

        return same_or_whole
    if dst0.is_cuda:

        def h2d() -> None:
            dg = groups_of(dst_t)
            for a, b, k in runs:
                scratch = src0[a : a + k].to(dst0.device, non_blocking=True)
                for x, y in zip(groups_of([scratch]), dg, strict=True):
                    y[b : b + k, :, :width].copy_(x[:, :, :width])

        return h2d

    def d2h() -> None:
        # read-modify-write through GPU scratch, so tokens [n, T) of the host block are written back unchanged
        sg = groups_of(src_t)
        for a, b, k in runs:
            if n == tokens:
                scratch = torch.empty(dst0[b : b + k].shape, dtype=dst0.dtype, device=src0.device)
            else:
                scratch = dst0[b : b + k].to(src0.device, non_blocking=True)
            for x, y in zip(sg, groups_of([scratch]), strict=True):
                y[:, :, :width].copy_(x[a : a + k, :, :width])
            dst0[b : b + k].copy_(scratch, non_blocking=True)

    return d2h
