"""The worker's Prometheus metrics against what the scheduler really did: the figures get_info carries
(KV pool size and use, generated tokens, retractions) become gauges and counters labelled with the
served model's name, and a final output's queue time and speculation feed their histograms and gauge.
The service end to end (a real worker over NATS) is in tests/test_pipeline.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from services.worker.frontend.engine import Engine
from services.worker.frontend.metrics import WorkerMetrics
from services.worker.scheduler.output import ReqOutput
from services.worker.scheduler.req import FinishReason
from shared.metrics import model_label
from shared.model_path import DEFAULT_MODEL_NAME, served_name
from tests.engine_helpers import GREEDY, random_prompts

MODEL = {"model_name": "tiny-llama"}


def worker_metrics() -> tuple[WorkerMetrics, CollectorRegistry]:
    registry = CollectorRegistry()
    return WorkerMetrics("tiny-llama", 4, registry), registry


def test_retractions_counter_moves_when_the_scheduler_retracts(llama_path: Path) -> None:
    """A pool of 160 slots for 16 requests of 10..20 + 40 tokens: decode runs out of KV and the
    scheduler retracts; the counter moves by the scheduler's own count, from a baseline taken before."""
    metrics, registry = worker_metrics()
    prompts = random_prompts(16, 10, 20, seed=6)
    with Engine(str(llama_path), max_total_tokens=160) as engine:
        metrics.observe_info(engine.get_server_info(), now=100.0)
        assert registry.get_sample_value("rs_worker_retractions_total", MODEL) == 0
        engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 40})
        info = engine.get_server_info()
    metrics.observe_info(info, now=104.0)
    retractions = info["stats"]["num_retractions"]
    assert retractions > 0
    assert registry.get_sample_value("rs_worker_retractions_total", MODEL) == retractions
    assert registry.get_sample_value("rs_worker_max_total_num_tokens", MODEL) == info["max_total_tokens"] == 160
    # 16 x 40 tokens in the 4 s between the two refreshes.
    assert info["stats"]["generated_tokens"] == 16 * 40
    assert registry.get_sample_value("rs_worker_gen_throughput", MODEL) == pytest.approx(16 * 40 / 4.0)
    # The scheduler's prefill and decode steps, counted from the same baseline.
    stats = info["stats"]
    assert stats["num_prefill_steps"] > 0 and stats["num_decode_steps"] >= 40 - 1
    assert registry.get_sample_value("rs_worker_prefill_steps_total", MODEL) == stats["num_prefill_steps"]
    assert registry.get_sample_value("rs_worker_decode_steps_total", MODEL) == stats["num_decode_steps"]
    # Another refresh with nothing new: no retraction or step counted twice, no tokens per second.
    metrics.observe_info(info, now=105.0)
    assert registry.get_sample_value("rs_worker_retractions_total", MODEL) == retractions
    assert registry.get_sample_value("rs_worker_prefill_steps_total", MODEL) == stats["num_prefill_steps"]
    assert registry.get_sample_value("rs_worker_gen_throughput", MODEL) == 0.0


def test_num_used_tokens_counts_a_running_request_and_drops_when_it_ends(llama_path: Path) -> None:
    metrics, registry = worker_metrics()
    prompt = random_prompts(1, 12, 12, seed=3)[0]
    with Engine(str(llama_path)) as engine:
        chunks = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 400}, stream=True,
                                 rid="long")
        first = next(iter(chunks))
        assert first["output_ids"]
        running = engine.get_server_info()
        metrics.observe_info(running, now=1.0)
        used = registry.get_sample_value("rs_worker_num_used_tokens", MODEL)
        # The prompt and at least the first token hold KV slots while the request runs.
        assert running["num_running"] == 1 and used == running["kv_in_use"] >= len(prompt) + 1
        assert registry.get_sample_value("rs_worker_running_requests", MODEL) == 1
        engine.abort("long")
        for _ in chunks:
            pass
        metrics.observe_info(engine.get_server_info(), now=2.0)
    assert registry.get_sample_value("rs_worker_num_used_tokens", MODEL) == 0
    assert registry.get_sample_value("rs_worker_running_requests", MODEL) == 0


def final(rid: str, queue_time: float | None, spec: tuple[int, int, int] | None = None) -> ReqOutput:
    out = ReqOutput(rid, [], finished_reason=FinishReason("length", 8), queue_time=queue_time)
    if spec is not None:
        out.spec_verify_steps, out.spec_proposed_tokens, out.spec_accepted_tokens = spec
        out.spec_accept_length = (spec[2] + spec[0]) / spec[0]
    return out


def test_queue_time_histogram_observes_each_scheduled_final() -> None:
    metrics, registry = worker_metrics()
    for i, seconds in enumerate((0.002, 0.3, 7.0)):
        metrics.observe_final(final(f"r{i}", seconds))
    metrics.observe_final(final("never-scheduled", None))  # aborted while waiting: no queue time
    assert registry.get_sample_value("rs_worker_queue_time_seconds_count", MODEL) == 3
    assert registry.get_sample_value("rs_worker_queue_time_seconds_sum", MODEL) == pytest.approx(7.302)
    assert registry.get_sample_value("rs_worker_queue_time_seconds_bucket", {**MODEL, "le": "0.5"}) == 2


def test_spec_accept_length_gauge_is_the_mean_over_the_last_interval() -> None:
    """Tokens per verify step over the requests finished between two refreshes (SGLang's gauge),
    beside the per-request histogram; an interval with no speculative final keeps the last value."""
    metrics, registry = worker_metrics()
    info = {"max_total_tokens": 64, "num_running": 0, "num_waiting": 0, "kv_in_use": 0,
            "stats": {"generated_tokens": 0, "num_retractions": 0, "prompt_tokens": 0, "cached_tokens": 0,
                      "num_prefill_steps": 0, "num_decode_steps": 0}}
    metrics.observe_info(info, now=0.0)
    metrics.observe_final(final("a", 0.01, spec=(4, 16, 8)))  # 12 tokens in 4 steps
    metrics.observe_final(final("b", 0.01, spec=(6, 24, 0)))  # 6 tokens in 6 steps
    metrics.observe_info(info, now=1.0)
    assert registry.get_sample_value("rs_worker_spec_accept_length_recent", MODEL) == pytest.approx(18 / 10)
    assert registry.get_sample_value("rs_worker_spec_accept_length_count", MODEL) == 2
    metrics.observe_final(final("c", 0.01, spec=(2, 8, 8)))  # 10 tokens in 2 steps
    metrics.observe_info(info, now=2.0)
    assert registry.get_sample_value("rs_worker_spec_accept_length_recent", MODEL) == pytest.approx(5.0)
    metrics.observe_info(info, now=3.0)
    assert registry.get_sample_value("rs_worker_spec_accept_length_recent", MODEL) == pytest.approx(5.0)


def test_worker_metrics_need_a_model_name() -> None:
    with pytest.raises(ValueError, match="model_name"):
        WorkerMetrics("", 4, CollectorRegistry())


def test_tokenizer_and_detokenizer_label_their_model_as_a_worker_names_it(llama_path: Path) -> None:
    """model_label (the tokenizer's and detokenizer's model_name) is the name a worker serves the same
    --model-path under by default (shared.model_path.served_name)."""
    for given in (str(llama_path), "Qwen/Qwen3-0.6B"):
        assert model_label(given) == served_name(given, llama_path if given == str(llama_path) else Path("x"))
    assert model_label(str(llama_path)) == llama_path.name
    assert model_label("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    assert model_label("") == model_label(None) == DEFAULT_MODEL_NAME
