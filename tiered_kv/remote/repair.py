"""Objects a remote tier found corrupted: reported once each, replaced by the next good put of their name.

Primitives: :class:`CorruptObjects` (what a :class:`~tiered_kv.remote.RemoteTier` holds) and :func:`digest`.

A get that reads an object failing verification records its name with the SHA-1 of the bytes read
(:meth:`CorruptObjects.found`); the warning is logged the first time a name is found bad, later reads of the
same bad object log at debug level. A put of a recorded name is a *replacement*
(:meth:`~tiered_kv.remote.RemoteStore.replace`: a compare-and-set on those bytes where the store has one)
instead of an insert that keeps the existing value; a verified read or a put of the name forgets it. The
memory is bounded (most recent names); a name that falls out of it is found bad again by its next read.
"""

from __future__ import annotations

import collections
import hashlib
import logging

import numpy as np

__all__ = ["CorruptObjects", "digest"]

log = logging.getLogger("tiered_kv.remote.tier")

#: corrupted object names remembered at most (a name and a digest each: ~100 bytes)
LIMIT = 1 << 16


def digest(raw: np.ndarray) -> str:
    """SHA-1 (hex) of an object's bytes, the form a Redis compare-and-set script compares."""
    return hashlib.sha1(np.ascontiguousarray(raw).data, usedforsecurity=False).hexdigest()


class CorruptObjects:
    """Names of objects found corrupted, with the SHA-1 of what was read (``None``: not of the object's size).

    Args:
        limit: names remembered at most (least recently found are forgotten first).
    """

    def __init__(self, limit: int = LIMIT) -> None:
        self._names: collections.OrderedDict[str, str | None] = collections.OrderedDict()
        self._limit = limit

    def found(self, name: str, sha1: str | None, reason: str) -> None:
        """Record that ``name`` failed verification (``reason``); warns the first time for this bad value."""
        again = name in self._names and self._names[name] == sha1
        self._names[name] = sha1
        self._names.move_to_end(name)
        if len(self._names) > self._limit:
            self._names.popitem(last=False)
        log.log(
            logging.DEBUG if again else logging.WARNING,
            "remote object %s failed verification (%s): treated as a miss; the next put of it replaces it",
            name,
            reason,
        )

    def forget(self, name: str) -> None:
        """``name`` was read verified or was put: nothing to replace."""
        self._names.pop(name, None)

    def expected(self, name: str) -> str | None:
        """The SHA-1 of the corrupted bytes read for ``name`` (``None``: their size was wrong)."""
        return self._names[name]

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __len__(self) -> int:
        return len(self._names)
