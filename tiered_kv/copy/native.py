"""The native submission job: a small copy issued, with its event and completion, in one call into C++.

Primitives:

* :class:`NativeCopy` -- the op and the :class:`~tiered_kv.handlers.Job` of a small copy on a CUDA stream
  (``kernels/fast_path.cpp``); :meth:`tiered_kv.copy.copier.Copier.build` makes it, the stream handler
  (:class:`~tiered_kv.copy.handler.StreamCopier`) hands it to the engine as the batch's job.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from ..device import CudaStream, Event

__all__ = ["NativeCopy"]


class NativeCopy:
    """A small copy on a CUDA stream through the native submission path: one call into C++ per copy.

    A :class:`~tiered_kv.handlers.Job` of its own: ``start(done)`` issues the DMA or the kernel, records a pooled
    event and enqueues the completion signal in that one call (:meth:`~tiered_kv.cuda_stream.CudaStream.notify_native`).
    Calling it (``op()``, as other ops are called under :meth:`~tiered_kv.device.Stream.submit`) issues the copy on
    its stream without a completion. ``beside``: signal the completion from the stream's side stream (the batch's
    ``more_follows``, see :meth:`~tiered_kv.cuda_stream.CudaStream.notify`).
    """

    __slots__ = ("_issue", "beside", "error", "failed", "lane", "nbytes", "stream")
    explicit_stream = True

    def __init__(
        self, stream: CudaStream, submit: Callable[..., Event], plan: int, s: list[int], d: list[int], nbytes: int = 0
    ):
        self.stream = stream
        self.lane: CudaStream = stream  # the stream it runs on (Job.lane)
        self.nbytes = nbytes  # what the copy moves (the stream expects its end from it)
        self.beside = False
        self.failed = False  # the call into C++ raised: the error reaches done() at the event
        self.error: BaseException | None = None  # that error
        self._issue: Callable[[int, int, int], Event] = functools.partial(submit, plan, s, d)

    def __call__(self) -> None:
        """Issue the copy on its stream, without a completion (an op under ``Stream.submit``)."""
        self._issue(self.stream.torch_stream.cuda_stream, 0, 0)

    def start(self, done: Callable[[BaseException | None], None]) -> Event:
        """Issue the copy and its completion: ``done(None)`` from the stream's waiter once it has run.

        An error of the call itself (nothing enqueued) reaches ``done`` in stream order, like an op's error.
        """
        try:
            return self.stream.notify_native(self._issue, lambda: done(None), beside=self.beside, nbytes=self.nbytes)
        except (RuntimeError, ValueError, IndexError, TypeError) as exc:
            if self.stream.closed:
                raise
            error = exc  # `exc` is unbound after the except block; the callback runs later
            self.failed = True
            self.error = error
            return self.stream.notify(lambda: done(error))

    def ok_at_event(self) -> bool:
        """True when the copy was issued: reaching its event is its whole completion (``Job.ok_at_event``)."""
        return not self.failed

    def error_at_event(self) -> BaseException | None:
        """The error ``done`` will report, known once the event is reached (``Job.error_at_event``)."""
        return self.error
