"""The layer order of the package is a contract: a module imports only from the layers below its own.

A unit is a top-level module of ``tiered_kv`` or one of its subpackages (``file``, ``remote``, ``integrations``,
``tools``, and ``backends``, which lives in ``backends/``). Every import counts: at the top of a module, inside a
function, or for type checking only. Units of one layer never import each other, so the graph has no circle and
no arrow back up. A new top-level module must be given its layer here.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent

#: Bottom to top. Each layer may import from the layers before it only.
LAYERS: list[tuple[str, set[str]]] = [
    ("foundations", {"errors", "layout", "config", "completions", "opdefs", "slotstate"}),
    ("keys, pools and formats", {"_ext", "keys", "pools", "slab"}),
    ("the two stream implementations", {"cuda_stream", "emulated_stream"}),
    ("device and ops", {"device", "ops", "backends"}),
    (
        "fences, handlers, block manager",
        {"faults", "layer_major", "fences", "handlers", "rowversions", "staging_pool", "offset_checks", "blocks"},
    ),
    ("pool kinds, transfers, checks", {"pool_kinds", "transfer", "staging", "integrity", "testing"}),
    ("copy machinery, plan issue", {"copy", "plan_batches"}),
    ("the copy machinery's module paths", {"copyops", "stream_copier"}),
    ("the file tier", {"file"}),
    ("the engine's parts", {"engine_pools", "copy_checks", "engine_sync", "inflight"}),
    ("the engine's inspection", {"engine_inspection"}),
    ("the engine", {"engine", "close_spill"}),
    ("above the engine", {"layerwise", "remote"}),
    ("the prefix cache's parts", {"cache_copies"}),
    ("the prefix cache", {"cache"}),
    ("around the cache", {"cost_model", "metrics"}),
    ("integrations", {"integrations"}),
    ("tools", {"tools"}),
    ("entry points", {"__init__", "__main__"}),
]


def _units() -> dict[str, list[pathlib.Path]]:
    """Unit name -> its source files."""
    units: dict[str, list[pathlib.Path]] = {"backends": sorted((ROOT / "backends").glob("*.py"))}
    package = ROOT / "tiered_kv"
    for path in sorted(package.iterdir()):
        if path.suffix == ".py":
            units[path.stem] = [path]
        elif path.is_dir() and (path / "__init__.py").exists():
            units[path.name] = sorted(path.rglob("*.py"))
    return units


def _module_of(path: pathlib.Path) -> list[str]:
    """The dotted package of ``path`` (for relative imports): ``tiered_kv``, ``tiered_kv.file``, ..."""
    if path.is_relative_to(ROOT / "backends"):
        return ["tiered_kv", "backends"]
    return list(path.relative_to(ROOT).parent.parts)


def _imported_units(path: pathlib.Path, names: set[str]) -> set[str]:
    """The units of ``tiered_kv`` that ``path`` imports, anywhere in it."""
    package = _module_of(path)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        modules: list[str] = []
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            modules.append(module)
            modules.extend(f"{module}.{a.name}" for a in node.names)  # `from . import cache`
        elif isinstance(node, ast.Import):
            modules.extend(a.name for a in node.names)
        for module in modules:
            parts = module.split(".")
            if parts[0] == "tiered_kv" and len(parts) > 1 and parts[1] in names:
                found.add(parts[1])
    return found


def test_every_unit_has_a_layer() -> None:
    placed = [name for _, layer in LAYERS for name in layer]
    assert len(placed) == len(set(placed)), "a unit is in two layers"
    missing = set(_units()) - set(placed)
    assert not missing, f"give these modules a layer in tests/test_layers.py: {sorted(missing)}"


def test_no_import_goes_up_or_sideways() -> None:
    rank = {name: i for i, (_, layer) in enumerate(LAYERS) for name in layer}
    units = _units()
    wrong: list[str] = []
    for unit, files in units.items():
        for path in files:
            wrong.extend(
                f"{path.relative_to(ROOT)} ({LAYERS[rank[unit]][0]}) imports {target} ({LAYERS[rank[target]][0]})"
                for target in _imported_units(path, set(units)) - {unit}
                if rank.get(target, -1) >= rank.get(unit, -1)
            )
    assert not wrong, "imports against the layer order:\n" + "\n".join(sorted(wrong))


def test_the_check_sees_an_import_that_goes_up(tmp_path: pathlib.Path) -> None:
    """The parser finds relative, absolute and function-level imports."""
    source = tmp_path / "tiered_kv" / "file" / "x.py"
    source.parent.mkdir(parents=True)
    source.write_text("from ..cache import A\nimport tiered_kv.engine\ndef f():\n    from . import tier\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert _imported_units(source, {"cache", "engine", "file"}) == {"cache", "engine", "file"}
    finally:
        ROOT = saved


def test_no_module_is_over_600_lines() -> None:
    """A module holds one concept a reviewer reads at once; a longer one is split by concept."""
    long = {
        str(path.relative_to(ROOT)): n
        for files in _units().values()
        for path in files
        if (n := len(path.read_text().splitlines())) > 600
    }
    assert not long, f"modules over 600 lines: {long}"
