"""Session r probe: what a GPU->GPU copy of the first n/16 of every 4 KiB row reaches, by copy engine and by kernel.

The bench's partial GPU->GPU rows copy tokens [0, n) of every (layer, kv, head) row of 16 tokens x 256 bytes: rows
of n x 256 bytes at a 4 KiB pitch. The engine's kernel reached 0.83-0.92 of a contiguous copy's device time on an
H200 (0.91-0.96 on an H100). Is the strided access itself the limit? Device times (CUDA events, median of 20) on
128 blocks of 2 MiB: one contiguous ``cudaMemcpyAsync`` of the same bytes; one ``cudaMemcpy2DAsync`` (the copy
engine, width n x 256, pitch 4 KiB); torch's strided ``copy_`` (an elementwise kernel); the engine's op
(``ops.copy_blocks``, the kernel). Run on a CUDA machine: ``python strided_d2d_probe.py``.
"""

from __future__ import annotations

import ctypes
import json
import statistics

import numpy as np
import torch

from tiered_kv import _ext, ops


def device_us(fn: object, reps: int = 20) -> float:
    """Median device time of ``fn()`` in microseconds (CUDA events on the current stream)."""
    times = []
    for _ in range(reps + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000)  # the host issues ahead of the device: issue cost hidden
        a.record()
        fn()  # type: ignore[operator]
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times[2:])


def main() -> None:
    """Every row of the probe."""
    assert _ext.load(), "the extension did not load"
    major = (torch.version.cuda or "").split(".")[0]
    cudart = ctypes.CDLL(f"libcudart.so.{major}")
    memcpy2d = cudart.cudaMemcpy2DAsync
    memcpy2d.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    memcpy2d.argtypes += [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    blocks, block = 128, 2 << 20
    rows = blocks * block // 4096
    src = torch.empty(blocks * block, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    src_rows, dst_rows = src.view(rows, 4096), dst.view(rows, 4096)
    pool = torch.empty(2 * blocks, 32, 2, 8, 16, 128, dtype=torch.bfloat16, device="cuda")
    idx = torch.from_numpy(np.arange(blocks))
    stream = torch.cuda.current_stream().cuda_stream
    for n in (4, 8, 12):
        width = n * 256
        nbytes = rows * width

        def dma2d(width: int = width) -> None:
            rc = memcpy2d(dst.data_ptr(), 4096, src.data_ptr(), 4096, width, rows, 3, stream)
            assert rc == 0, rc

        def contiguous(nbytes: int = nbytes) -> None:
            dst[:nbytes].copy_(src[:nbytes], non_blocking=True)

        def torch_strided(width: int = width) -> None:
            dst_rows[:, :width].copy_(src_rows[:, :width], non_blocking=True)

        def engine_op(n: int = n) -> None:
            ops.copy_blocks([pool], [pool], idx, idx + blocks, num_tokens=n, method=ops.METHOD_KERNEL)

        base = device_us(contiguous)
        row = {"tokens": f"{n}/16", "MiB": nbytes >> 20, "contiguous_us": round(base, 1)}
        for name, fn in (("dma_2d", dma2d), ("torch_strided", torch_strided), ("engine_kernel", engine_op)):
            t = device_us(fn)
            row[f"{name}_us"] = round(t, 1)
            row[f"{name}_fraction"] = round(base / t, 3)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
