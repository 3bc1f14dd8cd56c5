"""The worker's Prometheus metrics; every one carries `model_name`, the model this worker serves
(its --served-model-name), as vLLM's do.

Gauges, from the scheduler's get_info (refreshed every load_interval, beside the heartbeat):
rs_worker_running_requests, rs_worker_waiting_requests, rs_worker_kv_usage, rs_worker_cache_hit_rate,
rs_worker_max_total_num_tokens (KV slots), rs_worker_num_used_tokens (slots held by requests),
rs_worker_gen_throughput (tokens/s between the last two refreshes), and the counters
rs_worker_retractions_total, rs_worker_prefill_steps_total and rs_worker_decode_steps_total (the
scheduler's counts, taken as differences between refreshes: how a load's steps split between prefill
(extend) batches and decode batches, e.g. a burst admitted over more prefills than it needs).
Per step and per final output (the step publisher): rs_worker_generated_tokens_total,
rs_worker_prompt_tokens_total, rs_worker_steps_total, rs_worker_requests_total{status=stop|length|abort|error},
rs_worker_queue_time_seconds (arrival at the worker to first scheduled, observed on the final).
With speculative decoding, over finished requests: rs_worker_spec_verify_steps_total,
rs_worker_spec_proposed_tokens_total, rs_worker_spec_accepted_tokens_total, rs_worker_spec_accept_length
(histogram of each request's mean accepted length, 1 .. k+1) and rs_worker_spec_accept_length_recent
(gauge: the mean over the requests that finished between the last two refreshes, SGLang's
sglang:spec_accept_length).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from services.worker.scheduler.output import ReqOutput
from shared.metrics import REQUEST_LATENCY_BUCKETS

MODEL_LABEL = "model_name"


def accept_length_buckets(num_draft_tokens: int) -> list[float]:
    """Histogram buckets for a request's mean accepted length, which lies in 1 .. k+1: at most 16,
    evenly spaced (half-token steps up to k = 8)."""
    n = min(2 * num_draft_tokens, 16)
    return [1.0 + num_draft_tokens * i / n for i in range(n + 1)]


class WorkerMetrics:
    """The worker's Prometheus metrics for `model_name` (`num_draft_tokens`: k, for the accepted-length
    buckets), in prometheus_client's global registry unless `registry` is given."""

    def __init__(self, model_name: str, num_draft_tokens: int, registry: CollectorRegistry = REGISTRY) -> None:
        if not model_name:
            raise ValueError("WorkerMetrics needs the served model name (the model_name label)")
        self.model_name = model_name
        r, labels = registry, [MODEL_LABEL]

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        self.running = gauge("rs_worker_running_requests", "requests decoding or prefilling")
        self.waiting = gauge("rs_worker_waiting_requests", "requests waiting for admission")
        self.kv_usage = gauge("rs_worker_kv_usage", "fraction of KV slots held by running requests")
        self.cache_hit_rate = gauge(
            "rs_worker_cache_hit_rate", "prompt tokens served from the prefix cache / prompt tokens"
        )
        self.max_total_num_tokens = gauge("rs_worker_max_total_num_tokens", "KV slots in the pool (tokens)")
        self.num_used_tokens = gauge("rs_worker_num_used_tokens", "KV slots held by requests and locked prefixes")
        self.gen_throughput = gauge(
            "rs_worker_gen_throughput", "tokens generated per second between the last two get_info refreshes"
        )
        self.retractions = counter("rs_worker_retractions", "running requests sent back to the queue (KV full)")
        self.prefill_steps = counter("rs_worker_prefill_steps", "scheduler steps that ran a prefill (extend) batch")
        self.decode_steps = counter("rs_worker_decode_steps", "scheduler steps that ran a decode batch")
        self.generated = counter("rs_worker_generated_tokens", "tokens generated")
        self.prompt_tokens = counter("rs_worker_prompt_tokens", "prompt tokens of accepted requests")
        self.steps = counter("rs_worker_steps", "scheduler steps that produced output")
        self._requests = Counter("rs_worker_requests", "requests ended, by finish type", [MODEL_LABEL, "status"],
                                 registry=r)
        self.queue_time = Histogram(
            "rs_worker_queue_time_seconds", "a request's arrival at the worker to its first scheduled step",
            labels, buckets=REQUEST_LATENCY_BUCKETS, registry=r,
        ).labels(model_name)
        # Speculative decoding, counted when a request finishes.
        self.spec_verify_steps = counter("rs_worker_spec_verify_steps", "speculative decode steps")
        self.spec_proposed = counter("rs_worker_spec_proposed_tokens", "draft tokens proposed")
        self.spec_accepted = counter("rs_worker_spec_accepted_tokens", "draft tokens the target accepted")
        self.spec_accept_length = Histogram(
            "rs_worker_spec_accept_length", "a finished request's mean tokens per speculative decode step",
            labels, buckets=accept_length_buckets(num_draft_tokens), registry=r,
        ).labels(model_name)
        self.spec_accept_length_recent = gauge(
            "rs_worker_spec_accept_length_recent",
            "mean tokens per speculative decode step of the requests finished between the last two refreshes",
        )
        # What observe_info compares with: (when, generated tokens, retractions, prefill steps, decode
        # steps) at the last refresh, and the speculation of requests finished since.
        self._last: tuple[float, int, int, int, int] | None = None
        self._spec_steps = 0
        self._spec_accepted = 0

    def count_request(self, status: str) -> None:
        """A request ended with finish type `status` (stop, length, abort, error)."""
        self._requests.labels(self.model_name, status).inc()

    def observe_final(self, out: ReqOutput) -> None:
        """Count a final output's queue time and speculation (each when the request has one)."""
        if out.queue_time is not None:
            self.queue_time.observe(out.queue_time)
        if out.spec_accept_length is None:
            return
        self.spec_verify_steps.inc(out.spec_verify_steps)
        self.spec_proposed.inc(out.spec_proposed_tokens)
        self.spec_accepted.inc(out.spec_accepted_tokens)
        self.spec_accept_length.observe(out.spec_accept_length)
        self._spec_steps += out.spec_verify_steps
        self._spec_accepted += out.spec_accepted_tokens

    def observe_info(self, info: dict[str, Any], now: float) -> None:
        """Set the gauges from the scheduler's get_info answer, taken at monotonic time `now`: rates and
        the retraction count are differences from the previous call (the first call sets the baseline,
        counting retractions since the scheduler started)."""
        stats = info["stats"]
        total = info["max_total_tokens"]
        self.running.set(info["num_running"])
        self.waiting.set(info["num_waiting"])
        self.kv_usage.set(info["kv_in_use"] / max(1, total))
        self.cache_hit_rate.set(stats["cached_tokens"] / max(1, stats["prompt_tokens"]))
        self.max_total_num_tokens.set(total)
        self.num_used_tokens.set(info["kv_in_use"])
        generated, retractions = stats["generated_tokens"], stats["num_retractions"]
        prefills, decodes = stats["num_prefill_steps"], stats["num_decode_steps"]
        if self._last is None:
            self.retractions.inc(retractions)
            self.prefill_steps.inc(prefills)
            self.decode_steps.inc(decodes)
        else:
            then, generated_then, retractions_then, prefills_then, decodes_then = self._last
            if now > then:
                self.gen_throughput.set(max(0, generated - generated_then) / (now - then))
            self.retractions.inc(max(0, retractions - retractions_then))
            self.prefill_steps.inc(max(0, prefills - prefills_then))
            self.decode_steps.inc(max(0, decodes - decodes_then))
        self._last = (now, generated, retractions, prefills, decodes)
        if self._spec_steps:
            self.spec_accept_length_recent.set((self._spec_accepted + self._spec_steps) / self._spec_steps)
            self._spec_steps = self._spec_accepted = 0
