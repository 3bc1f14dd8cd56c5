"""shared/busy_poll.py: a touched BusyPoll keeps the event loop turning (never blocking in epoll) until
its window after the last touch has passed, and no longer; every NATS message a Bus delivers touches
it. What refuses it: a negative or absurd window (ValueError naming busy_poll_ms), and a worker or
`radixserve up` whose scheduler would be a thread sharing the GIL with the polling loop (exit 2 /
ValueError saying why). The pipeline with a polling worker is in tests/test_pipeline.py."""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import pytest

from shared import flags
from shared.busy_poll import BusyPoll
from shared.natsd import NatsServer, start_nats_server
from shared.protocol import PROTOCOL_VERSION, ControlRequest
from shared.service import ServiceConfig, connect_bus, drain_bus
from tests.services_helpers import run


def test_a_touched_poller_turns_the_loop_until_its_window_ends() -> None:
    async def main() -> tuple[int, float, bool, int]:
        poller = BusyPoll(0.05)
        assert not poller.polling
        start = time.monotonic()
        poller.touch()
        assert poller.polling
        # Touched again half way: the window restarts from there.
        await asyncio.sleep(0.03)
        poller.touch()
        while poller.polling:
            await asyncio.sleep(0.005)
        polled_for = time.monotonic() - start
        turns = poller.polls
        await asyncio.sleep(0.03)
        still = poller.polls
        poller.touch()
        poller.close()
        return turns, polled_for, poller.polling, still

    turns, polled_for, polling_after_close, still = run(main())
    assert 0.078 <= polled_for < 0.5  # 30 ms + a fresh 50 ms window, not 50 ms from the first touch
    assert turns > 100, "a polling loop yields to itself thousands of times in 80 ms"
    assert still == turns, "no polling once the window has passed"
    assert not polling_after_close


def test_an_untouched_or_zero_window_poller_never_polls() -> None:
    async def main() -> tuple[int, bool]:
        poller = BusyPoll(0)
        poller.touch()
        await asyncio.sleep(0.02)
        return poller.polls, poller.polling

    assert run(main()) == (0, False)
    assert not BusyPoll().enabled
    with pytest.raises(ValueError, match="busy poll window must be >= 0"):
        BusyPoll(-1)


def test_every_message_a_bus_delivers_opens_the_window() -> None:
    """connect_bus gives the Bus the service's window; a message (even a malformed one, which is
    dropped) wakes the process as much as a good one, so both touch it."""

    async def main(url: str) -> tuple[bool, int, bool, int, bool]:
        config = flags.build(ServiceConfig, None, {"RS_NATS_URL": url, "RS_BUSY_POLL_MS": "200"})
        bus = await connect_bus(config, "poll-test")
        seen = asyncio.Event()

        async def handler(msg: object, raw: object) -> None:
            seen.set()

        await bus.subscribe("poll.test", (ControlRequest,), handler)
        idle = bus.poller.polling
        await bus.nc.publish("poll.test", b"\x00not msgpack")
        await bus.nc.flush()
        await asyncio.sleep(0.05)
        after_bad = bus.poller.polls
        await bus.publish("poll.test", ControlRequest(v=PROTOCOL_VERSION, command="get_info"))
        await asyncio.wait_for(seen.wait(), 10)
        polling = bus.poller.polling
        await drain_bus(bus, 5.0)
        polls = bus.poller.polls
        await asyncio.sleep(0.02)
        return idle, after_bad, polling, bus.poller.polls - polls, bus.poller.polling

    with start_nats_server() as nats:
        idle, after_bad, polling, polls_after_drain, polling_after_drain = run(main(nats.url))
    assert not idle
    assert after_bad > 0
    assert polling
    assert polls_after_drain == 0 and not polling_after_drain


def test_a_window_out_of_range_is_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match=r"busy_poll_ms must be in \[0, 60000\], got -1"):
        flags.build(ServiceConfig, None, {"RS_BUSY_POLL_MS": "-1"})
    with pytest.raises(ValueError, match=r"busy_poll_ms must be in \[0, 60000\], got 1e\+06"):
        ServiceConfig(busy_poll_ms=1e6)


def test_busy_polling_needs_a_scheduler_process(qwen3_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker whose scheduler is a thread (--no-scheduler-process; a worker service's default is a
    process, on the CPU too): the worker and `radixserve up` refuse to poll, before anything starts."""
    from services.launch import add_up_commands, run_up
    from services.worker.frontend.service_config import WorkerServiceConfig

    with pytest.raises(ValueError, match="busy_poll_ms needs the scheduler in its own process"):
        WorkerServiceConfig.from_args(None, {"RS_MODEL_PATH": str(qwen3_path), "RS_DEVICE": "cpu",
                                             "RS_BUSY_POLL_MS": "50", "RS_SCHEDULER_PROCESS": "0"})
    assert WorkerServiceConfig.from_args(None, {"RS_MODEL_PATH": str(qwen3_path), "RS_DEVICE": "cpu",
                                                "RS_BUSY_POLL_MS": "50"}).engine.scheduler_in_process()

    parser = argparse.ArgumentParser()
    add_up_commands(parser.add_subparsers())
    model = ["--model-path", str(qwen3_path), "--device", "cpu", "--no-scheduler-process"]
    assert run_up(parser.parse_args(["up", "--busy-poll-ms", "50", *model])) == 2
    assert "busy_poll_ms needs the scheduler in its own process" in capsys.readouterr().err
    assert run_up(parser.parse_args(["up", "--busy-poll-ms", "-3", *model])) == 2
    assert r"busy_poll_ms must be in [0, 60000], got -3" in capsys.readouterr().err
    monkeypatch.setenv("RS_BUSY_POLL_MS", "soon")
    assert run_up(parser.parse_args(["up", *model])) == 2
    assert "RS_BUSY_POLL_MS: cannot read 'soon' as float" in capsys.readouterr().err


def test_an_http_request_opens_the_gateways_window(nats: NatsServer) -> None:
    """No worker and so no NATS traffic to the gateway: only the HTTP request can start its polling."""
    import httpx

    from tests.gateway_helpers import GatewayThread

    gateway = GatewayThread(nats.url, busy_poll_ms=100.0)
    try:
        poller = gateway.service.bus.poller
        deadline = time.monotonic() + 10
        while poller.polling and time.monotonic() < deadline:  # start-up messages, if any, have passed
            time.sleep(0.02)
        before = poller.polls
        time.sleep(0.05)
        assert poller.polls == before and not poller.polling
        sent_at = time.monotonic()
        assert httpx.get(f"{gateway.url}/v1/models", timeout=10).status_code == 200
        deadline = poller.deadline
    finally:
        gateway.close()
    # The request set the window's end a window after it came in. (Whether the loop then polled
    # depends on it getting a turn within 100 ms, which a loaded test machine need not give.)
    assert deadline >= sent_at + 0.1
