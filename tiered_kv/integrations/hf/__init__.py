"""Hugging Face transformers through a :class:`~tiered_kv.TieredKVCache`: prompts reuse KV from any tier.

* :class:`CachedGenerator` (:mod:`.generator`) -- ``await generate(prompt_ids, max_new_tokens=...)`` on a transformers
  causal LM: the prompt's cached prefix is reused from the GPU, host or file tier, the model runs the rest, and the
  KV it computes is written into the cache's blocks. :class:`Generation`, :class:`GenerationStream`,
  :class:`GeneratorStatistics` (:mod:`.results`), :class:`GenerateOptions`, :class:`SamplingOptions`
  (:mod:`.sampling`).
* :func:`layout_for`, :func:`model_geometry`, :func:`reference_generate` (:mod:`.model`) -- the
  :class:`~tiered_kv.KVLayout` a model's KV needs; the same generation with plain transformers (the baseline).
* :func:`random_causal_lm`, :func:`tiny_llama_config`, :func:`llama_8b_config` (:mod:`.models`) -- models with random
  weights built from a config, nothing downloaded (tests, the demo, the benchmarks, the server example).
* :class:`ByteTokenizer` (:mod:`.tokenizer`) -- a byte-level tokenizer with a minimal chat template, built in code.
* :mod:`.kv` -- the KV bridge between a forward and the GPU pool (past KV in, new KV written through).

Importing this package imports transformers (``pip install 'tiered-kv[hf]'``).
"""

from __future__ import annotations

from .generator import (
    CachedGenerator,
    GenerateOptions,
    Generation,
    GenerationStream,
    GeneratorStatistics,
    SamplingOptions,
    layout_for,
    model_geometry,
    reference_generate,
)
from .models import llama_8b_config, random_causal_lm, tiny_llama_config
from .tokenizer import ByteTokenizer

__all__ = [
    "ByteTokenizer",
    "CachedGenerator",
    "GenerateOptions",
    "Generation",
    "GenerationStream",
    "GeneratorStatistics",
    "SamplingOptions",
    "layout_for",
    "llama_8b_config",
    "model_geometry",
    "random_causal_lm",
    "reference_generate",
    "tiny_llama_config",
]
