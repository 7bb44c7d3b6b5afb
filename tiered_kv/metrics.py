"""Optional Prometheus export: a collector that reads ``statistics()`` at scrape time.

Nothing is counted twice and nothing runs between scrapes: the engine and the cache already keep their
counters (bytes, blocks and a latency histogram per direction; hits per tier; evictions); this module only
turns a snapshot into metric families. Needs ``prometheus-client`` (``pip install 'tiered-kv[metrics]'``)::

    from prometheus_client import start_http_server
    from tiered_kv.metrics import register_prometheus

    register_prometheus(cache)          # or an engine
    start_http_server(9400)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .engine import LATENCY_BUCKETS, EngineStatistics, TransferEngine

if TYPE_CHECKING:
    from .cache import TieredKVCache

__all__ = ["PrometheusCollector", "register_prometheus"]


def _directions(direction: str) -> tuple[str, str]:
    src, _, dst = direction.partition("->")
    return src, dst


class PrometheusCollector:
    """A ``prometheus_client`` custom collector over a :class:`TransferEngine` or :class:`TieredKVCache`.

    Metrics (prefix ``tiered_kv``): ``transfer_bytes_total``, ``transfer_blocks_total`` and
    ``transfer_seconds`` (histogram) by ``src``/``dst`` tier; ``transfers_in_flight``, ``fenced_blocks``,
    ``transfers_failed_total``; for a cache also ``cache_hit_blocks_total`` by tier,
    ``cache_evictions_total`` by ``src``/``dst``, ``cache_blocks`` by tier and state, ``cache_tokens_*``.
    """

    def __init__(self, source: TransferEngine | TieredKVCache, prefix: str = "tiered_kv") -> None:
        self.source = source
        self.prefix = prefix

    def describe(self) -> list[Any]:
        """Nothing up front: metrics are collected lazily."""
        return []  # collected lazily; prometheus_client then skips the eager describe()

    def collect(self) -> Iterator[Any]:
        """The metric families of one scrape."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        p = self.prefix
        stats = self.source.statistics()
        engine: EngineStatistics = stats if isinstance(stats, EngineStatistics) else stats.engine

        nbytes = CounterMetricFamily(f"{p}_transfer_bytes", "Bytes moved by completed transfers", labels=["src", "dst"])
        blocks = CounterMetricFamily(f"{p}_transfer_blocks", "Blocks moved by completed transfers", labels=["src", "dst"])
        latency = HistogramMetricFamily(f"{p}_transfer_seconds", "copy() to device completion, per transfer", labels=["src", "dst"])
        for direction, value in engine.bytes_by_direction.items():
            labels = list(_directions(direction))
            nbytes.add_metric(labels, value)
            blocks.add_metric(labels, engine.blocks_by_direction.get(direction, 0))
            counts = engine.latency_counts.get(direction, ())
            cumulative, buckets = 0, []
            for bound, count in zip((*map(str, LATENCY_BUCKETS), "+Inf"), counts, strict=False):
                cumulative += count
                buckets.append((bound, cumulative))
            latency.add_metric(labels, buckets, engine.seconds_by_direction.get(direction, 0.0))
        yield nbytes
        yield blocks
        yield latency
        yield GaugeMetricFamily(f"{p}_transfers_in_flight", "Transfers submitted and not completed", value=engine.in_flight)
        yield GaugeMetricFamily(f"{p}_fenced_blocks", "Blocks with a pending read or write", value=engine.fences.fenced_blocks)
        yield CounterMetricFamily(f"{p}_transfers_failed", "Transfers that failed", value=engine.failed)

        if isinstance(stats, EngineStatistics):
            return
        hits = CounterMetricFamily(f"{p}_cache_hit_blocks", "Reused full blocks, by the tier they were found in", labels=["tier"])
        for tier, value in stats.hits.items():
            hits.add_metric([tier], value)
        yield hits
        evictions = CounterMetricFamily(f"{p}_cache_evictions", "Evicted blocks, by source and destination", labels=["src", "dst"])
        for direction, value in stats.evictions.items():
            evictions.add_metric(list(_directions(direction)), value)
        yield evictions
        occupancy = GaugeMetricFamily(f"{p}_cache_blocks", "Blocks per tier and state", labels=["tier", "state"])
        for state in ("free", "cached", "in_use"):
            for tier, value in getattr(stats.blocks, state).items():
                occupancy.add_metric([tier, state], value)
        yield occupancy
        yield CounterMetricFamily(f"{p}_cache_tokens_requested", "Prompt tokens admitted", value=stats.tokens_requested)
        yield CounterMetricFamily(f"{p}_cache_tokens_reused", "Prompt tokens reused from the cache", value=stats.tokens_reused)


def register_prometheus(source: TransferEngine | TieredKVCache, registry: Any = None, prefix: str = "tiered_kv") -> PrometheusCollector:
    """Register a :class:`PrometheusCollector` (default registry unless ``registry`` is given).

    Raises:
        BackendUnavailable: prometheus-client is not installed.
    """
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        from .errors import BackendUnavailable

        raise BackendUnavailable("Prometheus export needs prometheus-client: pip install 'tiered-kv[metrics]'") from None
    collector = PrometheusCollector(source, prefix)
    (registry or REGISTRY).register(collector)
    return collector
