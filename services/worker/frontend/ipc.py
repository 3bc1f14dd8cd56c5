"""PipeChannel: the one-way channel between the scheduler's process and its client, in place of a
multiprocessing.Queue.

A multiprocessing.Queue pickles and writes on a feeder thread of its own, so every put wakes that thread
first: on the 16-vCPU GPU host a wake-up after a few idle milliseconds costs 0.1-0.3 ms, and a request
crossed two queues on its way to its first token (bench/pipeline_trace.py: 0.53-0.65 ms from the
worker's queue to the scheduler, 0.36-0.52 ms back). Here `put` pickles and writes to the pipe on the
caller's thread; only when the pipe is full (a reader behind by more than its buffer, 1 MiB where the
kernel allows) does the rest go to a writer thread, so the caller never blocks and order is kept. The
frames are the ones multiprocessing.Connection reads (a 4-byte big-endian length, then the pickle), so
the reader is a plain Connection.

    inbox = PipeChannel(); Process(target=run, args=(inbox,)).start(); inbox.put(AddReqs(reqs))
"""

from __future__ import annotations

import collections
import fcntl
import multiprocessing as mp
import os
import pickle
import queue
import select
import struct
import threading
import time
from multiprocessing import util as mp_util
from typing import Any

F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)  # Linux
PIPE_BYTES = 1 << 20
_MAX_FRAME = 0x7FFFFFFF
READ_BYTES = 1 << 16
EXIT_FLUSH_S = 60.0  # how long an exiting process waits for its reader to take the backlog


class PipeChannel:
    """Any number of writer threads in one process, one reader thread in another (or the same). The
    client's last put to a scheduler's outbox (the Shutdown that ends its reader) comes after the
    scheduler processes have stopped, so two processes never write one channel at once."""

    def __init__(self, ctx: Any = None) -> None:
        ctx = ctx or mp.get_context("spawn")
        self._reader, self._writer = ctx.Pipe(duplex=False)
        try:
            fcntl.fcntl(self._writer.fileno(), F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            pass  # the default 64 KiB; a full pipe only means the writer thread takes over
        self._init_local()

    def _init_local(self) -> None:
        """Per-process state: a pickled channel starts with none of it."""
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._backlog: collections.deque[memoryview] = collections.deque()
        self._flusher: threading.Thread | None = None
        self._nonblocking = False
        self._read_lock = threading.Lock()
        self._inbuf = bytearray()  # read_available's bytes not yet a whole frame
        self._reading_nonblocking = False

    def __getstate__(self) -> dict[str, Any]:
        return {"reader": self._reader, "writer": self._writer}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._reader, self._writer = state["reader"], state["writer"]
        self._init_local()

    # ---- writing --------------------------------------------------------------------------------

    def put(self, obj: object) -> None:
        """Send `obj`; never blocks (a full pipe's remainder is written by a thread, in order)."""
        # Plain pickle: what crosses here holds no tensors worth sharing, and multiprocessing's
        # pickler would move any it met into shared memory.
        data = pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
        if len(data) > _MAX_FRAME:
            raise ValueError(f"a message of {len(data)} bytes is too large for the scheduler's pipe")
        frame = memoryview(struct.pack("!i", len(data)) + data)
        fd = self._writer.fileno()
        with self._lock:
            if not self._nonblocking:
                os.set_blocking(fd, False)
                self._nonblocking = True
            if not self._backlog:
                try:
                    frame = frame[os.write(fd, frame):]
                except BlockingIOError:
                    pass
                if not frame:
                    return
            self._backlog.append(frame)
            if self._flusher is None:
                self._flusher = threading.Thread(target=self._flush, name="radixserve-pipe-writer", daemon=True)
                self._flusher.start()
                # As a multiprocessing.Queue does: a process that exits (a spawned one runs these
                # finalizers, not atexit) first lets the backlog reach the pipe, or its reader would
                # wait for ever on a torn frame.
                mp_util.Finalize(self, _wait_written, (self._wakeup, self._backlog), exitpriority=-5)
            self._wakeup.notify()

    def _flush(self) -> None:
        """The writer thread: writes the backlog as the reader makes room."""
        fd = self._writer.fileno()
        while True:
            with self._lock:
                while not self._backlog:
                    self._wakeup.wait()
                head = self._backlog[0]
                try:
                    written = os.write(fd, head)
                except BlockingIOError:
                    written = 0
                except OSError:
                    self._backlog.clear()  # the reader is gone: nothing will read what is left
                    continue
                if written == len(head):
                    self._backlog.popleft()
                    continue
                self._backlog[0] = head[written:]
            select.select([], [fd], [], 1.0)  # until there is room (or a second, then try again)

    def wait_written(self) -> None:
        """Until what was put has reached the pipe (at most EXIT_FLUSH_S), as a process's exit does:
        for a process about to leave by os._exit, which runs no finalizers."""
        _wait_written(self._wakeup, self._backlog)

    def backlog(self) -> int:
        """Frames waiting for room in the pipe (tests)."""
        with self._lock:
            return len(self._backlog)

    # ---- reading --------------------------------------------------------------------------------

    def get(self, timeout: float | None = None) -> Any:
        """The next object; queue.Empty if none came within `timeout` seconds (None: wait)."""
        with self._read_lock:
            if timeout is not None and not self._reader.poll(max(timeout, 0.0)):
                raise queue.Empty
            return pickle.loads(self._reader.recv_bytes())

    def get_nowait(self) -> Any:
        return self.get(0.0)

    def read_available(self, limit: int) -> list[Any]:
        """Up to `limit` whole objects, reading what the pipe holds without ever blocking: a frame still
        being written stays buffered here for the next call, so an event loop's reader cannot hang on a
        writer that is slow or died mid-frame. EOFError once every writer has closed. After the first
        call the read end is non-blocking: use this, not get(), from then on."""
        fd = self._reader.fileno()
        with self._read_lock:
            if not self._reading_nonblocking:
                os.set_blocking(fd, False)
                self._reading_nonblocking = True
            while True:
                try:
                    chunk = os.read(fd, READ_BYTES)
                except BlockingIOError:
                    break
                if not chunk:
                    if not self._inbuf:
                        raise EOFError("every writer of the channel has closed")
                    break
                self._inbuf += chunk
                if len(chunk) < READ_BYTES:
                    break
            items: list[Any] = []
            start = 0
            view = memoryview(self._inbuf)
            try:
                while len(items) < limit and len(view) - start >= 4:
                    (size,) = struct.unpack_from("!i", view, start)
                    if size < 0 or len(view) - start - 4 < size:
                        break
                    items.append(pickle.loads(view[start + 4 : start + 4 + size]))
                    start += 4 + size
            finally:
                view.release()
            del self._inbuf[:start]
            return items

    def has_whole_frame(self) -> bool:
        """Whether read_available's buffer already holds a whole frame (the pipe may be empty)."""
        with self._read_lock:
            if len(self._inbuf) < 4:
                return False
            (size,) = struct.unpack_from("!i", self._inbuf)
            return 0 <= size <= len(self._inbuf) - 4

    def fileno(self) -> int:
        """The read end, for a selector."""
        return self._reader.fileno()


def _wait_written(wakeup: threading.Condition, backlog: collections.deque[memoryview]) -> None:
    """Until the writer thread has written `backlog` (at most EXIT_FLUSH_S: a reader that stopped
    reading must not keep the process alive)."""
    deadline = time.monotonic() + EXIT_FLUSH_S
    with wakeup:
        while backlog and time.monotonic() < deadline:
            wakeup.wait(0.01)
