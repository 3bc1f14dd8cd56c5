"""The offline Engine: SGLang-shaped Python API over the scheduler, no NATS.

    engine = Engine("path/to/model")
    out = engine.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})
    print(out["text"]); engine.shutdown()

The scheduler runs in a background thread (tp_size 1) or in one process per rank (tp_size > 1), so
concurrent `generate` calls are batched together, and `async_generate` streams.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from services.worker.config import EngineConfig
from services.worker.frontend.request_state import RequestState
from services.worker.frontend.scheduler_client import SchedulerClient
from services.worker.scheduler.output import ReqOutput
from services.worker.scheduler.req import Req
from shared import trace


def offline_cpu_defaults(config: EngineConfig) -> EngineConfig:
    """The offline Engine's CPU threads: its caller waits while it computes, so no core is kept back
    unless asked. Where the count adapts (cpu_threads.py, the default under cpu_bind 'auto') it starts on
    every core and gives one back while other processes take CPU time there, as a worker service does: a
    fixed team of two threads on a 2-vCPU host beside two busy processes waited at every barrier for its
    descheduled thread (batch-1 decode 22 tok/s, llama.cpp 34 at one thread). Where the count is fixed
    (OMP_NUM_THREADS, cpu_threads, ...) every core computes (cpu_reserved_cores 0)."""
    if config.cpu_reserved_cores is None and not config.adaptive_threads():
        return config.replace(cpu_reserved_cores=0)
    return config


class Engine:
    """Generate with a model in this process (or its TP rank processes)."""

    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        self.config = offline_cpu_defaults(EngineConfig.resolved(model_path, **kwargs))
        self._states: dict[str, RequestState] = {}
        self._lock = threading.Lock()
        self._failed: str | None = None
        self._client = SchedulerClient(self.config, on_outputs=self._on_outputs, on_failure=self._fail_all)
        self.model_config = self._client.model_config
        self.tokenizer = self._client.tokenizer
        self.server_info: dict[str, Any] = self._client.server_info

    # ---- lifecycle ------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the scheduler (in-flight requests end with an abort error)."""
        if self._failed == "shut down":
            return
        self._client.shutdown()
        self._fail_all("shut down")

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- outputs --------------------------------------------------------------------------------

    def _on_outputs(self, outputs: list[ReqOutput]) -> None:
        trace.mark_each(outputs, "engine.outputs")
        for out in outputs:
            with self._lock:
                state = self._states.get(out.rid)
                if state is not None and out.finished_reason is not None:
                    del self._states[out.rid]
            if state is not None:
                state.push(out)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            self._failed = message
            states, self._states = list(self._states.values()), {}
        for state in states:
            state.fail(message)

    # ---- requests in ----------------------------------------------------------------------------

    def _build_states(
        self,
        prompt: str | list[str] | None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None,
        input_ids: list[int] | list[list[int]] | None,
        return_logprob: bool | list[bool],
        top_logprobs_num: int | list[int],
        rid: str | list[str] | None,
        stream: bool,
        logprob_start_len: int | list[int] | None = None,
    ) -> tuple[list[tuple[Req, RequestState]], bool]:
        """Validate every request of a call before any is submitted."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of `prompt` or `input_ids`")
        single = isinstance(prompt, str) or (
            input_ids is not None and (len(input_ids) == 0 or isinstance(input_ids[0], int))
        )
        if prompt is not None:
            prompts = [prompt] if isinstance(prompt, str) else list(prompt)
            if not prompts:
                raise ValueError("`prompt` is an empty list")
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer: pass `input_ids` instead of `prompt`")
            for p in prompts:
                if not isinstance(p, str) or not p:
                    raise ValueError("`prompt` must be a non-empty string")
            id_lists = [self.tokenizer.encode(p) for p in prompts]
        else:
            id_lists = [input_ids] if single else list(input_ids)  # type: ignore[list-item]
        count = len(id_lists)

        def per_item(value: Any, name: str) -> list[Any]:
            if isinstance(value, list) and not (name == "sampling_params" and not value):
                if len(value) != count:
                    raise ValueError(f"`{name}` has {len(value)} entries for {count} prompts")
                return value
            return [value] * count

        params_list = per_item(sampling_params, "sampling_params")
        logprob_list = per_item(return_logprob, "return_logprob")
        top_list = per_item(top_logprobs_num, "top_logprobs_num")
        start_list = per_item(logprob_start_len, "logprob_start_len")
        rid_list = per_item(rid, "rid") if rid is not None else [None] * count
        built: list[tuple[Req, RequestState]] = []
        for ids, params_dict, want_lp, top_n, start, item_rid in zip(
            id_lists, params_list, logprob_list, top_list, start_list, rid_list
        ):
            reqs = self._client.build_reqs(
                ids, params_dict, rid=item_rid, return_logprob=want_lp, top_logprobs_num=top_n,
                logprob_start_len=start,
            )
            built.extend((req, RequestState(req, self.tokenizer, stream=stream)) for req in reqs)
        if stream and len(built) != 1:
            raise ValueError("stream=True takes one prompt with n=1")
        return built, single and built[0][0].sampling_params.n == 1

    def _submit(self, built: list[tuple[Req, RequestState]]) -> None:
        with self._lock:
            if self._failed:
                raise RuntimeError(f"the engine is not running: {self._failed}")
            for req, _ in built:
                if req.rid in self._states:
                    raise ValueError(f"request id {req.rid!r} is already in flight")
            for req, state in built:
                self._states[req.rid] = state
        scheduled = []
        for req, state in built:
            if req.sampling_params.max_new_tokens == 0 and req.logprob_start_len is None:
                # Nothing to generate: answer without scheduling.
                with self._lock:
                    self._states.pop(req.rid, None)
                state.finish_empty()
            else:
                scheduled.append(req)
        # One command for the whole call: the scheduler admits its prompts before the same step.
        self._client.add(*scheduled)
        trace.mark_each(scheduled, "engine.queued")

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        top_logprobs_num: int | list[int] = 0,
        stream: bool = False,
        rid: str | list[str] | None = None,
        logprob_start_len: int | list[int] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generate for one prompt (returns a dict) or a list (returns a list of dicts, n per prompt).
        With stream=True (one prompt), returns an iterator of chunks; the last carries meta_info.
        With return_logprob and `logprob_start_len` k >= 0 (SGLang's), meta_info also has
        input_token_logprobs: (log-prob, id, None) for prompt tokens k .. n-1, the first log-prob None
        (and input_top_logprobs with top_logprobs_num); max_new_tokens 0 then still runs the prefill."""
        built, single = self._build_states(
            prompt, sampling_params, input_ids, return_logprob, top_logprobs_num, rid, stream, logprob_start_len
        )
        self._submit(built)
        if stream:
            return built[0][1].iter_chunks()
        results = [state.wait() for _, state in built]
        return results[0] if single else results

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        top_logprobs_num: int | list[int] = 0,
        stream: bool = False,
        rid: str | list[str] | None = None,
        logprob_start_len: int | list[int] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        """Like generate, awaiting instead of blocking; stream=True gives an async iterator."""
        built, single = self._build_states(
            prompt, sampling_params, input_ids, return_logprob, top_logprobs_num, rid, stream, logprob_start_len
        )
        loop = asyncio.get_running_loop()
        for _, state in built:
            state.attach_loop(loop)
        self._submit(built)
        if stream:
            return built[0][1].aiter_chunks()
        results = [await state.await_result() for _, state in built]
        return results[0] if single else results

    def abort(self, rid: str) -> None:
        self._client.abort(rid)

    def flush_cache(self) -> bool:
        """Empty the prefix cache; False while requests are in flight."""
        return bool(self._client.control("flush_cache"))

    def get_server_info(self) -> dict[str, Any]:
        return self._client.control("get_info")

    def apply_chat_template(self, messages: list[dict[str, str]], **template_kwargs: Any) -> str:
        """The checkpoint's chat template, with the assistant turn opened; `template_kwargs` are the
        template's own variables (Qwen3's `enable_thinking=False`)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this checkpoint has no chat template")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  **template_kwargs)
