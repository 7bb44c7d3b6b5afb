"""The A/B probes' summary (``partial_ab.sh``, ``lazy_ab.sh``): per row, each build's fractions and their medians.

Usage: python3 ab_summary.py partial-ab.jsonl (lines of ``partial_ab_probe.py``, tagged with build and round).
"""

from __future__ import annotations

import json
import statistics
import sys

runs = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
keys = sorted({k for r in runs for k in r["rows"]})
print(f"{'row':<16} {'new fraction (runs)':<36} {'old fraction (runs)':<36} new/old median")
for k in keys:
    got = {b: [r["rows"][k]["fraction"] for r in runs if r["build"] == b and k in r["rows"]] for b in ("new", "old")}
    med = {b: statistics.median(v) if v else float("nan") for b, v in got.items()}
    print(f"{k:<16} {got['new']!s:<36} {got['old']!s:<36} {med['new']:.3f} / {med['old']:.3f}")
