"""``tiered-kv`` / ``python -m tiered_kv``: demo, bench, soak, stress, crash, doctor, build-ext.

Primitives:

* :func:`main` -- run ``tiered-kv`` with ``argv``; :func:`build_parser` -- its argument parser.

torch is imported only by the subcommands that need it, so ``tiered-kv --help`` answers at once.

Every subcommand and its flags live here, each a short function; the work itself is in the modules they call.
The doctor's checks are :mod:`tiered_kv.tools.doctor`; its constants are importable from here too (the
``import X as X`` lines).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from .doctor import MEMLOCK_WARN_BYTES as MEMLOCK_WARN_BYTES
from .doctor import REQUIRED_CHECKS as REQUIRED_CHECKS
from .doctor import doctor_checks as _doctor_checks

__all__ = ["main"]

# Benchmarks of `tiered-kv bench`, in order (modules under tiered_kv.tools.bench). Those in ON_REQUEST run only when
# named with --only: they measure a peer library that must be installed.
BENCHMARKS = ["engine", "kernels", "overlap", "pagetables", "filetier", "cache", "remote", "model", "serving", "peers"]
ON_REQUEST = {"peers"}


def _writable_dir(path: str) -> str:
    """Argparse type: an existing directory this process may create files in."""
    if not (os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)):
        raise argparse.ArgumentTypeError(f"{path} is not a writable directory")
    return path


def _run_loop(coro: Any) -> Any:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:  # pragma: no cover
        return asyncio.run(coro)


# ------------------------------------------------------------------------------------------ demo


async def _demo(args: argparse.Namespace) -> int:
    """A real model (random weights) answers a seeded multi-turn chat through GPU, host and file tiers."""
    import importlib.util

    import torch

    from .demo import DemoConfig, check_outputs, plot_report, print_report, run_demo, write_json
    from .progress import Progress

    if importlib.util.find_spec("transformers") is None:
        raise ValueError("the demo runs a transformers model: pip install 'tiered-kv[hf]' (or '.[hf]' in a checkout)")
    check_outputs(args.plot, args.json)  # before a minute of work, not after it
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: no CUDA device here (use --device cpu or auto)")
    config = DemoConfig(
        device=args.device,
        seed=args.seed,
        conversations=args.conversations,
        max_new_tokens=args.max_new_tokens,
        gpu_blocks=args.gpu_blocks,
        host_blocks=args.host_blocks,
        file_blocks=args.file_blocks,
        directory=args.dir,
        remote=args.remote,
    )
    with Progress("chat turns through a real model", "turns", disable=args.quiet) as bar:

        def progress(done: int, total: int) -> None:
            bar.update_to(done, total)

        report = await run_demo(config, progress)
    print_report(report)
    if args.plot:
        plot_report(report, args.plot)
        print(f"wrote {args.plot}")
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    if report.mismatched_tokens:
        print(f"error: {report.mismatched_tokens} reused tokens' KV differ from a recompute", file=sys.stderr)
        return 1
    return 0


# ------------------------------------------------------------------------------------------ bench


def _bench(args: argparse.Namespace) -> int:
    from .bench.common import machine_info, print_grouped, print_table, write_json
    from .bench.targets import SCHEMA, compare, finalize, unmatched

    names = args.only or [n for n in BENCHMARKS if n not in ON_REQUEST]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        print(f"error: unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    modules = [importlib.import_module(f"tiered_kv.tools.bench.{name}") for name in names]
    for module in modules:  # a benchmark that cannot run here refuses (ValueError) before any of them runs
        preflight = getattr(module, "preflight", None)
        if preflight is not None:
            preflight(args.device)
    old = None
    if args.compare:
        try:
            with open(args.compare) as f:
                old = json.load(f)
        except (OSError, ValueError) as exc:
            print(f"error: cannot read {args.compare}: {exc}", file=sys.stderr)
            return 2
    results = []
    for i, (name, module) in enumerate(zip(names, modules, strict=True), 1):
        print(f"[{i}/{len(names)}] running bench.{name} ...", flush=True)  # each takes seconds to minutes
        t0 = time.perf_counter()
        result = finalize(module.run(args.quick, args.device))
        result["seconds"] = time.perf_counter() - t0
        if result.get("machine", {}).get("device") == "emulated (CPU)":
            result.setdefault("notes", []).append("emulated device: CPU figures, not comparable to the GPU targets")
        print_grouped(result)
        for note in result.get("notes", []):
            print(f"  note: {note}")
        results.append(result)
    payload = {"schema": SCHEMA, "machine": machine_info(args.device), "quick": args.quick, "benchmarks": results}
    write_json(args.json, payload)
    print(f"\nwrote {args.json}")
    _print_verdicts(payload)
    if old is not None:
        rows = compare(old, payload)
        print_table(rows, f"\ncompared with {args.compare} ({old.get('machine', {}).get('device', '?')})")
        if not rows:
            print("no row of this run has a counterpart with a target in the old file")
        only_new, only_old = unmatched(old, payload)
        for label, ids in (("only in this run", only_new), (f"only in {args.compare}", only_old)):
            if ids:
                print(f"not compared, {len(ids)} judged row(s) {label}:")
                for rid in ids:
                    print(f"  {rid}")
    return 0


def _print_verdicts(payload: dict[str, Any]) -> None:
    """One line per benchmark: rows with a target, met, missed (and which)."""
    for bench in payload["benchmarks"]:
        judged = [r for r in bench["rows"] if r.get("met") is not None]
        missed = [r["id"] for r in judged if r["met"] is False]
        line = f"{bench['name']}: {len(judged) - len(missed)}/{len(judged)} targets met"
        print(line + (f"; missed: {', '.join(missed)}" if missed else ""))


# ------------------------------------------------------------------------------------------ doctor


def _doctor(args: argparse.Namespace) -> int:
    """Exit 1 when a check that running needs fails (REQUIRED_CHECKS, and with --remote the remote probe).

    Missing optional features only advise.
    """
    checks = _doctor_checks(args.dir)
    required = set(REQUIRED_CHECKS)
    if args.remote:
        from ..remote.doctor import remote_checks

        remote = _run_loop(remote_checks(args.remote))
        required |= {c[0] for c in remote}  # asked for: a store that is down or loses data fails the doctor
        checks += remote
    width = max(len(c[0]) for c in checks)
    for name, ok, found, fix in checks:
        mark = "ok " if ok else ("XX " if name in required else "-- ")
        print(f"{mark} {name.ljust(width)}  {found}" + (f"\n    {' ' * width}  -> {fix}" if not ok and fix else ""))
    failed = [c for c in checks if not c[1] and c[0] in required]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                [{"check": c[0], "ok": c[1], "required": c[0] in required, "found": c[2], "fix": c[3]} for c in checks],
                f,
                indent=2,
            )
    if failed:
        print(f"\nfailed: {', '.join(c[0] for c in failed)} (XX: needed to run; --: optional, with what to do)")
        for name, _, found, _ in failed:  # one line per failed check, also on stderr for scripts
            print(f"error: {name}: {found}", file=sys.stderr)
        return 1
    print("\nready (--: optional features missing, with what to do)" if any(not c[1] for c in checks) else "\nready")
    return 0


# ------------------------------------------------------------------------------------------ soak


async def _soak(args: argparse.Namespace) -> int:
    import torch

    from .progress import Progress
    from .soak import SoakConfig, SoakFailure, soak

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.cache:
        return await _cache_soak(args, device)
    if args.file_blocks:
        import logging

        logging.getLogger("tiered_kv").setLevel(logging.ERROR)  # injected file faults fail copies: expected
    config = SoakConfig(ops=args.ops, seed=args.seed, tasks=args.tasks, device=device, file_blocks=args.file_blocks)
    with Progress(f"soak seed={args.seed} on {device}", "ops", args.ops, disable=args.quiet) as bar:
        try:
            report = await soak(config, progress=bar.update_to)
        except SoakFailure as failure:
            print(f"FAILED: {failure}", file=sys.stderr)
            return 1
    if args.file_blocks:
        print(
            f"file tier: all 8 routes, {report.failed} copies failed by injected file faults, {report.refused} reads "
            "of emptied slots refused; what they wrote was never checked as valid, everything else was"
        )
    print(
        f"ok: {report.ops} ops, {report.checked_blocks} block checks, {report.cancelled} cancelled waits, "
        f"{report.forgotten} unawaited, {report.stalls} stalls in {report.seconds:.1f} s; "
        f"close() {report.close_seconds * 1e3:.1f} ms"
    )
    return 0


async def _cache_soak(args: argparse.Namespace, device: str) -> int:
    import logging

    from .cache_soak import CacheSoakConfig, CacheSoakFailure, cache_soak
    from .progress import Progress

    logging.getLogger("tiered_kv").setLevel(logging.ERROR)  # injected faults fail copies by the hundred: expected
    config = CacheSoakConfig(
        ops=args.ops, seed=args.seed, tasks=args.tasks, device=device, min_verified_tokens=args.reused_tokens
    )
    total = max(args.reused_tokens, 1)
    desc = f"cache soak seed={args.seed} on {device}"
    with Progress(desc, "reused tokens verified", total, disable=args.quiet) as bar:
        try:
            report = await cache_soak(config, progress=lambda _n, verified: bar.update_to(min(verified, total)))
        except CacheSoakFailure as failure:
            print(f"FAILED: {failure}", file=sys.stderr)
            return 1
    hits = ", ".join(f"{t} {n}" for t, n in report.hits.items())
    print(
        f"ok: {report.admissions} admissions, {report.verified_tokens} reused tokens verified, "
        f"{report.wrong_tokens} wrong "
        f"(hits per tier: {hits}); {report.faults} file faults injected, {report.transfer_errors} admissions failed "
        f"with TransferError, {report.poisoned} blocks poisoned, {report.cancelled} cancelled, {report.cache_full} "
        f"retried when full, {report.appended} tokens appended, in {report.seconds:.1f} s"
    )
    return 0


# ------------------------------------------------------------------------------------------ crash


def _crash(args: argparse.Namespace) -> int:
    import tempfile

    from .crash import run_crash_test

    with tempfile.TemporaryDirectory(prefix="tiered-kv-crash-", dir=args.dir) as directory:
        report = run_crash_test(directory, args.seeds, tear=args.tear)
    print(report)
    return 0 if report.ok else 1


# ------------------------------------------------------------------------------------------ build-ext


def _build_ext(args: argparse.Namespace) -> int:
    from .. import _ext

    try:
        path = _ext.build(verbose=args.verbose)
    except Exception as exc:  # a build error is reported, not raised
        print(f"error: the CUDA extension did not build: {exc}", file=sys.stderr)
        return 1
    print(f"built {path}")
    return 0


# ------------------------------------------------------------------------------------------ main


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tiered-kv", description="Awaitable, fenced KV-cache block transfers: GPU <-> host <-> NVMe."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo",
        help="a real model (random weights) answers a seeded multi-turn chat through GPU, host and file tiers; "
        "every reused token's KV checked against a recompute; TTFT with vs without the cache",
    )
    demo.add_argument("--device", default="auto", help="auto (CUDA if present, else emulated) | cpu | cuda[:N]")
    demo.add_argument(
        "--dir",
        type=_writable_dir,
        help="directory of the file tier (default: a temporary directory, removed afterwards)",
    )
    demo.add_argument(
        "--conversations", type=_positive, default=24, help="conversations to replay (default: %(default)s)"
    )
    demo.add_argument("--max-new-tokens", type=_positive, default=24, help="longest reply (default: %(default)s)")
    demo.add_argument("--seed", type=int, default=0, help="workload and weights seed (default: %(default)s)")
    for tier, kind, what in (
        ("gpu", _positive, "GPU tier blocks of 16 tokens"),
        ("host", _positive, "host tier blocks"),
        ("file", _non_negative, "file tier blocks; 0 for none"),
    ):
        demo.add_argument(f"--{tier}-blocks", type=kind, help=f"{what} (default: sized for the device)")
    demo.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw hit rate and hits per tier, tier occupancy, TTFT with vs without (needs matplotlib)",
    )
    demo.add_argument("--json", metavar="FILE.json", help="also write the figures as JSON")
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    demo.add_argument(
        "--remote", metavar="URL", help="share blocks through a store: redis://host:port/0 or mooncake://host:port"
    )
    demo.set_defaults(func=lambda a: _run_loop(_demo(a)))

    bench = sub.add_parser("bench", help="run every benchmark next to its same-run baseline; one table, one JSON")
    bench.add_argument("--quick", action="store_true", help="CPU-sized run (under two minutes)")
    bench.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    bench.add_argument("--json", default="bench-tiered-kv.json", help="output file (default: %(default)s)")
    bench.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        help=f"run only these ({', '.join(BENCHMARKS)}; {', '.join(sorted(ON_REQUEST))} only when named here)",
    )
    bench.add_argument(
        "--compare", metavar="OLD_JSON", help="compare each judged row with the same row of an earlier run's JSON"
    )
    bench.set_defaults(func=_bench)

    soak = sub.add_parser(
        "soak", help="randomized soak with stalls and cancellations; every byte checked against a shadow model"
    )
    soak.add_argument("--ops", type=_positive, default=20_000, help="copies to issue (default: %(default)s)")
    soak.add_argument("--seed", type=int, default=0, help="seed of the op sequence (default: %(default)s)")
    soak.add_argument("--tasks", type=_positive, default=16, help="concurrent tasks (default: %(default)s)")
    soak.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    soak.add_argument("--quiet", action="store_true", help="no progress bar")
    soak.add_argument(
        "--cache",
        action="store_true",
        help="soak the prefix cache over GPU, host and file tiers with file faults; every reused token checked "
        "(--ops counts admissions)",
    )
    soak.add_argument(
        "--file-blocks",
        type=int,
        default=0,
        metavar="N",
        help="engine soak: add a file tier of N slots (all 8 routes, random file faults; default: none)",
    )
    soak.add_argument(
        "--reused-tokens",
        type=int,
        default=0,
        metavar="N",
        help="with --cache: keep going until N reused tokens were verified (default: %(default)s)",
    )
    soak.set_defaults(func=lambda a: _run_loop(_soak(a)))

    crash = sub.add_parser(
        "crash", help="SIGKILL a process spilling to the file tier at random points; reopen and verify every block"
    )
    crash.add_argument(
        "--seeds", type=_positive, default=6, help="kills (one child process each; default: %(default)s)"
    )
    crash.add_argument(
        "--tear",
        type=_non_negative,
        default=2,
        help="slots damaged after each kill, as a power cut might (default: %(default)s)",
    )
    crash.add_argument("--dir", type=_writable_dir, help="where the slabs go (default: a temporary directory)")
    crash.set_defaults(func=_crash)

    stress = sub.add_parser(
        "stress", add_help=False, help="the adversarial cache stress, many seeds side by side (--help: its flags)"
    )
    stress.add_argument("args", nargs=argparse.REMAINDER)  # main() hands them to tiered_kv.tools.stress

    build = sub.add_parser("build-ext", help="build the CUDA extension now (ahead of first use)")
    build.set_defaults(func=_build_ext)

    doctor = sub.add_parser(
        "doctor", help="report CUDA, kvikio/GDS, pinned-memory limits, uvloop; what to do if missing"
    )
    doctor.add_argument("--dir", default=os.getcwd(), help="directory to check for the file tier (default: cwd)")
    doctor.add_argument("--json", help="also write the checks as JSON")
    doctor.add_argument(
        "--remote", metavar="URL", help="also probe a remote store: reachability, round trip, bandwidth"
    )
    doctor.set_defaults(func=_doctor)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``tiered-kv`` with ``argv``; the exit status (2 for bad input, one line on stderr)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["stress"]:  # its own flags, parsed by its own parser
        return int(importlib.import_module("tiered_kv.tools.stress").main(argv[1:]))
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    from ..errors import BackendUnavailable, SlabInUseError, TieredKVError

    try:
        return int(args.func(args))
    except (ValueError, TypeError, BackendUnavailable, SlabInUseError) as exc:  # the user can fix these: one line
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except (OSError, TieredKVError) as exc:  # the machine: a full disk, a failed device -- one line, no traceback
        what = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        where = f": {exc.filename}" if isinstance(exc, OSError) and exc.filename else ""
        print(f"error: {type(exc).__name__}: {' '.join(what.split())}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
