"""The batched sampler: next-token logits [bs, V] -> token ids, on the logits' device, no host sync.

Pipeline per row (each row has its own parameters):
  penalties (penalties.py) -> logit_bias -> grammar mask (grammar.py) -> greedy rows: argmax here, done
  -> / temperature -> top-k -> top-p -> min-p (HF's order and semantics; one ascending sort serves all
  three) -> Gumbel-max with noise hashed from (seed, position, token id).

Seeded noise: a request's noise depends only on its own seed, the position being generated and the
token id, so its tokens do not depend on what else is in the batch or on its row, and sampling is
reproducible and testable. The scheduler draws a seed for requests that bring none.

On CUDA, unless top-k or top-p needs the sorted path, the noise and the argmax over the vocabulary (after
any min-p mask) are one fused Triton kernel (kernels/sampling.py: the same hashed uniforms bit for bit,
the same lowest-id tie-break) instead of ~20 elementwise passes over [bs, V] int64 tensors; CPU tensors and the
top-k/top-p path use the torch ops here.

Log-probs follow SGLang: log_softmax of the penalised, temperature-scaled logits, before top-k/top-p/
min-p truncation (greedy rows use temperature 1), so a truncated-away token still has a finite log-prob.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kernels.cpu_matvec import row_ops
from services.worker.runtime.sampling.grammar import apply_bitmask
from services.worker.runtime.sampling.penalties import (
    PenaltyState,
    TokenIds,
    row_token_pairs,
    to_device_async,
)
from shared.sampling_params import SAMPLING_EPS, SamplingParams


def _signed64(x: int) -> int:
    """A Python int as the int64 with the same low 64 bits (so any seed fits a tensor)."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


# Tests set this to run the CUDA path's Triton kernel on CPU tensors, through Triton's interpreter.
FUSED_GUMBEL_ON_CPU = False

# splitmix64 constants (Steele et al.), as signed int64 so torch accepts them as scalars.
_GAMMA = _signed64(0x9E3779B97F4A7C15)
_MIX1 = _signed64(0xBF58476D1CE4E5B9)
_MIX2 = _signed64(0x94D049BB133111EB)


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    # torch's >> on int64 is arithmetic; masking off the copied sign bits makes it logical.
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (multiplication wraps mod 2**64)."""
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def hashed_uniform(seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Uniform (0, 1) float32 noise u[i, j] = f(seeds[i], positions[i], token_ids[i or 0, j]).

    seeds, positions: [bs] int64; token_ids: [bs, n] or [1, n] int64. 23 random bits per value, so
    (k + 0.5) / 2**23 is exact in float32 and u never reaches 0 or 1.
    """
    row_key = mix64(mix64(seeds) + positions * _GAMMA).unsqueeze(1)
    bits = _shift_right(mix64(row_key + token_ids * _GAMMA), 41)
    return (bits.to(torch.float32) + 0.5) * (2.0**-23)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise keyed like `hashed_uniform`: argmax(logits + noise) samples softmax(logits)."""
    return -torch.log(-torch.log(hashed_uniform(seeds, positions, token_ids)))


@dataclass
class SamplingBatchInfo:
    """One step's sampling parameters as device tensors, built once per batch from per-request lists.

    Greedy rows (temperature < 1e-5 or top_k == 1) are stored as temperature 1, top_k 1. The boolean
    flags are host-side summaries so the sampler skips unused stages without reading the device.
    """

    temperatures: torch.Tensor  # [bs, 1] float32
    top_ps: torch.Tensor  # [bs, 1] float32
    top_ks: torch.Tensor  # [bs, 1] int64 in [1, vocab_size] (off = vocab_size)
    min_ps: torch.Tensor  # [bs, 1] float32
    seeds: torch.Tensor  # [bs] int64
    is_greedy: torch.Tensor  # [bs] bool
    penalties: PenaltyState | None
    vocab_size: int
    all_greedy: bool
    any_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    # OpenAI's logit_bias: (rows, token ids, biases) added to the penalised logits; None when unused.
    # Kept out of PenaltyState: it never changes during a request, so a decode step may reuse it.
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Constrained decoding (grammar.py): (rows, bitmask), bitmask int32 [len(rows), ceil(V / 32)], bit
    # j of word w allowing token 32 w + j; every other token of those rows is -inf. Set per step
    # (dataclasses.replace), never cached.
    grammar: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def batch_size(self) -> int:
        return int(self.seeds.shape[0])

    @classmethod
    def build(
        cls,
        *,
        temperatures: Sequence[float],
        top_ps: Sequence[float],
        top_ks: Sequence[int],
        min_ps: Sequence[float],
        seeds: Sequence[int],
        vocab_size: int,
        device: torch.device | str,
        repetition_penalties: Sequence[float] | None = None,
        frequency_penalties: Sequence[float] | None = None,
        presence_penalties: Sequence[float] | None = None,
        prompt_ids: Sequence[TokenIds] | None = None,
        output_ids: Sequence[TokenIds] | None = None,
        pending_output_ids: torch.Tensor | None = None,
        banned_ids: Sequence[Sequence[int]] | None = None,
        logit_biases: Sequence[Mapping[int, float] | None] | None = None,
    ) -> SamplingBatchInfo:
        """Per-request lists (all of length bs, in batch row order) -> device tensors.

        Values are taken as verified (SamplingParams.verify); top_k -1 means off. prompt_ids and
        output_ids are only read for rows with a penalty; banned_ids[i] are tokens row i may not
        sample this step; logit_biases[i] maps token ids to what row i adds to their logits. See
        PenaltyState.build for pending_output_ids (overlap scheduling).
        """
        device = torch.device(device)
        bs = len(seeds)
        for name, values in (
            ("temperatures", temperatures),
            ("top_ps", top_ps),
            ("top_ks", top_ks),
            ("min_ps", min_ps),
        ):
            if len(values) != bs:
                raise ValueError(f"{name} has {len(values)} entries for a batch of {bs} seeds")
        greedy = [t < SAMPLING_EPS or k == 1 for t, k in zip(temperatures, top_ks)]
        temps = [1.0 if g else float(t) for t, g in zip(temperatures, greedy)]
        ks = [1 if g else (vocab_size if k < 1 or k > vocab_size else int(k)) for k, g in zip(top_ks, greedy)]
        sampled = [not g for g in greedy]
        floats = torch.tensor([temps, list(top_ps), list(min_ps)], dtype=torch.float32).T.unsqueeze(2)
        ints = torch.tensor([ks, [_signed64(int(s)) for s in seeds], greedy], dtype=torch.int64)
        floats, ints = to_device_async(floats.contiguous(), device), to_device_async(ints, device)
        return cls(
            temperatures=floats[:, 0],
            top_ps=floats[:, 1],
            min_ps=floats[:, 2],
            top_ks=ints[0].unsqueeze(1),
            seeds=ints[1],
            is_greedy=ints[2].bool(),
            penalties=PenaltyState.build(
                batch_size=bs,
                vocab_size=vocab_size,
                device=device,
                repetition_penalties=repetition_penalties,
                frequency_penalties=frequency_penalties,
                presence_penalties=presence_penalties,
                prompt_ids=prompt_ids,
                output_ids=output_ids,
                pending_output_ids=pending_output_ids,
                banned_ids=banned_ids,
            ),
            vocab_size=vocab_size,
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            need_top_k=any(s and k < vocab_size for s, k in zip(sampled, ks)),
            need_top_p=any(s and p < 1.0 for s, p in zip(sampled, top_ps)),
            need_min_p=any(s and m > 0.0 for s, m in zip(sampled, min_ps)),
            bias=_bias_tensors(logit_biases, bs, vocab_size, device),
        )

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        *,
        vocab_size: int,
        device: torch.device | str,
        prompt_ids: Sequence[TokenIds] | None = None,
        output_ids: Sequence[TokenIds] | None = None,
        num_output_tokens: Sequence[int] | None = None,
        eos_token_ids: Sequence[int] = (),
        pending_output_ids: torch.Tensor | None = None,
    ) -> SamplingBatchInfo:
        """The usual entry point: one SamplingParams and one seed per row.

        A row with fewer than min_new_tokens output tokens may not sample EOS (unless ignore_eos) or
        its stop_token_ids. num_output_tokens[i] defaults to len(output_ids[i]); pass it when the
        host lists lag behind (overlap scheduling).
        """
        if len(seeds) != len(params):
            raise ValueError(f"seeds has {len(seeds)} entries for {len(params)} requests")
        if num_output_tokens is None:
            num_output_tokens = [len(o) for o in output_ids] if output_ids is not None else [0] * len(params)
        banned: list[list[int]] = []
        for p, produced in zip(params, num_output_tokens):
            row: list[int] = []
            if produced < p.min_new_tokens:
                row = list(p.stop_token_ids or []) + ([] if p.ignore_eos else list(eos_token_ids))
            banned.append(row)
        return cls.build(
            temperatures=[p.temperature for p in params],
            top_ps=[p.top_p for p in params],
            top_ks=[p.top_k for p in params],
            min_ps=[p.min_p for p in params],
            seeds=seeds,
            vocab_size=vocab_size,
            device=device,
            repetition_penalties=[p.repetition_penalty for p in params],
            frequency_penalties=[p.frequency_penalty for p in params],
            presence_penalties=[p.presence_penalty for p in params],
            prompt_ids=prompt_ids,
            output_ids=output_ids,
            pending_output_ids=pending_output_ids,
            banned_ids=banned,
            logit_biases=[p.logit_bias for p in params],
        )


def _bias_tensors(
    biases: Sequence[Mapping[int, float] | None] | None, bs: int, vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(rows, token ids, biases) on `device` for the rows with a logit_bias, or None."""
    if biases is None or not any(biases):
        return None
    if len(biases) != bs:
        raise ValueError(f"logit_biases has {len(biases)} entries for a batch of {bs}")
    rows, ids = row_token_pairs([row or {} for row in biases], vocab_size, device, "logit_biases")
    values = [float(v) for row in biases for v in (row or {}).values()]
    return rows, ids, to_device_async(torch.tensor(values, dtype=torch.float32), device)


@dataclass
class SampleOutput:
    """The sampler's result for one batch; every tensor is on the logits' device."""

    next_token_ids: torch.Tensor  # [bs] int64
    logprobs: torch.Tensor | None = None  # [bs] float32, log-prob of the chosen token
    top_logprobs_ids: torch.Tensor | None = None  # [bs, k] int64, most likely first
    top_logprobs_vals: torch.Tensor | None = None  # [bs, k] float32


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dimension (the first index of a row's maximum; a NaN counts as the maximum). On
    the CPU through kernels/cpu/rows.cpp's argmax_rows where the library is loaded (float32 rows with
    contiguous values: SmolLM2's [16, 49152] logits in ~0.05 ms against max(dim)'s ~0.75 on a 2-vCPU EPYC),
    else max(dim), which returns the same indices 2-3x faster than argmax. On CUDA [bs, V] rows take
    kernels/sampling.py's greedy_argmax (the same indices in one launch spread over the SMs)."""
    if logits.device.type != "cpu":
        # Imported here: triton is needed (and installed) only where CUDA runs.
        from kernels.sampling import greedy_argmax
        from kernels.step_inputs import step_kernels_enabled

        if logits.dim() == 2 and logits.shape[-1] > 0 and step_kernels_enabled(logits.device):
            return greedy_argmax(logits)
        return logits.argmax(dim=-1)
    ops = row_ops()
    if ops is not None and logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(-1) == 1:
        if logits.shape[-1] > 0:
            return ops.argmax_rows(logits)
    return logits.max(dim=-1).indices


def penalized_logits(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """float32 logits after penalties, bans, logit_bias and the grammar masks (greedy rows take the
    argmax of exactly this). A banned or disallowed token stays at -inf whatever its bias."""
    source = logits
    logits = logits.float()
    if info.penalties is not None:
        logits = info.penalties.apply(logits)
    if info.bias is not None:
        rows, ids, values = info.bias
        logits = logits.index_put((rows, ids), values, accumulate=True)  # a copy: the input is kept
    if info.grammar is not None:
        if logits is source and logits.is_cuda:
            logits = logits.clone()  # the mask kernel writes in place; the input is kept
        logits = apply_bitmask(logits, *info.grammar)
    return logits


def _truncate_sorted(scaled: torch.Tensor, info: SamplingBatchInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k, then top-p on the renormalised survivors, then min-p, in ascending-sorted space (as HF
    sorts for top-p, so the cumulative sums match it). Returns (masked sorted logits, their token ids)."""
    sorted_logits, sorted_ids = torch.sort(scaled, dim=-1, descending=False)
    vocab = scaled.shape[-1]
    neg_inf = float("-inf")
    if info.need_top_k:
        rank_from_top = vocab - 1 - torch.arange(vocab, device=scaled.device)
        sorted_logits = sorted_logits.masked_fill(rank_from_top.unsqueeze(0) >= info.top_ks, neg_inf)
    if info.need_top_p or info.need_min_p:
        probs = sorted_logits.softmax(dim=-1)
    if info.need_top_p:
        # Drop the low tail whose total mass is <= 1 - top_p; the most likely token always stays.
        remove = probs.cumsum(dim=-1) <= (1.0 - info.top_ps)
        remove[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(remove, neg_inf)
    if info.need_min_p:
        # min-p compares each token with the most likely one; that ratio is unchanged by the top-p
        # renormalisation, so the probabilities from before top-p serve.
        remove = probs < info.min_ps * probs[:, -1:]
        sorted_logits = sorted_logits.masked_fill(remove, neg_inf)
    return sorted_logits, sorted_ids


def _mask_min_p(scaled: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    probs = scaled.softmax(dim=-1)
    return scaled.masked_fill(probs < info.min_ps * probs.amax(dim=-1, keepdim=True), float("-inf"))


def processed_logits(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
    """The distribution each row samples from, as logits in vocab order: penalised, divided by the
    temperature, truncated tokens at -inf; greedy rows keep only their argmax. For tests and for
    speculative decoding's acceptance test."""
    penalised = penalized_logits(logits, info)
    scaled = penalised / info.temperatures
    if info.need_top_k or info.need_top_p:
        sorted_logits, sorted_ids = _truncate_sorted(scaled, info)
        out = torch.empty_like(scaled).scatter_(1, sorted_ids, sorted_logits)
    else:
        out = _mask_min_p(scaled, info) if info.need_min_p else scaled
    if info.any_greedy:
        vocab_ids = torch.arange(scaled.shape[-1], device=scaled.device)
        only_argmax = scaled.masked_fill(vocab_ids != penalised.argmax(dim=-1, keepdim=True), float("-inf"))
        out = torch.where(info.is_greedy.unsqueeze(1), only_argmax, out)
    return out


class Sampler:
    """Samples one token per row from next-token logits; see the module docstring for the pipeline."""

    def __call__(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        positions: torch.Tensor | None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
    ) -> SampleOutput:
        """logits: [bs, V]; positions: [bs] int64, the position of the token being generated (the
        sequence length so far), which keys the noise: only an all-greedy batch may pass None.
        top_logprobs_num is the batch maximum (0 = none); rows take a prefix."""
        penalised = penalized_logits(logits, info)
        if info.all_greedy:
            scaled = penalised
            next_ids = greedy_ids(penalised)
        else:
            scaled = penalised / info.temperatures
            if positions is None:
                raise ValueError("positions are required unless every row is greedy")
            next_ids = self._sample(scaled, info, positions.to(scaled.device, torch.int64))
            if info.any_greedy:
                next_ids = torch.where(info.is_greedy, greedy_ids(penalised), next_ids)
        out = SampleOutput(next_token_ids=next_ids)
        if return_logprob or top_logprobs_num > 0:
            all_logprobs = torch.log_softmax(scaled, dim=-1)
            if return_logprob:
                out.logprobs = all_logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1)
            if top_logprobs_num > 0:
                k = min(top_logprobs_num, all_logprobs.shape[-1])
                out.top_logprobs_vals, out.top_logprobs_ids = all_logprobs.topk(k, dim=-1)
        return out

    @staticmethod
    def _sample(scaled: torch.Tensor, info: SamplingBatchInfo, positions: torch.Tensor) -> torch.Tensor:
        """Gumbel-max over the truncated distribution; greedy rows are overwritten by the caller."""
        if info.need_top_k or info.need_top_p:
            candidates, token_ids = _truncate_sorted(scaled, info)
            noise = gumbel_noise(info.seeds, positions, token_ids)
            choice = (candidates + noise).argmax(dim=-1, keepdim=True)
            return token_ids.gather(1, choice).squeeze(1)
        candidates = _mask_min_p(scaled, info) if info.need_min_p else scaled
        if candidates.is_cuda or FUSED_GUMBEL_ON_CPU:
            # Imported here: triton is needed (and installed) only where CUDA runs.
            from kernels.sampling import gumbel_argmax

            return gumbel_argmax(candidates, info.seeds, positions)
        vocab_ids = torch.arange(scaled.shape[-1], device=scaled.device).unsqueeze(0)
        return (candidates + gumbel_noise(info.seeds, positions, vocab_ids)).argmax(dim=-1)
