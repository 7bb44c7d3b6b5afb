"""The handler of the memory pairs under its module path: :class:`StreamCopier` and :data:`STREAM_ROUTES`.

The code is in :mod:`tiered_kv.copy.handler`; this module names the same objects.
"""

from __future__ import annotations

from .copy.copier import Op as Op
from .copy.handler import STREAM_ROUTES, StreamCopier

__all__ = ["STREAM_ROUTES", "StreamCopier"]
