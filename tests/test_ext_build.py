"""The CUDA extension compiles, loads and registers a CUDA kernel for every op (whenever nvcc and a CUDA
build of torch exist, GPU or not), so a compile error fails CI. Builds run in subprocesses: one process
cannot load two builds of the same op library."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tiered_kv import _ext

CAN_COMPILE = _ext.find_cuda_home() is not None and torch.version.cuda is not None
needs_toolkit = pytest.mark.skipif(not CAN_COMPILE, reason="needs nvcc and a CUDA build of torch")

_BUILD = """
import json
from tiered_kv import _ext
path = _ext.build()
print(json.dumps({"path": str(path), "registered": _ext.cuda_kernels_registered(), "status": _ext.status()}))
"""


def _build_in_subprocess(cache: Path, builder: str) -> dict[str, Any]:
    env = {**os.environ, "TIERED_KV_EXT_DIR": str(cache), "TIERED_KV_EXT_BUILDER": builder}
    proc = subprocess.run([sys.executable, "-c", _BUILD], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, f"extension build failed:\n{proc.stderr[-8000:]}"
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


@needs_toolkit
@pytest.mark.timeout(900)
@pytest.mark.parametrize("builder", ["auto", "direct"])
def test_extension_compiles_and_registers_every_op(tmp_path: Path, builder: str) -> None:
    if builder == "auto":
        from torch.utils import cpp_extension

        if not cpp_extension.is_ninja_available():
            pytest.skip("ninja is not installed; the direct builder case covers this machine")
    out = _build_in_subprocess(tmp_path, builder)
    assert Path(out["path"]).exists()
    assert out["registered"] == {op: True for op in _ext.OPS}
    assert out["status"]["built"] is True and out["status"]["error"] is None
    # A second process finds the cache entry and does not rebuild.
    mtime = Path(out["path"]).stat().st_mtime_ns
    again = _build_in_subprocess(tmp_path, builder)
    assert again["path"] == out["path"] and Path(out["path"]).stat().st_mtime_ns == mtime


def test_status_reports_toolkit_and_ops() -> None:
    st = _ext.status()
    for key in (
        "cuda_home",
        "nvcc",
        "nvcc_version",
        "torch",
        "torch_cuda",
        "cuda_available",
        "ninja",
        "arch",
        "sources",
        "cache_dir",
        "built",
        "registered",
        "error",
    ):
        assert key in st
    assert set(st["registered"]) == set(_ext.OPS)
    assert {"gather_block_offsets.cpp", "copy_blocks.cpp", "copy_chunks.cpp", "copy_blocks.cu"} <= set(st["sources"])
    if CAN_COMPILE:
        assert st["nvcc_version"] and st["cuda_home"]


def test_build_key_changes_with_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    (kernels / "a.cu").write_text("// one\n")
    monkeypatch.setenv("TIERED_KV_KERNELS_DIR", str(kernels))
    k1 = _ext._build_key("9.0")
    assert _ext._build_key("9.0") == k1
    assert _ext._build_key("8.0") != k1
    (kernels / "a.cuh").write_text("// a header counts too\n")
    k2 = _ext._build_key("9.0")
    assert k2 != k1
    (kernels / "a.cu").write_text("// two\n")
    assert _ext._build_key("9.0") not in (k1, k2)


def test_find_cuda_home_reads_a_wrapper_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "cuda-99.1"
    (root / "bin").mkdir(parents=True)
    (root / "include").mkdir()
    (root / "bin" / "nvcc").write_text("#!/bin/sh\necho fake\n")
    (root / "include" / "cuda_runtime.h").write_text("")
    wrapper_dir = tmp_path / "wrapper"
    wrapper_dir.mkdir()
    wrapper = wrapper_dir / "nvcc"
    wrapper.write_text(f'#!/bin/sh\nexec {root}/bin/nvcc "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", f"{wrapper_dir}{os.pathsep}{os.environ['PATH']}")
    assert _ext.find_cuda_home() == str(root)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "nowhere"))  # invalid: ignored
    assert _ext.find_cuda_home() == str(root)


def test_load_without_gpu_falls_back_and_logs_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.setitem(_ext._state, "loaded", None)
    monkeypatch.setitem(_ext._state, "logged", False)
    with caplog.at_level("WARNING", logger="tiered_kv._ext"):
        assert _ext.load() is False
        assert _ext.load() is False
    assert sum("CPU reference" in r.getMessage() for r in caplog.records) == 1


def test_arch_flags() -> None:
    assert _ext._arch_flags("9.0") == ["-gencode=arch=compute_90,code=sm_90"]
    assert _ext._arch_flags("8.0;9.0+PTX") == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90",
    ]


# The native module, built on a machine without a GPU, answers what needs no device: the DMA path's calls.
_NATIVE_WITHOUT_A_GPU = """
import json, random
import torch
from tiered_kv import _ext

_ext.build()
# the DMA path's calls (kernels/copy_blocks.cpp: for_each_dma_call), applied to the bytes of CPU tensors with numpy,
# against the reference op: block- and layer-major sides, blocks with room between them, whole and partial blocks,
# runs and scattered pairs
import numpy as np
from tiered_kv import opdefs


def raw(t):
    store = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return store.numpy(), t.storage_offset() * t.element_size()


def side(kind, n, pad):
    L, KV, H, T, D = 3, 2, 2, 8, 16
    inner = {"block": (L, KV, H, T, D), "layer": (KV, H, T, D), "layerkv": (H, T, D)}[kind]
    count = {"block": 1, "layer": L, "layerkv": L * KV}[kind]
    per = int(np.prod(inner))
    return [
        torch.randint(-30000, 30000, (n, per + pad), dtype=torch.int16)[:, :per].unflatten(1, inner)
        for _ in range(count)
    ]


def apply(calls, dst, src):
    dviews, sviews = [raw(t) for t in dst], [raw(t) for t in src]
    for dt, doff, st, soff, dpitch, spitch, width, height in calls:
        dbuf, dbase = dviews[dt]
        sbuf, sbase = sviews[st]
        for h in range(max(height, 1)):
            a, b = dbase + doff + h * dpitch, sbase + soff + h * spitch
            dbuf[a : a + width] = sbuf[b : b + width]


rng2 = random.Random(7)
cases = mismatched = 0
for _ in range(300):
    kinds = rng2.choice([("block", "block"), ("block", "layer"), ("layer", "block"), ("layerkv", "block"),
                         ("layer", "layerkv"), ("layer", "layer")])
    n = 12
    src, dst = side(kinds[0], n, rng2.choice([0, 0, 8])), side(kinds[1], n, rng2.choice([0, 0, 8]))
    tokens = rng2.choice([8, 1, 3, 5])
    k = rng2.randint(1, 8)
    if rng2.random() < 0.5:  # runs
        a, b = rng2.randint(0, n - k), rng2.randint(0, n - k)
        s_idx, d_idx = list(range(a, a + k)), list(range(b, b + k))
    else:
        s_idx, d_idx = rng2.sample(range(n), k), rng2.sample(range(n), k)
    calls = torch.ops.tiered_kv.dma_calls(dst, src, s_idx, d_idx, tokens)
    want = [t.clone() for t in dst]  # the reference's copy first: the calls are applied to `dst` itself, in place
    got = dst
    apply([calls[i : i + 8] for i in range(0, len(calls), 8)], got, src)
    opdefs.copy_blocks_ref(want, src, torch.tensor(s_idx), torch.tensor(d_idx), tokens, 1)
    cases += 1
    mismatched += not all(torch.equal(x, y) for x, y in zip(got, want))
# the partial copy of a run of 8 dense block-major blocks is one 2-D call of all their rows; with room between the
# blocks (or scattered), one per block
dense_src, dense_dst = side("block", 12, 0), side("block", 12, 0)
one_run = torch.ops.tiered_kv.dma_calls(dense_dst, dense_src, list(range(8)), list(range(4, 12)), 3)
padded = torch.ops.tiered_kv.dma_calls(side("block", 12, 8), dense_src, list(range(8)), list(range(4, 12)), 3)
dma = {"cases": cases, "mismatched": mismatched, "one run": one_run, "padded calls": len(padded) // 8}
print(json.dumps({"dma": dma}))
"""


@needs_toolkit
@pytest.mark.timeout(900)
def test_native_module_builds_and_runs_without_a_gpu(tmp_path: Path) -> None:
    """The extension builds with nvcc on a machine without a GPU, and its DMA call planning equals the reference."""
    env = {**os.environ, "TIERED_KV_EXT_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", _NATIVE_WITHOUT_A_GPU], capture_output=True, text=True, env=env, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-8000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # the DMA path's calls, applied to CPU bytes, equal the reference op in every case
    dma = out["dma"]
    assert dma["cases"] == 300 and dma["mismatched"] == 0, dma
    # 8 blocks of 3 layers x K/V x 2 heads = 12 rows of 8 tokens x 16 int16 (256 B apart), 3 tokens (96 B) each: one
    # call of 96 rows; with room between the blocks, one call per block
    block = 12 * 256
    assert dma["one run"] == [0, 4 * block, 0, 0, 256, 256, 96, 96], dma
    assert dma["padded calls"] == 8, dma
