"""GPUDirect Storage backend: kvikio ``CuFile`` pread/pwrite of device buffers; host buffers as the posix backend.

Primitives:

* :class:`GdsMode` -- ``ON`` / ``OFF`` / ``AUTO``, from config or ``TIERED_KV_GDS`` (like kvikio's own
  compat mode, seen from the other side: GDS ``ON`` is kvikio compat mode ``OFF``).
* :func:`probe` -- what this machine offers: kvikio importable, ``libcuda.so.1`` loadable, cuFile's
  ``is_gds_available``; never hangs (the driver query runs under a timeout).
* :func:`select_backend` -- which backend a mode means here (``"gds"`` or ``"posix"``), logged once.
* :class:`GdsBackend` -- :class:`~tiered_kv.backends.FileBackend` over ``kvikio.CuFile`` for requests with a CUDA
  buffer, and over :class:`~tiered_kv.backends.posix.PosixBackend` (one vectored ``O_DIRECT`` call on the
  backend's own threads) for requests of host buffers only.

Notes:
    Facts this module is built around (kvikio 26.10): ``import kvikio`` works without a GPU, but every
    pread/pwrite -- host buffers too, compat mode too -- needs ``libcuda.so.1``, so ``AUTO`` checks that
    it loads and otherwise means posix. Forcing cuFile (compat ``OFF``) where nvidia-fs is absent spun at
    100% CPU inside ``cuFileHandleRegister``, so ``ON`` probes ``cufile_driver.get("is_gds_available")``
    first and raises :class:`~tiered_kv.errors.BackendUnavailable` at once when it is false.
    ``IOFuture.get()`` consumes the future and the future does not keep the buffer alive, so every call
    here keeps its buffers referenced until the completion is done, and calls ``get()`` exactly once.
    kvikio's host-memory path is a POSIX call on kvikio's own thread pool: a second thread hop per request,
    and one I/O per buffer (a slot's header and payload are two writes). A host-only request here is one
    ``pwritev``/``preadv`` on the backend's thread instead: on an H100 host, kvikio's compat mode wrote 1 MiB
    slots at 0.87-0.89x raw ``O_DIRECT`` ``pwritev`` in three runs.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import enum
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from tiered_kv.config import coerce_enum
from tiered_kv.errors import BackendUnavailable

from .posix import PosixBackend

__all__ = ["GdsBackend", "GdsMode", "GdsProbe", "probe", "select_backend"]

log = logging.getLogger(__name__)

#: Seconds the cuFile driver query may take before we call GDS unavailable (it must never hang a caller).
PROBE_TIMEOUT_S = 20.0


_GDS_ALIASES = {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off"}


class GdsMode(enum.StrEnum):
    """Whether the file tier uses GPUDirect Storage.

    * ``ON``: kvikio with real cuFile (kvikio compat mode OFF); fail fast if GDS is not available.
    * ``OFF``: never kvikio; the posix backend.
    * ``AUTO``: kvikio (its own compat mode AUTO: cuFile where it works, POSIX inside kvikio where not)
      when kvikio imports and ``libcuda.so.1`` loads; otherwise the posix backend.
    """

    ON = "on"
    OFF = "off"
    AUTO = "auto"

    @classmethod
    def coerce(cls, value: object) -> GdsMode:
        """Accept a :class:`GdsMode`, a bool, or ``"on"/"off"/"auto"`` (also ``"1"/"0"/"true"/"false"``)."""
        if isinstance(value, bool):
            return cls.ON if value else cls.OFF
        mode = coerce_enum(cls, value, _GDS_ALIASES)
        if mode is not None:
            return mode
        raise ValueError(f"GDS mode must be 'on', 'off' or 'auto', got {value!r}")

    @classmethod
    def from_env(cls, default: object = "auto") -> GdsMode:
        """``TIERED_KV_GDS`` if set, else ``default``."""
        raw = os.environ.get("TIERED_KV_GDS")
        if raw is None:
            return cls.coerce(default)
        try:
            return cls.coerce(raw)
        except ValueError:
            raise ValueError(f"TIERED_KV_GDS must be 'on', 'off' or 'auto', got {raw!r}") from None


@dataclasses.dataclass(frozen=True, slots=True)
class GdsProbe:
    """What this machine offers for GDS.

    Attributes:
        kvikio_version: the kvikio version, or ``None`` if it does not import.
        libcuda: whether ``libcuda.so.1`` loads (kvikio needs it for every read and write).
        gds_available: cuFile's ``is_gds_available`` (``None`` when not asked or not answerable).
        reason: a sentence for logs and errors.
    """

    kvikio_version: str | None
    libcuda: bool
    gds_available: bool | None
    reason: str


def _libcuda_loads() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _query_gds(kvikio_mod: Any) -> bool | None:
    """``cufile_driver.get("is_gds_available")`` under a timeout (a daemon thread, so a hang cannot block exit)."""
    box: list[object] = []

    def ask() -> None:
        try:
            import kvikio.cufile_driver as driver

            box.append(bool(driver.get("is_gds_available")))
        except BaseException as exc:  # any failure means "not available"
            box.append(exc)

    t = threading.Thread(target=ask, name="tiered_kv-gds-probe", daemon=True)
    t.start()
    t.join(PROBE_TIMEOUT_S)
    if not box:
        log.warning("cuFile driver query did not answer in %.0f s; treating GDS as unavailable", PROBE_TIMEOUT_S)
        return None
    value = box[0]
    if isinstance(value, BaseException):
        log.info("cuFile driver query failed: %r", value)
        return None
    return bool(value)


def probe(check_driver: bool = True) -> GdsProbe:
    """Probe kvikio, ``libcuda.so.1`` and (if ``check_driver`` and both are there) cuFile."""
    try:
        import kvikio
    except Exception as exc:  # ImportError, or a broken install raising anything
        return GdsProbe(None, _libcuda_loads(), None, f"kvikio does not import ({exc.__class__.__name__}: {exc})")
    version = str(getattr(kvikio, "__version__", "?"))
    if not _libcuda_loads():
        return GdsProbe(
            version, False, None, "libcuda.so.1 cannot be loaded (no CUDA driver); kvikio cannot do I/O here"
        )
    if not check_driver:
        return GdsProbe(version, True, None, "kvikio and libcuda.so.1 are present")
    available = _query_gds(kvikio)
    why = (
        "cuFile reports GDS available"
        if available
        else "cuFile reports GDS unavailable (kvikio would use its compat mode)"
    )
    return GdsProbe(version, True, available, why)


_logged_lock = threading.Lock()
_logged: set[tuple[str, str]] = set()


def _log_once(backend: str, why: str) -> None:
    with _logged_lock:
        if (backend, why) in _logged:
            return
        _logged.add((backend, why))
    log.info("tiered_kv file tier I/O: %s (%s)", backend, why)


def select_backend(mode: GdsMode | str | bool | None = None) -> tuple[str, GdsProbe | None]:
    """Which backend ``mode`` means on this machine: ``("gds" | "posix", probe)``; logged once.

    Args:
        mode: ``None`` reads ``TIERED_KV_GDS`` (default ``AUTO``).

    Raises:
        BackendUnavailable: ``ON`` and kvikio, ``libcuda.so.1`` or cuFile GDS is missing.
    """
    m = GdsMode.from_env() if mode is None else GdsMode.coerce(mode)
    if m is GdsMode.OFF:
        _log_once("posix", "GDS mode OFF")
        return "posix", None
    p = probe(check_driver=m is GdsMode.ON)
    if m is GdsMode.ON:
        if p.kvikio_version is None or not p.libcuda or not p.gds_available:
            raise BackendUnavailable(f"GDS mode ON, but {p.reason}; use TIERED_KV_GDS=auto or off")
        _log_once("gds", f"GDS mode ON, kvikio {p.kvikio_version}, cuFile available")
        return "gds", p
    if p.kvikio_version is None or not p.libcuda:
        _log_once("posix", f"GDS mode AUTO: {p.reason}")
        return "posix", p
    _log_once("gds", f"GDS mode AUTO, kvikio {p.kvikio_version} (its compat mode decides cuFile vs POSIX)")
    return "gds", p


def _kvikio_buffer(t: torch.Tensor | np.ndarray) -> Any:
    """What kvikio accepts: a CUDA tensor (``__cuda_array_interface__``) or a numpy view of a host tensor."""
    if isinstance(t, np.ndarray):
        return t.reshape(-1).view(np.uint8)
    if not t.is_contiguous():
        raise ValueError("buffers must be contiguous")
    flat = t.reshape(-1).view(torch.uint8)  # uint8: __cuda_array_interface__ has no bfloat16/fp8
    return flat if flat.is_cuda else flat.numpy()


class GdsBackend:
    """:class:`~tiered_kv.backends.FileBackend` over ``kvikio.CuFile`` (requests of host buffers: as posix).

    A request with a CUDA buffer (``device_io``) goes to kvikio: cuFile's DMA between the file and GPU memory
    where GDS works. A request of host buffers only is one vectored ``O_DIRECT`` call on this backend's own
    threads (a :class:`~tiered_kv.backends.posix.PosixBackend` on the same file), as kvikio's host path would do
    it less directly (see the module notes).

    Args:
        path: an existing file.
        mode: ``ON`` sets kvikio's compat mode OFF (process-wide, like ``num_threads``, which is raised to
            ``threads`` if lower) after checking that GDS is available;
            ``AUTO`` leaves kvikio's compat mode as configured (default AUTO, env ``KVIKIO_COMPAT_MODE``) where
            cuFile reports GDS available, and sets it ON (kvikio's POSIX path) where not. With kvikio's POSIX
            path it also turns on kvikio's O_DIRECT reads (``auto_direct_io_read``, process-wide) unless
            ``KVIKIO_AUTO_DIRECT_IO_READ`` is set.
            ``OFF`` is refused: it means the posix backend.
        threads: completion threads (each waits on one kvikio future; kvikio's own pool does the I/O), and as
            many I/O threads for requests of host buffers.
        device_io: pass CUDA buffers to kvikio. ``None``: only when cuFile is really used (GDS available and
            compat mode not forced on); otherwise the file tier stages through pinned host memory itself,
            which pipelines better than kvikio's internal bounce buffers.
        direct: ``O_DIRECT`` for requests of host buffers only (the posix path); ``None`` probes the file's
            directory once.

    Raises:
        BackendUnavailable: kvikio does not import, ``libcuda.so.1`` does not load, or ``ON`` without GDS.
    """

    name = "gds"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        mode: GdsMode | str = GdsMode.AUTO,
        threads: int = 4,
        device_io: bool | None = None,
        direct: bool | None = None,
    ) -> None:
        m = GdsMode.coerce(mode)
        if m is GdsMode.OFF:
            raise ValueError("GdsBackend with mode OFF: use the posix backend")
        backend, p = select_backend(m)
        if backend != "gds":
            raise BackendUnavailable(f"kvikio cannot be used here: {p.reason if p else 'GDS off'}")
        import kvikio
        import kvikio.defaults

        if m is GdsMode.ON:
            compat = getattr(kvikio, "CompatMode", None)
            kvikio.defaults.set("compat_mode", compat.OFF if compat is not None else False)
        try:
            # kvikio runs I/O on its own pool (default 1 thread): give it as many threads as we keep requests
            # in flight, or our ``threads`` concurrent calls would queue behind one another inside kvikio.
            if int(kvikio.defaults.get("num_threads")) < threads:
                kvikio.defaults.set("num_threads", threads)
        except Exception as exc:  # older kvikio: keep its default
            log.debug("could not raise kvikio num_threads: %r", exc)
        compat = getattr(kvikio, "CompatMode", None)
        try:
            compat_now = kvikio.defaults.get("compat_mode")
        except Exception:  # older kvikio: compat_mode() instead of get()
            compat_now = getattr(kvikio.defaults, "compat_mode", lambda: None)()
        # CompatMode may be an IntEnum (str() gives a number): compare values, not names.
        forced_on = (
            compat_now is True
            or (compat is not None and compat_now == compat.ON)
            or str(compat_now).lower() in ("on", "compatmode.on")
        )
        available = (
            p.gds_available
            if p is not None and p.gds_available is not None
            else (None if forced_on else _query_gds(kvikio))
        )
        if m is GdsMode.AUTO and not forced_on and not available:
            # No GDS here: pin kvikio to its POSIX path so that no call ever tries cuFile handle registration
            # (which spun at 100% CPU where nvidia-fs was missing). This is what AUTO would fall back to anyway.
            kvikio.defaults.set("compat_mode", compat.ON if compat is not None else True)
            forced_on = True
        if forced_on and "KVIKIO_AUTO_DIRECT_IO_READ" not in os.environ:
            # kvikio's POSIX path reads through the page cache by default: cold 1 MiB slot reads run at 0.91-0.94x
            # raw O_DIRECT preadv that way and at 0.98-0.99x with kvikio's opportunistic O_DIRECT (H100 host).
            # Slots and our buffers are page aligned, so reads can bypass the cache like the posix backend's;
            # kvikio falls back to buffered reads where not.
            try:
                kvikio.defaults.set("auto_direct_io_read", True)
            except Exception as exc:  # older kvikio: no such setting
                log.debug("could not turn on kvikio's O_DIRECT reads: %r", exc)
        gds_real = not forced_on and bool(available)
        self.device_io = gds_real if device_io is None else bool(device_io)
        self.gds = gds_real
        _log_once(
            "gds",
            f"kvikio {'cuFile (GPUDirect Storage)' if gds_real else 'compat mode (POSIX inside kvikio)'}, "
            f"device buffers {'direct' if self.device_io else 'staged through pinned memory'}",
        )
        self.mode = m
        self.path = os.fspath(path)
        self._file = kvikio.CuFile(self.path, "r+")
        self._host = PosixBackend(self.path, threads=threads, direct=direct)
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="tiered_kv-gds")
        self._closed = False
        self.threads = threads

    @property
    def direct(self) -> bool:
        """Whether requests of host buffers use ``O_DIRECT`` (the posix path's setting)."""
        return self._host.direct

    def _check(self, buffers: Sequence[torch.Tensor | np.ndarray]) -> None:
        if self._closed:
            raise RuntimeError("the gds backend is closed")
        for b in buffers:
            if not isinstance(b, (torch.Tensor, np.ndarray)):
                raise TypeError(f"buffers must be torch tensors or numpy arrays, got {type(b).__name__}")
            if isinstance(b, torch.Tensor) and b.is_cuda and not self.device_io:
                raise TypeError("this gds backend was opened without device_io; pass host buffers")

    @staticmethod
    def _kvikio_request(buffers: Sequence[torch.Tensor | np.ndarray]) -> bool:
        """Whether a request goes to kvikio: it has a CUDA buffer (host-only requests go to the posix path)."""
        return any(isinstance(b, torch.Tensor) and b.is_cuda for b in buffers)

    def _start(
        self, write: bool, buffers: Sequence[torch.Tensor | np.ndarray], offset: int, hook: Any
    ) -> concurrent.futures.Future[int]:
        self._check(buffers)
        if not self._kvikio_request(buffers):
            # host memory only: one vectored call on our own thread (no kvikio pool hop, one I/O per request)
            if write:
                return self._host.pwrite(buffers, offset, before=hook)
            return self._host.pread(buffers, offset, after=hook)
        arrays = [_kvikio_buffer(b) for b in buffers]
        call = self._file.pwrite if write else self._file.pread
        sizes = [b.nbytes for b in buffers]

        def run(_keep: object) -> int:
            # ``_keep`` (the tensors and kvikio's views of them) stays referenced by the executor's work item
            # until this returns: kvikio's IOFutures do not keep the memory alive.
            if write and hook is not None:
                hook()
            futures = []
            pos = offset
            try:
                for arr, size in zip(arrays, sizes, strict=True):
                    futures.append(call(arr, size, pos))
                    pos += size
            finally:
                total = 0
                for fut in futures:
                    total += int(fut.get())  # get() consumes the future: call it exactly once
            if not write and hook is not None:
                hook(total)
            return total

        if self._closed:
            raise RuntimeError("the gds backend is closed")
        return self._pool.submit(run, (tuple(buffers), arrays))

    def pwrite(
        self, buffers: Sequence[torch.Tensor | np.ndarray], offset: int, *, before: Callable[[], object] | None = None
    ) -> concurrent.futures.Future[int]:
        """Write ``buffers`` back to back at ``offset`` (host or, with ``device_io``, CUDA tensors)."""
        return self._start(True, buffers, offset, before)

    def pread(
        self, buffers: Sequence[torch.Tensor | np.ndarray], offset: int, *, after: Callable[[int], object] | None = None
    ) -> concurrent.futures.Future[int]:
        """Fill ``buffers`` back to back from ``offset``; ``after(nbytes)`` runs on the completion thread."""
        return self._start(False, buffers, offset, after)

    def sync(self, data_only: bool) -> concurrent.futures.Future[int]:
        """``fdatasync`` / ``fsync`` the file."""
        if self._closed:
            raise RuntimeError("the gds backend is closed")
        fd = self._file.fileno()

        def run() -> int:
            (os.fdatasync if data_only else os.fsync)(fd)
            return 0

        return self._pool.submit(run)

    def close(self) -> None:
        """Wait for started work, then release the file and threads (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        self._host.close()
        self._file.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"<GdsBackend {self.path} [{state}, mode:{self.mode.value}, cufile:{self.gds}, device_io:{self.device_io}]>"
        )
