"""The scheduler's per-step output format: what each request produced in a step (ReqOutput), and a
step's outputs packed as columns for the trip from the scheduler process to its parent (PackedOutputs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.worker.scheduler.req import FinishReason, Req

if TYPE_CHECKING:
    from services.worker.runtime.model_runner import SampledTokens

# What a final output adds to a step's tokens.
_FINAL_FIELDS = (
    "finished_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "spec_accept_length",
    "spec_accept_rate", "spec_verify_steps", "spec_proposed_tokens", "spec_accepted_tokens", "queue_time",
)


@dataclass
class ReqOutput:
    """What one request produced in one step: its new tokens (one, or several from a speculative
    step), and the final state if done."""

    rid: str
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # Prompt log-probs (Req.logprob_start_len = k), once, at the end of the prefill, shaped as SGLang's
    # input_token_logprobs: prompt tokens k .. n-1, the first with no log-prob (None) and no top list.
    input_token_ids: list[int] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    finished_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # With speculative decoding, on the final output (Req.spec_metrics), and the counts behind them:
    # the request's verify steps, the draft tokens proposed in them and those the target accepted.
    spec_accept_length: float | None = None
    spec_accept_rate: float | None = None
    spec_verify_steps: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    # Seconds from arrival at the worker to the first scheduled step (None: never scheduled).
    queue_time: float | None = None

    def take_final(self, final: ReqOutput) -> None:
        """Give this step's output the final state (finish, usage, speculation) of `final`."""
        for name in _FINAL_FIELDS:
            setattr(self, name, getattr(final, name))

    def only_tokens(self) -> bool:
        """True when every field but rid and token_ids has its default (a mid-stream decode step's
        output). tests/test_scheduler.py checks this against every field of the dataclass."""
        return (
            self.finished_reason is None
            and not self.logprobs
            and not self.top_logprobs
            and not self.input_token_ids
            and not self.input_logprobs
            and not self.input_top_logprobs
            and self.prompt_tokens == 0
            and self.completion_tokens == 0
            and self.cached_tokens == 0
            and self.spec_accept_length is None
            and self.spec_accept_rate is None
            and self.spec_verify_steps == 0
            and self.spec_proposed_tokens == 0
            and self.spec_accepted_tokens == 0
            and self.queue_time is None
        )


@dataclass(frozen=True)
class PackedOutputs:
    """One step's outputs as columns, for the trip from a scheduler process to its parent. Pickling
    256 ReqOutput objects took 0.65 ms in the scheduler's process (its queue's feeder thread, holding
    the GIL the scheduler needs) and unpickling them 1.3 ms in the parent; as two lists (rids, new
    tokens) they take 0.08 ms and 0.44 ms with the rebuild. Outputs with more than tokens (log-probs,
    a finish) travel whole in `full`, keyed by their index."""

    rids: list[str]
    tokens: list[list[int]]
    full: dict[int, ReqOutput]

    @classmethod
    def pack(cls, outputs: list[ReqOutput]) -> PackedOutputs:
        full = {i: out for i, out in enumerate(outputs) if not out.only_tokens()}
        return cls([out.rid for out in outputs], [out.token_ids for out in outputs], full)

    def unpack(self) -> list[ReqOutput]:
        full = self.full
        return [
            full[i] if i in full else ReqOutput(rid, tokens)
            for i, (rid, tokens) in enumerate(zip(self.rids, self.tokens))
        ]


def final_output(req: Req) -> ReqOutput:
    """The output that ends a request: its finish, usage and speculation figures, no tokens."""
    spec = req.spec_metrics()
    return ReqOutput(
        rid=req.rid,
        token_ids=[],
        finished_reason=req.finished_reason,
        prompt_tokens=len(req.origin_input_ids),
        completion_tokens=len(req.output_ids),
        cached_tokens=req.cached_tokens or 0,
        spec_accept_length=spec[0] if spec else None,
        spec_accept_rate=spec[1] if spec else None,
        spec_verify_steps=req.spec_verify_steps,
        spec_proposed_tokens=req.spec_proposed_tokens,
        spec_accepted_tokens=req.spec_accepted_tokens,
        queue_time=req.queue_time,
    )


def sampled_output(req: Req, result: SampledTokens, j: int) -> ReqOutput:
    """A step's output for a request sampled in row j of `result`, before its token is added: the
    log-probs, when asked for, which the request keeps too; after a prefill, the prompt log-probs
    once. A request with max_new_tokens 0 ran for those alone: it finishes here, taking no token."""
    out = ReqOutput(rid=req.rid, token_ids=[])
    if req.logprob_start_len is not None and not req.input_logprobs_sent:
        req.input_logprobs_sent = True
        out.input_token_ids = req.origin_input_ids[req.logprob_start_len :]
        out.input_logprobs = [None, *req.input_logprobs]
        if req.top_logprobs_num:
            out.input_top_logprobs = [None, *req.input_top_logprobs]
    if req.remaining_new_tokens() == 0:
        req.check_finished(None)
        return out
    if req.return_logprob:
        req.output_logprobs.append(result.logprobs[j])
        out.logprobs = [result.logprobs[j]]
        if req.top_logprobs_num:
            req.output_top_logprobs.append(result.top_logprobs[j])
            out.top_logprobs = [result.top_logprobs[j]]
    return out
