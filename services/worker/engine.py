"""The offline Engine: SGLang-shaped Python API over the scheduler, no NATS.

    engine = Engine("path/to/model")
    out = engine.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})
    print(out["text"]); engine.shutdown()

The scheduler runs in a background thread (tp_size 1) or in one process per rank (tp_size > 1), so
concurrent `generate` calls are batched together, and `async_generate` streams.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import queue
import random
import socket
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from services.worker.config import EngineConfig
from services.worker.model_config import ModelConfig
from services.worker.request_state import RequestState, validate_input_ids
from services.worker.sampling.sampling_params import SamplingParams
from services.worker.scheduler.req import Req
from services.worker.scheduler_loop import (
    AbortReq,
    AddReq,
    Control,
    ControlReply,
    LoopFailed,
    Ready,
    Shutdown,
    load_tokenizer,
    run_scheduler_loop,
)
from shared.model_path import resolve_model_path

START_TIMEOUT_S = 600.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    """Generate with a model in this process (or its TP rank processes)."""

    def __init__(self, model_path: str | None = None, **kwargs: Any) -> None:
        path = str(resolve_model_path(model_path))
        self.config = EngineConfig.from_kwargs(path, **kwargs)
        self.model_config = ModelConfig.from_path(
            path, dtype=self.config.dtype, context_length=self.config.context_length
        )
        self.tokenizer = load_tokenizer(path)
        self._rng = random.Random(self.config.random_seed)
        self._states: dict[str, RequestState] = {}
        self._lock = threading.Lock()
        self._tokens = itertools.count()
        self._replies: dict[int, queue.Queue[Any]] = {}
        self._failed: str | None = None
        self._start_scheduler()

    # ---- lifecycle ------------------------------------------------------------------------------

    def _start_scheduler(self) -> None:
        init_method = self.config.dist_init_addr or f"tcp://127.0.0.1:{_free_port()}"
        self._procs: list[Any] = []
        if self.config.tp_size == 1:
            self._inbox: Any = queue.Queue()
            self._outbox: Any = queue.Queue()
            self._thread = threading.Thread(
                target=run_scheduler_loop,
                args=(self.config, 0, init_method, self._inbox, self._outbox),
                name="radixserve-scheduler",
                daemon=True,
            )
            self._thread.start()
        else:
            ctx = mp.get_context("spawn")
            self._inbox, self._outbox = ctx.Queue(), ctx.Queue()
            for rank in range(self.config.tp_size):
                io = (self._inbox, self._outbox) if rank == 0 else (None, None)
                proc = ctx.Process(
                    target=run_scheduler_loop, args=(self.config, rank, init_method, *io), daemon=True
                )
                proc.start()
                self._procs.append(proc)
        first = self._outbox.get(timeout=START_TIMEOUT_S)
        if isinstance(first, LoopFailed):
            self._stop_processes()
            raise RuntimeError(f"the scheduler failed to start: {first.message}")
        assert isinstance(first, Ready)
        self.server_info: dict[str, Any] = first.info
        self._dispatcher = threading.Thread(target=self._dispatch, name="radixserve-outputs", daemon=True)
        self._dispatcher.start()

    def shutdown(self) -> None:
        """Stop the scheduler (in-flight requests end with an abort error)."""
        if self._failed == "shut down":
            return
        self._inbox.put(Shutdown())
        if self.config.tp_size == 1:
            self._thread.join(timeout=30)
        self._stop_processes()
        self._fail_all("shut down")

    def _stop_processes(self) -> None:
        for proc in self._procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        self._procs = []

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- outputs --------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        while True:
            try:
                item = self._outbox.get()
            except (EOFError, OSError):
                self._fail_all("the scheduler stopped")
                return
            if isinstance(item, ControlReply):
                self._replies.pop(item.token).put(item.value)
            elif isinstance(item, LoopFailed):
                self._fail_all(item.message)
                return
            else:
                for out in item:
                    with self._lock:
                        state = self._states.get(out.rid)
                        if state is not None and out.finished_reason is not None:
                            del self._states[out.rid]
                    if state is not None:
                        state.push(out)
            if self._failed:
                return

    def _fail_all(self, message: str) -> None:
        with self._lock:
            self._failed = message
            states, self._states = list(self._states.values()), {}
        for state in states:
            state.fail(message)
        for token, box in list(self._replies.items()):
            self._replies.pop(token, None)
            box.put(None)

    def _control(self, name: str) -> Any:
        token = next(self._tokens)
        box: queue.Queue[Any] = queue.Queue()
        self._replies[token] = box
        self._inbox.put(Control(name, token))
        return box.get(timeout=60)

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
        rid_list = per_item(rid, "rid") if rid is not None else [None] * count
        mc = self.model_config
        built: list[tuple[Req, RequestState]] = []
        for ids, params_dict, want_lp, top_n, item_rid in zip(id_lists, params_list, logprob_list, top_list, rid_list):
            validate_input_ids(ids, mc.vocab_size, mc.context_len, self.server_info["max_total_tokens"])
            params = SamplingParams.from_dict(params_dict, defaults=mc.generation_defaults)
            params.verify(mc.vocab_size)
            params.normalize()
            if params.stop_strings() and self.tokenizer is None:
                raise ValueError("`stop` strings need a tokenizer; this checkpoint has none")
            if not isinstance(top_n, int) or top_n < 0:
                raise ValueError(f"`top_logprobs_num` must be a non-negative integer, got {top_n!r}")
            params.max_new_tokens = min(params.max_new_tokens, mc.context_len - len(ids))
            for i in range(params.n):
                req_rid = item_rid or uuid.uuid4().hex
                if params.n > 1:
                    req_rid = f"{req_rid}-{i}"
                seed = params.seed + i if params.seed is not None else self._rng.getrandbits(63)
                req = Req(
                    req_rid,
                    list(ids),
                    params,
                    seed=seed,
                    return_logprob=bool(want_lp) or top_n > 0,
                    top_logprobs_num=top_n,
                    eos_token_ids=frozenset(mc.eos_token_ids),
                )
                built.append((req, RequestState(req, self.tokenizer, stream=stream)))
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
        for req, state in built:
            if req.sampling_params.max_new_tokens == 0:
                # Nothing to generate: answer without scheduling.
                with self._lock:
                    self._states.pop(req.rid, None)
                state.finish_empty()
            else:
                self._inbox.put(AddReq(req))

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        top_logprobs_num: int | list[int] = 0,
        stream: bool = False,
        rid: str | list[str] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generate for one prompt (returns a dict) or a list (returns a list of dicts, n per prompt).
        With stream=True (one prompt), returns an iterator of chunks; the last carries meta_info."""
        built, single = self._build_states(
            prompt, sampling_params, input_ids, return_logprob, top_logprobs_num, rid, stream
        )
        if stream and len(built) != 1:
            raise ValueError("stream=True takes one prompt with n=1")
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
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        """Like generate, awaiting instead of blocking; stream=True gives an async iterator."""
        built, single = self._build_states(
            prompt, sampling_params, input_ids, return_logprob, top_logprobs_num, rid, stream
        )
        if stream and len(built) != 1:
            raise ValueError("stream=True takes one prompt with n=1")
        loop = asyncio.get_running_loop()
        for _, state in built:
            state.attach_loop(loop)
        self._submit(built)
        if stream:
            return built[0][1].aiter_chunks()
        results = [await state.await_result() for _, state in built]
        return results[0] if single else results

    def abort(self, rid: str) -> None:
        self._inbox.put(AbortReq(rid))

    def flush_cache(self) -> bool:
        """Empty the prefix cache; False while requests are in flight."""
        return bool(self._control("flush_cache"))

    def get_server_info(self) -> dict[str, Any]:
        return self._control("get_info")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """The checkpoint's chat template, with the assistant turn opened."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this checkpoint has no chat template")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
