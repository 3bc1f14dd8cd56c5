"""The worker service's output batching (services/worker/frontend/output_batcher.py), without NATS: which tokens of
which scheduler steps go out in which BatchTokenOut. The reference is one message per step with every
request streamed: a request that is not streamed, and steps published together, must end with the same
token ids, log-probs, finish and text (the text also checked against the tokenizer's own decode)."""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from transformers import AutoTokenizer

from services.detokenizer.detokenizer import Detokenizer
from services.worker.frontend.metrics import WorkerMetrics
from services.worker.frontend.output_batcher import Flight, OutputBatcher
from services.worker.scheduler.output import ReqOutput
from services.worker.scheduler.req import FinishReason
from shared.protocol import BatchTokenOut, TokenOut

TEXTS = ["naïve café — 東京 🚀 done.", "The quick brown fox jumps over the lazy dog, twice!", "a"]


@pytest.fixture(scope="module")
def tokenizer(llama_path: Path):  # noqa: ANN201
    return AutoTokenizer.from_pretrained(llama_path)


def scheduler_steps(tokenizer, seed: int) -> tuple[list[list[ReqOutput]], dict[str, list[int]]]:  # noqa: ANN001
    """Requests that start at different steps and advance by one token, or several (a speculative
    step), with log-probs and top log-probs; each one's last output is its final."""
    rng = random.Random(seed)
    ids = {f"r{i}": tokenizer.encode(text, add_special_tokens=False) for i, text in enumerate(TEXTS)}
    start = {rid: rng.randrange(3) for rid in ids}
    sent = dict.fromkeys(ids, 0)
    steps: list[list[ReqOutput]] = []
    while any(sent[rid] < len(ids[rid]) for rid in ids):
        outputs = []
        for rid, toks in ids.items():
            if start[rid] > len(steps) or sent[rid] == len(toks):
                continue
            n = min(rng.choice((1, 1, 3)), len(toks) - sent[rid])
            new = toks[sent[rid] : sent[rid] + n]
            out = ReqOutput(rid, new, logprobs=[-0.01 * t for t in new], top_logprobs=[[(t, -0.5), (t + 1, -2.0)] for t in new])
            sent[rid] += n
            if sent[rid] == len(toks):
                out.finished_reason = FinishReason("length", len(toks))
                out.prompt_tokens, out.completion_tokens, out.cached_tokens = 7, len(toks), 2
            outputs.append(out)
        steps.append(outputs)
    return steps, ids


def batcher(stream: bool, registry: CollectorRegistry | None = None) -> OutputBatcher:
    """A batcher with a flight for each of TEXTS' requests (metrics in their own registry)."""
    b = OutputBatcher("w1", WorkerMetrics("tiny", 4, registry or CollectorRegistry()))
    for i in range(len(TEXTS)):
        b.flights[f"r{i}"] = Flight("g1", stop=["zzz"], skip_special_tokens=True, stream=stream)
    return b


def items_by_rid(messages: list[BatchTokenOut]) -> dict[str, list[TokenOut]]:
    found: dict[str, list[TokenOut]] = defaultdict(list)
    for message in messages:
        rids = [item.rid for item in message.items]
        assert len(rids) == len(set(rids)), "one item per request per message"
        for item in message.items:
            found[item.rid].append(item)
    return found


def summary(items: list[TokenOut]) -> tuple[list[int], list[float], list[tuple[int, float]], tuple]:
    final = items[-1]
    assert final.finish is not None and all(item.finish is None for item in items[:-1])
    assert items[0].first and items[0].stop == ["zzz"] and not any(item.first for item in items[1:])
    return (
        [t for item in items for t in item.token_ids],
        [lp for item in items if item.logprobs for lp in item.logprobs.values],
        [(c.token_id, c.logprob) for item in items if item.logprobs for step in item.logprobs.top or [] for c in step],
        (final.finish.type, final.finish.matched, final.usage.prompt_tokens, final.usage.completion_tokens,
         final.usage.cached_tokens),
    )


def produced(steps: list[list[ReqOutput]], rid: str) -> tuple[list[int], list[float], list[tuple[int, float]], tuple]:
    """What the scheduler produced for `rid`, as `summary` puts it."""
    outs = [out for s in steps for out in s if out.rid == rid]
    final = outs[-1]
    assert final.finished_reason is not None
    return (
        [t for out in outs for t in out.token_ids],
        [lp for out in outs for lp in out.logprobs],
        [c for out in outs for step in out.top_logprobs for c in step],
        (final.finished_reason.type, final.finished_reason.matched, final.prompt_tokens, final.completion_tokens,
         final.cached_tokens),
    )


def texts(tokenizer, messages: list[BatchTokenOut]) -> dict[str, str]:  # noqa: ANN001
    detok = Detokenizer(tokenizer)
    found: dict[str, str] = defaultdict(str)
    for message in messages:
        for stream_out in detok.process(message).values():
            for item in stream_out.items:
                found[item.rid] += item.text
    return dict(found)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_request_not_streamed_sends_its_first_tokens_then_one_final_with_all_the_others(tokenizer, seed: int) -> None:  # noqa: ANN001
    steps, ids = scheduler_steps(tokenizer, seed)
    streamed, whole = batcher(stream=True), batcher(stream=False)
    per_step = [streamed.batch([s]) for s in steps]
    held = [m for m in (whole.batch([s]) for s in steps) if m.items]

    reference, got = items_by_rid(per_step), items_by_rid(held)
    for rid in ids:
        first_step = next(out for s in steps for out in s if out.rid == rid)
        if first_step.finished_reason is None:
            assert len(got[rid]) == 2 and got[rid][0].token_ids == first_step.token_ids
        else:
            assert len(got[rid]) == 1
        assert len(reference[rid]) == sum(out.rid == rid for s in steps for out in s)
        assert summary(got[rid]) == summary(reference[rid]) == produced(steps, rid)
        assert summary(got[rid])[0] == ids[rid]
    assert texts(tokenizer, held) == texts(tokenizer, per_step) == {
        rid: tokenizer.decode(toks, skip_special_tokens=True) for rid, toks in ids.items()
    }
    assert not whole.flights and not streamed.flights


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_steps_queued_together_go_out_as_one_message_with_each_requests_tokens_in_order(tokenizer, seed: int) -> None:  # noqa: ANN001
    steps, ids = scheduler_steps(tokenizer, seed)
    rng = random.Random(seed)
    rounds, i = [], 0
    while i < len(steps):
        n = rng.randrange(1, 4)
        rounds.append(steps[i : i + n])
        i += n
    registry = CollectorRegistry()
    reference_batcher, together = batcher(stream=True), batcher(stream=True, registry=registry)
    per_step = [reference_batcher.batch([s]) for s in steps]
    grouped = [together.batch(r) for r in rounds]

    assert len(grouped) == len(rounds) < len(steps)
    assert [m.step for m in grouped] == [sum(len(r) for r in rounds[: k + 1]) for k in range(len(rounds))]
    reference, got = items_by_rid(per_step), items_by_rid(grouped)
    for rid in ids:
        assert summary(got[rid]) == summary(reference[rid]) == produced(steps, rid)
    assert texts(tokenizer, grouped) == texts(tokenizer, per_step)
    model = {"model_name": "tiny"}
    assert registry.get_sample_value("rs_worker_steps_total", model) == len(steps)
    assert registry.get_sample_value("rs_worker_generated_tokens_total", model) == sum(len(t) for t in ids.values())
    assert registry.get_sample_value("rs_worker_requests_total", {**model, "status": "length"}) == len(ids)


def test_outputs_of_requests_without_a_flight_are_dropped(tokenizer) -> None:  # noqa: ANN001
    b = batcher(stream=True)
    message = b.batch([[ReqOutput("gone", [5]), ReqOutput("r0", [6])]])
    assert [item.rid for item in message.items] == ["r0"]
