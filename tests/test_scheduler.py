"""The scheduler under a randomized workload: the KV pool accounting is exact after every step
(free + evictable + protected + held by running requests == total) and every request ends."""

from __future__ import annotations

import dataclasses
import math
import pickle
import random
from pathlib import Path

import pytest
import torch

from services.worker.config import EngineConfig
from services.worker.scheduler.output import PackedOutputs, ReqOutput
from services.worker.scheduler.req import FinishReason, Req
from services.worker.scheduler.schedule_policy import attention_cost, tokens_within_cost
from shared.sampling_params import SamplingParams
from tests.engine_helpers import random_prompts, scheduler_here


def make_scheduler(path: Path, **kwargs: object):  # noqa: ANN201 - a Scheduler
    config = EngineConfig.from_kwargs(str(path), **kwargs)
    return scheduler_here(config)


@pytest.mark.parametrize(
    "options",
    [
        {"schedule_policy": "fcfs"},
        {"schedule_policy": "lpm", "radix_eviction_policy": "lfu"},
        {"schedule_policy": "dfs-weight", "radix_eviction_policy": "fifo"},
        {"schedule_policy": "lof", "radix_eviction_policy": "mru"},
        {"schedule_policy": "random", "radix_eviction_policy": "priority", "enable_mixed_chunk": True},
        {"schedule_policy": "fcfs", "disable_radix_cache": True, "radix_eviction_policy": "filo"},
        {"schedule_policy": "lpm", "disable_overlap_schedule": False},
        {"schedule_policy": "fcfs", "disable_overlap_schedule": False, "enable_mixed_chunk": True},
    ],
    ids=lambda o: "-".join(str(v) for v in o.values()),
)
def test_pool_invariant_after_every_step_of_a_random_workload(qwen3_path: Path, options: dict) -> None:
    scheduler = make_scheduler(
        qwen3_path, max_total_tokens=240, chunked_prefill_size=24, max_running_requests=6, **options
    )
    rng = random.Random(hash(tuple(options.items())) & 0xFFFF)
    prefixes = random_prompts(3, 8, 40, seed=11)
    submitted: dict[str, Req] = {}
    finished: set[str] = set()
    steps = 0
    while len(submitted) < 40 or scheduler.has_work():
        if len(submitted) < 40 and rng.random() < 0.35:
            prompt = rng.choice(prefixes) + random_prompts(1, 1, 30, seed=rng.randrange(10**6))[0]
            params = SamplingParams(
                max_new_tokens=rng.randint(1, 24),
                temperature=rng.choice([0.0, 1.0]),
                ignore_eos=rng.random() < 0.5,
            )
            params.normalize()
            rid = f"r{len(submitted)}"
            req = Req(rid, prompt, params, seed=rng.randrange(1 << 30), priority=rng.randint(0, 3),
                      eos_token_ids=frozenset({2}))
            submitted[rid] = req
            scheduler.add_request(req)
        if rng.random() < 0.04:
            live = [rid for rid in submitted if rid not in finished]
            if live:
                scheduler.abort_request(rng.choice(live))
        for out in scheduler.step():
            if out.finished_reason is not None:
                assert out.rid not in finished, "a request finished twice"
                finished.add(out.rid)
        scheduler.check_pool_invariant()
        steps += 1
        assert steps < 5000, "the workload did not drain"
    assert finished == set(submitted)
    for req in submitted.values():
        if req.finished_reason.type != "abort":
            assert 1 <= len(req.output_ids) <= req.sampling_params.max_new_tokens
    # Nothing is held once every request is done: the pool is free or evictable cache.
    assert scheduler.tree_cache.protected_size() == 0
    assert scheduler.runner.allocator.available_size() + scheduler.tree_cache.evictable_size() == 240


def test_chunked_request_keeps_its_prefix_locked_between_chunks(qwen3_path: Path) -> None:
    scheduler = make_scheduler(qwen3_path, max_total_tokens=200, chunked_prefill_size=8)
    params = SamplingParams(max_new_tokens=2, temperature=0.0)
    params.normalize()
    req = Req("long", list(range(3, 40)), params, seed=0)
    scheduler.add_request(req)
    scheduler.step()  # first chunk of 8
    assert scheduler.chunked_req is req and req.kv_committed_len == 8
    assert scheduler.tree_cache.protected_size() == 8
    # Eviction cannot take a chunk in progress.
    assert scheduler.tree_cache.evict(100) == 0
    while scheduler.has_work():
        scheduler.step()
        scheduler.check_pool_invariant()
    assert req.finished_reason is not None and len(req.output_ids) == 2


def test_flush_cache_is_refused_while_requests_run(qwen3_path: Path) -> None:
    scheduler = make_scheduler(qwen3_path, max_total_tokens=100)
    params = SamplingParams(max_new_tokens=5, temperature=0.0)
    params.normalize()
    scheduler.add_request(Req("a", [3, 4, 5], params, seed=0))
    scheduler.step()
    assert scheduler.flush_cache() is False
    while scheduler.has_work():
        scheduler.step()
    assert scheduler.flush_cache() is True
    assert scheduler.runner.allocator.available_size() == 100


def test_overlap_returns_a_steps_tokens_one_step_later(qwen3_path: Path) -> None:
    scheduler = make_scheduler(qwen3_path, disable_overlap_schedule=False)
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    params.normalize()
    req = Req("a", [3, 4, 5, 6], params, seed=0)
    scheduler.add_request(req)
    # A prefill step in flight is read back before the next step is scheduled.
    assert scheduler.step() == [] and req.num_inflight == 1
    first = scheduler.step()  # launches decode 1, then reads the prefill's token
    assert [o.token_ids for o in first] == [[req.output_ids[0]]] and req.num_inflight == 1
    tokens = []
    while scheduler.has_work():
        tokens += [t for o in scheduler.step() for t in o.token_ids]
        scheduler.check_pool_invariant()
    assert req.output_ids == first[0].token_ids + tokens and len(req.output_ids) == 4


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_steady_decode_step_sends_one_host_to_device_copy_when_greedy(
    qwen3_path: Path, temperature: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each host-to-device copy is a pinned staging buffer and a copy launch, costly on some GPU hosts
    (bench/RESULTS.md, P2). With overlap on, a steady greedy decode step sends only its packed batch
    inputs; a sampled one adds the positions that key its noise. The tokens are those of the step
    without overlap, which computes every input afresh."""
    import services.worker.runtime.model_runner as model_runner
    import services.worker.scheduler.schedule_batch as schedule_batch

    copies: list[int] = []

    def counted(t, device):  # noqa: ANN001, ANN202 - the wrapped function's own signature
        copies.append(t.numel())
        return t.to(device)

    outputs = {}
    for overlap in (True, False):
        scheduler = make_scheduler(qwen3_path, disable_overlap_schedule=not overlap)
        params = SamplingParams(max_new_tokens=12, temperature=temperature, ignore_eos=True)
        params.normalize()
        reqs = [Req(f"r{i}", [3 + i, 4, 5, 6], params, seed=i) for i in range(3)]
        for req in reqs:
            scheduler.add_request(req)
        for _ in range(3):
            scheduler.step()
        monkeypatch.setattr(model_runner, "to_device_async", counted)
        monkeypatch.setattr(schedule_batch, "to_device_async", counted)
        copies.clear()
        for _ in range(4):
            scheduler.step()
        if overlap:
            assert len(copies) == 4 * (1 if temperature == 0.0 else 2)
        monkeypatch.undo()
        while scheduler.has_work():
            scheduler.step()
        outputs[overlap] = [r.output_ids for r in reqs]
    assert outputs[True] == outputs[False]


def test_a_decode_batch_packs_its_graph_inputs_as_one_block(qwen3_path: Path) -> None:
    """ForwardBatch.packed_rows (what a decode graph replay copies in one launch) holds exactly the
    batch's input ids, positions, request rows, lengths and KV slots, in the graph's row order."""
    scheduler = make_scheduler(qwen3_path)
    seen = []
    forward = scheduler.runner.forward
    scheduler.runner.forward = lambda batch: seen.append(batch) or forward(batch)  # type: ignore[method-assign]
    params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
    params.normalize()
    for i, n in enumerate((4, 9, 6)):
        scheduler.add_request(Req(f"r{i}", list(range(3, 3 + n)), params, seed=i))
    while scheduler.has_work():
        scheduler.step()
    decodes = [b for b in seen if b.forward_mode.is_decode()]
    assert decodes and seen[0].packed_rows is None  # the prefill has 19 tokens for 3 requests
    for batch in decodes:
        expected = torch.stack(
            [batch.input_ids, batch.positions, batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc]
        )
        assert batch.packed_rows is not None and torch.equal(batch.packed_rows, expected)


def test_only_an_all_greedy_batch_may_sample_without_positions() -> None:
    from services.worker.runtime.sampling.sampler import Sampler, SamplingBatchInfo

    logits = torch.randn(2, 16)
    greedy = SamplingBatchInfo.from_params([SamplingParams(temperature=0.0)] * 2, [0, 1], vocab_size=16, device="cpu")
    assert torch.equal(Sampler()(logits, greedy, None).next_token_ids, logits.argmax(-1))
    mixed = SamplingBatchInfo.from_params(
        [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)], [0, 1], vocab_size=16, device="cpu"
    )
    with pytest.raises(ValueError, match="positions are required"):
        Sampler()(logits, mixed, None)


# A non-default value for every ReqOutput field but rid and token_ids.
_EXTRA_VALUES = {
    "logprobs": [-0.25],
    "top_logprobs": [[(7, -0.25), (9, -1.5)]],
    "input_token_ids": [3, 4],
    "input_logprobs": [None, -0.5],
    "input_top_logprobs": [None, [(4, -0.5)]],
    "finished_reason": FinishReason("stop", 2),
    "prompt_tokens": 5,
    "completion_tokens": 3,
    "cached_tokens": 4,
    "spec_accept_length": 2.5,
    "spec_accept_rate": 0.75,
    "spec_verify_steps": 2,
    "spec_proposed_tokens": 8,
    "spec_accepted_tokens": 6,
    "queue_time": 0.125,
}


def test_packed_outputs_cross_a_process_boundary_unchanged() -> None:
    """A scheduler process sends each step's outputs as columns; what the parent unpacks must equal
    what the scheduler produced, field for field, whatever the outputs carry. A field added to
    ReqOutput without a value here, or without a check in only_tokens, fails this test."""
    names = {f.name for f in dataclasses.fields(ReqOutput)} - {"rid", "token_ids"}
    assert set(_EXTRA_VALUES) == names
    outputs = [ReqOutput(f"plain-{i}", [i, i + 1]) for i in range(3)]
    for name, value in _EXTRA_VALUES.items():
        out = ReqOutput(f"with-{name}", [11])
        setattr(out, name, value)
        assert not out.only_tokens(), name
        outputs.append(out)
    outputs.append(ReqOutput("empty", []))
    assert all(o.only_tokens() for o in outputs[:3])
    packed = pickle.loads(pickle.dumps(PackedOutputs.pack(outputs)))
    assert packed.unpack() == outputs
    assert sorted(packed.full) == list(range(3, 3 + len(_EXTRA_VALUES)))


@pytest.mark.parametrize("keys_per_token", [3.0, 50.0, 1280.0])
def test_chunk_cost_is_the_sum_over_its_tokens_and_the_longest_chunk_within_a_budget_is_found(
    keys_per_token: float,
) -> None:
    for prefix in (0, 1, 17, 500, 30_000):
        for n in (1, 2, 7, 64, 300):
            # Token i of the chunk attends to the prefix and to chunk tokens 0..i.
            naive = sum(1 + (prefix + i + 1) / keys_per_token for i in range(n))
            assert attention_cost(prefix, n, keys_per_token) == math.ceil(naive - 1e-9)
        for budget in (0, 1, 5, 64, 2048):
            fits = tokens_within_cost(prefix, budget, keys_per_token)
            brute = max((n for n in range(0, 2049) if attention_cost(prefix, n, keys_per_token) <= budget), default=0)
            assert fits == brute


@pytest.mark.parametrize("floor", [1, 24])
def test_a_mixed_step_shrinks_the_chunk_as_its_prefix_grows(qwen3_path: Path, floor: int) -> None:
    """With decodes riding along, each chunk of a long prompt is sized by its cost with the prefix it
    attends to: chunks get shorter, each stays within the budget (or at the backend's floor, below
    which a GPU kernel gets no faster), and the prompt's first token is the one an unchunked prefill
    gives."""
    budget, decodes = 40, 2
    scheduler = make_scheduler(
        qwen3_path, max_total_tokens=2048, chunked_prefill_size=budget, enable_mixed_chunk=True,
        disable_overlap_schedule=True,
    )  # fmt: skip
    assert scheduler._min_mixed_chunk == 1  # the torch backend has no floor
    scheduler._min_mixed_chunk = floor
    k = scheduler._keys_per_token
    assert 2 < k < 200  # the tiny model's attention is dear next to its linear layers
    params = SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True)
    params.normalize()
    for i in range(decodes):
        scheduler.add_request(Req(f"d{i}", random_prompts(1, 4, 4, seed=i)[0], params, seed=i))
    for _ in range(3):
        scheduler.step()
    prompt = random_prompts(1, 200, 200, seed=7)[0]
    one = SamplingParams(max_new_tokens=1, temperature=0.0)
    one.normalize()
    long_req = Req("long", prompt, one, seed=0)
    scheduler.add_request(long_req)
    chunks, first = [], None
    while first is None:
        before = long_req.kv_committed_len
        outputs = scheduler.step()
        if long_req.kv_committed_len > before:
            chunks.append((before, long_req.kv_committed_len - before))
        first = next((o.token_ids[0] for o in outputs if o.rid == "long"), None)
    assert sum(n for _, n in chunks) == len(prompt)
    sizes = [n for _, n in chunks]
    assert sizes[0] > sizes[-2] >= 1 and len(sizes) > len(prompt) // (budget - decodes)
    for prefix, n in chunks[:-1]:
        assert n == max(floor, tokens_within_cost(prefix, budget - decodes, k))
    if floor == 1:
        assert all(attention_cost(p, n, k) <= budget - decodes < attention_cost(p, n + 1, k) for p, n in chunks[:-1])
    alone = make_scheduler(qwen3_path, max_total_tokens=2048, chunked_prefill_size=None)
    alone.add_request(Req("long", prompt, one, seed=0))
    expect = None
    while expect is None:
        expect = next((o.token_ids[0] for o in alone.step() if o.rid == "long"), None)
    assert first == expect
