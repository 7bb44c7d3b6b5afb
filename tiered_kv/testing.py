"""Public test utilities: stall injection and content helpers.

Primitives:

* :func:`stall` -- delay the next work on a stream; :func:`fill_random`, :func:`assert_blocks_equal` -- content.
* :class:`FaultyBackend` -- file faults.

Users write the same ordering tests we do::

    from tiered_kv.testing import stall, fill_random, assert_blocks_equal

    stall(engine.stream("offload"), 0.2)      # the next copies on that stream start 0.2 s late
    t1 = engine.copy(Tier.GPU, [0], Tier.HOST, [0])
    t2 = engine.copy(Tier.HOST, [0], Tier.GPU, [1])   # must see t1's data, not the old host block

On CUDA a stall is ``torch.cuda._sleep`` on the stream (calibrated to seconds); on the emulated device it
is a sleeping op on the stream's worker thread. Either way the CPU and the event loop are not blocked.

File-tier faults (ENOSPC on the k-th write, EIO, short reads/writes, stalls, hangs until released):
:class:`FaultyBackend`.
Crash consistency of the file tier (SIGKILL a spilling child, reopen, verify) is a tool, not imported here:
``tiered_kv.tools.crash.run_crash_test``.

The cache-level soak (many tasks over a three-tier :class:`~tiered_kv.TieredKVCache` with file faults, stalls
and cancellations; every reused token checked) is a tool too, not imported here (it sits above the cache)::

    from tiered_kv.tools.cache_soak import CacheSoakConfig, cache_soak

    report = await cache_soak(CacheSoakConfig(ops=2_000, seed=7))   # raises CacheSoakFailure on a wrong token
"""

from __future__ import annotations

import torch

from .device import Device, Stream, stall_op
from .faults import FaultyBackend

__all__ = [
    "FaultyBackend",
    "assert_blocks_equal",
    "fill_random",
    "stall",
]


def stall(stream: Stream | torch.cuda.Stream, seconds: float) -> None:
    """Enqueue a stall of about ``seconds`` on ``stream``: work queued after it starts that much later.

    Args:
        stream: a tiered_kv stream (``engine.stream("offload")``, ``device.new_stream(...)``) or a
            ``torch.cuda.Stream``.
        seconds: how long the stream stays busy.
    """
    if seconds < 0:
        raise ValueError(f"seconds must be >= 0, got {seconds}")
    if isinstance(stream, torch.cuda.Stream):
        stream = Device(stream.device).wrap_stream(stream)
    stream.submit(stall_op(stream, seconds))


def fill_random(tensor: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill ``tensor`` (any dtype, any device) with random bits; returns it.

    Random *bytes*, so every bit pattern of the block is checked, including fp8 and int8 ones.
    """
    if not tensor.is_contiguous():  # a strided view (e.g. one layer of a padded cache): fill through a dense buffer
        return tensor.copy_(fill_random(torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device), generator))
    raw = torch.randint(0, 256, (tensor.numel() * tensor.element_size(),), dtype=torch.uint8, generator=generator)
    tensor.view(-1).view(torch.uint8).copy_(raw.to(tensor.device))
    return tensor


def assert_blocks_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "block") -> None:
    """Bit-exact comparison (NaN patterns included), with a message naming the first differing byte."""
    a = actual.detach().contiguous().view(-1).view(torch.uint8).cpu()
    e = expected.detach().contiguous().view(-1).view(torch.uint8).cpu()
    if a.shape != e.shape:
        raise AssertionError(f"{what}: {a.numel()} bytes != expected {e.numel()} bytes")
    diff = (a != e).nonzero()
    if diff.numel():
        first = int(diff[0])
        raise AssertionError(
            f"{what}: {diff.numel()} of {a.numel()} bytes differ; "
            f"first at byte {first} ({int(a[first])} != {int(e[first])})"
        )
