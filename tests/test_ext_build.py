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


# The one-call launch's decisions (kernels/fast_path.cpp: launch) run before any CUDA call: on a machine without a
# GPU the built module still answers them. A call that passes every check reaches the copy plan's lookup, which
# raises for the plan id -1 (no such plan): "issued" below. None (nothing enqueued): "declined".
_LAUNCH_DECISIONS = """
import importlib.machinery, importlib.util, json
from pathlib import Path
import torch
from tiered_kv import _ext
from tiered_kv.fences import Marker

path = _ext.build()
loader = importlib.machinery.ExtensionFileLoader(Path(path).stem, str(path))
spec = importlib.util.spec_from_file_location(Path(path).stem, str(path), loader=loader)
native = importlib.util.module_from_spec(spec)
loader.exec_module(native)
done, done2, busy = Marker(None), Marker(None), Marker(None)
done.completed = done2.completed = True
many = [Marker(None) for _ in range(17)]
for m in many:
    m.completed = True
# two, fifteen and sixteen pairs in one run, decided; plan -1 does not exist
choices = {(2, 1): (-1, [0, 0], 64), (15, 1): (-1, [0, 0], 64), (16, 1): (-1, [0, 0], 64)}

def outcome(src_writes, dst_writes, dst_reads, src=(0, 1), dst=(10, 11), holders=(None, None)):
    try:
        tables = (src_writes, dst_writes, dst_reads, *holders)
        got = native.launch(32, 32, False, *tables, list(src), list(dst), choices, 0, 0)
    except RuntimeError as exc:
        return "issued" if "unknown copy plan" in str(exc) else repr(exc)
    return "declined" if got is None else repr(got)

cases = {
    "no tables": (None, None, None),
    "empty tables": ({}, {}, {}),
    "completed writer and readers": (None, {10: done, 11: done2}, {11: {done: None, done2: None}}),
    "one completed marker everywhere": ({0: done, 1: done}, {10: done}, {11: done}),
    "first block completed, second busy": (None, {10: done, 11: busy}, None),
    "busy source": ({0: done, 1: busy}, None, None),
    "busy reader behind a completed one": (None, {10: done}, {11: {done: None, busy: None}}),
    "busy reader in a later set": (None, None, {10: {done: None}, 11: {done: None, done2: None, busy: None}}),
    "busy first block": (None, {10: busy, 11: done}, None),
    "undecided shape": (None, None, None, (0, 1, 2), (10, 11, 12)),
    "index out of range": (None, None, None, (0, 1), (10, 32)),
    # the pools' holders (FenceTable.tables): none still running -> the tables are not read
    "completed holders": (
        {0: done}, {10: done}, {11: {done: None, done2: None}}, (0, 1), (10, 11),
        ({done: None}, {done: None, done2: None}),
    ),
    "busy source holder": ({0: busy}, None, None, (0, 1), (10, 11), ({busy: None}, {})),
    "busy destination holder behind a completed one": (
        None, {11: busy}, None, (0, 1), (10, 11), ({}, {done: None, busy: None})
    ),
    "busy holder, other blocks": ({5: busy}, {12: busy}, None, (0, 1), (10, 11), ({busy: None}, {busy: None})),
    # from 16 pairs the holders are asked first (at most 16 per pool): the entry of a busy op that no holder names
    # (a state the fence table never has) shows whether the blocks were looked at
    "16 pairs, completed holders: blocks not looked at": (
        {0: busy}, None, None, range(16), range(16, 32), ({done: None}, {done2: None})
    ),
    "16 pairs, 17 completed holders: blocks looked at": (
        {0: busy}, None, None, range(16), range(16, 32), (dict.fromkeys(many), {})
    ),
    "15 pairs: blocks looked at": ({0: busy}, None, None, range(15), range(16, 31), ({done: None}, {done2: None})),
}
launch = {name: outcome(*args) for name, args in cases.items()}

# register_pair against its Python reference (FenceTable._register_blocks): random copies, completions and
# releases on two tables, one with the native entries; after each step both hold the same entries, in the same order
import random
from tiered_kv.fences import FenceTable

# each table has markers of its own (a marker records whether its entries are written), named by the copy's step
name = {}

def state(table):
    table.flush()  # the entries the copies registered so far, written (register records them)
    def entry(e):
        return [name[m] for m in e] if isinstance(e, dict) else name[e]
    return (
        {p: [(i, entry(e)) for i, e in t.items()] for p, t in table._reads.items() if t},
        {p: [(i, name[m]) for i, m in t.items()] for p, t in table._writes.items() if t},
        {p: [name[m] for m in t] for p, t in table._holders.items() if t},
    )

rng = random.Random(7)
ref, fast = FenceTable(), FenceTable(native.register_pair)
live, steps, mismatches = [], 0, []
for step in range(3000):
    action = rng.random()
    if action < 0.6 or not live:
        src_pool, dst_pool = rng.choice(["gpu", "host"]), rng.choice(["gpu", "host"])
        n = rng.randint(1, 12)
        d = rng.sample(range(40), n)
        pool_s = [i for i in range(40) if src_pool != dst_pool or i not in d]
        s = [rng.choice(pool_s) for _ in range(n)]  # sources may repeat
        pair = (Marker(None), Marker(None))
        for table, marker in zip((ref, fast), pair):
            name[marker] = step
            table.register(marker, [(src_pool, list(s))], [(dst_pool, list(d))])
        live.append(pair)
    elif action < 0.85:
        pair = live.pop(rng.randrange(len(live)))
        for table, marker in zip((ref, fast), pair):
            marker.completed = True
            table.release_later(marker)
    else:
        pair = live.pop(rng.randrange(len(live)))
        for table, marker in zip((ref, fast), pair):
            marker.completed = True
            table.release(marker)
    steps += 1
    if state(ref) != state(fast):
        mismatches.append(step)
register = {"steps": steps, "mismatches": mismatches[:5], "fenced": len(ref)}
try:
    native.register_pair({}, {}, [], Marker(None), [0], [1])
    register["bad table"] = "accepted"
except TypeError as exc:
    register["bad table"] = str(exc)

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
print(json.dumps({"launch": launch, "register": register, "dma": dma}))
"""


@needs_toolkit
@pytest.mark.timeout(900)
def test_one_call_launch_decisions_without_a_gpu(tmp_path: Path) -> None:
    """``launch`` declines (returns None) for any block with an op not completed, however the blocks share markers.

    The fence check reads a marker's ``completed`` once per call (a copy's blocks mostly share one): a block behind
    one whose completed marker it read must still be checked against its own writer and readers.
    """
    env = {**os.environ, "TIERED_KV_EXT_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", _LAUNCH_DECISIONS], capture_output=True, text=True, env=env, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-8000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    got = out["launch"]
    issued = {
        "no tables",
        "empty tables",
        "completed writer and readers",
        "one completed marker everywhere",
        "completed holders",
        "busy holder, other blocks",
        "16 pairs, completed holders: blocks not looked at",
    }
    assert got == {name: "issued" if name in issued else "declined" for name in got}, got
    assert len(got) == 18
    register = out["register"]
    assert register["steps"] == 3000 and register["mismatches"] == [], register
    assert register["fenced"] > 0, register  # the tables were not empty at the end: entries were compared
    assert register["bad table"] == "a fence table must be a dict", register
    # the DMA path's calls, applied to CPU bytes, equal the reference op in every case
    dma = out["dma"]
    assert dma["cases"] == 300 and dma["mismatched"] == 0, dma
    # 8 blocks of 3 layers x K/V x 2 heads = 12 rows of 8 tokens x 16 int16 (256 B apart), 3 tokens (96 B) each: one
    # call of 96 rows; with room between the blocks, one call per block
    block = 12 * 256
    assert dma["one run"] == [0, 4 * block, 0, 0, 256, 256, 96, 96], dma
    assert dma["padded calls"] == 8, dma
