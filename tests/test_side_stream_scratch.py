"""Scratch used on a private stream never takes memory the caller's queued kernels still use.

PyTorch's caching allocator gives a block freed on a stream to the next allocation on that same stream at once:
kernels queued there before the free may still read it, and stream order makes that safe for that stream only. A
buffer allocated on the caller's stream and then written on another stream can therefore overwrite the input of a
kernel the caller queued just before. That is how a model's KV write (``pool[slot] = kv``, the ``kv`` temporary
freed as the statement ends) landed as zeros when the file tier measured its link leg on a worker thread at the
same moment. These tests queue such a kernel behind a long sleep, free its input, and run the code under test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiered_kv import resolve_device
from tiered_kv.device import scratch_on
from tiered_kv.file.ring import measure_legs

pytestmark = pytest.mark.gpu

_SLEEP_CYCLES = 200_000_000  # ~0.1 s of one SM: the queued copy runs well after the code under test


def _queue_a_read_of_a_freed_input(pool: torch.Tensor, row: int, nbytes: int) -> tuple[torch.Tensor, int]:
    """Queue ``pool[row] = kv`` behind a sleep on the current stream and free ``kv``; returns (its bytes, address)."""
    want = torch.randint(1, 255, (nbytes,), dtype=torch.uint8)
    kv = want.cuda()
    torch.cuda._sleep(_SLEEP_CYCLES)
    pool[row] = kv  # queued: reads kv after the sleep
    address = kv.data_ptr()
    del kv  # freed now, reusable at once by the next allocation on this stream
    return want, address


def test_the_link_measurement_leaves_queued_model_writes_alone(tmp_path: Path) -> None:
    """measure_legs allocates its device target on its own stream: the model's queued write lands intact."""
    nbytes = 8192
    path = tmp_path / "slab.bin"
    path.write_bytes(b"\x01" * (4 * nbytes))
    device = resolve_device("cuda")
    pool = torch.zeros(8, nbytes, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    for row in range(8):
        want, _ = _queue_a_read_of_a_freed_input(pool, row, nbytes)
        measure_legs(device, str(path), 0, nbytes, repeat=1)
        torch.cuda.synchronize()
        assert torch.equal(pool[row].cpu(), want), f"row {row}: the queued write lost its bytes"


def test_calibration_scratch_is_never_a_block_the_caller_has_queued_work_on() -> None:
    """The calibrations' device scratch comes from their stream's blocks, not from one the caller just freed."""
    pool = torch.zeros(2, 1 << 20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    want, address = _queue_a_read_of_a_freed_input(pool, 0, 1 << 20)
    stream = torch.cuda.Stream()
    scratch = scratch_on(stream, 1 << 20, "cuda")
    with torch.cuda.stream(stream):
        scratch.fill_(0)
    stream.synchronize()
    assert scratch.data_ptr() != address
    torch.cuda.synchronize()
    assert torch.equal(pool[0].cpu(), want)
