"""Storage backends of tiered_kv (importable as ``tiered_kv.backends``).

Each backend is synchronous and non-blocking: it starts work and returns a completion with ``done()`` and
``result()``; the engine is the only async layer. The host DRAM tier is :class:`tiered_kv.pools.BlockPool`
over pinned memory; file backends live in this package, one module each.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["Completion"]


@runtime_checkable
class Completion(Protocol):
    """A started piece of backend work."""

    def done(self) -> bool:
        """True once the work has finished (successfully or not)."""
        ...

    def result(self) -> int:
        """Block until finished; return bytes moved or raise the error."""
        ...
