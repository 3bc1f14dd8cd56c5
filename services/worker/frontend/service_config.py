"""WorkerServiceConfig: the worker service's settings — its NATS side, plus the EngineConfig of its scheduler.

Both come from one command line (`radixserve worker --worker-id w1 --model-path ... --tp-size 2`) and
the matching RS_* variables (see shared/flags.py).
"""

from __future__ import annotations

import argparse
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from services.worker.config import EngineConfig
from shared import flags
from shared.model_path import served_name
from shared.service import ServiceConfig, is_subject_token


def _help(text: str, default: object) -> object:
    return field(default=default, metadata={"help": text})


def check_busy_poll(busy_poll_ms: float, engine: EngineConfig) -> None:
    """ValueError unless a worker with these engine settings may busy-poll: a polling loop would hold
    the GIL against a scheduler thread's Python half the time, so the scheduler must be a process."""
    if busy_poll_ms > 0 and not engine.scheduler_in_process():
        raise ValueError("busy_poll_ms needs the scheduler in its own process (device cuda, or "
                         "scheduler_process): a scheduler thread would share the GIL with the polling loop")


def random_worker_id() -> str:
    return uuid.uuid4().hex[:8]


@dataclass(frozen=True)
class WorkerServiceConfig(ServiceConfig):
    """One worker (all its TP ranks): rank 0's process alone talks to NATS."""

    worker_id: str = field(
        default_factory=random_worker_id, metadata={"help": "this worker's id in subjects (default: random)"}
    )
    served_model_name: str | None = _help("model name in WorkerLoad and /v1/models (default: a hub id as given, else the directory's name)", None)
    load_interval: float = _help("seconds between two WorkerLoad messages", 1.0)
    with_detokenizer: bool = _help("detokenize in this process and publish to gateways directly", False)
    drain_timeout: float = _help("seconds running requests may take to finish on SIGTERM; those still running then end with an error", 30.0)
    metrics_port: int | None = _help("Prometheus metrics port (0: any free port; none: no metrics)", 9402)
    engine: EngineConfig = field(default_factory=EngineConfig, metadata={"help": "the scheduler's settings"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not is_subject_token(self.worker_id):
            raise ValueError(f"worker_id must be one NATS token (no spaces, dots, * or >), got {self.worker_id!r}")
        if self.load_interval <= 0:
            raise ValueError(f"load_interval must be > 0, got {self.load_interval}")
        check_busy_poll(self.busy_poll_ms, self.engine)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.engine.model_path).name

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        flags.add_arguments(parser, cls, exclude=("engine",))
        flags.add_arguments(parser, EngineConfig)

    @classmethod
    def from_args(cls, args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None) -> WorkerServiceConfig:
        """Flags, then RS_* variables, then defaults; the model path resolved to a directory (ValueError
        when the default model is not fetched)."""
        engine_values = flags.values_from(EngineConfig, args, env)
        given = str(engine_values.pop("model_path", "")) or None
        engine = EngineConfig.resolved(given, **engine_values)
        if engine.scheduler_process is None:
            # A worker service runs its scheduler in a process of its own on the CPU as well (the CUDA
            # default; vLLM-CPU likewise keeps its engine core apart from its API server): a thread would
            # share the GIL with the event loop, and on a host where other processes take the cores the
            # OS preempts whichever thread holds it, stalling the other (SmolLM2 served with two busy
            # processes beside it: 186.7 vs 149.5 tok/s, bench/HISTORY.md "CPU, twenty-third session").
            engine = engine.replace(scheduler_process=True)
        values = flags.values_from(cls, args, env, exclude=("engine",))
        values.setdefault("served_model_name", served_name(given, Path(engine.model_path)))
        return cls(engine=engine, **values)
