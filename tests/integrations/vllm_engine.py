"""The two halves of a vLLM end-to-end test: the reference outputs of a run without any connector (a separate
process, ``vllm_baseline.py``) and an engine with the TieredKV offloading connector."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tiny_llama import BLOCK


def key(p: list[int]) -> str:
    """A prompt as a dict key."""
    return json.dumps(p)


def baseline_outputs(model_dir: Path, prompts: list[list[int]], directory: Path) -> dict[str, list[int]]:
    """``key(prompt) -> output tokens`` of the same model run without any connector."""
    (directory / "prompts.json").write_text(json.dumps(prompts))
    script = Path(__file__).with_name("vllm_baseline.py")
    subprocess.run([sys.executable, str(script), str(model_dir), str(directory / "prompts.json"),
                    str(directory / "out.json")], check=True, timeout=600)
    outs = json.loads((directory / "out.json").read_text())
    return {key(p): o for p, o in zip(prompts, outs, strict=True)}


def tiered_llm(vllm: Any, model_dir: Path, file_dir: Path, host_blocks: int, file_blocks: int,
               connector: str = "OffloadingConnector") -> Any:
    """A ``vllm.LLM`` of the model with the TieredKV spec over ``host_blocks`` host and ``file_blocks`` file blocks.

    ``connector="TieredKVConnector"``: the connector that reports loads failing verification (vLLM recomputes them).
    """
    config: dict[str, Any] = {
        "kv_connector": connector, "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "TieredKV", "host_blocks": host_blocks,
                                      "file_dir": str(file_dir), "file_blocks": file_blocks}}
    if connector == "TieredKVConnector":
        config["kv_load_failure_policy"] = "recompute"
    return vllm.LLM(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                    block_size=BLOCK, max_model_len=512, seed=0, kv_transfer_config=config)
