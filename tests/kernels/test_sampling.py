"""Fused Gumbel-max sampling (kernels/sampling.py) against the sampler's torch definition, under the
Triton interpreter."""

from __future__ import annotations

import pytest
import torch

import kernels.sampling
from kernels.sampling import gumbel_argmax
from services.worker.runtime.sampling import sampler
from services.worker.runtime.sampling.sampler import Sampler, SamplingBatchInfo, gumbel_noise, hashed_uniform

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Chi-square critical value at p = 0.001 for 7 degrees of freedom (8 tokens).
CHI2_CRITICAL_P001_7 = 24.322


def keys(gen: torch.Generator, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeds over the whole int64 range (negative ones must hash as their 64-bit pattern) and positions
    past 2**32 (the position is multiplied in 64 bits too)."""
    seeds = torch.randint(INT64_MIN, INT64_MAX, (bs,), generator=gen, dtype=torch.int64)
    positions = torch.randint(0, 1 << 40, (bs,), generator=gen, dtype=torch.int64)
    return seeds, positions


def reference_scores(scaled: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The sampler's torch path before its argmax: scaled + gumbel_noise over every token id."""
    return scaled + gumbel_noise(seeds, positions, torch.arange(scaled.shape[1]).unsqueeze(0))


def assert_same_choice(got: torch.Tensor, scaled: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor):
    scores = reference_scores(scaled, seeds, positions)
    best = scores.max(dim=-1).values
    chosen = scores.gather(1, got.unsqueeze(1)).squeeze(1)
    # The kernel's log may differ from torch's in the last bit (NumPy's under the interpreter), which
    # could flip only a near-tie: the chosen score is the best one to 1e-6 ...
    torch.testing.assert_close(chosen, best, rtol=1e-6, atol=0)
    # ... and on these inputs the very token torch.argmax picks.
    assert torch.equal(got, scores.argmax(dim=-1))


def test_hashed_uniform_is_bit_exact_with_the_sampler(gen) -> None:
    seeds, positions = keys(gen, 8)
    seeds[:4] = torch.tensor([0, -1, INT64_MIN, INT64_MAX])
    positions[:3] = torch.tensor([0, 1, INT64_MAX])
    vocab = 3000  # three 1024-wide tiles, the last one partial
    got = kernels.sampling.hashed_uniform(seeds, positions, vocab)
    assert torch.equal(got, hashed_uniform(seeds, positions, torch.arange(vocab).unsqueeze(0)))


@pytest.mark.parametrize("block", [256, 1024, 4096])
def test_choice_matches_torch_reference_with_masked_rows(gen, block) -> None:
    bs, vocab = 5, 3000
    seeds, positions = keys(gen, bs)
    scaled = torch.randn((bs, vocab), generator=gen) * 3
    scaled[1, torch.rand(vocab, generator=gen) < 0.3] = float("-inf")
    scaled[2, :-1] = float("-inf")  # only the last token, in the last (partial) tile, may be chosen
    scaled[3] = float("-inf")  # nothing may be chosen: torch.argmax gives token 0
    got = gumbel_argmax(scaled, seeds, positions, block=block)
    assert got.dtype == torch.int64
    assert_same_choice(got, scaled, seeds, positions)
    assert got[2] == vocab - 1 and got[3] == 0
    assert torch.isfinite(scaled[1, got[1]])


@pytest.mark.parametrize("view", ["every other row of a wider buffer", "every other column"])
def test_strided_views_are_read_in_place(gen, view) -> None:
    bs, vocab = 4, 2000
    seeds, positions = keys(gen, bs)
    if view == "every other column":
        scaled = (torch.randn((bs, 2 * vocab), generator=gen) * 2)[:, ::2]
    else:
        scaled = (torch.randn((2 * bs + 1, vocab + 40), generator=gen) * 2)[1::2, 7 : 7 + vocab]
    assert not scaled.is_contiguous()
    got = gumbel_argmax(scaled, seeds, positions, block=512)
    assert_same_choice(got, scaled, seeds, positions)
    assert torch.equal(got, gumbel_argmax(scaled.contiguous(), seeds, positions, block=512))


def test_ties_go_to_the_lowest_token_id(gen) -> None:
    # +inf plus any noise stays +inf, so these rows tie exactly; torch.argmax takes the first.
    seeds, positions = keys(gen, 3)
    scaled = torch.randn((3, 2000), generator=gen)
    scaled[0, [1500, 700, 1900]] = float("inf")  # in three different 512-wide tiles
    scaled[1, [710, 700]] = float("inf")  # in one tile
    scaled[2, [1999, 1024]] = float("inf")  # the first token of a tile and the last of the row
    got = gumbel_argmax(scaled, seeds, positions, block=512)
    assert got.tolist() == [700, 700, 1024]
    assert torch.equal(got, reference_scores(scaled, seeds, positions).argmax(dim=-1))


def test_wrong_key_tensors_are_rejected() -> None:
    scaled = torch.zeros((2, 16))
    with pytest.raises(ValueError, match="seeds"):
        gumbel_argmax(scaled, torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="positions"):
        gumbel_argmax(scaled, torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64))


def test_frequencies_match_softmax_over_temperature() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.5])
    draws, temperature = 800, 0.7
    seeds = torch.arange(draws, dtype=torch.int64) * 7919 - 400
    positions = torch.arange(draws, dtype=torch.int64) % 13
    tokens = gumbel_argmax((logits / temperature).expand(draws, -1), seeds, positions)

    def chi_square(probs: torch.Tensor) -> float:
        observed = torch.bincount(tokens, minlength=8).double()
        expected = probs.double() * draws
        return float(((observed - expected) ** 2 / expected).sum())

    assert chi_square(torch.softmax(logits / temperature, -1)) < CHI2_CRITICAL_P001_7
    # The test has power: the untempered distribution is rejected.
    assert chi_square(torch.softmax(logits, -1)) > CHI2_CRITICAL_P001_7


def _sample(logits: torch.Tensor, positions: torch.Tensor, **params: list) -> torch.Tensor:
    bs, vocab = logits.shape
    settings: dict[str, list] = {"top_ps": [1.0] * bs, "top_ks": [-1] * bs, "min_ps": [0.0] * bs}
    settings.update(params)
    info = SamplingBatchInfo.build(vocab_size=vocab, device="cpu", **settings)  # type: ignore[arg-type]
    return Sampler()(logits, info, positions).next_token_ids


@pytest.mark.parametrize(
    ("stage", "uses_kernel"), [("temperature", True), ("min_p", True), ("top_p", False), ("top_k", False)]
)
def test_sampler_takes_the_kernel_unless_top_k_or_top_p(gen, monkeypatch, stage, uses_kernel) -> None:
    bs, vocab = 4, 1500
    logits = torch.randn((bs, vocab), generator=gen) * 2
    positions = torch.randint(0, 5000, (bs,), generator=gen)
    params: dict[str, list] = {
        "temperatures": [0.7, 0.0, 1.3, 0.9],  # row 1 greedy
        "seeds": torch.randint(INT64_MIN, INT64_MAX, (bs,), generator=gen).tolist(),
    }
    if stage == "min_p":
        params["min_ps"] = [0.05, 0.0, 0.1, 0.0]
    elif stage == "top_p":
        params["top_ps"] = [0.9] * bs
    elif stage == "top_k":
        params["top_ks"] = [50] * bs
    torch_tokens = _sample(logits, positions, **params)

    calls = []

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(args)
        return gumbel_argmax(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(sampler, "FUSED_GUMBEL_ON_CPU", True)
    monkeypatch.setattr(kernels.sampling, "gumbel_argmax", counted)
    kernel_tokens = _sample(logits, positions, **params)
    assert len(calls) == (1 if uses_kernel else 0)
    assert torch.equal(kernel_tokens, torch_tokens)
    assert kernel_tokens[1] == logits[1].argmax()


@pytest.mark.parametrize("block", [16, 64, 2048])
def test_greedy_argmax_is_torch_argmax(gen, block) -> None:
    """greedy_argmax == torch.argmax row by row: random rows, ties (the first index wins, in another tile
    than the second), NaNs (the first NaN wins, even over +inf), -0.0 beside +0.0 (equal: the first),
    an all -inf row (token 0), bfloat16 rows read through a column slice of a wider buffer."""
    rows = torch.randn((6, 1000), generator=gen)
    rows[1, 700] = rows[1, 30] = rows[1].max() + 1
    rows[2, 900], rows[2, 10], rows[2, 400] = float("inf"), float("nan"), float("nan")
    rows[3] = -1.0
    rows[3, 555], rows[3, 111] = -0.0, 0.0
    rows[4] = float("-inf")
    rows[5, 999] = rows[5].max() + 1  # the last token of a tile that runs past the vocabulary
    got = kernels.sampling.greedy_argmax(rows, block=block)
    assert got.dtype == torch.int64 and torch.equal(got, rows.argmax(dim=-1))
    assert got[1:5].tolist() == [30, 10, 111, 0]
    wide = torch.randn((3, 1200), generator=gen).to(torch.bfloat16)
    assert torch.equal(kernels.sampling.greedy_argmax(wide[:, :1001], block=block), wide[:, :1001].argmax(dim=-1))
    # Every launch leaves its row counters zero for the next one.
    assert not kernels.sampling._greedy_counters[rows.device].any()


def test_greedy_argmax_rejects_what_it_cannot_take() -> None:
    with pytest.raises(ValueError, match="expected \\[bs, V\\]"):
        kernels.sampling.greedy_argmax(torch.zeros(5))
    with pytest.raises(ValueError, match="V >= 1"):
        kernels.sampling.greedy_argmax(torch.zeros(2, 0))
    assert kernels.sampling.greedy_argmax(torch.zeros(0, 7)).shape == (0,)
