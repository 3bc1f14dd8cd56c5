"""Penalties: the logit changes that depend on which tokens a request has already seen.

- repetition (HF `RepetitionPenaltyLogitsProcessor`): for tokens in the prompt or the output, a
  positive logit is divided by the penalty and a negative one multiplied by it;
- frequency / presence (OpenAI): on output tokens, logit -= frequency * count + presence * (count > 0);
- bans: tokens that may not be sampled this step (EOS and stop ids before min_new_tokens) get -inf.

Repetition goes first, then frequency/presence (vLLM's order). The per-token state is a [bs, V] tensor
built with one scatter from the flattened id lists, and only when some row needs it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

# One request's token ids: a list, or a 1-D CPU tensor (cheaper for long prompts kept as tensors).
TokenIds = Sequence[int] | torch.Tensor


@dataclass
class PenaltyState:
    """Device tensors for one batch's penalties; a field is None when no row uses that penalty."""

    repetition: torch.Tensor | None = None  # [bs, 1] float32, 1.0 where unused
    seen: torch.Tensor | None = None  # [bs, V] bool, token occurs in the prompt or the output
    frequency: torch.Tensor | None = None  # [bs, 1] float32
    presence: torch.Tensor | None = None  # [bs, 1] float32
    output_counts: torch.Tensor | None = None  # [bs, V] float32, occurrences in the output
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, token ids), both int64

    @classmethod
    def build(
        cls,
        *,
        batch_size: int,
        vocab_size: int,
        device: torch.device,
        repetition_penalties: Sequence[float] | None = None,
        frequency_penalties: Sequence[float] | None = None,
        presence_penalties: Sequence[float] | None = None,
        prompt_ids: Sequence[TokenIds] | None = None,
        output_ids: Sequence[TokenIds] | None = None,
        pending_output_ids: torch.Tensor | None = None,
        banned_ids: Sequence[Sequence[int]] | None = None,
    ) -> PenaltyState | None:
        """Tensors for the penalties some row actually uses, or None when no row uses any.

        prompt_ids / output_ids: each request's tokens known on the host. pending_output_ids: [bs]
        int64 on `device`, a token per row sampled by a step still in flight (overlap scheduling),
        -1 where there is none; it counts as the newest output token.
        """
        bs = batch_size
        for name, values in (
            ("repetition_penalties", repetition_penalties),
            ("frequency_penalties", frequency_penalties),
            ("presence_penalties", presence_penalties),
            ("prompt_ids", prompt_ids),
            ("output_ids", output_ids),
            ("banned_ids", banned_ids),
        ):
            if values is not None and len(values) != bs:
                raise ValueError(f"{name} has {len(values)} entries for a batch of {bs}")
        if pending_output_ids is not None and tuple(pending_output_ids.shape) != (bs,):
            raise ValueError(
                f"pending_output_ids must have shape ({bs},), got {tuple(pending_output_ids.shape)}"
            )

        rep = list(repetition_penalties) if repetition_penalties is not None else [1.0] * bs
        freq = list(frequency_penalties) if frequency_penalties is not None else [0.0] * bs
        pres = list(presence_penalties) if presence_penalties is not None else [0.0] * bs
        rep_rows = [r != 1.0 for r in rep]
        count_rows = [f != 0.0 or p != 0.0 for f, p in zip(freq, pres)]
        if not (any(rep_rows) or any(count_rows) or (banned_ids is not None and any(banned_ids))):
            return None

        state = cls()
        no_ids: list[TokenIds] = [[] for _ in range(bs)]
        prompts = prompt_ids if prompt_ids is not None else no_ids
        outputs = output_ids if output_ids is not None else no_ids
        if any(rep_rows):
            state.repetition = _column(rep, device)
            both = [_concat(p, o) if use else [] for p, o, use in zip(prompts, outputs, rep_rows)]
            seen_counts = _count_tokens(both, vocab_size, device, "prompt_ids/output_ids")
            _add_pending(seen_counts, pending_output_ids)
            state.seen = seen_counts > 0
        if any(count_rows):
            state.frequency = _column(freq, device)
            state.presence = _column(pres, device)
            used = [o if use else [] for o, use in zip(outputs, count_rows)]
            state.output_counts = _count_tokens(used, vocab_size, device, "output_ids")
            _add_pending(state.output_counts, pending_output_ids)
        if banned_ids is not None and any(banned_ids):
            state.banned = row_token_pairs(banned_ids, vocab_size, device, "banned_ids")
        return state

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Penalised copy of logits [bs, V] (the input is left untouched)."""
        if self.seen is not None and self.repetition is not None:
            penalised = torch.where(logits < 0, logits * self.repetition, logits / self.repetition)
            logits = torch.where(self.seen, penalised, logits)
        if self.output_counts is not None and self.frequency is not None and self.presence is not None:
            counts = self.output_counts
            logits = logits - (self.frequency * counts + self.presence * (counts > 0).to(counts.dtype))
        if self.banned is not None:
            # new_full fills on the device; torch.tensor(..., device=cuda) would be a synchronising copy.
            logits = logits.index_put(self.banned, logits.new_full((), float("-inf")))
        return logits


def row_token_pairs(
    per_row: Sequence[Iterable[int]], vocab_size: int, device: torch.device, name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, token ids) as int64 tensors on `device`, one pair per token of each row's ids (an
    index_put index); ValueError naming `name` for an id outside the vocabulary."""
    rows = [i for i, ids in enumerate(per_row) for _ in ids]
    ids = [int(t) for row in per_row for t in row]
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise ValueError(f"{name} holds a token id outside [0, {vocab_size})")
    pair = to_device_async(torch.tensor([rows, ids], dtype=torch.int64), device)
    return pair[0], pair[1]


def _concat(a: TokenIds, b: TokenIds) -> TokenIds:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.cat([torch.as_tensor(a, dtype=torch.int64), torch.as_tensor(b, dtype=torch.int64)])
    return [*a, *b]


def _count_tokens(rows: Sequence[TokenIds], vocab_size: int, device: torch.device, name: str) -> torch.Tensor:
    """counts[i, t] = occurrences of token t in rows[i], as float32 [len(rows), vocab_size]."""
    parts = [torch.as_tensor(r, dtype=torch.int64).reshape(-1) for r in rows]
    lengths = torch.tensor([p.numel() for p in parts], dtype=torch.int64)
    counts = torch.zeros((len(rows), vocab_size), dtype=torch.float32, device=device)
    if int(lengths.sum()) == 0:
        return counts
    ids = torch.cat(parts)
    # Checked on the host copy: an out-of-range index would be a device-side assert on CUDA.
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"{name} holds a token id outside [0, {vocab_size})")
    row_of = torch.repeat_interleave(torch.arange(len(rows), dtype=torch.int64), lengths)
    pair = to_device_async(torch.stack([row_of, ids]), device)
    counts.index_put_((pair[0], pair[1]), torch.ones((), device=device), accumulate=True)
    return counts


def _add_pending(counts: torch.Tensor, pending: torch.Tensor | None) -> None:
    if pending is None:
        return
    rows = torch.arange(counts.shape[0], device=counts.device)
    valid = (pending >= 0).to(counts.dtype)
    counts.index_put_((rows, pending.clamp(min=0)), valid, accumulate=True)


def _column(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return to_device_async(torch.tensor(values, dtype=torch.float32).unsqueeze(1), device)


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device copy that does not wait for the device's queued work (pinned, non-blocking)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
