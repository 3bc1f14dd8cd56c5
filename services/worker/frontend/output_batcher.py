"""From scheduler steps to BatchTokenOut messages: what the worker service remembers of each request in
flight, and which of its tokens go out in which message.

- A streamed request (GenerateRequest.stream) gets an item in every message its tokens advanced.
- A request whose client wants the whole answer only (non-streamed HTTP, OpenAI and NATS calls) gets
  its first output in an item of its own (the gateway's first-output watchdog and TTFT need it), then
  one final item with every other token. Like SGLang, which streams a non-streamed request's output
  only when it finishes: at 64 such requests, detokenizing and publishing (worker) and fanning out
  (gateway) every step cost ~2 ms of Python per step on a 2-vCPU machine, more than a GPU decode step.
- Steps that queued while the previous message was going out travel as one message (each request's
  tokens of those steps in one item), so a publisher slower than the scheduler falls behind by one
  round at most instead of by a growing queue of steps, and NATS arrivals are never stuck behind it.

A request's first item carries its stop strings and skip_special_tokens (and, for a request migrated
from a lost worker, the tokens and characters its client already has), so a detokenizer needs no
other channel; its final item carries the finish, usage and speculation figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.worker.scheduler.output import ReqOutput
from shared.protocol import (
    PROTOCOL_VERSION,
    BatchTokenOut,
    Finish,
    Logprobs,
    PromptLogprobs,
    TokenOut,
    TopLogprob,
    Usage,
)

if TYPE_CHECKING:
    from services.worker.frontend.metrics import WorkerMetrics


@dataclass
class Flight:
    """One request between its arrival and its final output, and its tokens not yet sent."""

    gateway_id: str
    stop: list[str]
    skip_special_tokens: bool
    stream: bool = True
    first: bool = True
    resume_ids: list[int] | None = None  # a migrated request's tokens its client already has
    resume_chars: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[TopLogprob]] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None

    def hold(self, out: ReqOutput) -> None:
        self.token_ids.extend(out.token_ids)
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        if out.top_logprobs:
            self.top_logprobs.extend([TopLogprob(tid, lp) for tid, lp in step] for step in out.top_logprobs)
        if out.input_token_ids:
            top = None if not out.input_top_logprobs else [
                None if step is None else [TopLogprob(tid, lp) for tid, lp in step] for step in out.input_top_logprobs]
            self.prompt_logprobs = PromptLogprobs(out.input_token_ids, out.input_logprobs, top)


class OutputBatcher:
    """The flights of one worker, and the BatchTokenOut of each publishing round."""

    def __init__(self, worker_id: str, metrics: WorkerMetrics) -> None:
        self.worker_id = worker_id
        self.metrics = metrics
        self.flights: dict[str, Flight] = {}
        self.step = 0

    def batch(self, steps: list[list[ReqOutput]]) -> BatchTokenOut:
        """One message for these steps (in order): an item per request that has something to send,
        at most one per request; requests with no flight (refused, already ended) are skipped."""
        sending: dict[str, tuple[Flight, ReqOutput | None]] = {}
        generated = 0
        for outputs in steps:
            for out in outputs:
                flight = self.flights.get(out.rid)
                if flight is None:
                    continue
                flight.hold(out)
                generated += len(out.token_ids)
                if out.finished_reason is not None:
                    del self.flights[out.rid]
                    sending[out.rid] = (flight, out)
                elif flight.stream or (flight.first and flight.token_ids):
                    sending.setdefault(out.rid, (flight, None))
        self.step += len(steps)
        self.metrics.steps.inc(len(steps))
        self.metrics.generated.inc(generated)
        items = [self._item(rid, flight, final) for rid, (flight, final) in sending.items()]
        return BatchTokenOut(v=PROTOCOL_VERSION, worker_id=self.worker_id, step=self.step, items=items)

    def _item(self, rid: str, flight: Flight, final: ReqOutput | None) -> TokenOut:
        item = TokenOut(rid=rid, gateway_id=flight.gateway_id, token_ids=flight.token_ids)
        if flight.logprobs or flight.prompt_logprobs is not None:
            item.logprobs = Logprobs(flight.logprobs, flight.top_logprobs or None, prompt=flight.prompt_logprobs)
        flight.token_ids, flight.logprobs, flight.top_logprobs, flight.prompt_logprobs = [], [], [], None
        if flight.first:
            item.first, flight.first = True, False
            item.stop = flight.stop or None
            item.skip_special_tokens = flight.skip_special_tokens
            if flight.resume_ids:
                item.resume_ids, item.resume_chars = flight.resume_ids, flight.resume_chars
        if final is not None:
            reason = final.finished_reason
            assert reason is not None
            item.finish = Finish(type=reason.type, matched=reason.matched, message=reason.message, status=reason.status)
            item.usage = Usage(final.prompt_tokens, final.completion_tokens, final.cached_tokens,
                               final.spec_accept_length, final.spec_accept_rate)
            self.metrics.count_request(reason.type)
            self.metrics.observe_final(final)
        return item
