"""Exact verification of proposed tokens: the target's distribution p decides, the proposer's q only
makes the guess.

For each request, target row j holds p for the position of draft token j (row n, after the last
draft, is the bonus position). Walking the drafts in order, draft x is accepted with probability
min(1, p(x) / q(x)); at the first rejection the next token is drawn from norm(max(0, p - q)) and the
walk stops; when every draft is accepted, one bonus token is drawn from p. The tokens produced are
then distributed exactly as if the target had sampled them one by one (Leviathan et al., Chen et al.
2023). A proposer without a distribution (n-gram lookup) is a point mass: q(x) = 1.

Greedy rows need no special case: their p is one-hot at the argmax, so a draft is accepted exactly
when it is the argmax, and the residual of a rejection is the argmax again.

Randomness is hashed from (seed, position) as in the sampler, so verification is reproducible and
a request's tokens do not depend on its batch: the acceptance test draws its uniform from a salted
seed, and the replacement / bonus token uses the sampler's own Gumbel noise for that position (with
no drafts, speculation samples exactly what plain decoding samples).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.runtime.sampling.sampler import gumbel_noise, hashed_uniform

# Salts XORed into a request's seed so the acceptance uniforms and the draft model's sampling noise
# are streams independent of the target sampler's (and of each other).
ACCEPT_SALT = 0x5A17_C0DE_0BAD_F00D
DRAFT_SALT = 0x0D12_AF75_EED5_1DE5


@dataclass
class Verdict:
    """Per request: how many drafts were accepted, and the tokens to append (the accepted drafts
    followed by the target's own token)."""

    num_accepted: list[int]
    tokens: list[list[int]]


def verify(
    target_logits: torch.Tensor,
    drafts: list[list[int]],
    draft_probs: torch.Tensor | None,
    seeds: torch.Tensor,
    first_positions: torch.Tensor,
) -> Verdict:
    """Accept or reject every request's drafts in one batched pass (one host sync).

    target_logits: [sum(n_i + 1), V] float32, the distribution logits each row samples from (after
        penalties, temperature and truncation: `processed_logits`), request i's n_i + 1 rows together.
    drafts: request i's n_i proposed token ids.
    draft_probs: [sum(n_i), V] the proposer's distribution for each draft, in the same order; None
        for point masses.
    seeds: [bs] int64, each request's sampling seed; first_positions: [bs] int64, the position of
        each request's first draft token (its sequence length before the step).
    """
    device = target_logits.device
    bs = len(drafts)
    counts = torch.tensor([len(d) for d in drafts], dtype=torch.int64)
    num_drafts = int(counts.sum())
    row_starts = (torch.cumsum(counts + 1, 0) - (counts + 1)).to(device)
    draft_starts = (torch.cumsum(counts, 0) - counts).to(device)
    counts_d = counts.to(device)
    p = target_logits.float().softmax(dim=-1)

    # The acceptance test of every draft at once; the walk is the run of leading acceptances.
    owner = torch.repeat_interleave(torch.arange(bs), counts).to(device)
    offset = torch.arange(num_drafts, device=device) - draft_starts[owner]
    tokens = torch.tensor([t for d in drafts for t in d], dtype=torch.int64).to(device)
    p_draft = p[row_starts[owner] + offset, tokens]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs[torch.arange(num_drafts, device=device), tokens].float()
    zero = torch.zeros(1, 1, dtype=torch.int64, device=device)
    uniform = hashed_uniform(seeds[owner] ^ ACCEPT_SALT, first_positions[owner] + offset, zero)[:, 0]
    # u < p / q without the division (q may underflow to 0 for a very unlikely draft).
    accepted = uniform * q_draft < p_draft
    width = int(counts.max()) if bs else 0
    grid = torch.zeros(bs, width, dtype=torch.int64, device=device)
    grid[owner, offset] = accepted.to(torch.int64)
    num_accepted = grid.cumprod(dim=1).sum(dim=1)

    # The next token: from the residual after a rejection, from p itself after full acceptance.
    rejected = num_accepted < counts_d
    next_p = p[row_starts + num_accepted]
    if num_drafts:
        at = (draft_starts + num_accepted).clamp(max=num_drafts - 1)
        if draft_probs is None:
            next_q = torch.zeros_like(next_p).scatter_(1, tokens[at].unsqueeze(1), 1.0)
        else:
            next_q = draft_probs[at].float()
        residual = (next_p - next_q * rejected.unsqueeze(1)).clamp(min=0.0)
        # p and q that agree to rounding leave nothing; p is then the right distribution anyway.
        empty = residual.sum(dim=1, keepdim=True) <= 0
        residual = torch.where(empty, next_p, residual)
    else:
        residual = next_p
    vocab = torch.arange(p.shape[-1], device=device).unsqueeze(0)
    noise = gumbel_noise(seeds, first_positions + num_accepted, vocab)
    next_tokens = (residual.log() + noise).argmax(dim=-1)

    accepted_host, next_host = torch.stack((num_accepted, next_tokens)).tolist()
    out = [d[:a] + [t] for d, a, t in zip(drafts, accepted_host, next_host)]
    return Verdict(accepted_host, out)


def verify_greedy(target_argmax: list[int], drafts: list[list[int]]) -> Verdict:
    """verify() for requests that all decode greedily, from the target's argmax at each row (request
    i's n_i + 1 rows together, as in verify): p is then one-hot, so a draft is accepted exactly when it
    is the argmax, and the token after the accepted run is the argmax there. The same Verdict as
    verify() on those rows, from one argmax instead of the distribution pipeline."""
    num_accepted: list[int] = []
    tokens: list[list[int]] = []
    first = 0
    for draft in drafts:
        n = 0
        while n < len(draft) and draft[n] == target_argmax[first + n]:
            n += 1
        num_accepted.append(n)
        tokens.append(draft[:n] + [target_argmax[first + n]])
        first += len(draft) + 1
    return Verdict(num_accepted, tokens)
