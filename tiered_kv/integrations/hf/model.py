"""What tiered_kv needs to know of a transformers causal LM, and the plain-transformers baseline.

Primitives:

* :func:`model_geometry` / :func:`layout_for` -- the :class:`~tiered_kv.KVLayout` a model's KV needs
  (layers, KV heads, head_dim, dtype from its config); :func:`check_layout` -- a cache's layout is that one.
* :func:`check_full_attention` -- refuse models with sliding-window, linear or hybrid attention layers.
* :func:`reference_generate` -- greedy generation with plain transformers and no tiered_kv (the baseline the
  tests and the demo compare :class:`~tiered_kv.integrations.hf.generator.CachedGenerator` against).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np
import torch

from ...layout import KVLayout

__all__ = [
    "cache_kwargs",
    "check_full_attention",
    "check_layout",
    "layout_for",
    "model_geometry",
    "output_cache",
    "reference_generate",
]


def cache_kwargs(model: Any, kv: Any) -> dict[str, Any]:
    """``{name: kv}`` for ``model(...)``: transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old warns)."""
    model_type = type(model)
    name = _CACHE_NAMES.get(model_type)
    if name is None:
        # One signature look per model class, not per decode step.
        forward = getattr(model_type, "forward", None)
        has_cache = forward is not None and "cache" in inspect.signature(forward).parameters
        name = _CACHE_NAMES[model_type] = "cache" if has_cache else "past_key_values"
    return {name: kv}


_CACHE_NAMES: dict[type, str] = {}


def output_cache(out: Any) -> Any:
    """The KV cache a model call returned (``cache`` from transformers 5.24, ``past_key_values`` before)."""
    cache = out.get("cache") if hasattr(out, "get") else None
    return cache if cache is not None else out.past_key_values


def model_geometry(model: Any) -> tuple[int, int, int, torch.dtype]:
    """``(layers, kv_heads, head_dim, dtype)`` of a transformers causal LM, from its config and weights.

    Raises:
        TypeError: ``model`` has no transformers config.
        ValueError: the config lacks the attention geometry.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise TypeError(f"model must be a transformers PreTrainedModel with a config, got {type(model).__name__}")
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layers = getattr(text, "num_hidden_layers", None)
    heads = getattr(text, "num_attention_heads", None)
    if not isinstance(layers, int) or not isinstance(heads, int):
        raise ValueError("the model's config has no num_hidden_layers / num_attention_heads")
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    dtype = next(model.parameters()).dtype
    return int(layers), int(kv_heads), int(head_dim), dtype


def layout_for(model: Any, tokens_per_block: int = 16) -> KVLayout:
    """The :class:`~tiered_kv.KVLayout` of ``model``'s KV cache (blocks of ``tokens_per_block`` tokens).

    Example::

        layout = layout_for(model)
        async with TieredKVCache(layout, gpu_blocks=1024, host_blocks=8192, model_id="my-model") as cache:
            generator = CachedGenerator(model, cache)
    """
    layers, kv_heads, head_dim, dtype = model_geometry(model)
    return KVLayout(
        num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, tokens_per_block=tokens_per_block, dtype=dtype
    )


def check_layout(model: Any, layout: KVLayout) -> None:
    """``layout`` must be :func:`layout_for` ``model`` (layers, KV heads, head_dim, dtype; K and V).

    Raises:
        ValueError: it is not, naming both.
    """
    layers, kv_heads, head_dim, dtype = model_geometry(model)
    want = (layers, kv_heads, head_dim, dtype, 2)
    have = (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype, layout.kv_factor)
    if want != have:
        raise ValueError(
            f"the cache's layout (layers={have[0]}, kv_heads={have[1]}, head_dim={have[2]}, dtype={have[3]}, "
            f"kv_factor={have[4]}) does not fit the model (layers={layers}, kv_heads={kv_heads}, "
            f"head_dim={head_dim}, dtype={dtype}); build it with tiered_kv.integrations.hf.layout_for(model)"
        )


def check_full_attention(model: Any) -> None:
    """Only models whose every layer is plain full attention (a ``DynamicLayer``) are supported."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    probe = DynamicCache(config=model.config)
    kinds = {type(layer).__name__ for layer in probe.layers if type(layer) is not DynamicLayer}
    if kinds:
        raise ValueError(
            f"this model has {', '.join(sorted(kinds))} cache layers (sliding window, linear or hybrid attention); "
            "CachedGenerator supports models whose every layer is full attention"
        )


def reference_generate(
    model: Any,
    prompt_ids: Sequence[int] | np.ndarray | torch.Tensor,
    *,
    max_new_tokens: int = 16,
    stop_token_ids: Collection[int] = (),
    output_logits: bool = False,
    past: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[list[int], torch.Tensor | None, float]:
    """Greedy generation with plain transformers and a plain ``DynamicCache`` (no tiered_kv).

    Args:
        model: the causal LM.
        prompt_ids: the prompt.
        max_new_tokens: tokens to generate.
        stop_token_ids: generation ends after any of these.
        output_logits: also return the logits of every position run.
        past: per layer ``(keys, values)`` ``[1, heads, r, head_dim]`` of the prompt's first ``r`` tokens,
            held in memory (e.g. from an earlier forward): the forward then runs ``prompt[r:]`` only, as
            :class:`CachedGenerator` does with ``r`` reused tokens; ``None`` runs the whole prompt.

    Returns:
        ``(tokens, logits, ttft_s)``: the generated ids; with ``output_logits`` the logits of every position
        run (prompt positions from ``r``, then one row per decode step, as :attr:`Generation.logits`);
        seconds to the first token.
    """
    from transformers.cache_utils import DynamicCache

    device = next(model.parameters()).device
    ids = torch.as_tensor(np.asarray(prompt_ids, dtype=np.int64)).reshape(1, -1).to(device)
    stops = {int(s) for s in stop_token_ids}
    rows: list[torch.Tensor] = []
    tokens: list[int] = []
    t0 = time.perf_counter()
    ttft = 0.0
    with torch.inference_mode():
        kv = DynamicCache()
        start = 0
        if past is not None:
            for i, (k, v) in enumerate(past):
                kv.update(k, v, i)
            start = past[0][0].shape[-2]
        out = model(
            input_ids=ids[:, start:],
            **cache_kwargs(model, kv),
            use_cache=True,
            logits_to_keep=0 if output_logits else 1,
        )
        logits = out.logits
        if output_logits:
            rows.append(logits[0].float().cpu())
        step = logits[:, -1, :]
        for i in range(max_new_tokens):
            tok = int(step.argmax(dim=-1).item())
            if i == 0:
                ttft = time.perf_counter() - t0
            tokens.append(tok)
            if tok in stops or i == max_new_tokens - 1:
                break
            out = model(
                input_ids=torch.tensor([[tok]], device=device),
                **cache_kwargs(model, kv),
                use_cache=True,
                logits_to_keep=1,
            )
            step = out.logits[:, -1, :]
            if output_logits:
                rows.append(step.float().cpu())
    return tokens, (torch.cat(rows) if output_logits else None), ttft
