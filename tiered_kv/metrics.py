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
    ``cache_evictions_total`` by ``src``/``dst``, ``cache_blocks`` by tier and state, ``cache_tokens_*``; for a
    cache with a remote tier ``remote_blocks_total`` by outcome, ``remote_bytes_total`` and
    ``remote_round_trips_total`` by op, ``remote_batch_seconds`` (histogram), ``remote_errors_total``,
    ``remote_available``.
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
        remote = getattr(stats, "remote", None)
        if remote is not None:
            yield from _remote_families(p, remote)


def _remote_families(p: str, remote: Any) -> Iterator[Any]:
    """The remote tier's families: blocks/bytes/round trips by op, a batch latency histogram, errors, availability."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    blocks = CounterMetricFamily(f"{p}_remote_blocks", "Remote tier blocks by outcome (get, miss, bad, put, put_dropped)", labels=["outcome"])
    for outcome, value in remote.blocks.items():
        blocks.add_metric([outcome], value)
    yield blocks
    nbytes = CounterMetricFamily(f"{p}_remote_bytes", "Object bytes moved to and from the remote store", labels=["op"])
    batches = CounterMetricFamily(f"{p}_remote_round_trips", "Store round trips (batches)", labels=["op"])
    latency = HistogramMetricFamily(f"{p}_remote_batch_seconds", "Latency of one store round trip", labels=["op"])
    for op in ("get", "put"):
        nbytes.add_metric([op], remote.bytes[op])
        batches.add_metric([op], remote.batches[op])
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, LATENCY_BUCKETS), "+Inf"), remote.latency_counts[op], strict=False):
            cumulative += count
            buckets.append((bound, cumulative))
        latency.add_metric([op], buckets, remote.seconds[op])
    yield nbytes
    yield batches
    yield latency
    yield CounterMetricFamily(f"{p}_remote_errors", "Remote store errors and timeouts", value=remote.errors)
    yield GaugeMetricFamily(f"{p}_remote_available", "1 while the remote store is connected and not backing off",
                            value=1 if remote.available else 0)


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
