"""Integrations with the engines and model libraries people run (each submodule imports its library lazily).

* :mod:`tiered_kv.integrations.vllm` -- ``TieredKVOffloadingSpec`` for vLLM's ``OffloadingConnector``, and a
  ``SecondaryTierManager`` for vLLM's own CPU tier.
* :mod:`tiered_kv.integrations.sglang` -- ``TieredKVHiCacheStorage``, a SGLang HiCache storage backend.
* :mod:`tiered_kv.integrations.hf` -- ``CachedGenerator``: a Hugging Face transformers causal LM
  whose prompts reuse KV blocks from GPU, host and file tiers.
* :mod:`tiered_kv.integrations.loop` -- the shared event-loop thread that lets an engine's synchronous hooks
  drive the asyncio :class:`~tiered_kv.TransferEngine`.

Importing this package imports none of those libraries.
"""

from __future__ import annotations

__all__: list[str] = []
