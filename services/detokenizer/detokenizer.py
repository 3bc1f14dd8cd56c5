"""Detokenizer: a worker step's BatchTokenOut in, one list of StreamOut per gateway out (no NATS here,
so the standalone service and a worker's in-process detokenizer share it).

Each request keeps an IncrementalDetokenizer (shared/detokenize.py) from its first TokenOut, which
carries its stop strings and skip_special_tokens (and a migrated request's tokens so far), to its final, when the state is freed. The final's
Usage (token counts and speculation metrics) passes through whole. The text
rules are the offline Engine's: never broken UTF-8, never part of a stop string mid-stream, text cut
where a stop string begins, and a matched stop token id kept in token_ids but left out of the text.
When a request asked for logprobs, each token's own text (and each top candidate's) rides along, since
OpenAI's logprobs name tokens by text and only the detokenizer holds the tokenizer.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from shared.detokenize import IncrementalDetokenizer
from shared.protocol import (
    PROTOCOL_VERSION,
    BatchStreamOut,
    BatchTokenOut,
    Finish,
    Logprobs,
    StreamOut,
    TokenOut,
)

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    text: IncrementalDetokenizer
    worker_id: str


def visible_token_ids(item: TokenOut) -> list[int]:
    """The ids whose text the client sees: all but a stop token that ended the request."""
    finish = item.finish
    if (
        finish is not None
        and finish.type == "stop"
        and isinstance(finish.matched, int)
        and item.token_ids
        and item.token_ids[-1] == finish.matched
    ):
        return item.token_ids[:-1]
    return item.token_ids


class Detokenizer:
    """Per-request incremental text for every request of the workers it serves."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._streams: dict[str, _Stream] = {}
        self._last_seen: dict[str, float] = {}
        # Bounded by the vocabulary; top logprobs ask for the same few tokens over and over.
        self._token_text: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def process(self, batch: BatchTokenOut, now: float | None = None) -> dict[str, BatchStreamOut]:
        """One worker step -> at most one BatchStreamOut per gateway (keyed by gateway id)."""
        self._last_seen[batch.worker_id] = time.monotonic() if now is None else now
        per_gateway: dict[str, list[StreamOut]] = {}
        for item in batch.items:
            try:
                out = self._advance(item, batch.worker_id)
            except Exception as exc:  # noqa: BLE001 - one item that cannot be decoded must not lose the others
                out = self._failed(item, exc)
            if out is not None:
                per_gateway.setdefault(item.gateway_id, []).append(out)
        return {gid: BatchStreamOut(v=PROTOCOL_VERSION, items=items) for gid, items in per_gateway.items()}

    def _advance(self, item: TokenOut, worker_id: str) -> StreamOut | None:
        stream = self._streams.get(item.rid)
        if stream is None:
            if not item.first:
                # This detokenizer started after the request did: its stop strings are unknown here
                # (the worker still stops on them; only the text's hold-back is lost).
                logger.warning("request %s joined mid-stream; detokenizing without its stop strings", item.rid)
            stream = _Stream(IncrementalDetokenizer(self.tokenizer, item.skip_special_tokens, item.stop), worker_id)
            if item.resume_ids:
                stream.text.resume(item.resume_ids, item.resume_chars)
            self._streams[item.rid] = stream
        final = item.finish is not None
        stream.text.add(visible_token_ids(item))
        text = stream.text.delta(final=final)
        if final:
            del self._streams[item.rid]
        if not text and not item.token_ids and not final:
            return None
        return StreamOut(rid=item.rid, text=text, token_ids=item.token_ids, logprobs=self.named(item),
                         finish=item.finish, usage=item.usage)

    def named(self, item: TokenOut) -> Logprobs | None:
        """The item's Logprobs with each token's own text and each top candidate's added."""
        logprobs = item.logprobs
        if logprobs is None:
            return None
        top_texts = None if logprobs.top is None else [
            [self.token_text(c.token_id) for c in step] for step in logprobs.top]
        prompt = logprobs.prompt
        if prompt is not None:
            prompt = msgspec.structs.replace(
                prompt, texts=[self.token_text(t) for t in prompt.token_ids],
                text=self.tokenizer.decode(prompt.token_ids, skip_special_tokens=False),
                top_texts=None if prompt.top is None else [
                    None if step is None else [self.token_text(c.token_id) for c in step] for step in prompt.top],
            )
        return msgspec.structs.replace(logprobs, texts=[self.token_text(t) for t in item.token_ids], top_texts=top_texts,
                                       prompt=prompt)

    def _failed(self, item: TokenOut, exc: Exception) -> StreamOut:
        """An item whose tokens cannot be decoded (ids the tokenizer does not have: only a worker that
        is not ours sends them): its request ends with an error final."""
        logger.warning("request %s cannot be detokenized: %s: %s", item.rid, type(exc).__name__, exc)
        self._streams.pop(item.rid, None)
        message = f"the worker sent tokens that cannot be detokenized ({type(exc).__name__}: {exc})"
        return StreamOut(rid=item.rid, text="", token_ids=[], finish=Finish(type="error", message=message))

    def token_text(self, token_id: int) -> str:
        """One token's text on its own (special tokens included), as logprobs name it."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def forget_silent_workers(self, silent_for: float, now: float | None = None) -> list[str]:
        """Free the requests of workers that sent nothing for `silent_for` seconds (a dead worker's
        requests never finish; their gateways already gave up on them). Returns the freed rids."""
        now = time.monotonic() if now is None else now
        silent = {w for w, seen in self._last_seen.items() if now - seen > silent_for}
        if not silent:
            return []
        freed = [rid for rid, s in self._streams.items() if s.worker_id in silent]
        for rid in freed:
            del self._streams[rid]
        for worker in silent:
            del self._last_seen[worker]
        if freed:
            logger.warning("freed %d request(s) of silent worker(s) %s", len(freed), sorted(silent))
        return freed
