from __future__ import annotations

import random

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from services.worker.runtime.sampling.sampler import (
    Sampler,
    SamplingBatchInfo,
    greedy_ids,
    mix64,
    penalized_logits,
    processed_logits,
)
from shared.sampling_params import SamplingParams

# Chi-square critical values at p = 0.001, by degrees of freedom.
CHI2_CRITICAL_P001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}
NO_IDS = torch.zeros((1, 0), dtype=torch.int64)


def build(bs: int, vocab: int, **kwargs: object) -> SamplingBatchInfo:
    """A batch with neutral settings, overridden by kwargs (per-request lists)."""
    args: dict[str, object] = {
        "temperatures": [1.0] * bs,
        "top_ps": [1.0] * bs,
        "top_ks": [-1] * bs,
        "min_ps": [0.0] * bs,
        "seeds": list(range(bs)),
    }
    args.update(kwargs)
    return SamplingBatchInfo.build(vocab_size=vocab, device="cpu", **args)  # type: ignore[arg-type]


def hf_warped(row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """One row through HF's warpers in generate()'s order: temperature, top-k, top-p, min-p."""
    scores = row.unsqueeze(0).clone()
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(NO_IDS, scores)
    if top_k != -1:
        scores = TopKLogitsWarper(top_k)(NO_IDS, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(NO_IDS, scores)
    if min_p > 0.0:
        scores = MinPLogitsWarper(min_p)(NO_IDS, scores)
    return scores[0]


def naive_penalties(
    row: torch.Tensor, prompt: list[int], output: list[int], rep: float, freq: float, pres: float
) -> torch.Tensor:
    """Penalties one token at a time: HF repetition on prompt+output, then OpenAI frequency/presence."""
    out = row.clone()
    for t in set(prompt + output):
        out[t] = out[t] * rep if out[t] < 0 else out[t] / rep
    for t in set(output):
        out[t] -= freq * output.count(t) + pres
    return out


def random_ids(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


@pytest.mark.parametrize("stage", ["temperature", "top_k", "top_p", "min_p", "all"])
def test_processed_logits_match_hf_warpers_row_by_row(stage: str) -> None:
    rng = random.Random(stage)
    torch.manual_seed(0)
    bs, vocab = 24, 300
    logits = torch.randn(bs, vocab) * 3
    temps = [rng.uniform(0.3, 1.7) if stage in ("temperature", "all") else 1.0 for _ in range(bs)]
    top_ks = [rng.choice([-1, 1, 2, 7, 40, 299]) if stage in ("top_k", "all") else -1 for _ in range(bs)]
    top_ps = [
        rng.choice([1.0, rng.uniform(0.2, 0.97)]) if stage in ("top_p", "all") else 1.0 for _ in range(bs)
    ]
    min_ps = [
        rng.choice([0.0, rng.uniform(0.01, 0.5)]) if stage in ("min_p", "all") else 0.0 for _ in range(bs)
    ]
    # A batch row with top_k 1 is greedy; HF's top-k=1 keeps exactly the argmax too.
    info = build(bs, vocab, temperatures=temps, top_ks=top_ks, top_ps=top_ps, min_ps=min_ps)
    ours = processed_logits(logits, info)
    for i in range(bs):
        expected = hf_warped(logits[i], temps[i], top_ks[i], top_ps[i], min_ps[i])
        kept = torch.isfinite(expected)
        assert torch.equal(torch.isfinite(ours[i]), kept), f"row {i}: different tokens survive"
        if top_ks[i] != 1:
            torch.testing.assert_close(ours[i][kept], expected[kept], rtol=1e-6, atol=0)
    assert not torch.isfinite(ours).all() or stage == "temperature"


def test_repetition_penalty_matches_hf_row_by_row() -> None:
    rng = random.Random(1)
    torch.manual_seed(1)
    bs, vocab = 6, 80
    logits = torch.randn(bs, vocab) * 2
    penalties = [1.0, 1.3, 0.7, 2.0, 1.1, 1.3]
    prompts = [random_ids(rng, vocab, rng.randrange(1, 30)) for _ in range(bs)]
    outputs = [random_ids(rng, vocab, rng.randrange(0, 10)) for _ in range(bs)]
    info = build(bs, vocab, repetition_penalties=penalties, prompt_ids=prompts, output_ids=outputs)
    ours = penalized_logits(logits, info)
    for i in range(bs):
        input_ids = torch.tensor([prompts[i] + outputs[i]])
        expected = RepetitionPenaltyLogitsProcessor(penalties[i])(input_ids, logits[i : i + 1].clone())[0]
        assert torch.equal(ours[i], expected)


def test_frequency_and_presence_penalties_match_naive_reference() -> None:
    rng = random.Random(2)
    torch.manual_seed(2)
    bs, vocab = 8, 50
    logits = torch.randn(bs, vocab)
    freq = [rng.uniform(-2, 2) for _ in range(bs)]
    pres = [rng.uniform(-2, 2) for _ in range(bs)]
    rep = [rng.choice([1.0, 1.5]) for _ in range(bs)]
    prompts = [random_ids(rng, vocab, 12) for _ in range(bs)]
    outputs = [random_ids(rng, vocab, rng.randrange(0, 40)) for _ in range(bs)]
    info = build(
        bs,
        vocab,
        frequency_penalties=freq,
        presence_penalties=pres,
        repetition_penalties=rep,
        prompt_ids=prompts,
        output_ids=outputs,
    )
    ours = penalized_logits(logits, info)
    for i in range(bs):
        expected = naive_penalties(logits[i], prompts[i], outputs[i], rep[i], freq[i], pres[i])
        torch.testing.assert_close(ours[i], expected, rtol=1e-6, atol=1e-6)


def test_token_ids_may_come_as_cpu_tensors() -> None:
    torch.manual_seed(3)
    logits = torch.randn(2, 40)
    lists = {"prompt_ids": [[1, 2, 2], [5]], "output_ids": [[3], [5, 6, 6]]}
    tensors = {k: [torch.tensor(r) for r in v] for k, v in lists.items()}
    pen = {"repetition_penalties": [1.4, 0.8], "frequency_penalties": [0.5, 1.0]}
    a = penalized_logits(logits, build(2, 40, **pen, **lists))
    b = penalized_logits(logits, build(2, 40, **pen, **tensors))
    assert torch.equal(a, b)
    assert not torch.equal(a, logits)


def test_pending_output_token_counts_like_an_appended_output_token() -> None:
    torch.manual_seed(4)
    logits = torch.randn(3, 30)
    pen = {"repetition_penalties": [1.5, 1.5, 1.5], "frequency_penalties": [0.7, 0.7, 0.7]}
    prompts = [[1, 2], [3], [4]]
    appended = build(3, 30, **pen, prompt_ids=prompts, output_ids=[[5, 9], [6], [7]])
    pending = build(
        3,
        30,
        **pen,
        prompt_ids=prompts,
        output_ids=[[5], [6], [7]],
        pending_output_ids=torch.tensor([9, -1, -1]),
    )
    assert torch.equal(penalized_logits(logits, appended), penalized_logits(logits, pending))


def test_out_of_range_history_token_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="output_ids"):
        build(1, 10, frequency_penalties=[1.0], output_ids=[[10]])
    with pytest.raises(ValueError, match="top_ks"):
        build(2, 10, top_ks=[-1])


def test_penalty_state_is_only_built_when_a_row_uses_a_penalty() -> None:
    assert build(2, 10, prompt_ids=[[1], [2]], output_ids=[[3], [4]]).penalties is None
    info = build(2, 10, presence_penalties=[0.0, 0.5], output_ids=[[3], [4]])
    assert info.penalties is not None and info.penalties.seen is None


def test_greedy_rows_take_argmax_of_penalised_logits() -> None:
    rng = random.Random(5)
    torch.manual_seed(5)
    bs, vocab = 8, 64
    logits = torch.randn(bs, vocab)
    prompts = [random_ids(rng, vocab, 20) for _ in range(bs)]
    outputs = [random_ids(rng, vocab, 10) for _ in range(bs)]
    rep, freq = [1.3] * bs, [0.4] * bs
    temps = [0.0 if i % 2 == 0 else 0.9 for i in range(bs)]
    top_ks = [-1 if i % 4 != 1 else 1 for i in range(bs)]  # rows 1 and 5: greedy through top_k=1
    info = build(
        bs,
        vocab,
        temperatures=temps,
        top_ks=top_ks,
        top_ps=[0.8] * bs,
        repetition_penalties=rep,
        frequency_penalties=freq,
        prompt_ids=prompts,
        output_ids=outputs,
    )
    out = Sampler()(logits, info, torch.arange(bs))
    for i in range(bs):
        if temps[i] == 0.0 or top_ks[i] == 1:
            expected = naive_penalties(logits[i], prompts[i], outputs[i], 1.3, 0.4, 0.0).argmax()
            assert out.next_token_ids[i] == expected
    all_greedy = build(bs, vocab, temperatures=[0.0] * bs)
    assert torch.equal(Sampler()(logits, all_greedy, torch.arange(bs)).next_token_ids, logits.argmax(-1))


def test_greedy_ids_are_torch_argmax_with_ties_and_nans() -> None:
    """greedy_ids takes the CPU's faster max(dim): the same first index of a tied maximum, the same NaN row."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randint(-3, 4, (64, 500), generator=g).float()  # many ties per row
    logits[5, 7] = float("nan")
    logits[6] = float("-inf")
    logits[7, [3, 9]] = float("inf")
    got = greedy_ids(logits)
    assert torch.equal(got, torch.argmax(logits, dim=-1))
    assert got[5] == 7 and got[6] == 0 and got[7] == 3


def test_logit_bias_adds_to_the_penalised_logits_of_its_row_only() -> None:
    """Against the naive reference: penalties first, then each biased token's logit + its bias; the
    distribution, the greedy argmax and the log-probs all see it; a banned token stays banned."""
    rng = random.Random(9)
    torch.manual_seed(9)
    bs, vocab, eos = 4, 32, 3
    logits = torch.randn(bs, vocab)
    outputs = [random_ids(rng, vocab, 6) for _ in range(bs)]
    top = logits.argmax(-1).tolist()
    biases = [{top[0]: -100.0, 5: 2.5}, None, {eos: 100.0, 11: 100.0}, {top[3]: -100.0}]
    params = [
        SamplingParams(temperature=0.0, frequency_penalty=0.5, logit_bias=biases[0]),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, min_new_tokens=10, logit_bias=biases[2]),
        SamplingParams(temperature=0.7, logit_bias=biases[3]),
    ]
    info = SamplingBatchInfo.from_params(
        params, [1, 2, 3, 4], vocab_size=vocab, device="cpu", output_ids=outputs, eos_token_ids=[eos]
    )
    expected = torch.stack([naive_penalties(logits[i], [], outputs[i], 1.0, 0.5 if i == 0 else 0.0, 0.0)
                            for i in range(bs)])
    expected[2, eos] = float("-inf")  # min_new_tokens bans EOS: its +100 does not lift it
    for i, bias in enumerate(biases):
        for tid, value in (bias or {}).items():
            expected[i, tid] += value
    assert torch.allclose(penalized_logits(logits, info), expected)
    out = Sampler()(logits, info, torch.arange(bs), return_logprob=True)
    assert out.next_token_ids[:3].tolist() == [expected[0].argmax().item(), top[1], 11]
    assert out.next_token_ids[3].item() != top[3]
    scaled = expected[3] / 0.7
    assert torch.allclose(out.logprobs[3], torch.log_softmax(scaled, -1)[out.next_token_ids[3]])
    # No bias, no tensors; a bias alone builds no PenaltyState, so the model runner may reuse the
    # batch's sampling tensors from one decode step to the next (ModelRunner._sampling_info).
    assert build(2, vocab).bias is None
    only_bias = SamplingBatchInfo.from_params([SamplingParams(logit_bias={1: 1.0})], [0], vocab_size=vocab,
                                              device="cpu")
    assert only_bias.penalties is None and only_bias.bias is not None


def test_min_new_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    vocab, eos, stop_id = 10, 2, 7
    logits = torch.zeros(3, vocab)
    logits[:, eos], logits[:, stop_id], logits[:, 4] = 5.0, 4.0, 3.0
    params = [
        SamplingParams(temperature=0.0, min_new_tokens=3, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0.0, min_new_tokens=3, stop_token_ids=[stop_id]),
        SamplingParams(temperature=0.0, min_new_tokens=3, ignore_eos=True),
    ]
    info = SamplingBatchInfo.from_params(
        params,
        [0, 1, 2],
        vocab_size=vocab,
        device="cpu",
        output_ids=[[1], [1, 1, 1], []],
        eos_token_ids=[eos],
    )
    assert Sampler()(logits, info, torch.zeros(3, dtype=torch.int64)).next_token_ids.tolist() == [4, eos, eos]


def test_input_logits_are_not_modified() -> None:
    torch.manual_seed(6)
    logits = torch.randn(4, 20)
    before = logits.clone()
    info = build(
        4, 20, top_ks=[3] * 4, top_ps=[0.5] * 4, repetition_penalties=[2.0] * 4, prompt_ids=[[1]] * 4
    )
    Sampler()(logits, info, torch.arange(4), return_logprob=True, top_logprobs_num=3)
    assert torch.equal(logits, before)


def test_hash_matches_python_splitmix64() -> None:
    mask = (1 << 64) - 1

    def reference(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    rng = random.Random(7)
    values = [rng.getrandbits(64) for _ in range(500)] + [0, 1, mask, 1 << 63]
    signed = torch.tensor([v - (1 << 64) if v >= 1 << 63 else v for v in values], dtype=torch.int64)
    assert [x & mask for x in mix64(signed).tolist()] == [reference(v) for v in values]


def _one_request_token(logits_row: torch.Tensor, seed: int, position: int, row: int, others: int) -> int:
    """Sample the target request at batch row `row` among `others` unrelated requests."""
    rng = random.Random(row * 31 + others)
    bs, vocab = others + 1, logits_row.shape[0]
    logits = torch.randn(bs, vocab, generator=torch.Generator().manual_seed(row))
    logits[row] = logits_row
    kw: dict[str, list[object]] = {
        "temperatures": [rng.choice([0.0, 0.5, 1.3]) for _ in range(bs)],
        "top_ps": [rng.choice([1.0, 0.6]) for _ in range(bs)],
        "top_ks": [rng.choice([-1, 5]) for _ in range(bs)],
        "min_ps": [rng.choice([0.0, 0.2]) for _ in range(bs)],
        "seeds": [rng.getrandbits(63) for _ in range(bs)],
        "repetition_penalties": [rng.choice([1.0, 1.2]) for _ in range(bs)],
        "prompt_ids": [random_ids(rng, vocab, 5) for _ in range(bs)],
    }
    target = {"temperatures": 0.9, "top_ps": 0.95, "top_ks": -1, "min_ps": 0.0, "seeds": seed}
    target.update({"repetition_penalties": 1.0, "prompt_ids": []})
    for key, value in target.items():
        kw[key][row] = value
    positions = torch.tensor([rng.randrange(1000) for _ in range(bs)])
    positions[row] = position
    return int(Sampler()(logits, build(bs, vocab, **kw), positions).next_token_ids[row])


def test_seeded_token_is_the_same_alone_and_at_any_row_of_a_mixed_batch() -> None:
    vocab = 1000
    row_logits = torch.randn(vocab, generator=torch.Generator().manual_seed(8)) * 0.5
    for position in (0, 17, 4095):
        alone = _one_request_token(row_logits, seed=1234, position=position, row=0, others=0)
        for row in range(8):
            assert _one_request_token(row_logits, 1234, position, row=row, others=7) == alone


def test_different_seeds_and_positions_give_different_tokens() -> None:
    vocab, n = 1000, 100
    info_a = build(n, vocab, seeds=[11] * n)
    info_b = build(n, vocab, seeds=[12] * n)
    logits, positions = torch.zeros(n, vocab), torch.arange(n)
    a = Sampler()(logits, info_a, positions).next_token_ids
    b = Sampler()(logits, info_b, positions).next_token_ids
    assert int((a != b).sum()) >= 90
    assert len(set(a.tolist())) >= 80
    assert torch.equal(a, Sampler()(logits, info_a, positions).next_token_ids)


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    kept = expected > 0
    return float((((observed - expected) ** 2)[kept] / expected[kept]).sum())


LOGITS6 = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0])
N_DRAWS = 5000


def _draw(temperature: float, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    rng = random.Random(9)
    info = build(
        N_DRAWS,
        6,
        temperatures=[temperature] * N_DRAWS,
        top_ks=[top_k] * N_DRAWS,
        top_ps=[top_p] * N_DRAWS,
        seeds=[rng.getrandbits(64) for _ in range(N_DRAWS)],
    )
    positions = torch.tensor([rng.randrange(100_000) for _ in range(N_DRAWS)])
    return Sampler()(LOGITS6.expand(N_DRAWS, 6), info, positions).next_token_ids


def test_sampled_frequencies_match_softmax_over_temperature() -> None:
    tokens = _draw(temperature=0.7)
    assert _chi_square(tokens, torch.softmax(LOGITS6 / 0.7, -1)) < CHI2_CRITICAL_P001[5]
    # The test has power: the untempered distribution is rejected.
    assert _chi_square(tokens, torch.softmax(LOGITS6, -1)) > CHI2_CRITICAL_P001[5]


@pytest.mark.parametrize(("top_k", "top_p"), [(3, 1.0), (-1, 0.75), (4, 0.9)])
def test_truncated_sampling_matches_renormalised_distribution(top_k: int, top_p: float) -> None:
    temperature = 1.2
    tokens = _draw(temperature, top_k, top_p)
    expected_logits = hf_warped(LOGITS6, temperature, top_k, top_p, 0.0)
    kept = torch.isfinite(expected_logits)
    assert kept.sum() < 6
    assert set(tokens.tolist()) <= set(torch.nonzero(kept).flatten().tolist())
    probs = torch.softmax(expected_logits, -1)
    assert _chi_square(tokens, probs) < CHI2_CRITICAL_P001[int(kept.sum()) - 1]


def test_logprobs_are_log_softmax_of_penalised_tempered_logits() -> None:
    rng = random.Random(10)
    torch.manual_seed(10)
    bs, vocab, k = 6, 40, 5
    logits = torch.randn(bs, vocab) * 2
    temps = [0.0, 0.5, 1.0, 1.5, 0.8, 0.0]
    prompts = [random_ids(rng, vocab, 8) for _ in range(bs)]
    outputs = [random_ids(rng, vocab, 8) for _ in range(bs)]
    info = build(
        bs,
        vocab,
        temperatures=temps,
        top_ks=[-1, 10, -1, 3, -1, -1],
        top_ps=[1.0, 0.9, 0.5, 1.0, 1.0, 1.0],
        repetition_penalties=[1.2] * bs,
        presence_penalties=[0.5] * bs,
        prompt_ids=prompts,
        output_ids=outputs,
    )
    out = Sampler()(logits, info, torch.arange(bs), return_logprob=True, top_logprobs_num=k)
    assert out.logprobs is not None and out.top_logprobs_ids is not None and out.top_logprobs_vals is not None
    for i in range(bs):
        penalised = naive_penalties(logits[i], prompts[i], outputs[i], 1.2, 0.0, 0.5)
        reference = torch.log_softmax(penalised / (temps[i] or 1.0), -1)
        token = int(out.next_token_ids[i])
        torch.testing.assert_close(out.logprobs[i], reference[token], rtol=1e-5, atol=1e-5)
        values, ids = reference.topk(k)
        assert out.top_logprobs_ids[i].tolist() == ids.tolist()
        torch.testing.assert_close(out.top_logprobs_vals[i], values, rtol=1e-5, atol=1e-5)


def test_no_logprobs_unless_asked() -> None:
    out = Sampler()(torch.randn(2, 10), build(2, 10), torch.arange(2))
    assert out.logprobs is None and out.top_logprobs_ids is None and out.top_logprobs_vals is None


def test_from_params_equals_build_from_lists() -> None:
    torch.manual_seed(11)
    params = [
        SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, frequency_penalty=0.3),
        SamplingParams(temperature=0.0, repetition_penalty=1.2, presence_penalty=-0.5),
    ]
    prompts, outputs = [[1, 2, 3], [4, 5]], [[6], [7, 7]]
    info = SamplingBatchInfo.from_params(
        params, [5, 6], vocab_size=30, device="cpu", prompt_ids=prompts, output_ids=outputs
    )
    lists = build(
        2,
        30,
        temperatures=[0.7, 0.0],
        top_ps=[0.9, 1.0],
        top_ks=[20, -1],
        min_ps=[0.05, 0.0],
        seeds=[5, 6],
        frequency_penalties=[0.3, 0.0],
        presence_penalties=[0.0, -0.5],
        repetition_penalties=[1.0, 1.2],
        prompt_ids=prompts,
        output_ids=outputs,
    )
    logits, positions = torch.randn(2, 30), torch.tensor([3, 2])
    assert torch.equal(processed_logits(logits, info), processed_logits(logits, lists))
    assert torch.equal(
        Sampler()(logits, info, positions).next_token_ids, Sampler()(logits, lists, positions).next_token_ids
    )
