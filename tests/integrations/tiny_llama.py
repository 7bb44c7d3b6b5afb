"""A tiny Llama with seeded weights that make attention position-sensitive, and prompts that probe reuse.

Random "dummy" weights make attention nearly uniform, which hides KV loaded at the wrong position. Here the
query and key projections are scaled up (sharp attention), weights are seeded and written to safetensors, the
model runs in fp32, and each probe prompt shares exactly the first ``k`` blocks of a cached prompt.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

BLOCK = 32  # vLLM's CPU attention needs a multiple of 32
VOCAB = 512


def write_model(directory: Path, seed: int = 0) -> Path:
    """Write ``config.json`` + ``model.safetensors`` of a 2-layer Llama (2 KV heads, head_dim 32) into ``directory``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (directory / "config.json").exists():
        return directory
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=VOCAB, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def prompt(seed: int, blocks: int, extra: int = 12) -> list[int]:
    """``blocks`` full blocks plus ``extra`` tokens of seeded token ids."""
    ids: list[int] = np.random.RandomState(seed).randint(1, VOCAB - 1, size=blocks * BLOCK + extra).tolist()
    return ids


def probes(base: list[int], seed: int) -> list[list[int]]:
    """Prompts sharing exactly the first 1..k-1 full blocks of ``base`` (then seeded tokens of the same length)."""
    out = []
    full = len(base) // BLOCK
    for k in range(1, full):
        rng = np.random.RandomState(seed + k)
        tail = rng.randint(1, VOCAB - 1, size=len(base) - k * BLOCK).tolist()
        if tail[0] == base[k * BLOCK]:
            tail[0] = (tail[0] % (VOCAB - 2)) + 1
        out.append(base[: k * BLOCK] + tail)
    return out
