"""Integrations of :class:`~tiered_kv.TieredKVCache` with model libraries (each imports its library lazily).

* :mod:`tiered_kv.integrations.transformers` -- ``CachedGenerator``: a Hugging Face transformers causal LM
  whose prompts reuse KV blocks from GPU, host and file tiers.
"""

__all__: list[str] = []
