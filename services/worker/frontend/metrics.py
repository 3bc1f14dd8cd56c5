"""The worker's Prometheus metrics.

rs_worker_running_requests, rs_worker_waiting_requests, rs_worker_kv_usage,
rs_worker_cache_hit_rate (gauges); rs_worker_generated_tokens_total, rs_worker_prompt_tokens_total,
rs_worker_steps_total, rs_worker_requests_total{status=stop|length|abort|error}. With speculative decoding,
over finished requests: rs_worker_spec_verify_steps_total, rs_worker_spec_proposed_tokens_total,
rs_worker_spec_accepted_tokens_total, and rs_worker_spec_accept_length (histogram of each request's mean
accepted length, 1 .. k+1).
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from services.worker.scheduler.output import ReqOutput


def accept_length_buckets(num_draft_tokens: int) -> list[float]:
    """Histogram buckets for a request's mean accepted length, which lies in 1 .. k+1: at most 16,
    evenly spaced (half-token steps up to k = 8)."""
    n = min(2 * num_draft_tokens, 16)
    return [1.0 + num_draft_tokens * i / n for i in range(n + 1)]


class WorkerMetrics:
    """The worker's Prometheus metrics (`num_draft_tokens`: k, for the accepted-length buckets), in
    prometheus_client's global registry unless `registry` is given."""

    def __init__(self, num_draft_tokens: int, registry: CollectorRegistry = REGISTRY) -> None:
        r = registry
        self.running = Gauge("rs_worker_running_requests", "requests decoding or prefilling", registry=r)
        self.waiting = Gauge("rs_worker_waiting_requests", "requests waiting for admission", registry=r)
        self.kv_usage = Gauge("rs_worker_kv_usage", "fraction of KV slots held by running requests", registry=r)
        self.cache_hit_rate = Gauge(
            "rs_worker_cache_hit_rate", "prompt tokens served from the prefix cache / prompt tokens", registry=r
        )
        self.generated = Counter("rs_worker_generated_tokens", "tokens generated", registry=r)
        self.prompt_tokens = Counter("rs_worker_prompt_tokens", "prompt tokens of accepted requests", registry=r)
        self.steps = Counter("rs_worker_steps", "scheduler steps that produced output", registry=r)
        self.requests = Counter("rs_worker_requests", "requests ended, by finish type", ["status"], registry=r)
        # Speculative decoding, counted when a request finishes.
        self.spec_verify_steps = Counter("rs_worker_spec_verify_steps", "speculative decode steps", registry=r)
        self.spec_proposed = Counter("rs_worker_spec_proposed_tokens", "draft tokens proposed", registry=r)
        self.spec_accepted = Counter("rs_worker_spec_accepted_tokens", "draft tokens the target accepted", registry=r)
        self.spec_accept_length = Histogram(
            "rs_worker_spec_accept_length", "a finished request's mean tokens per speculative decode step",
            buckets=accept_length_buckets(num_draft_tokens), registry=r,
        )

    def observe_final(self, out: ReqOutput) -> None:
        """Count a final output's speculation (nothing for a request without a speculative step)."""
        if out.spec_accept_length is None:
            return
        self.spec_verify_steps.inc(out.spec_verify_steps)
        self.spec_proposed.inc(out.spec_proposed_tokens)
        self.spec_accepted.inc(out.spec_accepted_tokens)
        self.spec_accept_length.observe(out.spec_accept_length)
