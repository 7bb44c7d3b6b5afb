"""Engine configuration: one dataclass, environment overrides, no hidden globals.

Primitives:

* :class:`EngineConfig` -- the engine's knobs; :meth:`EngineConfig.from_env`.
* :func:`env_int` -- the one parser of integer environment variables; :func:`env_flag` of on/off ones.
* :func:`coerce_enum` -- the one coercion of a :class:`enum.StrEnum` member from its value or name.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Mapping
from typing import TypeVar

__all__ = ["COMPLETIONS", "EngineConfig", "coerce_enum", "env_flag", "env_int"]

E = TypeVar("E", bound=enum.StrEnum)


def coerce_enum(cls: type[E], value: object, aliases: Mapping[str, str] | None = None) -> E | None:
    """``value`` as a member of ``cls``, or ``None`` (the caller raises its own ``ValueError`` sentence).

    Accepts a member, or its value in any case with blanks around it ignored (``aliases`` applied first).
    """
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if aliases:
            text = aliases.get(text, text)
        try:
            return cls(text)
        except ValueError:
            return None
    return None


def env_int(name: str, unit: str = "") -> int:
    """The integer value of environment variable ``name``; ``ValueError`` with a sentence if it is not one."""
    raw = os.environ[name]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an int{unit}, got {raw!r}") from None


def env_flag(name: str) -> bool:
    """The on/off value of environment variable ``name``; ``ValueError`` with a sentence if it is neither.

    On: ``1``, ``true``, ``yes``, ``on``; off: ``0``, ``false``, ``no``, ``off`` (any case, blanks around ignored).
    """
    raw = os.environ[name]
    text = raw.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 0 or 1 (or true/false, yes/no, on/off), got {raw!r}")


#: The completion signals of a CUDA stream's waiter (``EngineConfig.completion``).
COMPLETIONS = ("hostfunc", "event")


@dataclasses.dataclass(frozen=True, slots=True)
class EngineConfig:
    """Knobs of a :class:`~tiered_kv.TransferEngine`.

    Attributes:
        device: ``"auto"`` (CUDA if present, else the emulated device), ``"cpu"`` or ``"cuda[:N]"``.
            Env: ``TIERED_KV_DEVICE``.
        host_threads: threads that run host-only work (host-to-host copies). Env: ``TIERED_KV_HOST_THREADS``.
        dma_min_chunk_bytes: on CUDA, copies whose contiguous pieces are at least this big go to the DMA
            engines (batched ``cudaMemcpy(2D)Async``), smaller ones to the copy kernel. Default ``None``: measured
            on this GPU at the first engine's start (:func:`tiered_kv.copyops.calibrated_dma_threshold`,
            under a second once per process and device): where batched DMA is as fast as the kernel differs by
            card and host (64 KiB on an H100 host where the kernel led up to 1 MiB before DMA calls were
            batched). Env: ``TIERED_KV_DMA_MIN_CHUNK``.
        copy_path: ``"auto"`` (by ``dma_min_chunk_bytes``), ``"dma"`` or ``"kernel"`` (forced).
            Env: ``TIERED_KV_COPY_PATH``.
        completion_spin_us: an awaited copy on a device stream expected to end within twice this many
            microseconds is polled by the event loop itself, every round, until it ends or this long (or a quarter
            of its expected span, if longer) past its expected end (:class:`tiered_kv.completions.EventPoller`): the
            awaiting coroutine resumes within a loop round of the device finishing instead of after a thread wakes
            the sleeping loop (50-190 us on the GPU machines). It keeps the loop's core busy meanwhile. Default
            ``None``: 200 on CUDA, 0 (off) on the emulated device, whose streams are threads on the same cores.
            Env: ``TIERED_KV_COMPLETION_SPIN_US``.
        await_spin_us: an awaited copy on a device stream expected to end within this many microseconds of the
            ``await`` is waited for in place: the awaiting coroutine polls its event, for at most this long,
            without yielding to the loop, and goes on the moment the device is done (no loop round to see the
            event, none to resume the coroutine; on an H100 host the device's end to the coroutine going on fell
            from 23 to 14 us). Other tasks on the loop wait that long at most; a copy not done by then is awaited
            as usual. Default ``None``: 150 on CUDA, 0 (off) on the emulated device. ``0`` turns it off.
            Env: ``TIERED_KV_AWAIT_SPIN_US``.
        completion: how the waiter thread of each of the engine's CUDA streams learns that work completed:
            ``"hostfunc"`` (a CUDA host function posts a semaphore the waiter blocks on; a small native copy gets
            none, its event is polled) or ``"event"`` (the waiter blocks in ``cudaEventSynchronize``; woke ~200 us
            late on an H200). The emulated device ignores it. Env: ``TIERED_KV_COMPLETION``.
        completion_poll: with the CUDA extension, each stream's waiter expects a copy's end from its bytes and the
            stream's measured rate and polls its event from shortly before it (the signal above stays the
            fallback). ``False``: the signal alone, and the stream's rate is never learned. The emulated device
            ignores it. Env: ``TIERED_KV_COMPLETION_POLL`` (``0`` / ``1``).
        native_submit: a small CUDA copy (up to ``SMALL_CALL_BLOCKS`` block pairs, GPU<->host) is issued as one
            call into C++ (the native submission path, when the extension has it). ``False``: through the torch
            ops (same results, for comparison). Env: ``TIERED_KV_NATIVE`` (``0`` / ``1``).
    """

    device: str = "auto"
    host_threads: int = 2
    dma_min_chunk_bytes: int | None = None
    copy_path: str = "auto"
    completion_spin_us: int | None = None
    await_spin_us: int | None = None
    completion: str = "hostfunc"
    completion_poll: bool = True
    native_submit: bool = True

    def __post_init__(self) -> None:
        threshold = self.dma_min_chunk_bytes
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0):
            raise ValueError(
                f"dma_min_chunk_bytes must be a non-negative int or None (measured), got {self.dma_min_chunk_bytes!r}"
            )
        if self.copy_path not in ("auto", "dma", "kernel"):
            raise ValueError(f"copy_path must be 'auto', 'dma' or 'kernel', got {self.copy_path!r}")
        for name in ("completion_spin_us", "await_spin_us"):
            spin = getattr(self, name)
            if spin is not None and (isinstance(spin, bool) or not isinstance(spin, int) or spin < 0):
                raise ValueError(f"{name} must be a non-negative int or None, got {spin!r}")
        if isinstance(self.host_threads, bool) or not isinstance(self.host_threads, int) or self.host_threads < 1:
            raise ValueError(f"host_threads must be a positive int, got {self.host_threads!r}")
        if self.completion not in COMPLETIONS:
            raise ValueError(f"completion must be 'hostfunc' or 'event', got {self.completion!r}")
        for name in ("completion_poll", "native_submit"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @classmethod
    def from_env(cls, **overrides: object) -> EngineConfig:
        """Defaults, then ``TIERED_KV_*`` environment variables, then ``overrides``."""
        values: dict[str, object] = {}
        if "TIERED_KV_DEVICE" in os.environ:
            values["device"] = os.environ["TIERED_KV_DEVICE"]
        if "TIERED_KV_HOST_THREADS" in os.environ:
            values["host_threads"] = env_int("TIERED_KV_HOST_THREADS")
        if "TIERED_KV_DMA_MIN_CHUNK" in os.environ:
            values["dma_min_chunk_bytes"] = env_int("TIERED_KV_DMA_MIN_CHUNK", " (bytes)")
        if "TIERED_KV_COMPLETION_SPIN_US" in os.environ:
            values["completion_spin_us"] = env_int("TIERED_KV_COMPLETION_SPIN_US", " (microseconds)")
        if "TIERED_KV_AWAIT_SPIN_US" in os.environ:
            values["await_spin_us"] = env_int("TIERED_KV_AWAIT_SPIN_US", " (microseconds)")
        if "TIERED_KV_COPY_PATH" in os.environ:
            values["copy_path"] = os.environ["TIERED_KV_COPY_PATH"]
        if "TIERED_KV_COMPLETION" in os.environ:
            completion = os.environ["TIERED_KV_COMPLETION"].strip().lower()
            if completion not in COMPLETIONS:
                raise ValueError(
                    f"TIERED_KV_COMPLETION must be 'hostfunc' or 'event', got {os.environ['TIERED_KV_COMPLETION']!r}"
                )
            values["completion"] = completion
        if "TIERED_KV_COMPLETION_POLL" in os.environ:
            values["completion_poll"] = env_flag("TIERED_KV_COMPLETION_POLL")
        if "TIERED_KV_NATIVE" in os.environ:
            values["native_submit"] = env_flag("TIERED_KV_NATIVE")
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]
