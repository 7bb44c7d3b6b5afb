"""A file tier whose disk stalls on demand, for the engines' own configuration paths (which build their file tiers
themselves through ``FileTierConfig.from_env``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from tiered_kv.backends.posix import PosixBackend

from tiered_kv.faults import FaultSwitch, FaultyBackend
from tiered_kv.file import FileTierConfig


def hang_file_reads(monkeypatch: pytest.MonkeyPatch) -> tuple[FaultSwitch, list[FaultyBackend]]:
    """Every file tier built from now on reads through a :class:`FaultyBackend` whose reads hang while the switch is
    on; returns the switch and the backends made (``release()`` them when done)."""
    switch, made = FaultSwitch(), []
    from_env = FileTierConfig.from_env

    def hanging(*args: Any, **kwargs: Any) -> FileTierConfig:
        def factory(path: str) -> FaultyBackend:
            made.append(FaultyBackend(PosixBackend(path, direct=False), hang_on_read=switch))
            return made[-1]

        return dataclasses.replace(from_env(*args, **kwargs), backend_factory=factory)

    monkeypatch.setattr(FileTierConfig, "from_env", staticmethod(hanging))
    return switch, made
