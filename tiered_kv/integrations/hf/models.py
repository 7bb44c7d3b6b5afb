"""Randomly initialised transformers models built from a config (nothing downloaded), fast at any size.

Primitives:

* :func:`tiny_llama_config` -- a small ``LlamaConfig`` (tests, the demo, the server example's default).
* :func:`llama_8b_config` -- the shape of Llama-3-8B (32 layers, 32 heads, 8 KV heads, head_dim 128).
* :func:`random_causal_lm` -- build the model on the ``meta`` device, allocate it on the target device
  (``to_empty``) and fill the weights with a seeded cheap init: an 8B model is ready in seconds, not the
  minutes a full ``__init__`` takes. Query/key projections are scaled up so attention is sharp: with
  near-uniform attention wrong KV would hardly change the output and a test could miss it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["llama_8b_config", "random_causal_lm", "tiny_llama_config"]


def tiny_llama_config(
    *,
    layers: int = 4,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 256,
    vocab: int = 512,
    max_positions: int = 8192,
) -> Any:
    """A small ``LlamaConfig`` (grouped-query attention, head_dim ``hidden // heads``)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
    )


def llama_8b_config(max_positions: int = 65536) -> Any:
    """A ``LlamaConfig`` of Llama-3-8B's shape (vocabulary 128,256; rope theta 500,000)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=False,
    )


def random_causal_lm(
    config: Any,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    qk_scale: float = 2.0,
    attn_implementation: str = "sdpa",
) -> Any:
    """A causal LM of ``config`` with seeded random weights, in eval mode.

    Args:
        config: a transformers config (e.g. :func:`tiny_llama_config`).
        dtype: parameter dtype.
        device: where the weights live.
        seed: the same seed gives the same weights on the same device.
        qk_scale: multiplies the query and key projections (sharper attention).
        attn_implementation: ``"sdpa"`` or ``"eager"``.

    Weights are ``N(0, 1 / fan_in)``, norms 1, biases 0; the rotary embedding is rebuilt on ``device``.
    """
    from transformers import AutoModelForCausalLM

    config._attn_implementation = attn_implementation
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    model = model.to(dtype=dtype).to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                std = 1.0 / math.sqrt(p.shape[-1])
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    std *= qk_scale
                p.normal_(0.0, std, generator=generator)
        # non-persistent buffers (rotary inverse frequencies) were not materialised by to_empty: rebuild
        for module_name, module in list(model.named_modules()):
            if type(module).__name__.endswith("RotaryEmbedding"):
                parent_name, _, attr = module_name.rpartition(".")
                parent = model.get_submodule(parent_name) if parent_name else model
                setattr(parent, attr, type(module)(config=module.config).to(device))
    model.eval()
    return model
