"""Devices and streams: the stream / event interface and the device that makes streams and pool memory.

Primitives (one small interface, two implementations):

* :class:`Stream` -- ``submit(fn)`` enqueues work (``explicit=True``: ``fn`` names the stream itself, by its
  handle, so the CUDA stream need not be made current around it), ``record()`` returns an :class:`Event`,
  ``wait(event)`` makes later work wait for it *without blocking the CPU*, ``notify(cb)`` records an event and
  calls ``cb`` from another thread once everything submitted before it has executed (polling only near
  the end expected from the bytes it names),
  ``synchronize()``, ``close()``.
* :class:`Event` -- ``query()``, ``synchronize()``.
* :class:`Device` -- makes streams and pool memory; ``resolve_device("auto")`` picks CUDA when present.
* :func:`scratch_on` -- device scratch for work on a side stream only; :func:`stall_op` -- a stream kept busy.

The implementations: :class:`~tiered_kv.cuda_stream.CudaStream` (:mod:`tiered_kv.cuda_stream`: torch streams and
events, a waiter thread, the host-function signal and polled completion near the expected end) and
:class:`~tiered_kv.emulated_stream.EmulatedStream` (:mod:`tiered_kv.emulated_stream`: a FIFO worker thread per
stream). Both are named here too, with the CUDA stream's :func:`expected_end` and :func:`learn_rate`.

On CUDA, ``submit(fn)`` calls ``fn`` at once under the stream, so whatever ``fn`` enqueues (copies, kernels)
runs later on the GPU. The emulated device keeps the same semantics with threads: each stream is a FIFO
worker thread and ``fn`` runs when the worker reaches it, *not* when it is submitted. That is what makes
the races of the seeds reproducible on a CPU: a host buffer read by a queued op is read at execution time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from .config import COMPLETIONS
from .cuda_stream import CudaStream
from .cuda_stream import _HostFuncSignal as _HostFuncSignal  # the bench probes name it here
from .cuda_stream import expected_end as expected_end
from .cuda_stream import learn_rate as learn_rate
from .emulated_stream import EmulatedEvent, EmulatedStream

__all__ = [
    "CudaStream",
    "Device",
    "EmulatedEvent",
    "EmulatedStream",
    "Event",
    "Stream",
    "resolve_device",
]

Callback = Callable[[], object]  # the return value, if any, is ignored


@runtime_checkable
class Event(Protocol):
    """A point in a stream's work."""

    def query(self) -> bool:
        """True once the work before the event has finished."""

    def synchronize(self) -> None:
        """Block until the work before the event has finished."""


@runtime_checkable
class Stream(Protocol):
    """An ordered queue of device work."""

    name: str

    def submit(self, fn: Callback, *, explicit: bool = False) -> None:
        """Queue ``fn`` on the stream (``explicit``: ``fn`` names this stream by its handle itself)."""

    def record(self) -> Event:
        """An event after the work queued so far."""

    def wait(self, event: Event) -> None:
        """Make work queued from now on wait for ``event`` (stream-side: nothing blocks)."""

    def notify(self, callback: Callback, *, beside: bool = False, nbytes: int = 0) -> Event:
        """Call ``callback()`` from a waiter thread once the work queued so far has finished; its event.

        ``beside``: the completion signal must not hold up the work queued after it on this stream (a CUDA
        stream signals from a side stream then); the callbacks still run in order. ``nbytes``: the bytes the
        work since the previous notify moves (0: unknown), from which a CUDA stream expects its end.
        """

    def synchronize(self) -> None:
        """Block until the work queued so far has finished."""

    def close(self) -> None:
        """Finish the queued work and stop the stream's threads (idempotent)."""


class Device:
    """Where GPU-tier memory lives and how its streams behave.

    Args:
        torch_device: ``cuda[:N]`` for a real GPU or ``cpu`` for the emulated device.
    """

    def __init__(self, torch_device: torch.device) -> None:
        self.torch_device = torch_device
        self.is_cuda = torch_device.type == "cuda"
        if self.is_cuda and torch_device.index is None:
            self.torch_device = torch.device("cuda", torch.cuda.current_device())

    @property
    def kind(self) -> str:
        """``"cuda"`` or ``"emulated"``."""
        return "cuda" if self.is_cuda else "emulated"

    def new_stream(self, name: str, *, completion: str = "hostfunc", poll: bool = True) -> Stream:
        """A new stream on this device.

        ``completion`` and ``poll``: how a CUDA stream's waiter learns that work completed (:class:`CudaStream`;
        ``EngineConfig.completion`` and ``completion_poll``). The emulated stream ignores them.

        Raises:
            ValueError: ``completion`` is not ``"hostfunc"`` or ``"event"``.
        """
        if self.is_cuda:
            return CudaStream(name, device=self.torch_device, completion=completion, poll=poll)
        if completion not in COMPLETIONS:
            raise ValueError(f"completion must be 'hostfunc' or 'event', got {completion!r}")
        return EmulatedStream(name)

    def wrap_stream(self, stream: object) -> Stream:
        """Accept one of our streams or a ``torch.cuda.Stream`` (e.g. the compute stream)."""
        if isinstance(stream, (EmulatedStream, CudaStream)):
            if isinstance(stream, CudaStream) != self.is_cuda:
                raise TypeError(f"stream {stream!r} does not belong to a {self.kind} device")
            return stream
        if isinstance(stream, torch.cuda.Stream):
            if not self.is_cuda:
                raise TypeError("a torch.cuda.Stream cannot be used with the emulated device")
            return CudaStream("external", stream=stream)
        raise TypeError(f"expected a tiered_kv stream or torch.cuda.Stream, got {type(stream).__name__}")

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """GPU-tier memory (CPU memory on the emulated device)."""
        return torch.empty(shape, dtype=dtype, device=self.torch_device)

    def empty_host(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Host-tier memory: pinned on CUDA, so copies are asynchronous DMA; plain when emulated.

        Either way the base address is page aligned (cudaHostAlloc is; plain memory is aligned here), so
        the file tier can hand host blocks to O_DIRECT without a bounce copy.
        """
        if self.is_cuda:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = itemsize
        for d in shape:
            nbytes *= d
        raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
        start = (-raw.data_ptr()) % 4096
        return raw[start : start + nbytes].view(dtype).view(shape)

    def __repr__(self) -> str:
        return f"<Device {self.kind} {self.torch_device}>"


def resolve_device(device: str | torch.device | None = "auto") -> Device:
    """``"auto"`` (CUDA if available, else emulated), ``"cpu"`` (emulated), ``"cuda"``, ``"cuda:N"``.

    Raises:
        ValueError: the string is not a device.
        BackendUnavailable: CUDA was asked for and is not available.
    """
    from .errors import BackendUnavailable

    if device is None or device == "auto":
        return Device(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise BackendUnavailable("CUDA was requested but torch.cuda.is_available() is False")
        return Device(dev)
    if dev.type == "cpu":
        return Device(dev)
    raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")


def scratch_on(stream: torch.cuda.Stream | None, nbytes: int, device: torch.device | str) -> torch.Tensor:
    """``nbytes`` of device scratch for work on ``stream`` only, allocated with ``stream`` current (``None``: plain).

    The caching allocator hands a block freed on a stream to the next allocation on that same stream, even while
    kernels queued there before the free still read or write it (stream order makes that safe for that stream).
    Scratch allocated on the caller's stream and written on ``stream`` could take such a block and race with the
    caller's queued work: the model's activations, or KV it has yet to write into a pool.
    """
    if stream is None:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    with torch.cuda.stream(stream):
        return torch.empty(nbytes, dtype=torch.uint8, device=device)


def stall_op(stream: Stream, seconds: float) -> Callback:
    """A callable that, submitted to ``stream``, keeps it busy for about ``seconds``."""
    if isinstance(stream, CudaStream):
        cycles = int(seconds * _cuda_cycles_per_second())
        return lambda: torch.cuda._sleep(cycles)
    return lambda: time.sleep(seconds)


_CYCLES_PER_SECOND: float | None = None


def _cuda_cycles_per_second() -> float:
    """Calibrate ``torch.cuda._sleep`` once (its unit is GPU clock cycles)."""
    global _CYCLES_PER_SECOND
    if _CYCLES_PER_SECOND is None:
        s = torch.cuda.Stream()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(s):
            torch.cuda._sleep(1_000_000)  # warm up
            start.record(s)
            torch.cuda._sleep(50_000_000)
            end.record(s)
        end.synchronize()
        _CYCLES_PER_SECOND = 50_000_000 / max(start.elapsed_time(end) / 1e3, 1e-6)
    return _CYCLES_PER_SECOND
