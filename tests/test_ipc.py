"""services/worker/frontend/ipc.py: PipeChannel, the scheduler process's inbox and outbox. Its reader is a plain
multiprocessing Connection, so these check what a multiprocessing.Queue would guarantee: every object
arrives once, in each writer's order, across a spawned process, with a full pipe never blocking a put."""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import time

import pytest

from services.worker.frontend.ipc import PipeChannel


def test_objects_arrive_in_order_and_an_empty_channel_says_so() -> None:
    channel = PipeChannel()
    with pytest.raises(queue.Empty):
        channel.get_nowait()
    started = time.monotonic()
    with pytest.raises(queue.Empty):
        channel.get(timeout=0.05)
    assert time.monotonic() - started >= 0.04
    items = [1, "two", {"three": [3.0]}, None, ("tuple", b"bytes")]
    for item in items:
        channel.put(item)
    assert [channel.get(timeout=1) for _ in items] == items


def test_a_full_pipe_never_blocks_a_put_and_the_backlog_keeps_its_order() -> None:
    channel = PipeChannel()
    chunk = b"x" * 100_000
    done = threading.Event()

    def writer() -> None:
        for i in range(40):  # 4 MB: more than any pipe buffer, with no reader yet
            channel.put((i, chunk))
        done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    assert done.wait(timeout=10), "put blocked on a full pipe"
    assert channel.backlog() > 0
    got = [channel.get(timeout=5) for _ in range(40)]
    assert [i for i, _ in got] == list(range(40)) and all(body == chunk for _, body in got)
    deadline = time.monotonic() + 5
    while channel.backlog() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert channel.backlog() == 0
    channel.put("after the backlog")
    assert channel.get(timeout=1) == "after the backlog"


def test_writer_threads_each_keep_their_order() -> None:
    channel = PipeChannel()
    threads = [threading.Thread(target=lambda w=w: [channel.put((w, i)) for i in range(300)]) for w in range(4)]
    for thread in threads:
        thread.start()
    got = [channel.get(timeout=5) for _ in range(4 * 300)]
    for thread in threads:
        thread.join()
    for w in range(4):
        assert [i for writer, i in got if writer == w] == list(range(300))


def _echo(inbox: PipeChannel, outbox: PipeChannel) -> None:
    while (item := inbox.get()) is not None:
        outbox.put(item)
    outbox.put("bye")


def test_a_spawned_process_reads_and_writes_through_pickled_channels() -> None:
    ctx = mp.get_context("spawn")
    inbox, outbox = PipeChannel(ctx), PipeChannel(ctx)
    child = ctx.Process(target=_echo, args=(inbox, outbox), daemon=True)
    child.start()
    try:
        items = [("small", i) for i in range(200)] + [("large", b"y" * (3 << 20))] + [("small", -1)]
        for item in items:
            inbox.put(item)
        inbox.put(None)
        assert [outbox.get(timeout=30) for _ in items] == items
        assert outbox.get(timeout=30) == "bye"
    finally:
        child.join(timeout=30)
    assert child.exitcode == 0


def test_a_queued_request_crosses_without_its_empty_prefix_tensor() -> None:
    import pickle

    import torch

    from services.worker.scheduler.req import _EMPTY, Req
    from shared.sampling_params import SamplingParams

    params = SamplingParams.from_dict({"temperature": 0.0, "max_new_tokens": 4})
    params.normalize()
    req = Req("r1", list(range(50)), params, seed=3, eos_token_ids=frozenset([2]))
    data = pickle.dumps(req, pickle.HIGHEST_PROTOCOL)
    assert b"torch" not in data  # no tensor in the bytes
    back = pickle.loads(data)
    assert back.prefix_indices is _EMPTY
    assert (back.rid, back.origin_input_ids, back.seed, back.stop_token_ids) == ("r1", list(range(50)), 3, req.stop_token_ids)
    req.prefix_indices = torch.arange(5)  # a request with KV keeps its prefix
    assert pickle.loads(pickle.dumps(req)).prefix_indices.tolist() == [0, 1, 2, 3, 4]


def test_read_available_never_blocks_on_a_frame_still_being_written() -> None:
    import os
    import pickle
    import struct

    channel = PipeChannel()
    for i in range(5):
        channel.put(("item", i))
    assert channel.read_available(limit=2) == [("item", 0), ("item", 1)]
    assert channel.has_whole_frame()  # read already: the pipe's readiness will not say so
    assert channel.read_available(limit=10) == [("item", 2), ("item", 3), ("item", 4)]
    assert not channel.has_whole_frame() and channel.read_available(limit=10) == []
    # Half a frame (a writer slow, or killed mid-write): nothing yet, and no wait.
    data = pickle.dumps({"big": "x" * 5000})
    frame = struct.pack("!i", len(data)) + data
    fd = channel._writer.fileno()
    os.write(fd, frame[:3000])
    started = time.monotonic()
    assert channel.read_available(limit=10) == []
    assert time.monotonic() - started < 0.5 and not channel.has_whole_frame()
    os.write(fd, frame[3000:])
    assert channel.read_available(limit=10) == [{"big": "x" * 5000}]
    channel._writer.close()  # every writer gone: the reader is told so
    with pytest.raises(EOFError):
        channel.read_available(limit=10)
