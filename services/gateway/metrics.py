"""The gateway's Prometheus metrics, served at `/metrics`.

Each gateway owns its registry (not the process-global one) so several gateways can live in one
process, as they do in tests; the process, platform and GC collectors are added to it. Latencies are measured where stream messages arrive, once per request.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from shared.metrics import INTER_TOKEN_LATENCY_BUCKETS, REQUEST_LATENCY_BUCKETS

CONTENT_TYPE = CONTENT_TYPE_LATEST


def observe_many(histogram: Histogram, value: float, count: int) -> None:
    """`histogram.observe(value)` `count` times, in O(1): a request's final that carries its whole
    answer (128 tokens x 64 requests) took 14 ms of the event loop one observation at a time. As
    SGLang's metrics collector does, through prometheus_client's bucket counters (what observe uses);
    exemplars are not supported."""
    if count <= 0:
        return
    histogram._raise_if_not_observable()
    histogram._sum.inc(value * count)
    for i, bound in enumerate(histogram._upper_bounds):
        if value <= bound:
            histogram._buckets[i].inc(count)
            break


class GatewayMetrics:
    """Request counts by endpoint and status, TTFT, inter-token and end-to-end latency, token totals."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.requests = Counter(
            "rs_gateway_requests", "requests answered, by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.ttft = Histogram(
            "rs_gateway_time_to_first_token_seconds", "time to the first output token", buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "rs_gateway_inter_token_latency_seconds", "time between output tokens", buckets=INTER_TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "rs_gateway_e2e_request_latency_seconds", "request start to final output", buckets=REQUEST_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("rs_gateway_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(
            "rs_gateway_generation_tokens", "tokens generated for finished requests", registry=r
        )
        self.cached_tokens = Counter("rs_gateway_cached_tokens", "prompt tokens served from the prefix cache", registry=r)
        self.in_flight = Gauge("rs_gateway_requests_in_flight", "requests waiting for their final output", registry=r)
        self.migrations = Counter(
            "rs_gateway_migrations", "requests moved to another worker after theirs was lost", registry=r
        )
        self.live_workers = Gauge("rs_gateway_live_workers", "workers heard from within the TTL", registry=r)

    def count(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
