"""The command line: demo, bench --quick, soak and doctor run on the emulated device; errors are one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "TIERED_KV_DEVICE": "cpu"}


def tkv(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tiered_kv", *args], capture_output=True, text=True, timeout=timeout, env=ENV
    )


def test_demo_runs_a_real_model_and_verifies_every_reused_token(tmp_path):
    out = tmp_path / "demo.json"
    r = tkv("demo", "--device", "cpu", "--quiet", "--conversations", "6", "--dir", str(tmp_path), "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert " 0 wrong" in r.stdout and "hit rate" in r.stdout and "time to first token" in r.stdout
    assert "CPU figures, not comparable to GPU targets" in r.stdout  # emulated runs are labelled
    assert "emulated device: the model and every copy ran on this CPU" in r.stdout
    assert "by where the reused prefix came from" in r.stdout
    for tier in ("gpu", "host", "file"):
        assert f"\n{tier:>4} " in r.stdout
    assert [p for p in os.listdir(tmp_path) if p != "demo.json"]  # the file tier lived in --dir
    report = json.loads(out.read_text())
    assert report["emulated"] and report["turns"] == len(report["ttft_with"]) == len(report["ttft_without"])
    assert report["verified_tokens"] >= report["reused_tokens"] > 0 and report["mismatched_tokens"] == 0
    assert report["first_token_agree"] == report["turns"]
    assert sum(report["hits"].values()) > 0 and "Llama" in report["model"]
    sources = {row["prefix from"]: row["turns"] for row in report["ttft_by_source"]}
    assert sum(sources.values()) == report["turns"] and sources.get("gpu", 0) > 0


def test_demo_checks_its_output_paths_before_the_run(tmp_path):
    for args, message in (
        (["--plot", str(tmp_path / "missing" / "x.png")], "does not exist or is not writable"),
        (["--plot", str(tmp_path / "x.txt")], "use a .png, .svg or .pdf"),
        (["--json", str(tmp_path)], "is a directory"),
    ):
        r = tkv("demo", "--device", "cpu", "--quiet", *args, timeout=60)
        assert r.returncode == 2 and message in r.stderr, r.stderr
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr and "turns" not in r.stdout


def test_bench_quick_writes_one_json_with_every_benchmark(tmp_path):
    out = tmp_path / "bench.json"
    r = tkv("bench", "--quick", "--device", "cpu", "--json", str(out), timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    payload = json.loads(out.read_text())
    names = [b["name"] for b in payload["benchmarks"]]
    assert names == ["engine", "kernels", "overlap", "pagetables", "filetier", "cache", "remote", "model", "serving"]
    assert all(b["rows"] for b in payload["benchmarks"])
    assert payload["machine"]["device"] == "emulated (CPU)"
    assert payload["schema"] == "tiered_kv.bench/2"
    for bench in payload["benchmarks"]:  # every row shows its target (or "") and whether it is met
        ids = [row["id"] for row in bench["rows"]]
        assert len(ids) == len(set(ids)), bench["name"]
        for row in bench["rows"]:
            assert {"bench", "id", "target", "met"} <= row.keys() and row["met"] in (True, False, None)
            assert (row["met"] is None) == (row["target"] == "") or row["met"] is None
    judged = {b["name"]: [r for r in b["rows"] if r["target"]] for b in payload["benchmarks"]}
    assert judged["engine"] and judged["kernels"] and judged["filetier"] and judged["pagetables"]
    overlap = payload["benchmarks"][2]["rows"]
    assert overlap and all(r["same_output"] for r in overlap)  # layer-by-layer compute saw the loaded layers
    assert "targets met" in r.stdout


def test_bench_compare_matches_rows_of_an_earlier_run(tmp_path):
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    assert (
        tkv("bench", "--quick", "--device", "cpu", "--only", "engine", "--json", str(old), timeout=300).returncode == 0
    )
    # one judged row of the old run under another id (a label that changed between two builds)
    payload = json.loads(old.read_text())
    (renamed,) = [r for b in payload["benchmarks"] for r in b["rows"] if r.get("id") == "wakeup/loop=asyncio"]
    renamed["id"] = "wakeup/loop=renamed"
    old.write_text(json.dumps(payload))
    r = tkv(
        "bench",
        "--quick",
        "--device",
        "cpu",
        "--only",
        "engine",
        "--json",
        str(new),
        "--compare",
        str(old),
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"compared with {old}" in r.stdout
    for rid in (
        "call/loop=uvloop",
        "wakeup/loop=asyncio",
        "bandwidth/block_MiB=0.5/blocks=64/indices=scattered/direction=both",
    ):
        assert rid in r.stdout
    assert "not compared, 1 judged row(s) only in this run:\n  engine: wakeup/loop=asyncio\n" in r.stdout
    assert f"not compared, 1 judged row(s) only in {old}:\n  engine: wakeup/loop=renamed\n" in r.stdout
    bad = tkv("bench", "--quick", "--only", "engine", "--compare", str(tmp_path / "missing.json"))
    assert bad.returncode == 2 and "cannot read" in bad.stderr


def test_soak_command():
    r = tkv("soak", "--ops", "500", "--seed", "3", "--quiet", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ok: 500 ops")


def test_crash_command(tmp_path):
    r = tkv("crash", "--seeds", "2", "--dir", str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "runs, OK" in r.stdout and "mismatched 0" in r.stdout and "torn served 0" in r.stdout


def test_doctor_reports_every_check(tmp_path):
    r = tkv("doctor", "--dir", str(tmp_path), "--json", str(tmp_path / "d.json"))
    assert r.returncode == 0, r.stderr
    checks = {c["check"] for c in json.loads((tmp_path / "d.json").read_text())}
    assert {
        "python",
        "torch",
        "CUDA device",
        "uvloop",
        "kvikio",
        "CUDA extension",
        "pinned memory (ulimit -l)",
    } <= checks
    assert "CUDA device" in r.stdout


def test_doctor_exits_1_when_a_needed_check_fails_and_advises_for_the_installed_torch(tmp_path):
    r = tkv("doctor", "--dir", str(tmp_path / "missing"), "--json", str(tmp_path / "d.json"))
    assert r.returncode == 1 and "failed: directory" in r.stdout
    checks = {c["check"]: c for c in json.loads((tmp_path / "d.json").read_text())}
    assert checks["directory"]["required"] and not checks["directory"]["ok"]
    assert not checks["CUDA device"]["required"]
    import torch

    if not torch.cuda.is_available():
        cuda = checks["CUDA device"]
        if torch.version.cuda:  # a CUDA build is installed: the advice is about the driver, not reinstalling torch
            assert "nvidia-smi" in cuda["fix"] and "install a CUDA build" not in cuda["fix"]
        else:
            assert "install a CUDA build of torch" in cuda["fix"]
    import resource

    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    small = soft != resource.RLIM_INFINITY and soft < 64 << 20
    assert checks["pinned memory (ulimit -l)"]["ok"] is (not small)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc (a filesystem with no free space)")
def test_doctor_refuses_a_directory_the_engine_refuses(tmp_path):
    """`doctor --dir /proc` fails with one line, as `TransferEngine(file_dir="/proc")` does (issue 41, item 5)."""
    r = tkv("doctor", "--dir", "/proc", "--json", str(tmp_path / "d.json"))
    assert r.returncode == 1, r.stdout
    errors = [line for line in r.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "/proc" in errors[0] and "free" in errors[0], r.stderr
    assert "failed: directory" in r.stdout and "ready" not in r.stdout.splitlines()[-1]
    checks = {c["check"]: c for c in json.loads((tmp_path / "d.json").read_text())}
    assert checks["directory"]["required"] and not checks["directory"]["ok"]


def test_doctor_fails_when_the_remote_store_asked_for_is_unreachable(tmp_path):
    r = tkv("doctor", "--dir", str(tmp_path), "--remote", "redis://127.0.0.1:1/0", timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "remote store" in errors[0] and "unreachable" in errors[0], r.stderr


def test_doctor_passes_a_writable_directory_and_leaves_nothing_in_it(tmp_path):
    d = tmp_path / "tier"
    d.mkdir(mode=0o700)
    r = tkv("doctor", "--dir", str(d))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ready" in r.stdout and not list(d.iterdir())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["demo", "--dir", "/nonexistent/dir"], "is not a writable directory"),
        (["demo", "--conversations", "0"], "expected a positive integer"),
        (["bench", "--only", "nope"], "unknown benchmark"),
        (["frobnicate"], "invalid choice"),
        (["demo", "--no-such-flag"], "unrecognized arguments"),
        (["crash", "--tear", "-1"], "expected a non-negative integer"),
        (["demo", "--file-blocks", "-1"], "expected a non-negative integer"),
    ],
)
def test_bad_flags_are_one_line_errors(args, message):
    r = tkv(*args)
    assert r.returncode == 2
    assert message in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message of a machine without CUDA")
@pytest.mark.parametrize(
    "command", [["soak", "--ops", "10", "--quiet"], ["bench", "--only", "engine", "--quick"], ["demo", "--quiet"]]
)
def test_asking_for_cuda_without_it_is_one_line(command):
    r = tkv(*command, "--device", "cuda", timeout=120)
    lines = [line for line in r.stderr.splitlines() if line.startswith("error")]
    assert r.returncode == 2 and len(lines) == 1 and "CUDA" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_help():
    r = tkv("--help")
    assert r.returncode == 0 and "demo" in r.stdout and "bench" in r.stdout and "doctor" in r.stdout


def test_help_does_not_import_torch():
    """`tiered-kv --help` answers without loading torch (or any heavy module); a library name loads it on use."""
    code = (
        "import sys, contextlib, io\n"
        "from tiered_kv.tools.cli import main\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['--help'])\n"
        "assert 'torch' not in sys.modules, 'torch imported by --help'\n"
        "import tiered_kv\n"
        "assert 'torch' not in sys.modules, 'torch imported by import tiered_kv'\n"
        "assert tiered_kv.KVLayout.__name__ == 'KVLayout' and 'torch' in sys.modules\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 0, r.stderr
