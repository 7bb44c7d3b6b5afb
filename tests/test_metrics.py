"""Observability: engine and cache statistics, and their Prometheus export."""

from __future__ import annotations

import pytest
import torch

from tiered_kv import KVLayout, Tier, TieredKVCache, TransferEngine
from tiered_kv.engine import LATENCY_BUCKETS

prometheus_client = pytest.importorskip("prometheus_client", reason="the [test] extra installs prometheus-client")
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

from tiered_kv.metrics import register_prometheus  # noqa: E402

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, tokens_per_block=4, dtype=torch.float16)


async def test_engine_statistics_per_direction_and_histogram():
    async with TransferEngine(LAYOUT, gpu_blocks=4, host_blocks=4, device="cpu") as engine:
        await engine.copy(Tier.GPU, [0, 1], Tier.HOST, [0, 1])
        await engine.copy(Tier.HOST, [0], Tier.GPU, [3])
        stats = engine.statistics()
        assert stats.blocks_by_direction == {"gpu->host": 2, "host->gpu": 1}
        assert stats.seconds_by_direction["gpu->host"] > 0
        assert sum(stats.latency_counts["gpu->host"]) == 1
        assert len(stats.latency_counts["host->gpu"]) == len(LATENCY_BUCKETS) + 1


async def test_prometheus_export_of_an_engine():
    registry = CollectorRegistry()
    async with TransferEngine(LAYOUT, gpu_blocks=4, host_blocks=4, device="cpu") as engine:
        register_prometheus(engine, registry)
        await engine.copy(Tier.GPU, [0, 1, 2], Tier.HOST, [0, 1, 2])
        text = generate_latest(registry).decode()
    assert f'tiered_kv_transfer_bytes_total{{dst="host",src="gpu"}} {3 * LAYOUT.bytes_per_block}.0' in text
    assert 'tiered_kv_transfer_seconds_count{dst="host",src="gpu"} 1.0' in text
    assert 'tiered_kv_transfer_seconds_bucket{dst="host",le="+Inf",src="gpu"} 1.0' in text
    assert "tiered_kv_transfers_in_flight 0.0" in text


async def test_prometheus_export_of_a_cache():
    registry = CollectorRegistry()
    async with TieredKVCache(LAYOUT, gpu_blocks=8, host_blocks=8, device="cpu") as cache:
        register_prometheus(cache, registry)
        for _ in range(2):
            [adm] = await cache.add_sequences([list(range(13))])
            cache.commit(adm.seq_id)
            cache.free(adm.seq_id)
        text = generate_latest(registry).decode()
    assert 'tiered_kv_cache_hit_blocks_total{tier="gpu"} 3.0' in text
    assert "tiered_kv_cache_tokens_reused_total 12.0" in text
    assert 'tiered_kv_cache_blocks{state="free",tier="gpu"}' in text
