"""Benchmark rows as a user reads them: every row's target and whether it is met; a stable schema; compare.

Primitives:

* :data:`SCHEMA` -- the version tag of the JSON ``tiered-kv bench`` writes (``payload["schema"]``).
* :class:`Target` -- ``metric op value`` (``ratio >= 0.95``); :meth:`Target.met` judges a row.
* :func:`target_for` -- the target of one row (``None`` for rows that are context, not a goal).
* :func:`finalize` -- give every row of a benchmark result ``id``, ``target`` and ``met`` (in place).
* :func:`compare` -- rows of two payloads matched by ``(benchmark, id)``: the target metric before and after.

Schema ``tiered_kv.bench/2``: ``{"schema", "machine", "quick", "benchmarks": [{"name", "machine", "rows",
"notes", "seconds"}]}``; every row is a flat dict with at least ``bench`` (its kind), ``id`` (stable between
runs: the row's label fields), ``target`` (text, ``""`` when none) and ``met`` (``true``/``false``/``null``).
Measurements keep their own keys; a row's target names the one it is judged by.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

__all__ = ["SCHEMA", "Target", "compare", "finalize", "row_id", "target_for"]

SCHEMA = "tiered_kv.bench/2"

Row = dict[str, Any]


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    """A goal on one measurement of a row.

    Attributes:
        metric: the row key judged.
        op: ``">="`` or ``"<="``.
        value: the bound.
        requires: a boolean row key that must also be true (``""``: none).
    """

    metric: str
    op: str
    value: float
    requires: str = ""

    def met(self, row: Row) -> bool | None:
        """Whether ``row`` meets the target; ``None`` when the metric is missing or not a number.

        A row whose ``requires`` flag (e.g. ``same_output``) is not true misses the target whatever its figure.
        """
        v = row.get(self.metric)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v):
            return None
        if self.requires and row.get(self.requires) is not True:
            return False
        return bool(v >= self.value) if self.op == ">=" else bool(v <= self.value)

    def __str__(self) -> str:
        return f"{self.metric} {self.op} {self.value:g}" + (f" and {self.requires}" if self.requires else "")


def _engine(row: Row) -> Target | None:
    kind = row.get("bench")
    if kind == "schedule":
        return Target("loop_cpu_us_per_block", "<=", 2.0) if row.get("blocks") == 4096 else None
    if kind == "call":
        return Target("copy_returns_us", "<=", 20.0)
    if kind == "wakeup":
        return Target("p50_ratio", "<=", 1.2)
    if kind == "bandwidth":
        return Target("ratio", ">=", 0.9 if row.get("direction") == "both" else 0.95)
    return None


def _kernels(row: Row) -> Target | None:
    kind = row.get("bench")
    if kind == "layer_major":
        return Target("vs_contiguous", ">=", 0.95 if row.get("chunk_KiB", 0) >= 64 else 0.9)
    if kind == "sweep":
        return Target("choice_vs_best", ">=", 0.95)
    if kind == "partial":
        return Target("fraction", ">=", 0.8 if row.get("direction") == "gpu->gpu" else 0.9)
    if kind == "gather":
        return Target("speedup", ">=", 3.0) if str(row.get("path", "")).startswith("tiered") else None
    return None


def _overlap(row: Row) -> Target | None:
    return Target("vs_bound", "<=", 1.15, requires="same_output") if "vs_bound" in row else None


def _filetier(row: Row) -> Target | None:
    return Target("ratio", ">=", 0.9) if "ratio" in row else None


def _pagetables(row: Row) -> Target | None:
    if "host_x_racy" not in row:
        return None
    return Target("host_x_racy", "<=", 1.3 if row.get("mode") == "gather" else 1.2)


def _model(row: Row) -> Target | None:
    # TTFT with the prefix in host at most 1.25x its floor (the copy at the pinned rate, or the forward with the KV
    # resident); a miss at most 1.05x the recompute time; with the prefix in the file tier (hybrid prefill) at most
    # 1.15x its floor and never slower than recomputing
    path = row.get("path")
    if path == "host":
        return Target("vs_floor", "<=", 1.25)
    if path == "file":
        return Target("vs_floor", "<=", 1.15, requires="at_least_recompute")
    if path == "cold":
        return Target("vs_recompute", ">=", round(1 / 1.05, 3))
    return None


def _serving(row: Row) -> Target | None:
    # decode with the cache at least 0.95x plain transformers, the checksums at most 2% of it; a host hit's
    # GPU memory beyond its KV at most 10% of the KV
    kind, path = row.get("bench"), row.get("path")
    if kind == "decode" and path == "cache":
        return Target("vs_plain", ">=", 0.95)
    if kind == "decode" and path == "no_integrity":
        return Target("integrity_cost", "<=", 0.02)
    if kind == "memory" and path == "host":
        return Target("beyond_kv", "<=", 0.10)
    return None


def _peers(row: Row) -> Target | None:
    # at least as fast as the peer (LMCache; the per-block loop), with both sides' retrieves giving back exact bytes
    return Target("ratio", ">=", 1.0, requires="verified") if "ratio" in row else None


_RULES: dict[str, Callable[[Row], Target | None]] = {
    "model": _model,
    "serving": _serving,
    "engine": _engine,
    "kernels": _kernels,
    "filetier": _filetier,
    "pagetables": _pagetables,
    "overlap": _overlap,
    "peers": _peers,
}

# keys that are measurements or verdicts, never part of a row's identity
# not labels: verdicts, and what the engine chose for a row (a row keeps its id when a calibration chooses otherwise)
_NOT_LABELS = {"target", "met", "id", "device", "engine_path"}
# int fields that label a row (other ints, such as counts of hits, are measurements)
_INT_LABELS = {"blocks", "chunks", "seqs", "threads", "pairs", "layers", "tokens", "new_tokens", "group_layers"}
_INT_LABEL_ENDINGS = ("_tokens", "_blocks", "_layers", "_seqs")  # prefix_tokens ... (not tokens_reused: a count)


def target_for(benchmark: str, row: Row) -> Target | None:
    """The target of ``row`` of ``benchmark`` (``None``: the row is context, it has no goal of its own)."""
    rule = _RULES.get(benchmark)
    return rule(row) if rule is not None else None


def row_id(row: Row) -> str:
    """A row's identity: its label fields in order, e.g. ``bandwidth/block_MiB=4/blocks=256/indices=contiguous``.

    Labels are strings, ints named like labels (``blocks``, ``seqs``...) and sizes (``chunk_KiB``, ``block_MiB``);
    other numbers are measurements.
    """
    parts = [str(row.get("bench", ""))]
    for key, value in row.items():
        if key in _NOT_LABELS or key == "bench" or isinstance(value, bool):
            continue
        int_label = isinstance(value, int) and (key in _INT_LABELS or key.endswith(_INT_LABEL_ENDINGS))
        if isinstance(value, str) or int_label:
            parts.append(f"{key}={value}")
        elif isinstance(value, float) and key.endswith(("KiB", "MiB")):
            parts.append(f"{key}={value:g}")
    return "/".join(parts)


def finalize(result: dict[str, Any]) -> dict[str, Any]:
    """Give every row of one benchmark result ``id``, ``target`` (text) and ``met``; returns ``result``."""
    name = str(result.get("name", ""))
    rows = result.get("rows", [])
    for i, row in enumerate(rows):
        if "bench" not in row:  # a module with one kind of row: the kind is the module
            row = rows[i] = {"bench": name, **row}
        t = target_for(name, row)
        own_met = row.get("met")
        own_target = row.pop("target", None)  # a module's own free-text target is replaced by the judged one
        row.pop("target_ratio", None)
        row.pop("target_us_per_block", None)
        row.pop("met", None)
        row["id"] = row_id(row)
        if t is not None:
            row["target"] = str(t)
            row["met"] = t.met(row)
        elif isinstance(own_met, bool):  # a module that judges its own rows (no rule here) keeps its verdict
            row["target"] = str(own_target) if own_target is not None else ""
            row["met"] = own_met
        else:
            row["target"] = ""
            row["met"] = None
    return result


def _judged_ids(payload: dict[str, Any]) -> list[tuple[str, str]]:
    """``(benchmark, id)`` of every row of ``payload`` that has a target, in order."""
    return [
        (bench["name"], row.get("id") or row_id(row))
        for bench in payload.get("benchmarks", [])
        for row in bench.get("rows", [])
        if target_for(bench["name"], row) is not None
    ]


def unmatched(old: dict[str, Any], new: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Judged rows :func:`compare` cannot pair: ``(only in new, only in old)``, each as ``"benchmark: id"``.

    A row id holds the row's labels (a backend, a path the engine chose), so a row whose label changed between two
    runs shows up here twice, once under each name.
    """
    a, b = _judged_ids(old), _judged_ids(new)
    sa, sb = set(a), set(b)
    return [f"{n}: {i}" for n, i in b if (n, i) not in sa], [f"{n}: {i}" for n, i in a if (n, i) not in sb]


def compare(old: dict[str, Any], new: dict[str, Any]) -> list[Row]:
    """Rows present in both payloads, matched by ``(benchmark, id)``: the judged metric before and after.

    Returns rows ``{"benchmark", "id", "metric", "old", "new", "new/old", "met_old", "met_new"}`` in the new
    payload's order; rows without a target are compared on nothing and left out.
    """
    before: dict[tuple[str, str], Row] = {}
    for bench in old.get("benchmarks", []):
        for row in bench.get("rows", []):
            before[(bench["name"], row.get("id") or row_id(row))] = row
    out: list[Row] = []
    for bench in new.get("benchmarks", []):
        for row in bench.get("rows", []):
            rid = row.get("id") or row_id(row)
            prev = before.get((bench["name"], rid))
            t = target_for(bench["name"], row)
            if prev is None or t is None:
                continue
            a, b = prev.get(t.metric), row.get(t.metric)
            ratio = b / a if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a else float("nan")
            out.append(
                {
                    "benchmark": bench["name"],
                    "id": rid,
                    "metric": str(t),
                    "old": a,
                    "new": b,
                    "new/old": ratio,
                    "met_old": t.met(prev),
                    "met_new": t.met(row),
                }
            )
    return out
