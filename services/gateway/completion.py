"""A request's outputs accumulated from its stream: what a front door that answers whole (not
streamed) builds its reply from, and the token names logprobs carry."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from services.gateway.streams import RequestStream
from shared.protocol import Finish, PromptLogprobs, StreamOut, TopLogprob, Usage


@dataclass
class Completion:
    """A request's outputs accumulated: the whole text, ids, logprobs, finish and usage."""

    rid: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[TopLogprob]] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    top_logprob_texts: list[list[str]] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None  # when the request asked (logprob_start_len)
    finish: Finish | None = None
    usage: Usage = field(default_factory=Usage)  # the final's

    def add(self, out: StreamOut) -> None:
        self.text += out.text
        self.token_ids.extend(out.token_ids)
        if out.logprobs is not None:
            self.logprobs.extend(out.logprobs.values)
            self.top_logprobs.extend(out.logprobs.top or [])
            self.prompt_logprobs = out.logprobs.prompt or self.prompt_logprobs
        self.token_texts.extend(token_texts(out))
        self.top_logprob_texts.extend(top_logprob_texts(out))
        if out.finish is not None:
            self.finish = out.finish
            usage = out.usage or Usage()
            # A final without a count (an error or abort the gateway made) counts what arrived.
            self.usage = usage if usage.completion_tokens else msgspec.structs.replace(
                usage, completion_tokens=len(self.token_ids))


def token_texts(out: StreamOut) -> list[str]:
    """Each output token's text, as the detokenizer sent it, else `token_id:<id>`."""
    sent = out.logprobs.texts if out.logprobs is not None else None
    if sent is not None and len(sent) == len(out.token_ids):
        return list(sent)
    return [f"token_id:{t}" for t in out.token_ids]


def top_logprob_texts(out: StreamOut) -> list[list[str]]:
    """Each top-logprob candidate's text, as the detokenizer sent it, else `token_id:<id>`."""
    if out.logprobs is None:
        return []
    tops, sent = out.logprobs.top or [], out.logprobs.top_texts
    if sent is not None and [len(s) for s in sent] == [len(t) for t in tops]:
        return [list(s) for s in sent]
    return [[f"token_id:{c.token_id}" for c in step] for step in tops]


async def collect(stream: RequestStream) -> Completion:
    """Read a stream to its final (GatewayError on an error final)."""
    completion = Completion(stream.rid)
    async for out in stream.outputs():
        completion.add(out)
    return completion
