"""The prefix cache for Qwen3.5 (hybrid) models: a hit restores the linear layers' conv and recurrent
state from the snapshot at the hit point, so greedy outputs with the cache equal those with it off
(--disable-radix-cache) and transformers'; the cache is actually hit; and the pools (KV slots, state
rows, snapshot slots) balance after every step and leak nothing, under every eviction policy, chunked
prefill, the overlap schedule, retraction and aborts. Tiny seeded checkpoints, float32, on the CPU."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from services.worker.config import EngineConfig
from services.worker.mem.eviction_policy import EVICTION_POLICIES
from services.worker.mem.hybrid_radix_cache import HybridRadixCache
from services.worker.mem.memory_pool import TokenToKVPool
from services.worker.mem.state_snapshots import SNAPSHOT_SHARE
from services.worker.runtime.model_runner import ModelRunner
from services.worker.scheduler.req import Req
from services.worker.scheduler.scheduler import Scheduler
from shared.sampling_params import SamplingParams
from tests.engine_helpers import hf_greedy, random_prompts, scheduler_here

NEW_TOKENS = 8
SHARED = random_prompts(1, 24, 24, seed=31)[0]  # a system-prompt-like head
TAILS = random_prompts(5, 2, 9, seed=32, prefix=SHARED)


def make_scheduler(path: Path, **kwargs: object) -> Scheduler:
    config = EngineConfig.from_kwargs(str(path), dtype="float32", **kwargs)
    return scheduler_here(config)


def greedy(max_new_tokens: int = NEW_TOKENS) -> SamplingParams:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    params.normalize()
    return params


def drain(scheduler: Scheduler, on_step: Callable[[int], None] | None = None) -> None:
    """Step until idle, checking every pool's accounting after each step."""
    steps = 0
    while scheduler.has_work():
        scheduler.step()
        scheduler.check_pool_invariant()
        if on_step is not None:
            on_step(steps)
        steps += 1
        assert steps < 3000, "the workload did not drain"


def serve(
    scheduler: Scheduler,
    prompts: list[list[int]],
    max_new: list[int] | None = None,
    first_rid: int = 0,
    on_step: Callable[[int], None] | None = None,
) -> list[Req]:
    """Submit the prompts together (greedy) and step until every one has finished."""
    max_new = max_new or [NEW_TOKENS] * len(prompts)
    reqs = [Req(f"r{first_rid + i}", p, greedy(n), seed=0) for i, (p, n) in enumerate(zip(prompts, max_new))]
    for req in reqs:
        scheduler.add_request(req)
    drain(scheduler, on_step)
    return reqs


def run_waves(scheduler: Scheduler, waves: list[list[list[int]]]) -> list[Req]:
    """Each wave's requests are submitted together once the previous wave has finished."""
    done: list[Req] = []
    for wave in waves:
        done += serve(scheduler, wave, first_rid=len(done))
    return done


def assert_nothing_leaked(scheduler: Scheduler) -> None:
    """Idle: no request holds anything, and evicting the whole cache gives back every KV slot and
    every snapshot slot (a state row is held only by a request)."""
    cache, runner = scheduler.tree_cache, scheduler.runner
    assert isinstance(cache, HybridRadixCache)
    assert cache.protected_size() == cache.protected_snapshot_count() == 0
    assert runner.state_pool is not None and runner.state_pool.available_size() == runner.state_pool.size
    assert runner.req_to_token_pool.available_size() == runner.req_to_token_pool.size
    cache.evict(cache.evictable_size())
    cache.evict_snapshots(cache.snapshot_count())
    assert cache.total_size() == cache.snapshot_count() == 0
    assert runner.allocator.available_size() == runner.allocator.size
    assert cache.state_slots.available_size() == cache.state_slots.total > 0


def shared_prefix_waves(path: Path, **kwargs: object) -> tuple[list[Req], Scheduler]:
    """One request; five more sharing its head; the first prompt twice more; then a turn that
    extends the first prompt and its answer."""
    scheduler = make_scheduler(path, **kwargs)
    first = TAILS[0]
    reqs = run_waves(scheduler, [[first], TAILS[1:], [first], [first]])
    follow_up = first + reqs[0].output_ids + [7, 8, 9]
    reqs += run_waves(scheduler, [[follow_up]])
    return reqs, scheduler


@pytest.fixture(scope="module")
def reference(qwen3_5_path: Path) -> list[list[int]]:
    reqs, _ = shared_prefix_waves(qwen3_5_path, disable_radix_cache=True)
    assert all(r.cached_tokens == 0 for r in reqs)
    return [r.output_ids for r in reqs]


def test_cache_off_matches_transformers(qwen3_5_path: Path, reference: list[list[int]]) -> None:
    assert reference[0] == hf_greedy(qwen3_5_path, TAILS[0], NEW_TOKENS)
    assert reference[-1] == hf_greedy(qwen3_5_path, TAILS[0] + reference[0] + [7, 8, 9], NEW_TOKENS)


@pytest.mark.parametrize(
    "options",
    [{}, {"chunked_prefill_size": 5}, {"disable_overlap_schedule": False}],
    ids=["plain", "chunked", "overlap"],
)
def test_prefix_hits_restore_the_state_and_give_the_same_tokens(
    qwen3_5_path: Path, reference: list[list[int]], options: dict
) -> None:
    reqs, scheduler = shared_prefix_waves(qwen3_5_path, **options)
    assert [r.output_ids for r in reqs] == reference
    cached = [r.cached_tokens for r in reqs]
    # The second request's first chunk ends where its KV match does (the branch point), leaving a
    # snapshot there that the other four resume from.
    assert cached[0] == 0 and cached[1] < len(SHARED)
    assert all(c >= len(SHARED) for c in cached[2:5])
    # The repeated prompt resumes one token short of its end both times (that token is always computed):
    # the first request's prefill tracked the state there.
    assert cached[5] == cached[6] == len(TAILS[0]) - 1
    # The follow-up turn resumes at the end of the first request's cached tokens.
    assert cached[7] >= len(TAILS[0]) + NEW_TOKENS - 1
    assert scheduler.stats.cached_tokens == sum(cached)
    assert_nothing_leaked(scheduler)


@pytest.mark.parametrize("policy", sorted(EVICTION_POLICIES))
def test_every_eviction_policy_under_a_small_pool_gives_the_same_tokens(
    qwen3_5_path: Path, reference: list[list[int]], policy: str
) -> None:
    # 3 snapshot slots and a KV pool of two requests' worth: both kinds of eviction happen.
    reqs, scheduler = shared_prefix_waves(
        qwen3_5_path,
        radix_eviction_policy=policy,
        max_total_tokens=96,
        hybrid_snapshot_slots=3,
        chunked_prefill_size=16,
    )
    assert [r.output_ids for r in reqs] == reference
    assert scheduler.stats.cached_tokens > 0
    assert_nothing_leaked(scheduler)


def test_retraction_and_aborts_under_a_tight_pool_leak_nothing(qwen3_5_path: Path) -> None:
    prompts = random_prompts(12, 4, 12, seed=33, prefix=SHARED[:16])
    max_new = [32] * len(prompts)
    expected = [
        r.output_ids for r in serve(make_scheduler(qwen3_5_path, disable_radix_cache=True), prompts, max_new)
    ]
    scheduler = make_scheduler(
        qwen3_5_path, max_total_tokens=128, hybrid_snapshot_slots=4, chunked_prefill_size=12
    )
    aborts = {3: "r4", 60: "r9"}  # step -> request aborted then (waiting, then decoding)

    def abort_some(step: int) -> None:
        if step in aborts:
            assert scheduler.abort_request(aborts[step])

    reqs = serve(scheduler, prompts, max_new, on_step=abort_some)
    assert scheduler.stats.num_retractions > 0
    for req, want in zip(reqs, expected):
        if req.rid in aborts.values():
            assert req.finished_reason is not None and req.finished_reason.type == "abort"
            assert req.output_ids == want[: len(req.output_ids)]
        else:
            assert req.output_ids == want
    assert_nothing_leaked(scheduler)


def test_snapshot_bytes_come_out_of_the_memory_budget(
    qwen3_5_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    budget = 16 * 2**20
    monkeypatch.setattr(ModelRunner, "_memory_budget", lambda self: budget)
    runner = make_scheduler(qwen3_5_path, max_running_requests=4).runner
    assert runner.state_pool is not None and runner.state_snapshots is not None
    row_bytes = runner.state_pool.shape.bytes_per_row()
    mc = runner.model_config
    kv_bytes = TokenToKVPool.bytes_per_token(mc.num_attention_layers, mc.num_kv_heads, mc.head_dim, mc.dtype)
    snapshots = runner.state_snapshots.total
    assert snapshots == int((budget - 5 * row_bytes) * SNAPSHOT_SHARE) // row_bytes > 0
    assert runner.state_snapshots.nbytes() == snapshots * row_bytes
    assert 5 * row_bytes + snapshots * row_bytes + runner.max_total_tokens * kv_bytes <= budget
    off = make_scheduler(qwen3_5_path, max_running_requests=4, disable_radix_cache=True).runner
    assert off.state_snapshots is not None and off.state_snapshots.total == 0
    assert off.max_total_tokens > runner.max_total_tokens  # the snapshots' bytes went to the KV pool


def test_negative_snapshot_slots_is_a_value_error_naming_the_option(qwen3_5_path: Path) -> None:
    with pytest.raises(ValueError, match="hybrid_snapshot_slots must be >= 0, got -1"):
        EngineConfig.from_kwargs(str(qwen3_5_path), hybrid_snapshot_slots=-1)


def test_flush_cache_frees_every_snapshot(qwen3_5_path: Path) -> None:
    scheduler = make_scheduler(qwen3_5_path)
    first = serve(scheduler, [TAILS[0]])[0]
    cache = scheduler.tree_cache
    assert isinstance(cache, HybridRadixCache) and cache.snapshot_count() > 0
    assert scheduler.flush_cache()
    assert cache.snapshot_count() == 0 and cache.state_slots.available_size() == cache.state_slots.total
    again = serve(scheduler, [TAILS[0]], first_rid=1)[0]
    assert again.cached_tokens == 0 and again.output_ids == first.output_ids
    assert_nothing_leaked(scheduler)


@pytest.mark.parametrize(
    "options",
    [
        {"schedule_policy": "lpm", "enable_mixed_chunk": True, "radix_eviction_policy": "lfu"},
        {"schedule_policy": "dfs-weight", "disable_overlap_schedule": False, "radix_eviction_policy": "mru"},
    ],
    ids=["lpm-mixed", "dfs-weight-overlap"],
)
def test_pools_balance_after_every_step_of_a_random_workload(qwen3_5_path: Path, options: dict) -> None:
    """Shared heads, sampled and greedy requests, aborts, a pool that evicts and retracts: the KV, state
    row and snapshot accounting holds after every step (drain checks it) and nothing is left held."""
    scheduler = make_scheduler(
        qwen3_5_path,
        max_total_tokens=112,
        chunked_prefill_size=12,
        max_running_requests=5,
        hybrid_snapshot_slots=6,
        **options,
    )
    rng = random.Random(34)
    heads = random_prompts(3, 6, 20, seed=35)
    reqs = []
    for i in range(24):
        params = SamplingParams(
            max_new_tokens=rng.randint(1, 32),
            temperature=rng.choice([0.0, 1.0]),
            ignore_eos=rng.random() < 0.5,
        )
        params.normalize()
        prompt = rng.choice(heads) + random_prompts(1, 1, 12, seed=rng.randrange(10**6))[0]
        reqs.append(Req(f"r{i}", prompt, params, seed=rng.randrange(1 << 30), eos_token_ids=frozenset({2})))
    pending = list(reqs)

    def feed(step: int) -> None:
        if pending and rng.random() < 0.7:
            scheduler.add_request(pending.pop(0))
        if rng.random() < 0.05:
            scheduler.abort_request(rng.choice(reqs).rid)

    scheduler.add_request(pending.pop(0))
    while pending or scheduler.has_work():
        drain(scheduler, feed)
        if pending:
            scheduler.add_request(pending.pop(0))
    assert all(r.finished_reason is not None for r in reqs)
    assert scheduler.stats.cached_tokens > 0
    assert_nothing_leaked(scheduler)


def test_no_snapshot_slots_turns_the_cache_off(qwen3_5_path: Path, reference: list[list[int]]) -> None:
    """Without snapshot slots no cached prefix could ever be resumed: nothing is cached."""
    reqs, scheduler = shared_prefix_waves(qwen3_5_path, hybrid_snapshot_slots=0)
    assert scheduler.tree_cache.disable and scheduler.tree_cache.total_size() == 0
    assert [r.output_ids for r in reqs] == reference and scheduler.stats.cached_tokens == 0


@pytest.mark.parametrize("checkpoint", ["qwen3_5_tied_path", "qwen3_5_moe_path"])
def test_linear_first_checkpoints_give_the_same_tokens_with_hits(
    request: pytest.FixtureRequest, checkpoint: str
) -> None:
    """A linear-attention layer first (tied dense; MoE): the state restored feeds the model's first layer."""
    path: Path = request.getfixturevalue(checkpoint)
    off, _ = shared_prefix_waves(path, disable_radix_cache=True)
    on, scheduler = shared_prefix_waves(path, chunked_prefill_size=7)
    assert [r.output_ids for r in on] == [r.output_ids for r in off]
    assert all(r.cached_tokens >= len(SHARED) for r in on[2:])
    assert_nothing_leaked(scheduler)


@pytest.mark.parametrize(
    "options",
    [{}, {"chunked_prefill_size": 7}, {"disable_overlap_schedule": False}, {"enable_mixed_chunk": True}],
    ids=["plain", "chunked", "overlap", "mixed"],
)
def test_a_repeated_prompt_hits_all_but_its_last_token_from_the_second_time(
    qwen3_5_path: Path, options: dict
) -> None:
    """The first request leaves a snapshot one token short of its prompt (the state before the last
    prompt token, taken in the same forward), so the second identical request already resumes where the
    third does: only the last prompt token, whose logits it needs, is computed again."""
    prompt = TAILS[0]
    expected = serve(make_scheduler(qwen3_5_path, disable_radix_cache=True), [prompt])[0].output_ids
    scheduler = make_scheduler(qwen3_5_path, **options)
    reqs = run_waves(scheduler, [[prompt], [prompt], [prompt]])
    assert [r.output_ids for r in reqs] == [expected] * 3
    assert [r.cached_tokens for r in reqs] == [0, len(prompt) - 1, len(prompt) - 1]
    assert_nothing_leaked(scheduler)
