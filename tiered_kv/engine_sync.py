"""Ordering a compute stream and the engine's copy streams against each other, stream-side.

Primitives:

* :class:`ComputeSync` -- the base of :class:`~tiered_kv.engine.TransferEngine` that makes copies wait for compute
  (:meth:`~ComputeSync.sync_with_compute`, before offloading blocks a forward is still writing) and compute wait for
  copies (:meth:`~ComputeSync.sync_transfers` for every copy enqueued, :meth:`~ComputeSync.sync_transfer` for one,
  e.g. one layer group of a layer-by-layer load). Only events are recorded and waited for: neither the CPU nor the
  event loop blocks, except where the compute itself runs on the calling thread (``stream=None``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .device import Device, Stream
from .errors import EngineClosedError
from .transfer import Transfer

if TYPE_CHECKING:
    import asyncio

__all__ = ["ComputeSync"]


class ComputeSync:
    """Stream-side ordering between the caller's compute and the engine's copy streams."""

    device: Device
    _streams: dict[str, Stream]
    _closing: bool

    if TYPE_CHECKING:  # the engine's: its loop, or EngineClosedError

        def _check_open(self) -> asyncio.AbstractEventLoop: ...

    def sync_with_compute(self, stream: object) -> None:
        """Make copies enqueued from now on wait for the work already queued on ``stream``.

        Use it before offloading blocks that the compute stream is still writing. Stream-side: neither
        the CPU nor the event loop blocks.

        Args:
            stream: the compute stream (``torch.cuda.Stream`` or a tiered_kv stream).
        """
        self._check_open()
        compute = self.device.wrap_stream(stream)
        event = compute.record()
        for copy_stream in self._streams.values():
            copy_stream.wait(event)

    def sync_transfer(self, transfer: Transfer, stream: object | None) -> None:
        """Make work queued on ``stream`` from now on wait for one transfer. Stream-side: nothing blocks.

        Use it before compute reads what one transfer brought in (e.g. one layer group of
        :func:`tiered_kv.layerwise.copy_layerwise`) while later transfers are still running. ``stream=None``: the
        compute runs on the calling thread itself (the emulated device's): the call blocks until the copy has run.
        Callable from any thread (a model's forward runs on its own): it reads the transfer's event, which the loop
        set when it enqueued the copy, and changes nothing the loop owns.

        Raises:
            ValueError: the transfer is still deferred on the loop (waiting for a file-tier dependency) or
                runs off-stream (host-to-host, file): await it instead.
            EngineClosedError: the engine is closed.
        """
        if self._closing:
            raise EngineClosedError("the TransferEngine is closed")
        marker = transfer._marker
        if marker.completed:
            return
        if marker.event is None:
            raise ValueError("this transfer is not on a copy stream yet (deferred or off-stream): await it instead")
        if stream is None:
            marker.event.synchronize()
        else:
            self.device.wrap_stream(stream).wait(marker.event)

    @staticmethod
    def on_stream(transfer: Transfer) -> bool:
        """Whether :meth:`sync_transfer` can order compute after ``transfer``: done, or enqueued on a copy stream."""
        marker = transfer._marker
        return bool(marker.completed or marker.event is not None)

    def sync_transfers(self, stream: object) -> None:
        """Make work queued on ``stream`` from now on wait for every copy enqueued on the copy streams.

        Use it before compute reads blocks that were just onboarded. Stream-side: nothing blocks.

        Notes:
            Copies still deferred (waiting on the loop for an off-stream dependency such as file I/O) and
            host-to-host copies are not covered: await those transfers first.
        """
        self._check_open()
        compute = self.device.wrap_stream(stream)
        for copy_stream in self._streams.values():
            compute.wait(copy_stream.record())
