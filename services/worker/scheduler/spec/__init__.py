"""Speculative decoding: a cheap proposer guesses the next k tokens of each decoding request, and the
target model checks all of them in one forward, keeping the longest run it agrees with plus one token
of its own. Decode is memory-bound, so checking k tokens costs about as much as generating one.

    ngram.py        proposer: prompt lookup (the request's own tokens), no model
    draft.py        proposer: a small draft model with its own KV pool
    verify.py       acceptance (greedy: argmax matches; sampling: min(1, p/q), residual resampling)
    spec_worker.py  one speculative decode step inside the scheduler: propose, verify, free rejects

A proposer is anything with the `Proposer` methods below; the spec worker owns exactly one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from services.worker.scheduler.req import Req


@dataclass
class Proposal:
    """Proposed tokens per request (possibly fewer than asked, possibly none) and the distribution
    each was drawn from: probs[r] is the row of the r-th proposed token overall, requests in batch
    order; None when every token is a point mass (n-gram lookup, or greedy drafting)."""

    tokens: list[list[int]]
    probs: torch.Tensor | None = None
    # Set by a proposer whose tokens are still on the device (the draft model): every request's
    # proposals, request-major in batch order, while `tokens` holds placeholders of the right lengths.
    # The verify forward reads them there, and they reach the host with the target's own tokens in
    # one read-back (resolve), instead of a sync of their own between drafting and verifying.
    device_tokens: torch.Tensor | None = None

    def resolve(self, flat: list[int]) -> None:
        """Replace the placeholders with the proposals read back from device_tokens."""
        at = 0
        for i, draft in enumerate(self.tokens):
            self.tokens[i] = flat[at : at + len(draft)]
            at += len(draft)
        assert at == len(flat), "one read-back value per proposed token"
        self.device_tokens = None


class Proposer(Protocol):
    """What the spec worker asks of a proposer, once per speculative decode step."""

    def propose(self, reqs: list[Req], limits: list[int]) -> Proposal:
        """At most limits[i] tokens to follow request i's tokens so far (req.all_ids)."""
        ...

    def commit(self, reqs: list[Req], num_accepted: list[int]) -> None:
        """The target accepted num_accepted[i] of request i's proposed tokens: drop the rest's state."""
        ...

    def release(self, req: Req) -> None:
        """The request finished or left the running batch: free everything held for it."""
        ...

    def retain_only(self, reqs: list[Req]) -> None:
        """Release every request not in `reqs` (the running batch): retracted requests leave it
        without passing through `release`."""
        ...

    def check_pool_invariant(self) -> None:
        """AssertionError when the proposer's own memory does not add up."""
        ...
