"""The peer benchmark on CPU: its refusals, its rows and targets with a fake peer, the per-block baseline."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tiered_kv.tools import cli
from tiered_kv.tools.bench import peers, targets

TINY = peers.KVShape(layers=2, kv_heads=2, head_dim=64, dtype=torch.bfloat16, block_tokens=16, chunk_tokens=64)


@pytest.fixture
def no_lmcache_modules(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """LMCache's modules are whatever the test puts on sys.path, and none are left behind."""
    monkeypatch.setenv("LMCACHE_TRACK_USAGE", "false")
    monkeypatch.setenv("LMCACHE_LOG_LEVEL", "WARNING")
    saved = {k: v for k, v in sys.modules.items() if k == "lmcache" or k.startswith("lmcache.")}
    for name in saved:
        del sys.modules[name]
    yield
    for name in [k for k in sys.modules if k == "lmcache" or k.startswith("lmcache.")]:
        del sys.modules[name]
    sys.modules.update(saved)


def _fake_lmcache(root: Path, cuda_ops: str, bound: bool, utils: str = "") -> None:
    package = root / "lmcache"
    (package / "v1" / "gpu_connector").mkdir(parents=True)
    for empty in ("lmcache_native", "utils", "v1/__init__", "v1/config", "v1/metadata", "v1/cache_engine"):
        (package / f"{empty}.py").write_text("")
    (package / "v1" / "gpu_connector" / "__init__.py").write_text("")
    (package / "utils.py").write_text(utils)
    (package / "cuda_ops.py").write_text(cuda_ops)
    init = '__version__ = "0.5.6"\n\n\ndef _torch_fallback(*args):\n    pass\n\n\n'
    if bound:
        init += "from lmcache import cuda_ops as _native\n\n\nclass device_ops:\n"
        init += "    multi_layer_kv_transfer = staticmethod(_native.multi_layer_kv_transfer)\n"
    else:
        init += "class device_ops:\n    multi_layer_kv_transfer = staticmethod(_torch_fallback)\n"
    (package / "__init__.py").write_text(init)


def _never(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the benchmark measured although it must refuse")


def test_without_lmcache_it_refuses_in_one_line_and_measures_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], no_lmcache_modules: None
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lmcache" else real(name, *a))
    monkeypatch.setattr(peers, "measure", _never)
    out = tmp_path / "bench-peers.json"
    assert peers.main(["--device", "cpu", "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "LMCache is not installed: pip install 'lmcache>=0.5,<0.6'" in err
    assert not out.exists()
    # the command line refuses before running any benchmark it was given
    assert cli.main(["bench", "--only", "engine", "peers", "--device", "cpu", "--json", str(out)]) == 2
    captured = capsys.readouterr()
    assert "running bench" not in captured.out and captured.err.count("\n") == 1 and "pip install" in captured.err
    assert not out.exists()


@pytest.mark.parametrize(
    ("cuda_ops", "bound", "message"),
    [
        ('raise ImportError("cuda_ops.so: undefined symbol: _ZN3c104cuda9SetDeviceEab")', False, "undefined symbol"),
        ("def multi_layer_kv_transfer(*args):\n    pass\n", False, "without binding lmcache.cuda_ops"),
    ],
)
def test_lmcache_without_its_compiled_ops_is_refused(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    no_lmcache_modules: None,
    cuda_ops: str,
    bound: bool,
    message: str,
) -> None:
    _fake_lmcache(tmp_path, cuda_ops, bound)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(peers, "measure", _never)
    with pytest.raises(peers.PeerUnavailable, match=message):
        peers.check_lmcache()
    assert peers.main(["--device", "cpu", "--json", str(tmp_path / "out.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "plain torch ops" in err


def test_lmcache_with_its_compiled_ops_passes_the_check_and_still_needs_cuda(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_lmcache_modules: None
) -> None:
    _fake_lmcache(tmp_path, "def multi_layer_kv_transfer(*args):\n    pass\n", bound=True)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert peers.check_lmcache() == "0.5.6"
    with pytest.raises(peers.PeerUnavailable, match="needs a CUDA device"):
        peers.preflight("cpu")


def test_lmcache_missing_a_dependency_is_refused_before_measuring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_lmcache_modules: None
) -> None:
    ops = "def multi_layer_kv_transfer(*args):\n    pass\n"
    _fake_lmcache(tmp_path, ops, bound=True, utils="import cachetools_not_installed_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(peers.PeerUnavailable, match="LMCache did not import: No module named 'cachetools_not_inst"):
        peers.check_lmcache()


def test_a_row_is_built_from_the_turns_and_judged_by_its_target() -> None:
    seconds = [[1.0, 2.0, 4.0], [2.0, 2.0, 2.0], [0.5, 0.5, 0.5]]  # tiered_kv, peer, line rate; one per turn
    row = peers.make_row("lmcache", "gpu->cpu", 8192, 10**9, seconds, [True, True])
    assert row["tiered_kv_GBps"] == pytest.approx(0.5) and row["peer_GBps"] == pytest.approx(0.5)
    assert row["ratio"] == pytest.approx(1.0)  # the median of 2/1, 2/2, 2/4: per turn, not of the medians
    assert row["line_GBps"] == pytest.approx(2.0)
    slower = peers.make_row(
        "lmcache", "gpu->cpu", 8192, 10**9, [[1.0, 1.0, 1.0], [1.0, 0.5, 0.8], [1.0] * 3], [True, True]
    )
    wrong = peers.make_row("lmcache", "disk->gpu", 8192, 10**9, seconds, [True, False])
    result = targets.finalize({"name": "peers", "rows": [row, slower, wrong]})
    judged = [(r["id"], r["target"], r["met"]) for r in result["rows"]]
    assert judged == [
        ("lmcache/direction=gpu->cpu/tokens=8192", "ratio >= 1 and verified", True),
        ("lmcache/direction=gpu->cpu/tokens=8192", "ratio >= 1 and verified", False),
        ("lmcache/direction=disk->gpu/tokens=8192", "ratio >= 1 and verified", False),  # fast, but not exact
    ]
    assert result["rows"][2]["verified"] is False and result["rows"][2]["tiered_kv_exact"] is True


class FakePeer:
    """Moves the blocks with plain torch copies into its own tensors (cpu) or a file (disk)."""

    name = "fake"

    def __init__(self, paged: peers.PagedKV, directory: str, direct: bool, delay: float, broken: bool) -> None:
        self.paged, self.path, self.delay, self.broken = paged, os.path.join(directory, "fake.pt"), delay, broken
        self.held: list[torch.Tensor] = []
        self.calls: list[tuple[str, str, int]] = []

    def _idx(self, tokens: int) -> torch.Tensor:
        return self.paged.blocks[: tokens // self.paged.shape.block_tokens]

    def store(self, where: str, tokens: int) -> None:
        self.calls.append(("store", where, tokens))
        time.sleep(self.delay)
        blocks = [t[:, self._idx(tokens)].clone() for t in self.paged.kv]
        if where == "disk":
            torch.save(blocks, self.path)
        else:
            self.held = blocks

    def retrieve(self, where: str, tokens: int) -> None:
        self.calls.append(("retrieve", where, tokens))
        time.sleep(self.delay)
        blocks = torch.load(self.path) if where == "disk" else self.held
        if not self.broken:
            for t, b in zip(self.paged.kv, blocks, strict=True):
                t[:, self._idx(tokens)] = b

    def forget(self, where: str, tokens: int) -> None:
        self.calls.append(("forget", where, tokens))

    def close(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)


def _measure(tmp_path: Path, delay: float, broken: bool) -> tuple[list[dict[str, Any]], FakePeer]:
    made: list[FakePeer] = []

    def make(paged: peers.PagedKV, directory: str, direct: bool) -> FakePeer:
        made.append(FakePeer(paged, directory, direct, delay, broken))
        return made[0]

    rows = asyncio.run(peers.measure("cpu", TINY, (128, 256), (2, 2), str(tmp_path), make))
    return targets.finalize({"name": "peers", "rows": rows})["rows"], made[0]


def test_the_rows_of_a_slower_peer_and_the_per_block_loop_on_the_emulated_device(tmp_path: Path) -> None:
    rows, peer = _measure(tmp_path, delay=0.1, broken=False)
    assert [(r["bench"], r["direction"], r["tokens"]) for r in rows] == [
        *[("fake", d, t) for t in (128, 256) for d in ("gpu->cpu", "cpu->gpu")],
        *[("fake", d, t) for t in (128, 256) for d in ("gpu->disk", "disk->gpu")],
        *[("per_block", d, t) for t in (128, 256) for d in ("gpu->cpu", "cpu->gpu")],
    ]
    for r in rows:
        assert r["tiered_kv_GBps"] > 0 and r["peer_GBps"] > 0 and r["line_GBps"] > 0, r
        assert r["verified"] and r["tiered_kv_exact"] and r["peer_exact"], r  # the per-block loop's bytes too
        assert r["target"] == "ratio >= 1 and verified"
    for r in rows[:8]:  # 100 ms a call: far slower than tiered_kv moving 128 or 256 KiB
        assert r["ratio"] > 1 and r["met"] is True, r
    # every store of the peer after its forget; warm-up turn + 2 turns per row, and the exactness check
    stores = [c for c in peer.calls if c[0] == "store"]
    assert len(stores) == 2 * 2 * 3 and all(peer.calls[peer.calls.index(s) - 1][0] == "forget" for s in stores)
    assert not list(tmp_path.iterdir())  # the slab, the raw file and the peer's file are gone


def test_a_peer_whose_retrieve_leaves_the_blocks_wrong_misses_every_target(tmp_path: Path) -> None:
    rows, _ = _measure(tmp_path, delay=0.0, broken=True)
    for r in rows:
        if r["bench"] == "fake":
            assert r["tiered_kv_exact"] and not r["peer_exact"] and r["met"] is False, r
        else:
            assert r["verified"], r


def test_the_benchmark_is_registered_and_runs_only_when_named() -> None:
    assert "peers" in cli.BENCHMARKS and cli.ON_REQUEST <= set(cli.BENCHMARKS) and "peers" in cli.ON_REQUEST
