"""The ``vllm.general_plugins`` entry point: registers the short spec name ``"TieredKV"``.

Primitives:

* :func:`register` -- idempotent (vLLM loads plugins in every process, sometimes more than once).
"""

from __future__ import annotations

__all__ = ["SPEC_NAME", "register"]

#: The short ``spec_name`` the entry point registers.
SPEC_NAME = "TieredKV"


def register() -> None:
    """Register ``TieredKV`` with vLLM's ``OffloadingSpecFactory`` (no-op if already registered)."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    if SPEC_NAME in getattr(OffloadingSpecFactory, "_registry", {}):
        return
    OffloadingSpecFactory.register_spec(SPEC_NAME, "tiered_kv.integrations.vllm", "TieredKVOffloadingSpec")
