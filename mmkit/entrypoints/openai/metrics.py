"""`GET /metrics`: Prometheus text format through prometheus_client.

Engine state (running/waiting requests, KV blocks, token and cache counters) is read from
the engine when scraped, so it never drifts from the engine's own numbers; request latency
and time to first token are histograms the handlers observe. Names follow vLLM's with the
`mmkit:` prefix. Each app has its own registry, so several apps can live in one process.
"""

from __future__ import annotations

from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
# engine.get_metrics() key -> (metric name, help) of the cumulative counters.
_COUNTERS = {
    "prompt_tokens": ("mmkit:prompt_tokens", "Prompt tokens processed (image tokens included)."),
    "generation_tokens": ("mmkit:generation_tokens", "Tokens generated."),
    "num_requests_finished": ("mmkit:request_success", "Requests the engine finished."),
    "num_preemptions": ("mmkit:num_preemptions", "Sequences preempted for lack of KV blocks."),
    "prefix_cache_queries": ("mmkit:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("mmkit:prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "encoder_cache_hits": ("mmkit:encoder_cache_hits", "Images whose vision embeddings were cached."),
    "encoder_cache_misses": ("mmkit:encoder_cache_misses", "Images run through the vision tower."),
}


class _EngineCollector(Collector):
    def __init__(self, async_engine) -> None:
        self.async_engine = async_engine

    def collect(self) -> Iterable[Metric]:
        llm_engine = self.async_engine.engine
        stats = llm_engine.get_metrics()
        running, waiting = llm_engine.get_request_counts()
        waiting += len(getattr(self.async_engine, "_pending_adds", ()))  # accepted, not yet in the engine
        yield GaugeMetricFamily("mmkit:num_requests_running", "Requests being decoded or prefilled.", running)
        yield GaugeMetricFamily("mmkit:num_requests_waiting", "Requests waiting to be scheduled.", waiting)
        total, free = stats["kv_blocks_total"], stats["kv_blocks_free"]
        yield GaugeMetricFamily("mmkit:kv_blocks_total", "KV cache blocks.", total)
        yield GaugeMetricFamily("mmkit:kv_blocks_used", "KV cache blocks held by live requests.", total - free)
        yield GaugeMetricFamily("mmkit:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).",
                                (total - free) / total if total else 0.0)
        for key, doc in (("model_weight_bytes", "Bytes of every weight held (quantization scales included)."),
                         ("decoder_linear_weight_bytes", "Bytes of the decoder's linear layers' weights.")):
            if key in stats:
                yield GaugeMetricFamily(f"mmkit:{key}", doc, stats[key])
        for key, (name, doc) in _COUNTERS.items():
            if key in stats:
                yield CounterMetricFamily(name, doc, value=stats[key])


class ServerMetrics:
    """The app's Prometheus registry and the histograms the handlers observe."""

    def __init__(self, async_engine) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(async_engine))
        self.request_latency = Histogram(
            "mmkit:e2e_request_latency_seconds", "Time from an HTTP request's arrival to its last token.",
            registry=self.registry, buckets=_LATENCY_BUCKETS)
        self.time_to_first_token = Histogram(
            "mmkit:time_to_first_token_seconds", "Time from a request's arrival in the engine to its first token.",
            registry=self.registry, buckets=_LATENCY_BUCKETS)
        self.request_queue_time = Histogram(
            "mmkit:request_queue_time_seconds", "Time a request waited in the engine before it was scheduled.",
            registry=self.registry, buckets=_LATENCY_BUCKETS)
        # status: ok, disconnected (the client left), aborted (shutdown), error (engine), or the
        # HTTP code of a rejected request (400, 401 is not counted: it never reaches a handler).
        self.http_requests = Counter(
            "mmkit:http_requests", "Completion requests by outcome.", ["status"], registry=self.registry)

    def observe_request(self, seconds: float, status: str) -> None:
        self.request_latency.observe(seconds)
        self.http_requests.labels(status=status).inc()

    def count_rejected(self, status_code: int) -> None:
        self.http_requests.labels(status=str(status_code)).inc()
