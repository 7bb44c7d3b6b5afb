"""Old import paths that keep working for one release, with a :class:`DeprecationWarning` naming the new one."""

from __future__ import annotations

import importlib
import types
import warnings


def moved(old: str, new: str, namespace: dict[str, object]) -> None:
    """Make module ``old`` (its ``globals()`` given) an alias of module ``new``, warning once on import.

    Every name of ``new`` resolves through ``old`` (its ``__all__`` and the rest), so code written against the old
    path runs unchanged.
    """
    warnings.warn(
        f"{old} moved to {new}; import it from there (the old path goes in the next release)",
        DeprecationWarning,
        stacklevel=3,
    )
    target: types.ModuleType = importlib.import_module(new)
    namespace["__all__"] = list(getattr(target, "__all__", []))
    for name in namespace["__all__"]:  # type: ignore[attr-defined]
        namespace[name] = getattr(target, name)

    def __getattr__(name: str) -> object:
        return getattr(target, name)

    namespace["__getattr__"] = __getattr__
