"""The gateway's Prometheus metrics, served at `/metrics`.

Each gateway owns its registry (not the process-global one) so several gateways can live in one
process, as they do in tests; the process, platform and GC collectors are added to it. Latencies are measured where stream messages arrive, once per request.

Every rs_gateway_ metric carries `model_name`, as vLLM's do. For a request's metrics (latencies, tokens,
migrations, in flight) it is the served name of the model its worker serves (the model it named, or
the one it was routed to without naming one). rs_gateway_requests_total counts every HTTP, gRPC and
NATS request, also those about no model (/health, /v1/models, a refused key): their model_name is the
model the request named (a 404 for an unknown model counts under that name) or "" when it named and
reached none. rs_gateway_live_workers is per model served. A front door calls `begin_request()` when a
request comes in; the dispatcher notes its model (`note_model`) and `count` reads it back.
"""

from __future__ import annotations

import collections
from contextvars import ContextVar

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
MODEL_LABEL = "model_name"

# The model of the request being served in this context: a dict shared by the front door's task and
# the handler's (a child task copies the context, and with it this same dict).
_request_model: ContextVar[dict[str, str] | None] = ContextVar("rs_request_model", default=None)


def begin_request() -> None:
    """A front door took a request: until `note_model`, it is about no model."""
    _request_model.set({})


def note_model(name: str | None) -> None:
    """The current request names (or was routed to) the model `name`."""
    box = _request_model.get()
    if box is not None and name:
        box[MODEL_LABEL] = name


def request_model() -> str:
    """The current request's model for rs_gateway_requests_total ("" when it reached none)."""
    box = _request_model.get()
    return box.get(MODEL_LABEL, "") if box is not None else ""


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
    """Request counts by endpoint and status, TTFT, inter-token and end-to-end latency, token totals,
    requests in flight, migrations and live workers; each by model_name."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r, model = self.registry, [MODEL_LABEL]
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.requests = Counter(
            "rs_gateway_requests", "requests answered, by model, endpoint and status",
            [MODEL_LABEL, "endpoint", "status"], registry=r,
        )
        self.ttft = Histogram(
            "rs_gateway_time_to_first_token_seconds", "time to the first output token", model,
            buckets=REQUEST_LATENCY_BUCKETS, registry=r,
        )
        self.inter_token = Histogram(
            "rs_gateway_inter_token_latency_seconds", "time between output tokens", model,
            buckets=INTER_TOKEN_LATENCY_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "rs_gateway_e2e_request_latency_seconds", "request start to final output", model,
            buckets=REQUEST_LATENCY_BUCKETS, registry=r,
        )
        self.prompt_tokens = Counter("rs_gateway_prompt_tokens", "prompt tokens of finished requests", model,
                                     registry=r)
        self.generation_tokens = Counter(
            "rs_gateway_generation_tokens", "tokens generated for finished requests", model, registry=r
        )
        self.cached_tokens = Counter("rs_gateway_cached_tokens", "prompt tokens served from the prefix cache", model,
                                     registry=r)
        self.in_flight = Gauge("rs_gateway_requests_in_flight", "requests waiting for their final output", model,
                               registry=r)
        self.migrations = Counter(
            "rs_gateway_migrations", "requests moved to another worker after theirs was lost", model, registry=r
        )
        self.live_workers = Gauge("rs_gateway_live_workers", "workers heard from within the TTL, by model served",
                                  model, registry=r)
        self._live_models: set[str] = set()

    def count(self, endpoint: str, status: int) -> None:
        """One request answered on `endpoint` with `status`, under the model it named or reached."""
        self.requests.labels(request_model(), endpoint, str(status)).inc()

    def set_live_workers(self, models: list[str]) -> None:
        """The live workers, one model name each: a model none serves any more reads 0. A model seen
        for the first time gets its in-flight gauge and migration counter at 0, so a query or rate()
        over them finds a series before anything happened."""
        counts = dict.fromkeys(self._live_models, 0) | collections.Counter(models)
        for name, n in counts.items():
            self.live_workers.labels(name).set(n)
            if name not in self._live_models:
                self.in_flight.labels(name)
                self.migrations.labels(name)
        self._live_models |= set(counts)

    def render(self) -> bytes:
        return generate_latest(self.registry)
