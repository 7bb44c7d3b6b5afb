"""Engine configuration: one dataclass, environment overrides, no hidden globals."""

from __future__ import annotations

import dataclasses
import os

__all__ = ["EngineConfig"]


@dataclasses.dataclass(frozen=True, slots=True)
class EngineConfig:
    """Knobs of a :class:`~tiered_kv.TransferEngine`.

    Attributes:
        device: ``"auto"`` (CUDA if present, else the emulated device), ``"cpu"`` or ``"cuda[:N]"``.
            Env: ``TIERED_KV_DEVICE``.
        host_threads: threads that run host-only work (host-to-host copies). Env: ``TIERED_KV_HOST_THREADS``.
    """

    device: str = "auto"
    host_threads: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.host_threads, bool) or not isinstance(self.host_threads, int) or self.host_threads < 1:
            raise ValueError(f"host_threads must be a positive int, got {self.host_threads!r}")

    @classmethod
    def from_env(cls, **overrides: object) -> EngineConfig:
        """Defaults, then ``TIERED_KV_*`` environment variables, then ``overrides``."""
        values: dict[str, object] = {}
        if "TIERED_KV_DEVICE" in os.environ:
            values["device"] = os.environ["TIERED_KV_DEVICE"]
        if "TIERED_KV_HOST_THREADS" in os.environ:
            raw = os.environ["TIERED_KV_HOST_THREADS"]
            try:
                values["host_threads"] = int(raw)
            except ValueError as exc:
                raise ValueError(f"TIERED_KV_HOST_THREADS must be an int, got {raw!r}") from exc
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]
