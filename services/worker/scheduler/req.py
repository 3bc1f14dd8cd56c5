"""Req: one request's state inside the scheduler, from admission to finish.

Positions 0 .. kv_committed_len-1 of the request have KV in the pool, mapped by row `req_pool_idx`
of the ReqToTokenPool; the first len(prefix_indices) of them are shared with the radix cache (locked
through `last_node`), the rest are the request's own until it is cached or freed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from shared.detokenize import finished_text

if TYPE_CHECKING:
    from services.worker.mem.radix_cache import TreeNode
    from services.worker.runtime.sampling.grammar import GrammarBackend
    from shared.sampling_params import SamplingParams


@dataclass(frozen=True)
class FinishReason:
    """Why a request ended: 'stop' (EOS, a stop token or a stop string), 'length', 'abort' or 'error'."""

    type: str
    matched: int | str | None = None
    message: str | None = None
    status: int | None = None  # an 'error' final's HTTP status (shared.protocol.Finish)

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {"type": self.type}
        if self.matched is not None:
            out["matched"] = self.matched
        if self.message is not None:
            out["message"] = self.message
        if self.status is not None:
            out["status"] = self.status
        return out


_EMPTY = torch.empty(0, dtype=torch.int64)


class Req:
    """A request as the scheduler tracks it."""

    def __init__(
        self,
        rid: str,
        input_ids: list[int],
        sampling_params: SamplingParams,
        *,
        seed: int,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int | None = None,
        priority: int = 0,
        eos_token_ids: frozenset[int] = frozenset(),
        output_ids: list[int] | None = None,
    ) -> None:
        self.rid = rid
        self.origin_input_ids = list(input_ids)
        self.sampling_params = sampling_params
        self.seed = seed
        self.return_logprob = return_logprob
        self.top_logprobs_num = top_logprobs_num
        # Prompt log-probs (SGLang's logprob_start_len): those of prompt tokens k+1 .. n-1, each given
        # its prefix, computed in prefill from the logits at positions k .. n-2; None: none.
        self.logprob_start_len = logprob_start_len
        self.input_logprobs: list[float] = []  # position k + i's log-prob of the token after it
        self.input_top_logprobs: list[list[tuple[int, float]]] = []
        self.input_logprobs_sent = False  # they go out once, with the request's first sampled output
        self.priority = priority
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids or ()) | (
            frozenset() if sampling_params.ignore_eos else eos_token_ids
        )

        # Non-empty at the start only for a request migrated from a lost worker (its tokens so far).
        self.output_ids: list[int] = list(output_ids or [])
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[int, float]]] = []
        self.finished_reason: FinishReason | None = None
        # Stop strings are matched against the output's finished text (whole characters): its window
        # into output_ids (see shared.detokenize.finished_text) and its last characters so far.
        self._text_prefix = 0
        self._text_read = 0
        self._text_tail = ""

        # Memory state.
        self.req_pool_idx: int | None = None
        self.prefix_indices: torch.Tensor = _EMPTY
        self.last_node: TreeNode | None = None
        # Tokens of the last match with KV in the cache: past prefix_indices when a hybrid model's match
        # stopped at the deepest state snapshot (then the first chunk ends here, see PrefillAdder).
        self.cached_kv_len = 0
        self.kv_committed_len = 0
        # Hybrid models: the snapshot slot the current step writes the state one token short of its end
        # into, and that length (HybridRadixCache.track_state; the cache glue takes it back).
        self.track_slot: int | None = None
        self.track_len = 0
        # Tokens whose KV the current step makes resident (a prefix of all_ids for a chunk).
        self.fill_ids: list[int] = []
        self.extend_input_len = 0
        # Prompt tokens served from the cache at first admission (reported as cached_tokens).
        self.cached_tokens: int | None = None
        self.num_retractions = 0
        # When the request reached the worker (monotonic, the same clock in a scheduler process), and
        # the seconds from then to its first scheduled step (set at first admission; the queue time).
        self.arrival_time = time.monotonic()
        self.queue_time: float | None = None
        # Tokens sampled by launched steps but not yet read back (overlap scheduling: 0 or 1).
        self.num_inflight = 0
        # Speculative decoding: this request's decode steps, and the draft tokens proposed to and
        # accepted by the target in them (see spec_metrics).
        self.spec_verify_steps = 0
        self.spec_proposed_tokens = 0
        self.spec_accepted_tokens = 0
        # Constrained decoding: the llguidance matcher of the request's grammar, advanced by each
        # output token (made by the scheduler at admission; None when unconstrained).
        self.grammar: Any = None

    @property
    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def mark_admitted(self) -> None:
        """Its first admission to a batch: how long it waited in the queue, and how many of its prompt
        tokens the prefix cache gave it."""
        self.queue_time = time.monotonic() - self.arrival_time
        self.cached_tokens = len(self.prefix_indices)

    def finished(self) -> bool:
        return self.finished_reason is not None

    def next_prompt_logprob_position(self) -> int | None:
        """The first prompt position whose logits the request still needs for its prompt log-probs
        (positions up to n-2: the last one's logits pick the first output token), or None when it
        needs none. A prefix-cache hit stops short of it: a cached position has no logits."""
        if self.logprob_start_len is None:
            return None
        position = self.logprob_start_len + len(self.input_logprobs)
        return position if position < len(self.origin_input_ids) - 1 else None

    def prompt_logprob_span(self, start: int, end: int) -> range:
        """Positions of [start, end) (the tokens a step extends) whose logits give prompt log-probs."""
        first = self.next_prompt_logprob_position()
        if first is None:
            return range(0)
        return range(max(start, first), min(end, len(self.origin_input_ids) - 1))

    def init_next_round_input(self) -> None:
        """Before admission: everything generated so far must be resident after the next extend."""
        self.fill_ids = self.all_ids
        self.extend_input_len = len(self.fill_ids) - len(self.prefix_indices)

    def remaining_new_tokens(self) -> int:
        return max(self.sampling_params.max_new_tokens - len(self.output_ids), 0)

    def spec_metrics(self) -> tuple[float, float] | None:
        """(spec_accept_length, spec_accept_rate), or None when no speculative step ran.

        The accept length is the mean number of tokens a decode step gained, counting the target's
        own token after the accepted drafts, as SGLang does (1.0 = no gain); the rate is accepted
        drafts / proposed drafts (0.0 when none was proposed)."""
        if self.spec_verify_steps == 0:
            return None
        length = (self.spec_accepted_tokens + self.spec_verify_steps) / self.spec_verify_steps
        rate = self.spec_accepted_tokens / self.spec_proposed_tokens if self.spec_proposed_tokens else 0.0
        return length, rate

    def check_finished(self, tail_text: str | None) -> None:
        """After a token was appended. `tail_text` is the decoded tail of the output, given when the
        request has stop strings."""
        if self.finished_reason is not None:
            return
        params = self.sampling_params
        if len(self.output_ids) >= params.max_new_tokens:
            self.finished_reason = FinishReason("length", params.max_new_tokens)
            return
        if len(self.output_ids) < params.min_new_tokens:
            return
        last = self.output_ids[-1]
        if last in self.stop_token_ids:
            self.finished_reason = FinishReason("stop", last)
            return
        if tail_text is not None:
            for stop in params.stop_strings():
                if stop and stop in tail_text:
                    self.finished_reason = FinishReason("stop", stop)
                    return

    def _finished_tail(self, decode: Callable[[list[int]], str], longest: int) -> str:
        """The finished text the last token added, after the `longest - 1` characters before it (the
        most a stop string that ends in the new text reaches back). A window of the last ids would
        show U+FFFD for a character still incomplete at its end or cut at its start, and a stop
        string containing U+FFFD would match it."""
        new, self._text_prefix, self._text_read = finished_text(decode, self.output_ids, self._text_prefix, self._text_read)
        tail = self._text_tail + new
        self._text_tail = tail[max(0, len(tail) - longest + 1) :] if longest > 1 else ""
        return tail

    def attach_grammar(self, backend: GrammarBackend | None) -> None:
        """Compile the request's grammar into its matcher; ValueError when it cannot be (or there is
        no backend). A migrated request's grammar resumes after its tokens so far."""
        if backend is None:
            raise ValueError("this scheduler has no grammar backend (no tokenizer)")
        self.grammar = backend.matcher(self.sampling_params)
        for token in self.output_ids:
            if not self.grammar.consume_token(token):
                raise ValueError("the migrated tokens left the grammar")

    def append_output_token(self, token: int, decode_tail: Callable[[list[int]], str]) -> None:
        """Take a generated token and check for a finish (`decode_tail` detokenizes a few of the
        output's last ids, called only when the request has stop strings)."""
        self.output_ids.append(token)
        tail = None
        stops = self.sampling_params.stop_strings()
        if stops:
            tail = self._finished_tail(decode_tail, max(len(s) for s in stops))
        if self.grammar is not None:
            self.advance_grammar(token)
        self.check_finished(tail)

    def advance_grammar(self, token: int) -> None:
        """The grammar takes the request's new token: a request the grammar can take no further
        finishes ('stop', also when the token was its last by max_new_tokens, and without spending a
        step on EOS), one whose token it refuses (only when min_new_tokens bans the grammar's way
        out) ends as 'abort' saying why."""
        grammar = self.grammar
        if not grammar.consume_token(token):
            error = grammar.get_error().strip().splitlines()
            self.finished_reason = FinishReason(
                "abort", message=f"the output left its grammar: {error[0] if error else 'token refused'}"
            )
        elif grammar.is_stopped():
            self.finished_reason = FinishReason("stop", token if token in self.stop_token_ids else None)

    def reset_for_retract(self) -> None:
        """Back to the waiting queue: the memory state is released by the caller first."""
        self.req_pool_idx = None
        self.prefix_indices = _EMPTY
        self.last_node = None
        self.cached_kv_len = 0
        self.kv_committed_len = 0
        self.fill_ids = []
        self.extend_input_len = 0
        self.num_retractions += 1

    def __getstate__(self) -> dict[str, object]:
        """A request crosses to a scheduler process before it has any KV: its empty prefix tensor stays
        behind (pickling a tensor costs more than the rest of the request)."""
        state = self.__dict__.copy()
        if state.get("prefix_indices") is _EMPTY:
            del state["prefix_indices"]
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        if "prefix_indices" not in state:
            self.prefix_indices = _EMPTY

    def __repr__(self) -> str:
        return f"Req(rid={self.rid!r}, input={len(self.origin_input_ids)}, output={len(self.output_ids)})"
