"""N-gram (prompt lookup) proposer: find the request's last few tokens earlier in its own tokens
(prompt and output) and propose what followed them there.

It costs no model and no memory, and it shines where the output copies its input: rewriting, quoting,
editing or summarising a given passage, code edits. Its proposals are point masses (q(x) = 1), so
under sampling a proposed token x is accepted with probability p(x).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.worker.scheduler.spec import Proposal

if TYPE_CHECKING:
    from services.worker.scheduler.req import Req


def ngram_lookup(ids: list[int], num_tokens: int, max_match: int, min_match: int) -> list[int]:
    """Up to num_tokens tokens that followed the longest earlier occurrence of ids' suffix (at least
    min_match, at most max_match tokens long); the most recent occurrence wins a tie. [] when the
    suffix occurs nowhere else."""
    n = len(ids)
    if num_tokens < 1 or n < 2:
        return []
    last = ids[-1]
    best_len, best_end = 0, -1
    # Candidate ends: earlier positions holding the last token, newest first; each one's match is
    # grown backwards.
    end = n - 1
    while best_len < max_match:
        try:
            end = _rindex(ids, last, end)
        except ValueError:
            break
        length = 1
        while length < max_match and end - length >= 0 and ids[end - length] == ids[n - 1 - length]:
            length += 1
        if length > best_len:
            best_len, best_end = length, end
    if best_len < min_match:
        return []
    return ids[best_end + 1 : best_end + 1 + num_tokens]


def _rindex(ids: list[int], value: int, stop: int) -> int:
    """The last index < stop holding value (ValueError when none)."""
    for i in range(stop - 1, -1, -1):
        if ids[i] == value:
            return i
    raise ValueError(value)


class NgramProposer:
    """Prompt-lookup proposer (see the module docstring); it holds no per-request state."""

    def __init__(self, max_match: int, min_match: int) -> None:
        self.max_match = max_match
        self.min_match = min_match

    def propose(self, reqs: list[Req], limits: list[int]) -> Proposal:
        return Proposal(
            [ngram_lookup(r.all_ids, n, self.max_match, self.min_match) if n else [] for r, n in zip(reqs, limits)]
        )

    def commit(self, reqs: list[Req], num_accepted: list[int]) -> None:
        pass

    def release(self, req: Req) -> None:
        pass

    def retain_only(self, reqs: list[Req]) -> None:
        pass

    def check_pool_invariant(self) -> None:
        pass
