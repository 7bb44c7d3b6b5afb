"""The ``vllm.general_plugins`` entry point: registers tiered_kv's short names with vLLM.

Primitives:

* :func:`register` -- idempotent (vLLM loads plugins in every process, sometimes more than once):
  ``spec_name`` ``"TieredKV"`` (:class:`~tiered_kv.integrations.vllm.TieredKVOffloadingSpec`) and, where vLLM
  has secondary tiers, the tier ``type`` ``"TieredKVFile"`` (:class:`~tiered_kv.integrations.vllm.TieredKVFileTier`),
  and the ``kv_connector`` ``"TieredKVConnector"`` (:class:`~tiered_kv.integrations.vllm.TieredKVConnector`).
"""

from __future__ import annotations

__all__ = ["CONNECTOR_NAME", "SPEC_NAME", "TIER_TYPE", "register"]

#: The short ``spec_name`` the entry point registers.
SPEC_NAME = "TieredKV"
#: The short secondary-tier ``type`` the entry point registers.
TIER_TYPE = "TieredKVFile"
#: The ``kv_connector`` name the entry point registers.
CONNECTOR_NAME = "TieredKVConnector"
_MODULE = "tiered_kv.integrations.vllm"


def register() -> None:
    """Register the short names with vLLM's factories (no-op for names already registered)."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    if SPEC_NAME not in getattr(OffloadingSpecFactory, "_registry", {}):
        OffloadingSpecFactory.register_spec(SPEC_NAME, _MODULE, "TieredKVOffloadingSpec")
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in getattr(KVConnectorFactory, "_registry", {}):
        KVConnectorFactory.register_connector(CONNECTOR_NAME, _MODULE, "TieredKVConnector")
    try:
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    except ImportError:  # a vLLM without secondary tiers
        return
    if TIER_TYPE not in getattr(SecondaryTierFactory, "_registry", {}):
        SecondaryTierFactory.register_tier(TIER_TYPE, _MODULE, "TieredKVFileTier")
