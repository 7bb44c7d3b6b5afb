"""Greedy outputs of the tiny Llama on vLLM *without* any connector (the reference for test_vllm.py).

Usage: ``python vllm_baseline.py MODEL_DIR PROMPTS_JSON OUT_JSON``. Each prompt runs alone after a prefix
cache reset, so every token is computed.
"""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    model, prompts_path, out_path = sys.argv[1:4]
    with open(prompts_path) as f:
        prompts = json.load(f)
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, block_size=32,
              max_model_len=512, seed=0)
    params = SamplingParams(max_tokens=8, temperature=0, detokenize=False)
    outputs = []
    for p in prompts:
        llm.reset_prefix_cache()
        [o] = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
        outputs.append(list(o.outputs[0].token_ids))
    with open(out_path, "w") as f:
        json.dump(outputs, f)
