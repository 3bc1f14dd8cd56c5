"""Speculative decoding (n-gram lookup and a draft model): greedy output is unchanged token for token,
sampling keeps the target's distribution (chi-square against transformers' p), KV accounting stays
exact with rejections, and bad settings fail at start-up."""

from __future__ import annotations

import math
import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from services.worker.config import EngineConfig
from services.worker.frontend.engine import Engine
from services.worker.runtime.forward_batch import ForwardMode
from services.worker.scheduler.req import Req
from services.worker.scheduler.schedule_batch import ScheduleBatch
from services.worker.scheduler.spec.ngram import ngram_lookup
from services.worker.scheduler.spec.verify import verify, verify_greedy
from shared.sampling_params import SamplingParams
from tests.checkpoints import tiny_llama_config, tiny_qwen3_config, write_checkpoint
from tests.engine_helpers import GREEDY, hf_model, output_ids, random_prompts, scheduler_here

K = 4
# Chi-square at significance 0.001: the critical value for df degrees of freedom by Wilson-Hilferty,
# with the standard normal's 0.999 quantile.
Z_999 = 3.0902


def chi2_critical(df: int) -> float:
    return df * (1 - 2 / (9 * df) + Z_999 * math.sqrt(2 / (9 * df))) ** 3


def chi_square(groups: dict[int, Counter[int]], probs: dict[int, list[float]]) -> tuple[float, int]:
    """Pearson's statistic summed over independent groups (draws conditioned on different contexts),
    each against its own distribution; tokens expected fewer than 5 times are pooled into one bin,
    itself folded into the smallest other bin while it is still under 5."""
    stat, df = 0.0, 0
    for key, counts in groups.items():
        n, p = sum(counts.values()), probs[key]
        bins = [[t] for t in range(len(p)) if n * p[t] >= 5]
        rest = [t for t in range(len(p)) if n * p[t] < 5]
        if rest and bins:
            if n * sum(p[t] for t in rest) >= 5:
                bins.append(rest)
            else:
                min(bins, key=lambda b: sum(p[t] for t in b)).extend(rest)
        if len(bins) < 2:
            continue
        for b in bins:
            expected = n * sum(p[t] for t in b)
            stat += (sum(counts[t] for t in b) - expected) ** 2 / expected
        df += len(bins) - 1
    return stat, df


@pytest.fixture(scope="module")
def bad_draft_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another Qwen3 (one layer, other seed) with the target's vocabulary: a draft that is mostly wrong."""
    return write_checkpoint(tmp_path_factory.mktemp("draft"), tiny_qwen3_config(num_hidden_layers=1), seed=31)


@pytest.fixture(params=["ngram", "draft", "draft-is-target"])
def spec_options(request: pytest.FixtureRequest, qwen3_path: Path, bad_draft_path: Path) -> dict:
    if request.param == "ngram":
        return {"speculative_algorithm": "ngram"}
    draft = qwen3_path if request.param == "draft-is-target" else bad_draft_path
    return {"speculative_algorithm": "draft", "speculative_draft_model_path": str(draft)}


# ---- the pieces ---------------------------------------------------------------------------------


def test_ngram_lookup_proposes_what_followed_the_longest_earlier_match() -> None:
    ids = [7, 1, 2, 3, 9, 9, 2, 3, 4, 5, 1, 2, 3]
    # The suffix [1, 2, 3] occurs at the start (then 9, 9); [2, 3] alone occurs later (then 4, 5, 1).
    assert ngram_lookup(ids, 3, max_match=8, min_match=1) == [9, 9, 2]
    assert ngram_lookup(ids, 3, max_match=2, min_match=1) == [4, 5, 1]  # ties: the most recent
    assert ngram_lookup(ids, 3, max_match=8, min_match=4) == []
    assert ngram_lookup([5, 6, 7], 3, max_match=8, min_match=1) == []


def test_greedy_verification_accepts_exactly_the_leading_argmax_matches() -> None:
    argmax = [[4, 1, 3, 0], [2, 2]]  # per request: the target's argmax at each row
    drafts = [[4, 1, 0], [5]]
    rows = torch.full((6, 6), float("-inf"))
    for r, t in enumerate(a for per_req in argmax for a in per_req):
        rows[r, t] = 0.0
    verdict = verify(rows, drafts, None, torch.tensor([1, 2]), torch.tensor([10, 3]))
    assert verdict.num_accepted == [2, 0]
    assert verdict.tokens == [[4, 1, 3], [2]]
    # The greedy fast path, from the argmaxes alone, gives the same verdict.
    assert verify_greedy([a for per_req in argmax for a in per_req], drafts) == verdict


def test_greedy_fast_path_matches_verify_on_random_cases() -> None:
    rng = random.Random(3)
    for _ in range(200):
        drafts = [[rng.randrange(4) for _ in range(rng.randint(0, 4))] for _ in range(rng.randint(1, 4))]
        argmax = [rng.randrange(4) for d in drafts for _ in range(len(d) + 1)]
        rows = torch.full((len(argmax), 4), float("-inf"))
        rows[torch.arange(len(argmax)), torch.tensor(argmax)] = 0.0
        seeds, positions = torch.arange(len(drafts)), torch.full((len(drafts),), 7)
        assert verify_greedy(argmax, drafts) == verify(rows, drafts, None, seeds, positions)


def test_verification_samples_the_target_distribution_whatever_the_draft() -> None:
    """Drafts drawn from a bad q: the first token is distributed as p0, the second (after an accepted
    first) as p1, the bonus (after two accepted) as p2."""
    gen = torch.Generator().manual_seed(0)
    vocab, n = 6, 20000
    p = torch.softmax(torch.randn(3, vocab, generator=gen) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(2, vocab, generator=gen) * 1.5, dim=-1)
    drafts_t = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=gen) for j in range(2)], 1)
    drafts = drafts_t.tolist()
    target = p.log().repeat(n, 1)
    verdict = verify(target, drafts, q.repeat(n, 1), torch.arange(n) * 7919, torch.full((n,), 40))
    by_position = [Counter(t[0] for t in verdict.tokens),
                   Counter(t[1] for t, a in zip(verdict.tokens, verdict.num_accepted) if a >= 1),
                   Counter(t[2] for t, a in zip(verdict.tokens, verdict.num_accepted) if a == 2)]
    for j, counts in enumerate(by_position):
        stat, df = chi_square({0: counts}, {0: p[j].tolist()})
        assert stat < chi2_critical(df), f"position {j}: chi2 {stat:.1f} with {df} df"
    wrong, df = chi_square({0: by_position[0]}, {0: q[0].tolist()})
    assert wrong > chi2_critical(df), "the test cannot tell p from the draft's q"


# ---- the engine ---------------------------------------------------------------------------------

PROMPTS = random_prompts(5, 3, 40, seed=21)
PROMPTS[2] = PROMPTS[2][:8] * 4  # a repetitive prompt, for n-gram lookup to find something


@pytest.fixture(scope="module")
def greedy_reference(qwen3_path: Path) -> list[list[int]]:
    with Engine(str(qwen3_path), chunked_prefill_size=8) as engine:
        return output_ids(engine.generate(input_ids=PROMPTS, sampling_params={**GREEDY, "max_new_tokens": 24}))


def test_greedy_output_is_identical_with_speculation(
    qwen3_path: Path, spec_options: dict, greedy_reference: list[list[int]]
) -> None:
    params = {**GREEDY, "max_new_tokens": 24}
    with Engine(str(qwen3_path), chunked_prefill_size=8, speculative_num_draft_tokens=K, **spec_options) as engine:
        batched = engine.generate(input_ids=PROMPTS, sampling_params=params)
        alone = engine.generate(input_ids=PROMPTS[3], sampling_params=params)
        info = engine.get_server_info()
    assert output_ids(batched) == greedy_reference
    assert alone["output_ids"] == greedy_reference[3]
    assert info["kv_in_use"] == 0
    rates = [r["meta_info"]["spec_accept_rate"] for r in batched]
    lengths = [r["meta_info"]["spec_accept_length"] for r in batched]
    if spec_options.get("speculative_draft_model_path") == str(qwen3_path):
        # The target drafting for itself: every proposal is accepted, K + 1 tokens per step (fewer only
        # where max_new_tokens cuts the last step short).
        assert rates == [1.0] * len(PROMPTS) and min(lengths) > K
    else:
        assert all(0.0 <= r < 1.0 for r in rates) and all(length >= 1.0 for length in lengths)
    if spec_options["speculative_algorithm"] == "ngram":
        # A tiny random model falls into loops that lookup in its own output predicts.
        assert max(rates) > 0.0


def test_verification_as_decode_rows_gives_the_extend_logits(qwen3_path: Path) -> None:
    """[last token, proposals...] of each running request as one decode row per token (what a CUDA
    graph replays) against one EXTEND over the same tokens with every token's logits (float32)."""
    config = EngineConfig.from_kwargs(str(qwen3_path), max_total_tokens=512)
    scheduler = scheduler_here(config)
    for i, prompt in enumerate(PROMPTS[:3]):
        params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
        params.normalize()
        scheduler.add_request(Req(f"r{i}", prompt, params, seed=i))
    while len(scheduler.running) < 3 or scheduler.waiting:
        scheduler.step()
    scheduler.step()  # a decode step: every request holds KV up to its last token
    reqs = list(scheduler.running)
    committed = [r.kv_committed_len for r in reqs]
    assert committed == [r.seq_len - 1 for r in reqs]
    mem, runner = scheduler.mem, scheduler.runner

    def run(prepare: str) -> torch.Tensor:
        for req, extra in zip(reqs, ([], [5, 9], [7, 7, 3, 1])):
            req.fill_ids = req.all_ids + extra
        batch = ScheduleBatch(reqs, ForwardMode.EXTEND, mem)
        forward_batch = batch.prepare_rows() if prepare == "rows" else batch.prepare_extend()
        forward_batch.return_all_logits = prepare == "extend"
        logits = runner.forward(forward_batch).clone()
        for req, start in zip(reqs, committed):
            mem.allocator.free(mem.req_to_token_pool.read(req.req_pool_idx, start, len(req.fill_ids)))
            req.fill_ids = req.all_ids
        return logits

    rows, extend = run("rows"), run("extend")
    assert rows.shape == extend.shape == (1 + 3 + 5, runner.model_config.vocab_size)
    torch.testing.assert_close(rows, extend, rtol=1e-5, atol=1e-5)
    scheduler.check_pool_invariant()


def test_greedy_speculation_through_extend_steps_matches_decode_rows(
    qwen3_path: Path, greedy_reference: list[list[int]]
) -> None:
    """With the rows bound at 0, the target verifies and the draft catches up in EXTEND steps (what
    the GPU does past its largest CUDA graph): the tokens are still plain greedy's."""
    config = EngineConfig.from_kwargs(
        str(qwen3_path), chunked_prefill_size=8, speculative_algorithm="draft",
        speculative_draft_model_path=str(qwen3_path), speculative_num_draft_tokens=K,
    )
    scheduler = scheduler_here(config)
    assert scheduler.spec is not None
    scheduler.spec.max_verify_rows = 0
    scheduler.spec.proposer.max_rows = 0
    reqs = []
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(**{**GREEDY, "max_new_tokens": 24})
        params.normalize()
        reqs.append(Req(f"r{i}", prompt, params, seed=i))
        scheduler.add_request(reqs[-1])
    while scheduler.has_work():
        scheduler.step()
    assert [r.output_ids for r in reqs] == greedy_reference
    assert all(r.spec_accepted_tokens == r.spec_proposed_tokens > 0 for r in reqs)


def test_draft_proposals_stay_on_the_device_until_verification(
    qwen3_path: Path, greedy_reference: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The draft's proposals reach the verify forward as device tokens (placeholders on the host) and
    come back with the target's argmaxes in one read-back; the tokens are plain greedy's."""
    from services.worker.scheduler.spec import Proposal
    from services.worker.scheduler.spec.draft import DraftProposer

    proposals: list[Proposal] = []
    propose = DraftProposer.propose

    def recording(self: DraftProposer, reqs: list[Req], limits: list[int]) -> Proposal:
        proposal = propose(self, reqs, limits)
        proposals.append(proposal)
        assert proposal.device_tokens is not None
        assert proposal.device_tokens.numel() == sum(len(t) for t in proposal.tokens)
        assert all(t == 0 for draft in proposal.tokens for t in draft), "placeholders until verified"
        return proposal

    monkeypatch.setattr(DraftProposer, "propose", recording)
    options = {"speculative_algorithm": "draft", "speculative_draft_model_path": str(qwen3_path)}
    with Engine(str(qwen3_path), speculative_num_draft_tokens=K, scheduler_process=False, **options) as engine:
        out = engine.generate(input_ids=PROMPTS, sampling_params={**GREEDY, "max_new_tokens": 24})
    assert output_ids(out) == greedy_reference
    assert proposals and all(p.device_tokens is None for p in proposals), "every proposal was resolved"
    # Some steps proposed tokens (the draft is the target, so they were all accepted).
    assert any(any(p.tokens) for p in proposals)


def test_tokens_after_a_stop_token_in_an_accepted_run_are_dropped(qwen3_path: Path) -> None:
    prompt = PROMPTS[0]
    options = {"speculative_algorithm": "draft", "speculative_draft_model_path": str(qwen3_path)}
    with Engine(str(qwen3_path), speculative_num_draft_tokens=K, **options) as engine:
        free = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 16})["output_ids"]
        stop = free[6]  # inside the second step's accepted run
        cut = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 16, "stop_token_ids": [stop]})
        info = engine.get_server_info()
    assert cut["output_ids"] == free[: free.index(stop) + 1]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert info["kv_in_use"] == 0


def test_retraction_under_a_small_pool_keeps_the_greedy_tokens(qwen3_path: Path, spec_options: dict) -> None:
    prompts = random_prompts(12, 10, 20, seed=6)
    params = {**GREEDY, "max_new_tokens": 40}
    with Engine(str(qwen3_path)) as engine:
        ample = output_ids(engine.generate(input_ids=prompts, sampling_params=params))
    with Engine(str(qwen3_path), max_total_tokens=160, speculative_num_draft_tokens=K, **spec_options) as engine:
        small = output_ids(engine.generate(input_ids=prompts, sampling_params=params))
        info = engine.get_server_info()
    assert info["stats"]["num_retractions"] > 0
    assert small == ample and info["kv_in_use"] == 0


# ---- sampling keeps the target's distribution -----------------------------------------------------

SMALL_VOCAB = 8
TEMPERATURE, TOP_K = 2.0, 6
DIST_PROMPT = [3, 4, 5, 6, 3, 4, 5]


@pytest.fixture(scope="module")
def small_vocab_paths(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A target and a deliberately different draft over 8 tokens."""
    target = write_checkpoint(tmp_path_factory.mktemp("v8_target"), tiny_llama_config(vocab_size=SMALL_VOCAB), seed=41)
    draft = write_checkpoint(tmp_path_factory.mktemp("v8_draft"), tiny_llama_config(vocab_size=SMALL_VOCAB), seed=42)
    return target, draft


def hf_next_token_probs(path: Path, context: list[int]) -> list[float]:
    """transformers' next-token distribution after temperature and top-k."""
    with torch.no_grad():
        logits = hf_model(str(path))(torch.tensor([context])).logits[0, -1].float() / TEMPERATURE
    cutoff = logits.topk(TOP_K).values[-1]
    return logits.masked_fill(logits < cutoff, float("-inf")).softmax(-1).tolist()


@pytest.mark.parametrize("algorithm", ["draft", "ngram"])
def test_sampling_with_speculation_preserves_the_target_distribution(
    small_vocab_paths: tuple[Path, Path], algorithm: str
) -> None:
    """The first speculated token (the second generated: the first comes from the prefill) of 3000
    seeded requests, grouped by the first token, against transformers' p for that context."""
    target, draft = small_vocab_paths
    options = {"speculative_algorithm": algorithm}
    if algorithm == "draft":
        options["speculative_draft_model_path"] = str(draft)
    n = 3000
    params = [{"temperature": TEMPERATURE, "top_k": TOP_K, "max_new_tokens": 4, "ignore_eos": True, "seed": s}
              for s in range(n)]
    with Engine(str(target), max_running_requests=512, speculative_num_draft_tokens=K, **options) as engine:
        results = engine.generate(input_ids=[DIST_PROMPT] * n, sampling_params=params)
    proposed = [r["meta_info"]["spec_accept_rate"] for r in results]
    assert any(0.0 < rate < 1.0 for rate in proposed), "no request had both accepted and rejected drafts"
    groups: dict[int, Counter[int]] = {}
    for r in results:
        first, second = r["output_ids"][:2]
        groups.setdefault(first, Counter())[second] += 1
    p = {g: hf_next_token_probs(target, DIST_PROMPT + [g]) for g in groups}
    stat, df = chi_square(groups, p)
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} with {df} df"
    # The same draws against the draft's distribution: a verifier that trusted the draft would fail.
    q = {g: hf_next_token_probs(draft, DIST_PROMPT + [g]) for g in groups}
    wrong, wrong_df = chi_square(groups, q)
    assert wrong > chi2_critical(wrong_df)


# ---- KV accounting ------------------------------------------------------------------------------

# A pool small enough that running requests get retracted and speculation is cut short by memory.
POOL, MAX_NEW = 240, 40


@pytest.mark.parametrize("algorithm", ["ngram", "draft"])
def test_pool_invariant_holds_after_every_step_with_rejections(
    qwen3_path: Path, bad_draft_path: Path, algorithm: str
) -> None:
    options: dict = {"speculative_algorithm": algorithm}
    if algorithm == "draft":
        # Decodes riding in mixed prefill steps leave the draft behind: it catches up next time.
        options.update(speculative_draft_model_path=str(bad_draft_path), enable_mixed_chunk=True)
    config = EngineConfig.from_kwargs(
        str(qwen3_path), max_total_tokens=POOL, chunked_prefill_size=24, max_running_requests=6, **options
    )
    scheduler = scheduler_here(config)
    rng = random.Random(5)
    prefixes = random_prompts(3, 8, 30, seed=11)
    reqs: list[Req] = []
    finished: set[str] = set()
    steps = 0
    while len(reqs) < 30 or scheduler.has_work():
        if len(reqs) < 30 and rng.random() < 0.4:
            body = random_prompts(1, 1, 20, seed=rng.randrange(10**6))[0]
            prompt = rng.choice(prefixes) + body * rng.randint(1, 2)
            params = SamplingParams(
                max_new_tokens=rng.randint(1, MAX_NEW),
                temperature=rng.choice([0.0, 1.0]),
                ignore_eos=rng.random() < 0.5,
                presence_penalty=0.5 if rng.random() < 0.15 else 0.0,
            )
            params.normalize()
            req = Req(f"r{len(reqs)}", prompt, params, seed=rng.randrange(1 << 30),
                      return_logprob=rng.random() < 0.15, eos_token_ids=frozenset({2}))
            reqs.append(req)
            scheduler.add_request(req)
        if rng.random() < 0.03:
            live = [r.rid for r in reqs if r.rid not in finished]
            if live:
                scheduler.abort_request(rng.choice(live))
        for out in scheduler.step():
            if out.finished_reason is not None:
                assert out.rid not in finished
                finished.add(out.rid)
        scheduler.check_pool_invariant()  # the target's pool and the draft's
        steps += 1
        assert steps < 3000, "the workload did not drain"
    assert finished == {r.rid for r in reqs}
    proposed = sum(r.spec_proposed_tokens for r in reqs)
    accepted = sum(r.spec_accepted_tokens for r in reqs)
    assert proposed > accepted, "no rejection happened"
    for r in reqs:
        if r.finished_reason.type != "abort":
            assert 1 <= len(r.output_ids) <= r.sampling_params.max_new_tokens
    assert scheduler.tree_cache.protected_size() == 0
    assert scheduler.runner.allocator.available_size() + scheduler.tree_cache.evictable_size() == POOL
    proposer = scheduler.spec.proposer
    if algorithm == "draft":
        assert proposer.runner.allocator.available_size() == proposer.runner.allocator.size


# ---- bad settings -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 0}, "speculative_num_draft_tokens"),
        ({"speculative_algorithm": "medusa"}, "speculative_algorithm"),
        ({"speculative_algorithm": "draft"}, "speculative_draft_model_path"),
        ({"speculative_algorithm": "ngram", "speculative_ngram_min_match": 0}, "speculative_ngram_min_match"),
    ],
)
def test_bad_speculative_settings_are_refused_naming_the_field(qwen3_path: Path, options: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Engine(str(qwen3_path), **options)


def test_a_draft_with_another_vocabulary_is_refused_at_start_up(qwen3_path: Path, tmp_path: Path) -> None:
    other = write_checkpoint(tmp_path / "vocab200", tiny_qwen3_config(vocab_size=200), seed=5)
    with pytest.raises(ValueError, match="speculative_draft_model_path.*vocabulary of 200"):
        Engine(str(qwen3_path), speculative_algorithm="draft", speculative_draft_model_path=str(other))


def test_runners_whose_decode_rows_share_requests_say_so(qwen3_path: Path, bad_draft_path: Path) -> None:
    """Verification (the target) and catch-ups (the draft) run rows of one request in one decode batch,
    row j attending to rows 0 .. j-1's new tokens, so their attention backends must store every row's K/V
    before any row attends (tests/kernels/test_triton_backend.py's rows-share-requests case); a plain
    scheduler's decode rows are one per request."""
    plain = scheduler_here(EngineConfig.from_kwargs(str(qwen3_path), max_total_tokens=256))
    assert not plain.runner.attn_backend.decode_rows_share_requests
    spec = scheduler_here(EngineConfig.from_kwargs(
        str(qwen3_path), max_total_tokens=256, speculative_algorithm="draft",
        speculative_draft_model_path=str(bad_draft_path), speculative_num_draft_tokens=K,
    ))  # fmt: skip
    assert spec.runner.attn_backend.decode_rows_share_requests
    assert spec.spec.proposer.runner.attn_backend.decode_rows_share_requests
