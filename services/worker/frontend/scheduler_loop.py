"""The scheduler's event loop for one rank: commands in, per-step outputs out.

Rank 0 (TP rank 0 of the first pipeline stage) takes commands from its inbox (blocking only when
idle) and, with TP or PP, broadcasts them so every rank of every stage applies the same commands
before the same step. With one rank the loop runs in a thread of the Engine's process; otherwise every
rank is its own process, on one node or several (global rank = node_rank * ranks_per_node + local
rank = pp_rank * tp_size + tp_rank). An idle rank 0 still broadcasts an empty list every
IDLE_BEAT_S, so the other ranks' wait never reaches the group's timeout and a lost rank is noticed
while idle too.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import hashlib
import logging
import os
import queue
import socket
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.worker.config import EngineConfig
from services.worker.cpu_placement import ComputePlacement, pin_compute_threads
from services.worker.cpu_threads import AdaptiveThreads, adaptive_threads, start_row_helpers
from services.worker.runtime import distributed
from services.worker.runtime.model_config import ModelConfig
from services.worker.runtime.model_runner import ModelRunner, default_device
from services.worker.runtime.sampling.grammar import GrammarBackend
from services.worker.scheduler.output import PackedOutputs
from services.worker.scheduler.req import FinishReason, Req
from services.worker.scheduler.scheduler import Scheduler
from shared import trace
from shared.hf_tokenizer import load_hf_tokenizer

logger = logging.getLogger(__name__)
CLEANUP_TRACE_S = 10.0
IDLE_BEAT_S = 2.0  # at most; a quarter of dist_timeout when that is shorter


@dataclass
class AddReqs:
    """Requests that arrived together, in one command: the scheduler takes them before the same step,
    so a burst is admitted together rather than its first request prefilled alone."""

    reqs: list[Req]


@dataclass
class AbortReq:
    rid: str
    reason: FinishReason | None = None  # None: a client's abort


@dataclass
class Control:
    """A request/reply command: 'flush_cache' or 'get_info'; the reply carries the same token."""

    name: str
    token: int


@dataclass
class Shutdown:
    pass


@dataclass
class HandOverFirstTokens:
    """From a worker service whose scheduler is a process on the CPU (tp_size 1): after a step that gave
    some request its first output, wait for FirstTokensOut (at most FIRST_TOKEN_WAIT_S) before the next
    step, so a first token leaves alone and before the next step's compute threads take every core (the
    process form of the thread's hand-over in service.py)."""


@dataclass
class FirstTokensOut:
    """The worker published the first tokens of a step."""


# How long a step that gave a request its first output waits for the worker's FirstTokensOut.
FIRST_TOKEN_WAIT_S = 0.005


@dataclass
class ControlReply:
    token: int
    value: Any


@dataclass
class Ready:
    info: dict[str, Any]


@dataclass
class LoopFailed:
    message: str
    # The loop raised ValueError (bad configuration: a backend the device cannot run, a model that does
    # not fit): the caller re-raises it as one, without the traceback.
    invalid_config: str | None = None


def load_tokenizer(config: EngineConfig) -> Any | None:
    """The model's tokenizer (its --tokenizer-path and --chat-template applied), or None when the
    checkpoint ships none (tiny test checkpoints); a --tokenizer-path without one is a ValueError."""
    try:
        return load_hf_tokenizer(config.model_path, config.tokenizer_path, config.chat_template)
    except ValueError:
        if config.tokenizer_path:
            raise
        return None


def resolve_device(config: EngineConfig, rank: int) -> torch.device:
    """The device of global TP rank `rank`: on CUDA, the GPU of its local rank on this node."""
    device = torch.device(config.device) if config.device else default_device()
    if device.type == "cuda":
        index = (device.index or 0) + rank - config.local_ranks().start
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return device


# Every rank runs the same scheduler on the same commands and must take the same decisions, so these
# must agree too (the KV pool's size is agreed separately: the smallest rank's).
SCHEDULING_FIELDS = (
    "context_length", "max_running_requests", "schedule_policy", "chunked_prefill_size", "max_prefill_tokens",
    "enable_mixed_chunk", "disable_radix_cache", "radix_eviction_policy", "schedule_conservativeness",
    "random_seed", "disable_overlap_schedule", "speculative_algorithm", "speculative_num_draft_tokens",
)


def group_fingerprint(config: EngineConfig, model_config: ModelConfig) -> str:
    """What every rank of a TP group must agree on: the model (its config.json's digest, the size of its
    weight files, the shapes that decide the shards), the dtype, the group's shape and the scheduling
    settings (SCHEDULING_FIELDS). Paths may differ between nodes (another mount point), so they are
    named in errors but not compared."""
    path = Path(config.model_path)
    digest = hashlib.sha256((path / "config.json").read_bytes()).hexdigest()[:12]
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    mc = model_config
    return (
        f"{mc.architecture} (config.json sha256 {digest}, {weights} bytes of safetensors, {mc.num_layers} layers, "
        f"hidden {mc.hidden_size}, vocab {mc.vocab_size}) in {str(mc.dtype).removeprefix('torch.')} (quantization {config.quantization}) with "
        f"tp_size {config.tp_size}, pp_size {config.pp_size} over nnodes {config.nnodes}; scheduling "
        + ", ".join(f"{name}={getattr(config, name)}" for name in SCHEDULING_FIELDS)
    )


FAULT_STALL_ENV = "RS_FAULT_STALL"


def _fault_stall(spec: str) -> tuple[int, float] | None:
    """RS_FAULT_STALL's 'N:S' (block S seconds after the N-th step with outputs), or None when unset."""
    if not spec:
        return None
    try:
        after, seconds = spec.split(":")
        return int(after), float(seconds)
    except ValueError:
        raise ValueError(f"{FAULT_STALL_ENV} must be 'N:S' (steps, seconds), got {spec!r}") from None


class SchedulerLoop:
    """Owns one rank's Scheduler and feeds it."""

    def __init__(self, config: EngineConfig, rank: int, init_method: str) -> None:
        self.config = config
        self.rank = rank
        device = resolve_device(config, rank)
        self.placement: ComputePlacement | None = None
        self.adaptive: AdaptiveThreads | None = None
        if device.type == "cpu":
            # In this thread, before any parallel op: it runs the model, and its OpenMP pool starts here.
            self.placement = config.compute_placement(rank, torch.get_num_threads())
            pinned = pin_compute_threads(self.placement)
            where = f"pinned to cores {sorted(pinned.values())}" if pinned else "placed by the OS"
            threads = self.placement.threads
            if config.adaptive_threads() and threads > 1 and len(pinned) == threads:
                self.adaptive = adaptive_threads(self.placement, pinned)
                where += ", fewer while other processes take CPU time there"
            logger.info("rank %d computes with %d CPU thread(s), %s", rank, threads, where)
        distributed.init_tp(rank, config.tp_size, init_method, device, config.dist_timeout, pp_size=config.pp_size)
        model_config = ModelConfig.from_path(
            config.model_path, dtype=config.dtype, context_length=config.context_length, device=device,
            quantization=config.quantization,
        )
        distributed.check_same_everywhere(
            group_fingerprint(config, model_config),
            f"node {config.node_rank} on {socket.gethostname()}, model_path {config.model_path}",
        )
        self._idle_beat_s = min(IDLE_BEAT_S, config.dist_timeout / 4)
        self.runner = ModelRunner(config, model_config, device)
        tokenizer = load_tokenizer(config)
        grammar = GrammarBackend(tokenizer, model_config.vocab_size) if tokenizer is not None else None
        if grammar is not None:
            grammar.prebuild()
        self.grammar = grammar
        self.loop_seconds = {"commands": 0.0, "step": 0.0, "hand_off": 0.0}
        self._stall = _fault_stall(os.environ.get(FAULT_STALL_ENV, ""))
        self._steps_with_outputs = 0
        self._init_hand_over()
        self.scheduler = Scheduler(
            config,
            self.runner,
            decode_tail=(lambda ids: tokenizer.decode(ids)) if tokenizer is not None else (lambda ids: ""),
            grammar=grammar,
        )

    def _init_hand_over(self) -> None:
        # HandOverFirstTokens: on once the worker asks; the requests that have had an output; commands
        # that arrived during a wait, applied before the next step.
        self._hand_over = False
        self._started: set[str] = set()
        self._pending: list[object] = []

    def _gave_first_outputs(self, outputs: list[Any]) -> bool:
        """Whether a request among `outputs` had its first output (forgets finished requests)."""
        first = False
        for out in outputs:
            if out.rid not in self._started:
                first = True
                self._started.add(out.rid)
            if out.finished_reason is not None:
                self._started.discard(out.rid)
        return first

    def _await_first_tokens_out(self, inbox: Any) -> None:
        """Wait (at most FIRST_TOKEN_WAIT_S) for FirstTokensOut; other commands wait in `_pending`."""
        deadline = time.monotonic() + FIRST_TOKEN_WAIT_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                cmd = inbox.get(timeout=left)
            except queue.Empty:
                return
            if isinstance(cmd, FirstTokensOut):
                return
            self._pending.append(cmd)

    def _stall_once(self) -> None:
        """Fault injection (RS_FAULT_STALL=N:S): after the N-th step with outputs, block S seconds once,
        as a step that long would (tests use it to show a slow worker keeps its requests)."""
        assert self._stall is not None
        after, seconds = self._stall
        self._steps_with_outputs += 1
        if self._steps_with_outputs == after:
            logger.warning("fault injection: the scheduler blocks for %g s", seconds)
            time.sleep(seconds)
            self._stall = None

    def info(self) -> dict[str, Any]:
        s = self.scheduler
        return {
            "max_total_tokens": self.runner.max_total_tokens,
            "weight_bytes": self.runner.weight_bytes,
            "kv_cache_dtype": str(self.runner.token_to_kv_pool.dtype).removeprefix("torch."),
            "max_running_requests": s.max_running,
            "num_running": s.num_running(),
            "num_waiting": len(s.waiting),
            "kv_free": self.runner.allocator.available_size(),
            "kv_cached": s.tree_cache.total_size(),
            "kv_in_use": s.tree_cache.protected_size() + s.kv_slots_in_use_by_requests(),
            "stats": vars(s.stats).copy(),
            "device": str(self.runner.device),
            "cpu_single_row": self.runner.single_row,
            "cpu_threads": self.adaptive.threads if self.adaptive else getattr(self.placement, "threads", None),
            "cpu_foreign_load": self.adaptive.foreign if self.adaptive else None,
            "loop_seconds": dict(self.loop_seconds),
            "scheduler_pid": os.getpid(),
        }

    def _apply(self, cmd: object, outbox: Any, taken_ns: int | None = None) -> bool:
        """Apply one command; False on shutdown. `taken_ns`: when the loop took it in (the trace's
        scheduler.added, the same for every request taken in before one step)."""
        if isinstance(cmd, AddReqs):
            for req in cmd.reqs:
                trace.mark(req.rid, "scheduler.added", taken_ns)
                self.scheduler.add_request(req)
        elif isinstance(cmd, AbortReq):
            self.scheduler.abort_request(cmd.rid, cmd.reason)
        elif isinstance(cmd, Control):
            value = self.scheduler.flush_cache() if cmd.name == "flush_cache" else self.info()
            if outbox is not None:
                outbox.put(ControlReply(cmd.token, value))
        elif isinstance(cmd, Shutdown):
            return False
        elif isinstance(cmd, HandOverFirstTokens):
            self._hand_over = self.config.world_size() == 1
        return True  # FirstTokensOut outside a wait: it came after the wait gave up

    def _take_commands(self, inbox: Any) -> list[object]:
        cmds, self._pending = self._pending, []
        if self.rank == 0:
            if not cmds and not self.scheduler.has_work():
                if self.config.world_size() == 1:
                    cmds.append(inbox.get())
                else:
                    with contextlib.suppress(queue.Empty):  # an empty broadcast: the idle beat
                        cmds.append(inbox.get(timeout=self._idle_beat_s))
            while True:
                try:
                    cmds.append(inbox.get_nowait())
                except queue.Empty:
                    break
        if self.config.world_size() > 1:
            cmds = distributed.broadcast_object(cmds)  # type: ignore[assignment]
        return cmds

    def run(self, inbox: Any, outbox: Any, pack: bool = False) -> None:
        """Serve commands and steps until Shutdown. `pack`: the outbox crosses processes, so each
        step's outputs go as PackedOutputs (columns) rather than a list of objects to pickle.
        `loop_seconds` (in info()) splits the loop's wall time into waiting for and applying commands,
        scheduler steps, and handing outputs over."""
        clock = time.perf_counter
        spent = self.loop_seconds
        while True:
            t0 = clock()
            cmds = self._take_commands(inbox)
            taken_ns = time.monotonic_ns() if trace.TRACE_DIR is not None else None
            for cmd in cmds:
                if not self._apply(cmd, outbox, taken_ns):
                    return
            t1 = clock()
            outputs = self.scheduler.step()
            if outputs and self._stall is not None:
                self._stall_once()
            t2 = clock()
            if outputs and outbox is not None:
                trace.mark_each(outputs, "scheduler.outputs")
                outbox.put(PackedOutputs.pack(outputs) if pack else outputs)
                if self._hand_over and self._gave_first_outputs(outputs):
                    self._await_first_tokens_out(inbox)
            t3 = clock()
            if self.adaptive is not None:
                self.adaptive.after_step(waited_s=t1 - t0)
            spent["commands"] += t1 - t0
            spent["step"] += t2 - t1
            spent["hand_off"] += t3 - t2


def run_scheduler_loop(
    config: EngineConfig, rank: int, init_method: str, inbox: Any, outbox: Any, own_process: bool = False
) -> bool:
    """Entry point of a rank (thread or process); False when it failed. Reports Ready or LoopFailed on
    the outbox (rank 0). In its own process, a clean-up that takes over CLEANUP_TRACE_S prints every
    thread's stack to stderr (the parent kills a rank that has not exited 30 s after shutdown; this
    says where it was)."""
    loop = None
    ready = False
    try:
        loop = SchedulerLoop(config, rank, init_method)
        if outbox is not None:
            outbox.put(Ready(loop.info()))
        ready = True
        loop.run(inbox, outbox, pack=own_process)
        return True
    except Exception as exc:  # noqa: BLE001 - reported to the engine, which fails its requests
        message = f"{type(exc).__name__}: {exc}"
        if ready and config.world_size() > 1 and isinstance(exc, RuntimeError):
            # A collective failed: gloo says at once when a peer's process is gone, NCCL after dist_timeout.
            message = (f"the TP group failed on rank {rank} (node {config.node_rank}): another rank exited or did "
                       f"not answer within {config.dist_timeout:g} s (dist_timeout): {exc}")
        if isinstance(exc, ValueError):
            logger.error("scheduler loop of rank %d failed: %s", rank, exc)
        else:
            logger.exception("scheduler loop of rank %d failed", rank)
        if outbox is not None:
            invalid = str(exc) if isinstance(exc, ValueError) else None
            outbox.put(LoopFailed(f"{message}\n{traceback.format_exc()}", invalid))
        return False
    finally:
        if own_process:
            faulthandler.dump_traceback_later(CLEANUP_TRACE_S)
        if loop is not None and loop.grammar is not None:
            loop.grammar.close()
        if loop is not None and loop.adaptive is not None:
            start_row_helpers((), 0)  # this rank's row helpers end with it (the process may start another)
        if loop is not None and loop.placement is not None:
            loop.placement.release()  # the cores' claims, for a later Engine or worker on this host
        distributed.destroy_tp(exiting=own_process)
        # Give the device memory back (pool, weights, graph pools): a later Engine in the same
        # process sizes its pool from what is free.
        del loop
        if torch.cuda.is_available():
            gc.collect()
            torch.cuda.empty_cache()
