"""The tools wing: programs built on the library, apart from its core.

Nothing in the library core imports from here; the tools import the core.

* :mod:`tiered_kv.tools.cli` -- the ``tiered-kv`` command (demo, bench, soak, crash, doctor, build-ext).
* :mod:`tiered_kv.tools.doctor` -- the checks ``tiered-kv doctor`` runs.
* :mod:`tiered_kv.tools.bench` -- benchmarks, each next to its same-run baseline; the kernel probe.
* :mod:`tiered_kv.tools.soak` -- randomized soak checked against a shadow model.
* :mod:`tiered_kv.tools.crash` -- the SIGKILL crash-consistency harness of the file tier.
* :mod:`tiered_kv.tools.workload` -- the seeded multi-turn chat workload and its verifying replay.
"""
