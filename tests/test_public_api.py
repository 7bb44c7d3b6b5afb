"""The public API is a snapshot: a change to it is deliberate, reviewed, and written in CHANGELOG.md.

The snapshot (``tests/public_api.txt``) lists every name ``tiered_kv`` exports with its signature (for classes, every
public method and property, those inherited from a tiered_kv base class included), the names users put in
configuration (the vLLM spec module and class, the vLLM plugin entry point, SGLang's backend class path, the
integrations' public names), and the ``TIERED_KV_*`` environment variables the package reads. After a deliberate
change, regenerate it with ``python tests/test_public_api.py`` and say what changed in CHANGELOG.md.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
SNAPSHOT = ROOT / "tests" / "public_api.txt"

#: Modules whose ``__all__`` users import.
MODULES = ["tiered_kv", "tiered_kv.testing", "tiered_kv.integrations.hf", "tiered_kv.remote"]
#: Modules that import an optional engine (vLLM, SGLang): read from their source, so the snapshot is the same
#: whether the engine is installed or not.
SOURCE_MODULES = ["tiered_kv.integrations.vllm", "tiered_kv.integrations.vllm.plugin", "tiered_kv.integrations.sglang"]
#: Classes a source module exports from another of its files and that users name in configuration: described with
#: their methods, as if defined in the module (the vLLM package imports its names lazily, on first use).
SOURCE_DEFINITIONS = {
    "tiered_kv.integrations.vllm": ["tiered_kv.integrations.vllm.spec", "tiered_kv.integrations.vllm.connector"]
}


def _signature(obj: object) -> str:
    try:
        return str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "(...)"


def _members(cls: type) -> dict[str, object]:
    """The attributes of ``cls`` that users reach on it: its own, and those it inherits from classes of ``tiered_kv``.

    A method a tiered_kv base class defines is the subclass's API as much as one defined on it, so moving a method
    into such a base leaves the snapshot as it was. What comes from classes outside tiered_kv (``object``,
    ``Exception``, ...) is not listed.
    """
    members: dict[str, object] = {}
    for klass in reversed(inspect.getmro(cls)):  # nearest definition last: it wins
        if klass is cls or klass.__module__.partition(".")[0] == "tiered_kv":
            members.update(vars(klass))
    return members


def _describe(module_name: str, name: str, obj: object) -> list[str]:
    qual = f"{module_name}.{name}"
    if inspect.isclass(obj):
        lines = [f"class {qual}{_signature(obj)}"]
        for attr, value in sorted(_members(obj).items()):
            if attr.startswith("_"):
                continue
            if isinstance(value, property):
                lines.append(f"  property {attr}")
            elif isinstance(value, (staticmethod, classmethod)):
                lines.append(f"  {type(value).__name__} {attr}{_signature(value.__func__)}")
            elif inspect.isfunction(value):
                lines.append(f"  def {attr}{_signature(value)}")
        fields = getattr(obj, "__dataclass_fields__", None)
        if fields:
            lines.extend(f"  field {f}" for f in fields)
        return lines
    if inspect.isfunction(obj) or inspect.isbuiltin(obj):
        return [f"def {qual}{_signature(obj)}"]
    return [f"{type(obj).__name__} {qual}"]


def _describe_source(module_name: str) -> list[str]:
    """``__all__`` of a module read from its source: classes with their public methods and arguments."""
    import ast

    def source(name: str) -> pathlib.Path:
        path = ROOT / pathlib.Path(*name.split("."))
        return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")

    exported: list[str] = []
    defs: dict[str, ast.AST] = {}
    for name in [module_name, *SOURCE_DEFINITIONS.get(module_name, [])]:
        for node in ast.parse(source(name).read_text()).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                defs.setdefault(node.name, node)
            elif (
                name == module_name
                and isinstance(node, ast.Assign)
                and any(getattr(t, "id", None) == "__all__" for t in node.targets)
            ):
                exported = [ast.literal_eval(e) for e in node.value.elts]  # type: ignore[attr-defined]

    def args(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
        a = fn.args
        names = [x.arg for x in [*a.posonlyargs, *a.args]]
        names += [f"*{a.vararg.arg}"] if a.vararg else (["*"] if a.kwonlyargs else [])
        names += [x.arg for x in a.kwonlyargs] + ([f"**{a.kwarg.arg}"] if a.kwarg else [])
        return "(" + ", ".join(names) + ")"

    lines: list[str] = []
    for name in sorted(exported):
        found = defs.get(name)
        if isinstance(found, ast.ClassDef):
            lines.append(f"class {module_name}.{name}")
            lines.extend(
                f"  def {item.name}{args(item)}"
                for item in found.body
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not item.name.startswith("_")
            )
        elif isinstance(found, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines.append(f"def {module_name}.{name}{args(found)}")
        else:
            lines.append(f"name {module_name}.{name}")
    return lines


def _env_variables() -> list[str]:
    names: set[str] = set()
    kernels = [p for p in (ROOT / "kernels").rglob("*") if p.suffix in (".cpp", ".cu", ".h", ".cuh")]
    for path in [*(ROOT / "tiered_kv").rglob("*.py"), *(ROOT / "backends").glob("*.py"), *kernels]:
        if "tools" in path.parts:
            continue
        names.update(re.findall(r"\"(TIERED_KV_[A-Z0-9_]+)\"", path.read_text()))
    return sorted(names)


def snapshot() -> str:
    """The public API as text, one line per name (see the module docstring)."""
    lines: list[str] = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in sorted(getattr(module, "__all__", [])):
            lines.extend(_describe(module_name, name, getattr(module, name)))
    for module_name in SOURCE_MODULES:
        lines.extend(_describe_source(module_name))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for group, entries in sorted(project.get("entry-points", {}).items()):
        lines.extend(f"entry point {group}: {k} = {v}" for k, v in sorted(entries.items()))
    lines.extend(f"script {k} = {v}" for k, v in sorted(project.get("scripts", {}).items()))
    lines.extend(f"environment {name}" for name in _env_variables())
    return "\n".join(lines) + "\n"


def test_the_public_api_matches_its_snapshot() -> None:
    now = snapshot()
    then = SNAPSHOT.read_text()
    if now != then:
        import difflib

        diff = "".join(difflib.unified_diff(then.splitlines(True), now.splitlines(True), "snapshot", "now", n=0))
        raise AssertionError(
            "the public API changed; if that is deliberate, run `python tests/test_public_api.py` and say what "
            f"changed in CHANGELOG.md:\n{diff}"
        )


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    SNAPSHOT.write_text(snapshot())
    print(f"wrote {SNAPSHOT}")
