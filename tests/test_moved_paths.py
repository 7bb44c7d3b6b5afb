"""Import paths that moved keep working for one release: each warns once (DeprecationWarning) and names the new path."""

from __future__ import annotations

import importlib
import sys

import pytest

pytest.importorskip("transformers")

MOVED = {
    "tiered_kv.integrations.transformers": ("tiered_kv.integrations.hf", "CachedGenerator"),
    "tiered_kv.integrations.hf_kv": ("tiered_kv.integrations.hf.kv", "RowTargets"),
    "tiered_kv.integrations.hf_model": ("tiered_kv.integrations.hf.model", "output_cache"),
    "tiered_kv.integrations.hf_results": ("tiered_kv.integrations.hf.results", "Generation"),
    "tiered_kv.integrations.hf_sampling": ("tiered_kv.integrations.hf.sampling", "SamplingOptions"),
    "tiered_kv.integrations.models": ("tiered_kv.integrations.hf.models", "random_causal_lm"),
    "tiered_kv.integrations.byte_tokenizer": ("tiered_kv.integrations.hf.tokenizer", "ByteTokenizer"),
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_warns_and_gives_the_same_objects(old: str) -> None:
    new, name = MOVED[old]
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        module = importlib.import_module(old)
    target = importlib.import_module(new)
    assert getattr(module, name) is getattr(target, name)
    assert set(module.__all__) == set(target.__all__)
    for public in module.__all__:
        assert getattr(module, public) is getattr(target, public)
