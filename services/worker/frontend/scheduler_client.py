# Over 400 lines: one class fronts the scheduler; start-up, rank and node watchdogs, outputs, requests share its state.
"""SchedulerClient: the front of a running scheduler, shared by the offline Engine and the worker service.

It starts the scheduler (one spawned process per rank of this node, rank_processes.py; at tp_size 1
on CPU a thread, see EngineConfig.scheduler_process; with nnodes > 1 this is node 0, the other nodes
run rank_processes.serve_node and heartbeat this one, node_liveness.py), turns a validated request
into `Req`s (seeds drawn here, so every sampled token is reproducible), sends commands, answers
request/reply controls, and hands every step's outputs to a callback on its dispatcher thread:

    client = SchedulerClient(config, on_outputs=handle_step, on_failure=handle_death)
    client.add(*client.build_reqs([1, 2, 3], {"temperature": 0}))
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing as mp
import pickle
import queue
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from services.worker.config import EngineConfig
from services.worker.frontend.ipc import PipeChannel
from services.worker.frontend.node_liveness import NodeLivenessServer
from services.worker.frontend.rank_processes import RANK_EXIT_GRACE_S, end_group, start_ranks, wait_for_exit
from services.worker.frontend.scheduler_loop import (
    AbortReq,
    AddReqs,
    Control,
    ControlReply,
    FirstTokensOut,
    HandOverFirstTokens,
    LoopFailed,
    Ready,
    Shutdown,
    load_tokenizer,
    run_scheduler_loop,
)
from services.worker.runtime.model_config import ModelConfig
from services.worker.scheduler.output import PackedOutputs, ReqOutput
from services.worker.scheduler.req import FinishReason, Req
from shared.grammar_spec import GRAMMAR_FIELDS
from shared.input_ids import check_logprob_start_len, validate_input_ids
from shared.sampling_params import SamplingParams

START_TIMEOUT_S = 600.0
LOOP_READ_BATCH = 16
# Reading a closed channel (TypeError/ValueError: its handle already released), or the torn frame of a
# scheduler killed mid-write, is a stop too.
_CLOSED = (EOFError, OSError, TypeError, ValueError, pickle.UnpicklingError)
CONTROL_TIMEOUT_S = 60.0
NODE_LOSS_WAIT_S = 1.0  # after rank 0's collective failed, for node liveness to name the node lost


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _InlineOutbox(queue.Queue):  # type: ignore[type-arg]
    """A scheduler thread's outbox that hands each step's outputs to `on_outputs` from the scheduler
    thread itself, without waking the dispatcher thread on the way; everything else (Ready, control
    replies, LoopFailed) queues for the dispatcher as usual."""

    def __init__(self, on_outputs: Callable[[list[ReqOutput]], None]) -> None:
        super().__init__()
        self._on_outputs = on_outputs

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if isinstance(item, list):
            self._on_outputs(item)
        else:
            super().put(item, block, timeout)


class SchedulerClient:
    """Starts one worker's scheduler and talks to it through its inbox and outbox.

    `on_outputs(outputs)` receives each scheduler step's list of ReqOutput (one per request advanced)
    and `on_failure(message)` is called once if the scheduler dies; both run on the dispatcher thread.
    With `outputs_inline` (for an `on_outputs` that is cheap and thread-safe, such as handing the step
    to an event loop) a scheduler that runs as a thread calls it from its own thread after each step:
    one thread wake-up fewer between a step and its outputs going out. With `outputs_loop`, a scheduler
    in its own process(es) has its outbox read by that asyncio loop (a reader on the pipe) instead of
    a dispatcher thread, so `on_outputs` and `on_failure` run on the loop's thread: the step's outputs
    wake the loop once, not a dispatcher that then wakes the loop.
    """

    def __init__(
        self,
        config: EngineConfig,
        on_outputs: Callable[[list[ReqOutput]], None],
        on_failure: Callable[[str], None],
        outputs_inline: bool = False,
        outputs_loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.config = config
        self._outputs_inline = outputs_inline
        self._outputs_loop = outputs_loop if config.scheduler_in_process() else None
        self._loop_done = False  # the loop's reader has seen the last item
        self.model_config = ModelConfig.from_path(
            config.model_path, dtype=config.dtype, context_length=config.context_length,
            quantization=config.quantization,
        )
        self.tokenizer = load_tokenizer(config)
        self._on_outputs = on_outputs
        self._on_failure = on_failure
        self._rng = random.Random(config.random_seed)
        self._tokens = itertools.count()
        self._replies: dict[int, queue.Queue[Any]] = {}
        self._replies_lock = threading.Lock()
        self._closed = False  # shut down by the owner
        self._dead = False  # the scheduler died
        self._procs: list[Any] = []
        # nnodes > 1: the other nodes' heartbeats (node_liveness.py); a node lost during start-up is said here
        self._liveness: NodeLivenessServer | None = None
        self._lost_at_start: str | None = None
        self._ready = False
        self._start()

    # ---- lifecycle ------------------------------------------------------------------------------

    def _start(self) -> None:
        if self.config.node_rank != 0:
            raise ValueError(
                f"node_rank {self.config.node_rank} runs TP ranks only, and node 0 takes the requests: start it "
                "with `radixserve worker --node-rank N` (rank_processes.serve_node), not as an Engine or worker"
            )
        init_method = self.config.dist_init_addr or f"tcp://127.0.0.1:{_free_port()}"
        if not self.config.scheduler_in_process():
            self._inbox: Any = queue.Queue()
            self._outbox: Any = _InlineOutbox(self._on_outputs) if self._outputs_inline else queue.Queue()
            self._thread = threading.Thread(
                target=run_scheduler_loop,
                args=(self.config, 0, init_method, self._inbox, self._outbox),
                name="radixserve-scheduler",
                daemon=True,
            )
            self._thread.start()
        else:
            ctx = mp.get_context("spawn")
            # Pipes written on the caller's thread, not multiprocessing queues: no feeder thread to
            # wake on the way to or from the scheduler (ipc.py).
            self._inbox, self._outbox = PipeChannel(ctx), PipeChannel(ctx)
            if self.config.nnodes > 1:
                self._liveness = NodeLivenessServer(self.config, self._node_lost)
            self._procs = start_ranks(self.config, init_method, self._inbox, self._outbox)
        try:
            first = self._wait_ready()
            if isinstance(first, LoopFailed):
                self._stop_processes()
                if first.invalid_config is not None:
                    raise ValueError(first.invalid_config)
                raise RuntimeError(f"the scheduler failed to start: {first.message}")
        except Exception as exc:
            if self._liveness is not None:  # the other nodes' ranks may wait for these in a collective
                self._liveness.fail_others(f"node 0's scheduler failed to start: {str(exc).splitlines()[0]}")
            raise
        assert isinstance(first, Ready)
        self.server_info: dict[str, Any] = first.info
        self._ready = True
        if self._liveness is not None:
            self._liveness.expect_all()
        if len(self._procs) > 1:
            threading.Thread(target=self._watch_ranks, args=(list(self._procs),), name="radixserve-ranks",
                             daemon=True).start()
        if self._outputs_loop is not None:
            self._outputs_loop.call_soon_threadsafe(self._outputs_loop.add_reader, self._outbox.fileno(), self._read_on_loop)
            return
        self._dispatcher = threading.Thread(target=self._dispatch, name="radixserve-outputs", daemon=True)
        self._dispatcher.start()

    def _wait_ready(self) -> Any:
        """The scheduler's first message (Ready or LoopFailed). A rank process that dies before sending
        it (a crash, or a script that creates an Engine outside `if __name__ == "__main__":`, which a
        spawned process re-runs) ends the wait at once with an error that says so."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                return self._outbox.get(timeout=0.5)
            except queue.Empty:
                if self._lost_at_start is not None:  # the ranks may wait for that node in a collective
                    end_group(self._procs, grace_s=0.0)
                    self._procs = []
                    raise RuntimeError(f"the TP group failed to start: {self._lost_at_start}") from None
                dead = [p for p in self._procs if not p.is_alive()]
                if dead:
                    with contextlib.suppress(queue.Empty):
                        # Another rank's failure (a group that did not form, a node with another model)
                        # is rank 0's too, and rank 0 says why.
                        return self._outbox.get(timeout=RANK_EXIT_GRACE_S if self._procs[0].is_alive() else 0.5)
                    self._stop_processes()
                    raise RuntimeError(
                        f"a scheduler process exited during start-up (exit code {dead[0].exitcode}); the "
                        "scheduler runs in spawned processes (tp_size > 1, or on CUDA), so a script that "
                        "creates an Engine must do it under `if __name__ == \"__main__\":` (or pass "
                        "scheduler_process=False at tp_size 1); the process's own error is printed above"
                    ) from None
                if time.monotonic() > deadline:
                    self._stop_processes()
                    raise RuntimeError(f"the scheduler did not start within {START_TIMEOUT_S:.0f} s") from None

    def _watch_ranks(self, procs: list[Any]) -> None:
        """A local rank other than rank 0 that exits while this client runs has taken the TP group down.
        Rank 0 says so itself when its next collective fails (gloo at once, or within the idle beat),
        with the collective's error; if it has not exited RANK_EXIT_GRACE_S later (an NCCL collective
        would wait dist_timeout), every rank is killed and the client fails naming the rank."""
        proc = wait_for_exit(procs[1:])
        if self._closed or proc is None:
            return
        rank = self.config.local_ranks()[procs.index(proc)]
        procs[0].join(timeout=RANK_EXIT_GRACE_S)
        if self._closed or not procs[0].is_alive():
            return
        end_group(procs, grace_s=0.0)
        self._fail(f"TP rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}; the TP group is down")

    def _node_lost(self, message: str) -> None:
        """Another node died, froze, was cut off or failed (node_liveness.py): this node's ranks may wait
        in a collective for it until dist_timeout, so they are killed, and the client fails."""
        if self._closed:
            return
        if not self._ready:
            self._lost_at_start = message  # _wait_ready raises it
            return
        if any(not proc.is_alive() for proc in self._procs):
            return  # a rank here failed first (the other node's report echoes it): rank 0 or _watch_ranks says so
        self._fail(message)
        end_group(list(self._procs), grace_s=0.0)

    def _fail_naming_node(self, message: str) -> None:
        """Rank 0's collective failed: when another node's loss caused it (its process died: gloo and the
        liveness channel see it at once), the failure names that node and its host."""
        lost = self._liveness.wait_lost(NODE_LOSS_WAIT_S) if self._liveness is not None else None
        # A local rank killed or crashed first (a negative exit code) is the cause, and the other node's report an echo.
        if lost is not None and not any((proc.exitcode or 0) < 0 for proc in self._procs[1:]):
            message = f"{lost}\nrank 0 saw: {message}"
        self._fail(message)

    def shutdown(self) -> None:
        """Stop the scheduler and the dispatcher; pending controls get None."""
        if self._closed:
            return
        self._closed = True
        if self._liveness is not None:
            self._liveness.close()  # before the ranks leave: the other nodes see a clean end, not a loss
        self._inbox.put(Shutdown())
        if not self.config.scheduler_in_process():
            self._thread.join(timeout=30)
        self._stop_processes()
        # Wakes the dispatcher, which would otherwise wait on the outbox forever; it is joined so that
        # it is not still reading a multiprocessing queue when the interpreter closes it.
        self._outbox.put(Shutdown())
        dispatcher = getattr(self, "_dispatcher", None)
        if dispatcher is not None and threading.current_thread() is not dispatcher:
            dispatcher.join(timeout=30)
        self._fail_replies()

    def _stop_processes(self) -> None:
        for proc in self._procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        self._procs = []

    # ---- outputs --------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        """The dispatcher thread: every item of the outbox, until a stop."""
        while True:
            try:
                item = self._outbox.get()
            except _CLOSED:
                if not self._closed:
                    self._fail("the scheduler stopped")
                return
            if not self._handle(item):
                return

    def _read_on_loop(self) -> None:
        """The outbox's reader on `outputs_loop`: the whole items already there (at most
        LOOP_READ_BATCH, so a busy scheduler cannot keep the loop from publishing), then back to the
        loop. It never blocks: a frame still being written waits in the channel for the next call."""
        loop = self._outputs_loop
        assert loop is not None
        if self._loop_done:
            return
        try:
            items = self._outbox.read_available(LOOP_READ_BATCH)
        except _CLOSED:
            self._stop_loop_reader()
            if not self._closed:
                self._fail("the scheduler stopped")
            return
        for item in items:
            if not self._handle(item):
                self._stop_loop_reader()
                return
        if self._outbox.has_whole_frame():
            loop.call_soon(self._read_on_loop)  # read already, so the pipe's reader will not fire for it

    def _stop_loop_reader(self) -> None:
        assert self._outputs_loop is not None
        self._loop_done = True
        self._outputs_loop.remove_reader(self._outbox.fileno())

    def _handle(self, item: object) -> bool:
        """One outbox item; False once nothing more is to be read."""
        if isinstance(item, Shutdown):
            return False
        if isinstance(item, ControlReply):
            with self._replies_lock:
                box = self._replies.pop(item.token, None)
            if box is not None:
                box.put(item.value)
        elif isinstance(item, LoopFailed):
            if self._liveness is not None and self._ready:
                threading.Thread(target=self._fail_naming_node, args=(item.message,), daemon=True).start()
            else:
                self._fail(item.message)
            return False
        elif isinstance(item, PackedOutputs):
            self._on_outputs(item.unpack())
        else:
            self._on_outputs(item)  # type: ignore[arg-type]
        return not self._closed

    def _fail(self, message: str) -> None:
        """Once: the first report of a dead scheduler wins (a rank's watchdog, or rank 0's own)."""
        with self._replies_lock:
            if self._dead:
                return
            self._dead = True
        if self._liveness is not None:
            self._liveness.fail_others(message.splitlines()[0])
        self._fail_replies()
        self._on_failure(message)

    def _fail_replies(self) -> None:
        with self._replies_lock:
            boxes, self._replies = list(self._replies.values()), {}
        for box in boxes:
            box.put(None)

    # ---- requests and commands ------------------------------------------------------------------

    def build_reqs(
        self,
        input_ids: Any,
        sampling: dict[str, Any] | None,
        *,
        rid: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: Any = 0,
        logprob_start_len: Any = None,
        priority: int = 0,
        resume_ids: list[int] | None = None,
    ) -> list[Req]:
        """Validate one prompt's token ids and sampling settings (ValueError naming the field) and
        build its `n` Reqs; without `rid` each gets a fresh id, with n > 1 ids get a `-i` suffix.
        Requests without a seed get one from this client's RNG (`random_seed`). `resume_ids`: tokens
        a request migrated from a lost worker has already generated; they are its first outputs here,
        so max_new_tokens, penalties and stop checks go on as if it had never moved."""
        mc = self.model_config
        resume = list(resume_ids or [])
        validate_input_ids(input_ids, mc.vocab_size, mc.context_len, self.server_info["max_total_tokens"])
        if resume:
            try:
                validate_input_ids(list(input_ids) + resume, mc.vocab_size, mc.context_len,
                                   self.server_info["max_total_tokens"])
            except ValueError as exc:
                raise ValueError(f"`resume_ids`: {exc}") from None
        params = SamplingParams.from_dict(sampling, defaults=mc.generation_defaults)
        params.verify(mc.vocab_size)
        params.normalize()
        if params.stop_strings() and self.tokenizer is None:
            raise ValueError("`stop` strings need a tokenizer; this checkpoint has none")
        if params.is_constrained and self.tokenizer is None:
            field = next(f for f in GRAMMAR_FIELDS if getattr(params, f) is not None)
            raise ValueError(f"{field} (constrained decoding) needs a tokenizer; this checkpoint has none")
        if not isinstance(top_logprobs_num, int) or top_logprobs_num < 0:
            raise ValueError(f"`top_logprobs_num` must be a non-negative integer, got {top_logprobs_num!r}")
        start = check_logprob_start_len(logprob_start_len, len(input_ids)) if return_logprob or top_logprobs_num else None
        params.max_new_tokens = min(params.max_new_tokens, mc.context_len - len(input_ids))
        reqs: list[Req] = []
        for i in range(params.n):
            req_rid = rid or uuid.uuid4().hex
            if params.n > 1:
                req_rid = f"{req_rid}-{i}"
            seed = params.seed + i if params.seed is not None else self._rng.getrandbits(63)
            reqs.append(
                Req(
                    req_rid,
                    list(input_ids),
                    params,
                    seed=seed,
                    return_logprob=bool(return_logprob) or top_logprobs_num > 0,
                    top_logprobs_num=top_logprobs_num,
                    logprob_start_len=start,
                    priority=priority,
                    eos_token_ids=frozenset(mc.eos_token_ids),
                    output_ids=resume,
                )
            )
        return reqs

    def add(self, *reqs: Req) -> None:
        """Queue requests for the scheduler as one command: it takes all of them before the same step."""
        if reqs:
            self._inbox.put(AddReqs(list(reqs)))

    def hand_over_first_tokens(self) -> None:
        """Make the scheduler wait, after a step that gave a request its first output, for
        first_tokens_out() (at most scheduler_loop.FIRST_TOKEN_WAIT_S) before its next step."""
        self._inbox.put(HandOverFirstTokens())

    def first_tokens_out(self) -> None:
        """The first tokens the scheduler waits for are published."""
        self._inbox.put(FirstTokensOut())

    def abort(self, rid: str, reason: FinishReason | None = None) -> None:
        """Abort a waiting or running request; its final output comes with the next step, with
        `reason` as its finish (default: type 'abort', as a client asked)."""
        self._inbox.put(AbortReq(rid, reason))

    def control(self, name: str, timeout: float = CONTROL_TIMEOUT_S) -> Any:
        """'flush_cache' (bool) or 'get_info' (dict), answered between two steps; None once the
        scheduler has stopped. queue.Empty after `timeout` seconds."""
        token = next(self._tokens)
        box: queue.Queue[Any] = queue.Queue()
        with self._replies_lock:
            if self._closed or self._dead:
                return None
            self._replies[token] = box
        self._inbox.put(Control(name, token))
        return box.get(timeout=timeout)
