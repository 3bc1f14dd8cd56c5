"""Busy polling: keep a service's event loop polling instead of sleeping in epoll for a while after
each piece of work, so the next message or request finds it awake.

A process idle in epoll sleeps on a halted CPU; the message that wakes it pays the wake-up (on the
H200's 16-vCPU KVM guest ~0.15-0.2 ms per process after a few ms idle, more after 20 ms:
bench/results/pipeline_hops_gpu_2026-11-30_a.json), and a request on its way to its first token wakes the
gateway, the worker and the gateway again. `touch()` (called for every NATS message, HTTP request and
batch of scheduler outputs) opens a window of `window_s`; while it is open one task yields to the loop
(`asyncio.sleep(0)`, a non-blocking poll per turn), so the loop never blocks. It holds one core for
the window: off by default (`busy_poll_ms` 0), for hosts with cores to spare. As Linux's
SO_BUSY_POLL, the window is the bound on what it may spend after the last piece of work.
"""

from __future__ import annotations

import asyncio
import time


class BusyPoll:
    """Polls the running loop until `window_s` after the last touch(); window 0 never polls."""

    def __init__(self, window_s: float = 0.0) -> None:
        if window_s < 0:
            raise ValueError(f"busy poll window must be >= 0, got {window_s}")
        self.window_s = window_s
        self.deadline = 0.0
        self._task: asyncio.Task[None] | None = None
        self.polls = 0  # loop turns spent polling (tests read it)

    @property
    def enabled(self) -> bool:
        return self.window_s > 0

    @property
    def polling(self) -> bool:
        return self._task is not None

    def touch(self) -> None:
        """Work arrived or left: poll until window_s from now (on the running loop)."""
        if self.window_s <= 0:
            return
        self.deadline = time.monotonic() + self.window_s
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        try:
            while time.monotonic() < self.deadline:
                self.polls += 1
                await asyncio.sleep(0)
        finally:
            if self._task is asyncio.current_task():
                self._task = None

    def close(self) -> None:
        """Stop polling now (the service is draining)."""
        self.deadline = 0.0
        if self._task is not None:
            self._task.cancel()
            self._task = None
