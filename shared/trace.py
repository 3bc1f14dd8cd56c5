"""Request-path timestamps for latency work. With RS_TRACE_DIR set, every process that marks a stage
appends `rid stage nanoseconds` lines to DIR/<pid>.trace; the clock is CLOCK_MONOTONIC, which every
process on one host shares, so one request's stages line up across the gateway, NATS hops, the worker
and its scheduler process; the directory is made if it is missing. Unset (the default), `mark` returns
at once. `bench/pipeline_trace.py` reads the files."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any, TextIO

TRACE_DIR = os.environ.get("RS_TRACE_DIR") or None
_files: dict[int, TextIO] = {}


def mark(rid: str, stage: str, at_ns: int | None = None) -> None:
    """Record that request `rid` reached `stage` now, or at `at_ns` (a time.monotonic_ns() taken
    earlier); nothing unless RS_TRACE_DIR is set."""
    if TRACE_DIR is None:
        return
    now = time.monotonic_ns() if at_ns is None else at_ns
    pid = os.getpid()  # a forked or spawned child writes its own file
    out = _files.get(pid)
    if out is None:
        os.makedirs(TRACE_DIR, exist_ok=True)  # RS_TRACE_DIR need not exist yet
        out = _files[pid] = open(os.path.join(TRACE_DIR, f"{pid}.trace"), "a", buffering=1)  # noqa: SIM115
    out.write(f"{rid} {stage} {now}\n")


def mark_each(reqs: Iterable[Any], stage: str) -> None:
    """mark(req.rid, stage) for each of `reqs` (objects with a `rid`), at one moment; nothing unless
    RS_TRACE_DIR is set."""
    if TRACE_DIR is None:
        return
    now = time.monotonic_ns()
    for req in reqs:
        mark(req.rid, stage, now)
