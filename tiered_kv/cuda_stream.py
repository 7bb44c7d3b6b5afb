"""The CUDA stream: a torch stream whose completions reach callbacks through a waiter thread.

Primitives:

* :class:`CudaStream` -- the CUDA implementation of :class:`tiered_kv.device.Stream`: ``submit(fn)`` calls ``fn``
  at once under the stream (whatever it enqueues runs later on the GPU), ``record()`` a CUDA event, ``wait(event)``
  a stream-side wait, ``notify(cb)`` an event plus a callback from the stream's waiter thread once the work before
  it has run. :meth:`CudaStream.notify_native` is ``notify`` for native code that enqueues the work, a pooled event
  and the waiter's signal in one call (the native submission path of small copies, ``kernels/fast_path.cpp``).
* :class:`_HostFuncSignal` -- the completion signal: a semaphore a CUDA host function posts.
* :func:`expected_end`, :func:`learn_rate` -- when the waiter expects a copy to end (from its bytes and the
  stream's rate), and how a seen copy updates that rate.

The waiter sleeps while most of a copy runs and polls its event only near the expected end (with the extension's
completion wait, ``kernels/fast_path.cpp: wait_done``); callbacks run in notify order.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .config import COMPLETIONS

__all__ = ["CudaStream", "expected_end", "learn_rate"]

log = logging.getLogger(__name__)

Callback = Callable[[], object]  # the return value, if any, is ignored
_E = TypeVar("_E")  # the event a native issue returns

_STOP = object()  # ends the waiter


class _HostFuncSignal:
    """A POSIX semaphore that a CUDA host function posts when its stream reaches it.

    ``cudaLaunchHostFunc(stream, sem_post, &sem)`` enqueues a plain C call (libc's ``sem_post``: no Python,
    no GIL) that CUDA's callback thread runs once everything before it on the stream has executed; the
    stream's waiter thread blocks in ``sem_wait`` (ctypes releases the GIL) and wakes within microseconds.
    Measured on an H200: a waiter blocked in ``cudaEventSynchronize`` on a blocking-sync event woke ~210 us
    after the work completed; spinning instead costs a CPU core per stream.
    """

    def __init__(self) -> None:
        api = _host_func_api()
        self._launch, self._post_fn, self._sem_init, self._sem_wait, self._sem_destroy, ctypes = api
        self._sem = ctypes.create_string_buffer(64)  # sem_t: 32 bytes on 64-bit glibc; room to spare
        self._address = ctypes.addressof(self._sem)
        self.address: int = self._address  # for native code that posts it (kernels/fast_path.cpp)
        if self._sem_init(self._address, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed")

    def enqueue(self, stream: torch.cuda.Stream) -> None:
        """Post the semaphore once the stream reaches this point."""
        rc = self._launch(stream.cuda_stream, self._post_fn, self._address)
        if rc != 0:
            raise RuntimeError(f"cudaLaunchHostFunc failed with CUDA error {rc}")

    def wait(self) -> None:
        """Block (GIL released) until the next post."""
        while self._sem_wait(self._address) != 0:  # EINTR: a signal arrived; wait again
            pass

    def destroy(self) -> None:
        self._sem_destroy(self._address)


_HOST_FUNC_API: tuple[Any, ...] | None = None


def _host_func_api() -> tuple[Any, ...]:
    """Ctypes handles of ``cudaLaunchHostFunc`` and libc's semaphore calls, looked up once per process."""
    global _HOST_FUNC_API
    if _HOST_FUNC_API is None:
        import ctypes
        import ctypes.util

        major = (torch.version.cuda or "").split(".")[0]
        cudart = ctypes.CDLL(f"libcudart.so.{major}")  # the runtime torch already loaded (same soname)
        launch = cudart.cudaLaunchHostFunc
        launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        launch.restype = ctypes.c_int
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        post_fn = ctypes.cast(libc.sem_post, ctypes.c_void_p).value
        sem_init, sem_wait, sem_destroy = libc.sem_init, libc.sem_wait, libc.sem_destroy
        sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
        sem_wait.argtypes = [ctypes.c_void_p]
        sem_destroy.argtypes = [ctypes.c_void_p]
        _HOST_FUNC_API = (launch, post_fn, sem_init, sem_wait, sem_destroy, ctypes)
    return _HOST_FUNC_API


_now_ns = time.monotonic_ns  # one global lookup per notify

#: How long before a copy's expected end the waiter calls ``near_end`` (an event loop idle for milliseconds took
#: 100-190 us to wake on the GPU machines, one idle for 0.2 ms 35-60 us), and the shortest expected copy it does it
#: for.
_PREWAKE_NS = 200_000
_PREWAKE_MIN_SPAN_NS = 400_000

#: Copies of at least this many bytes, started on an idle stream, teach it its rate (smaller ones are mostly fixed
#: cost; a queued one's start is not known to the microsecond).
_RATE_MIN_BYTES = 4 << 20


def expected_end(start: int, nbytes: int, rate: float) -> tuple[int, int]:
    """When a stream's waiter starts polling for work of ``nbytes`` started at ``start``, and its expected end.

    Both in monotonic ns, ``(wake, due)``, at ``rate`` bytes per ns (0: not measured yet, :data:`_RATE_GUESS`).
    The waiter polls from 80 % of the expected span: a copy up to 25 % faster than the rate is still polled
    before it ends, and one faster still is seen by its host-function post. ``nbytes`` 0 (unknown): ``(-1, -1)``,
    the post alone.
    """
    if nbytes <= 0:
        return -1, -1
    span = nbytes / (rate or _RATE_GUESS)
    return start + int(0.8 * span), start + int(span)


def learn_rate(rate: float, known: bool, seen: float, misses: int) -> tuple[float, bool]:
    """A stream's ``(rate, known)`` after a copy its waiter saw move at ``seen`` bytes per ns.

    ``misses``: looks that found the copy still running. With one or more it was seen ending between two looks, to
    within a poll period: the rate tracks the fastest such copy (jumping up, easing down 2 % per copy) and is known.
    With none the copy was already done at the first look (the waiter came late), so it moved at least at ``seen``:
    that may raise the rate, marked not known (the next large copy is polled from its start), never lower it.
    """
    if misses:
        return (seen if seen > rate else 0.98 * rate + 0.02 * seen), True
    if seen > rate:
        return seen, False
    return rate, known


#: Bytes per nanosecond (GB/s) a stream assumes before it has measured its own rate: above a PCIe link, so that
#: host copies are polled early rather than late; the first large copy on an idle stream replaces it.
_RATE_GUESS = 100.0


def _native_wait() -> Callable[..., tuple[int, bool, int, int]] | None:
    """The extension's completion wait (``kernels/fast_path.cpp: wait_done``), or ``None`` without it."""
    from . import _ext  # lazy: the device layer does not need the extension

    if not _ext.loaded():  # never build the extension from here: a stream's first notify must not stall
        return None
    native = _ext.native()
    return getattr(native, "wait_done", None) if native is not None else None


class CudaStream:
    """A torch CUDA stream plus a waiter thread that turns completions into callbacks.

    Completion signal (``completion``; the engine passes ``EngineConfig.completion``): ``hostfunc`` (default)
    enqueues a CUDA host function that posts a semaphore the waiter thread blocks on (:class:`_HostFuncSignal`);
    ``event`` (also the fallback when the CUDA runtime cannot be reached through ctypes) blocks in
    ``cudaEventSynchronize`` on events created with ``blocking=True``. With the extension loaded, a notify that
    names its bytes is expected to end at the stream's measured rate: the waiter sleeps until shortly before that
    and then polls the event (:func:`expected_end`; ``poll=False``, from ``EngineConfig.completion_poll``, turns
    this off), since the post can come 0.1-0.5 ms after the copy. Either way the CPU sleeps while most of a copy
    runs, and callbacks run in FIFO order: work on one stream completes in order.

    Raises:
        ValueError: ``completion`` is not ``"hostfunc"`` or ``"event"``.
    """

    def __init__(
        self,
        name: str,
        stream: torch.cuda.Stream | None = None,
        device: torch.device | None = None,
        *,
        completion: str = "hostfunc",
        poll: bool = True,
    ):
        if completion not in COMPLETIONS:
            raise ValueError(f"completion must be 'hostfunc' or 'event', got {completion!r}")
        self.name = name
        self._mode = completion  # the signal asked for; `completion` says the one the waiter got
        self._poll = poll
        self.owned = stream is None
        self.torch_stream = stream if stream is not None else torch.cuda.Stream(device=device)
        self._waits: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._waiter: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._signal: _HostFuncSignal | None = None  # made with the waiter, at the first notify()
        self._sem_address = 0  # the signal's semaphore, for native code (0: event mode)
        self._side: torch.cuda.Stream | None = None  # carries the ``beside`` signals (notify), made at first use
        self._handle: int = self.torch_stream.cuda_stream
        self._device = self.torch_stream.device.index or 0
        #: the extension's completion wait, if any
        self._wait_done: Callable[..., tuple[int, bool, int, int]] | None = None
        #: bytes per nanosecond this stream's copies have reached (the fastest seen; 0: none measured yet)
        self.rate = 0.0
        #: whether a copy was seen ending between two of the waiter's looks since the rate was last found too low
        #: (:func:`learn_rate`); until then, each large copy is polled from its start
        self.rate_known = False
        #: called from the waiter shortly before a copy of at least 0.4 ms is expected to end (the engine wakes its
        #: event loop with it, so that the loop is not deep asleep when the completion comes)
        self.near_end: Callback | None = None
        #: set by the engine: ``watch(marker, transfer)`` from a coroutine about to await work on this stream (the
        #: loop polls the work's event near its end, see ``EngineConfig.completion_spin_us``)
        self.watch: Callable[[Any, Any], None] | None = None

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    @property
    def completion(self) -> str:
        """``"hostfunc"`` or ``"event"``: how this stream's waiter learns that work completed.

        Known after the first ``notify``.
        """
        return "hostfunc" if self._signal is not None else "event"

    def submit(self, fn: Callback, *, explicit: bool = False) -> None:
        """Run ``fn`` now with this stream current: the CUDA work it enqueues goes on this stream.

        ``explicit``: ``fn`` enqueues on this stream by its handle, so the stream is not made current around it.
        """
        if self._closed:
            raise RuntimeError(f"stream {self.name} is closed")
        if explicit:  # fn enqueues on this stream by its handle: skip making it the current stream
            fn()
            return
        with torch.cuda.stream(self.torch_stream):
            fn()

    def record(self) -> torch.cuda.Event:
        """A blocking-sync CUDA event recorded on the stream."""
        event = torch.cuda.Event(blocking=True)
        event.record(self.torch_stream)
        return event

    def wait(self, event: object) -> None:
        """Make work queued from now on wait for a CUDA ``event`` (stream-side).

        ``event``: a ``torch.cuda.Event`` or an event of the native submission path (:meth:`notify_native`).
        """
        if isinstance(event, torch.cuda.Event):
            self.torch_stream.wait_event(event)
            return
        from . import _ext  # lazy: the device layer does not need the extension

        native = _ext.native()
        if native is not None and isinstance(event, native.DeviceEvent):
            event.wait(self.torch_stream.cuda_stream)
            return
        raise TypeError(f"a CUDA stream can only wait on a torch.cuda.Event, got {type(event).__name__}")

    def notify(self, callback: Callback, *, beside: bool = False, nbytes: int = 0) -> torch.cuda.Event:
        """Call ``callback()`` from the waiter thread once the work queued so far has finished; its event.

        A host function holds up its stream until it has run (tens of microseconds on a busy host): ``beside``
        enqueues it on this stream's side stream, behind a stream-side wait for the event, so the work queued next
        on this stream starts at once (a load issued as many layer groups). Posts may then reach the waiter in
        another order than their notifies; each callback still runs in notify order, after its own event.

        ``nbytes`` (the bytes the work since the previous notify moves; 0: unknown): with the extension's
        completion wait, the waiter expects the end from the bytes and the stream's measured rate and polls the
        event from shortly before it (:func:`expected_end`), instead of waiting for the host function alone.
        """
        if self._waiter is None:
            self._start_waiter()
        event = self.record()  # other streams wait on it stream-side
        self._waits.put((event, callback, nbytes, _now_ns(), self._sem_address))
        signal = self._signal
        if signal is not None:
            if beside:
                side = self._side_stream()
                side.wait_event(event)
                signal.enqueue(side)
            else:
                signal.enqueue(self.torch_stream)
        return event

    def notify_native(
        self, issue: Callable[[int, int, int], _E], callback: Callback, *, beside: bool = False, nbytes: int = 0
    ) -> _E:
        """Enqueue native work and call ``callback()`` as :meth:`notify` does, in one call into C++.

        ``issue(stream handle, semaphore address, signal stream handle)`` enqueues the work on this stream,
        records an event after it and, when the address is not 0, a host function that posts that semaphore (the
        waiter's) -- on the signal stream behind a wait for the event when its handle is not 0 (``beside``, as in
        :meth:`notify`) -- and returns the event (the native submission path of small copies,
        ``kernels/fast_path.cpp``). If it raises, nothing was enqueued. ``nbytes`` as in :meth:`notify`.

        Work that names its bytes, with the extension's completion wait, gets no host function: the waiter polls its
        event from near the expected end, backing off past it (at most 1/16 of the overrun, 1 ms), which sees the end
        as soon as the post would (0.1-0.5 ms after a copy on the GPU machines) or sooner; the host function's launch
        (~5 us of the caller's time) is saved on every small copy.
        """
        if self._closed:
            raise RuntimeError(f"stream {self.name} is closed")
        if self._waiter is None:
            self._start_waiter()
        sem = 0 if nbytes > 0 and self._wait_done is not None else self._sem_address
        side = self._side_stream().cuda_stream if beside and sem else 0
        event = issue(self._handle, sem, side)
        self._waits.put((event, callback, nbytes, _now_ns(), sem))
        return event

    def _side_stream(self) -> torch.cuda.Stream:
        """The stream that carries this stream's ``beside`` completion signals (made at first use)."""
        side = self._side
        if side is None:
            with self._lock:
                if self._side is None:
                    self._side = torch.cuda.Stream(device=self.torch_stream.device)
                side = self._side
        return side

    def _start_waiter(self) -> None:
        with self._lock:
            if self._waiter is None:
                if self._mode == "hostfunc":
                    try:
                        self._signal = _HostFuncSignal()
                        self._sem_address = self._signal.address
                    except (OSError, AttributeError, RuntimeError) as exc:
                        log.info("CUDA host-function completion unavailable (%s); waiting on events instead", exc)
                self._wait_done = _native_wait() if self._poll else None
                self._waiter = threading.Thread(target=self._wait_loop, name=f"tiered_kv-cuda-{self.name}", daemon=True)
                self._waiter.start()

    def _wait_loop(self) -> None:
        wait_done = self._wait_done
        if wait_done is not None:
            self._native_wait_loop(wait_done)
            return
        while True:
            if self._signal is not None:
                self._signal.wait()  # one post per notify (or close), in stream order
            item = self._waits.get()
            if item is _STOP:
                return
            event: torch.cuda.Event = item[0]  # type: ignore[index]
            callback: Callback = item[1]  # type: ignore[index]
            if self._signal is None or not event.query():
                event.synchronize()  # event mode; or a guard that cannot wait long in host-function mode
            self._run(callback)

    def _native_wait_loop(self, wait_done: Callable[..., tuple[int, bool, int, int]]) -> None:
        """The waiter with the extension's completion wait: poll near each expected end, learn the stream's rate.

        A notify enqueues its host-function post unless it is a native one naming its bytes (then its wait polls
        alone: ``sem`` 0); ``owed`` counts the posts of items found done by polling before their post came
        (``wait_done`` pays them back as they arrive).
        """
        owed = 0
        last_done = 0
        while True:
            item = self._waits.get()
            if item is _STOP:
                return
            entry: tuple[Any, Callback, int, int, int] = item  # type: ignore[assignment]
            event, callback, nbytes, notified, sem = entry  # sem: its post's semaphore, 0 when it has none
            # it starts when it was notified, or when the work before it ended (this thread saw that end)
            start = max(notified, last_done)
            wake, due = expected_end(start, nbytes, self.rate)
            if not self.rate_known and wake > start:  # the rate may be far too low (a route 10-30x a host link)
                wake = start
            handle = event.cuda_event if isinstance(event, torch.cuda.Event) else event.handle
            near_end = self.near_end
            stop = due - _PREWAKE_NS if near_end is not None and due - start >= _PREWAKE_MIN_SPAN_NS else -1
            seen_at, misses = 0, 0
            try:
                owed, ended, seen_at, misses = wait_done(handle, self._device, sem, wake, due, owed, stop)
                if not ended:  # shortly before the expected end: wake the loop, then wait for the end itself
                    assert near_end is not None
                    self._run(near_end)
                    before = misses
                    owed, _, seen_at, misses = wait_done(handle, self._device, sem, wake, due, owed, -1)
                    misses += before
            except RuntimeError:  # a CUDA error: surface it the way the plain waiter does
                log.exception("CUDA stream %s: waiting for a completion failed", self.name)
                event.synchronize()
            # when this thread saw the end (before it had the GIL back: a busy loop can hold it for a while)
            done = seen_at or time.monotonic_ns()
            if nbytes >= _RATE_MIN_BYTES and notified >= last_done:  # it started on an idle stream, at its notify
                span = done - notified
                if span > 0:
                    self.rate, self.rate_known = learn_rate(self.rate, self.rate_known, nbytes / span, misses)
            last_done = done
            self._run(callback)

    def _run(self, callback: Callback) -> None:
        try:
            callback()
        except BaseException:
            log.exception("CUDA stream %s: completion callback raised", self.name)

    def synchronize(self) -> None:
        """Block until the work queued so far has finished."""
        self.torch_stream.synchronize()

    def close(self) -> None:
        """Finish the queued work and stop the waiter thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._waits.put(_STOP)
        if self._waiter is not None:
            if self._signal is not None:
                self._signal.enqueue(self.torch_stream)  # the stop is posted in stream order too
            if threading.current_thread() is not self._waiter:
                self._waiter.join()
        if self._signal is not None:
            # Posts still on their way (of items the waiter found done by polling, or signalled beside on the side
            # stream, and the stop's own) would post a destroyed semaphore, freed memory once this stream is gone:
            # the streams finish their host functions first.
            self.torch_stream.synchronize()
            if self._side is not None:
                self._side.synchronize()
            self._signal.destroy()

    def __repr__(self) -> str:
        return f"<CudaStream {self.name} [{'closed' if self._closed else 'open'}] {self.torch_stream}>"
