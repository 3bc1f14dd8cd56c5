"""RequestState: the Engine's side of one request — outputs arriving from the scheduler turned into
the result dict (or stream chunks) a caller sees.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from services.worker.scheduler.output import ReqOutput
from services.worker.scheduler.req import FinishReason, Req
from shared.detokenize import IncrementalDetokenizer

_DONE = object()


class RequestState:
    """Collects one request's outputs; thread-safe between the dispatcher and the caller."""

    def __init__(self, req: Req, tokenizer: Any | None, stream: bool = False) -> None:
        self.rid = req.rid
        self.prompt_tokens = len(req.origin_input_ids)
        params = req.sampling_params
        self.detok = (
            IncrementalDetokenizer(tokenizer, params.skip_special_tokens, params.stop_strings())
            if tokenizer is not None
            else None
        )
        self.output_ids: list[int] = []
        self._undecoded: list[int] = []  # visible ids not yet given to detok (a non-streamed request)
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.return_logprob = req.return_logprob
        self.final_input: ReqOutput | None = None  # the output with the prompt log-probs, when asked
        self.finished: FinishReason | None = None
        self.final: ReqOutput | None = None
        self.error: str | None = None
        self._done = threading.Event()
        self._stream = stream
        self._chunks: queue.Queue[Any] = queue.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._achunks: asyncio.Queue[Any] | None = None

    # ---- fed by the dispatcher thread ----------------------------------------------------------

    def attach_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._achunks = asyncio.Queue()

    def _emit(self, item: Any) -> None:
        if self._loop is not None and self._achunks is not None:
            try:
                self._loop.call_soon_threadsafe(self._achunks.put_nowait, item)
            except RuntimeError:
                pass  # the caller's event loop has closed: nobody waits for this request any more
        elif self._stream:
            self._chunks.put(item)

    def push(self, out: ReqOutput) -> None:
        self.output_ids.extend(out.token_ids)
        self.logprobs.extend(out.logprobs)
        self.top_logprobs.extend(out.top_logprobs)
        if out.input_token_ids:
            self.final_input = out
        if out.finished_reason is not None:
            self.finished, self.final = out.finished_reason, out
        incremental = self._stream or self._loop is not None
        if self.detok is not None:
            visible = out.token_ids
            if self.finished is not None and self.finished.type == "stop" and isinstance(self.finished.matched, int) and visible:
                visible = visible[:-1]  # a matched stop token is not part of the text
            if incremental:
                self.detok.add(visible)
            else:
                # Nobody reads this request's text before it ends, so it is decoded once, at the end:
                # detokenizing every token of every request as it came (~35 us each) held P3's 256
                # requests to the caller's pace, half the scheduler's (bench/results/gpu_serving_2026-11-29_e.json
                # against _f.json, which has this change).
                self._undecoded.extend(visible)
                if self.finished is not None:
                    self.detok.add(self._undecoded)
                    self._undecoded = []
                    self.detok.delta(final=True)  # an incomplete last character is kept as the tokenizer decodes it
        if incremental:
            chunk = self._chunk(out)
            if chunk is not None:
                self._emit(chunk)
        if self.finished is not None:
            self._done.set()
            self._emit(_DONE)

    def fail(self, message: str) -> None:
        self.error = message
        self.finished = FinishReason("abort", message=message)
        self._done.set()
        self._emit(_DONE)

    def finish_empty(self) -> None:
        self.finished = FinishReason("length", 0)
        self.final = ReqOutput(self.rid, [], finished_reason=self.finished, prompt_tokens=self.prompt_tokens)
        if self._stream or self._loop is not None:
            self._emit(self._chunk(self.final))
        self._done.set()
        self._emit(_DONE)

    # ---- results --------------------------------------------------------------------------------

    def _meta(self) -> dict[str, Any]:
        final = self.final
        meta: dict[str, Any] = {
            "id": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": final.cached_tokens if final else 0,
            "finish_reason": self.finished.to_dict() if self.finished else None,
        }
        if final is not None and final.spec_accept_length is not None:
            meta["spec_accept_length"] = final.spec_accept_length
            meta["spec_accept_rate"] = final.spec_accept_rate
        if self.return_logprob:
            meta["output_token_logprobs"] = [(lp, tid, None) for lp, tid in zip(self.logprobs, self.output_ids)]
            if self.top_logprobs:
                meta["output_top_logprobs"] = [
                    [(lp, tid, None) for tid, lp in step] for step in self.top_logprobs
                ]
            if self.final_input is not None:
                prompt = self.final_input
                meta["input_token_logprobs"] = [(lp, tid, None) for lp, tid in zip(prompt.input_logprobs, prompt.input_token_ids)]
                if prompt.input_top_logprobs:
                    meta["input_top_logprobs"] = [
                        None if step is None else [(lp, tid, None) for tid, lp in step] for step in prompt.input_top_logprobs
                    ]
        return meta

    def _chunk(self, out: ReqOutput) -> dict[str, Any] | None:
        text = self.detok.delta(final=self.finished is not None) if self.detok is not None else ""
        if not out.token_ids and not text and self.finished is None:
            return None
        chunk: dict[str, Any] = {"text": text, "output_ids": list(out.token_ids)}
        if self.finished is not None:
            chunk["meta_info"] = self._meta()
        return chunk

    def result(self) -> dict[str, Any]:
        if self.error is not None:
            raise RuntimeError(f"request {self.rid} failed: {self.error}")
        text = self.detok.output_text() if self.detok is not None else ""
        return {"text": text, "output_ids": list(self.output_ids), "meta_info": self._meta()}

    def wait(self) -> dict[str, Any]:
        self._done.wait()
        return self.result()

    async def await_result(self) -> dict[str, Any]:
        assert self._achunks is not None
        while (await self._achunks.get()) is not _DONE:
            pass
        return self.result()

    def iter_chunks(self) -> Iterator[dict[str, Any]]:
        while (item := self._chunks.get()) is not _DONE:
            yield item
        if self.error is not None:
            raise RuntimeError(f"request {self.rid} failed: {self.error}")

    async def aiter_chunks(self) -> AsyncIterator[dict[str, Any]]:
        assert self._achunks is not None
        while (item := await self._achunks.get()) is not _DONE:
            yield item
        if self.error is not None:
            raise RuntimeError(f"request {self.rid} failed: {self.error}")
