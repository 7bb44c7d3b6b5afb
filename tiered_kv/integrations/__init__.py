"""Engine integrations: vLLM (:mod:`tiered_kv.integrations.vllm`) and SGLang (:mod:`tiered_kv.integrations.sglang`).

Each submodule imports its engine lazily-at-import (it *is* the plug-in an engine loads); importing this
package imports neither engine. :mod:`tiered_kv.integrations.loop` is the shared event-loop thread that lets
an engine's synchronous hooks drive the asyncio :class:`~tiered_kv.TransferEngine`.
"""

from __future__ import annotations

__all__: list[str] = []
