"""Where the pipeline's own latency goes: the first-chunk time of a request the worker answers without
the model (max_new_tokens=0), through HTTP and through the NATS front door, beside an HTTP request
that does nothing (/health) and a bare NATS round trip.

    .venv/bin/python bench/pipeline_floor.py [--gateway-tokenizes short|all|none] [--runs 60]

Starts `radixserve up` (its own nats-server, gateway, tokenizer, one worker with the detokenizer
in-process, the embedded default model on the CPU, one compute thread) and stops it at the end. Each
figure is the median (and quartiles) of --runs sequential requests after 5 warm-ups, a 64-token prompt
of ids. A table closes the output.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import msgspec
import nats

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.http_burst import SseProbe  # noqa: E402
from bench.pipeline_overhead import free_port  # noqa: E402
from services.launch import GATEWAY_TOKENIZES  # noqa: E402
from shared.protocol import PROTOCOL_VERSION, NatsGenerateRequest, Sampling  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
IDS = list(range(100, 164))
WARMUP = 5


def start_up(up_args: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str, str]:
    """`radixserve up` with its own nats-server, one compute thread per model process, on the CPU, plus
    `up_args`; returns the process, its URL and its nats-server URL once it prints them."""
    env = {**os.environ, "RS_NATS_URL": "nats://127.0.0.1:1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           **(env or {})}
    cmd = [sys.executable, "-m", "services.cli", "up", "--grpc-port", str(free_port()), "--device", "cpu", *up_args]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    deadline = time.monotonic() + 300
    seen, url = "", ""
    while time.monotonic() < deadline:
        line = proc.stdout.readline().decode(errors="replace")
        if not line and proc.poll() is not None:
            raise RuntimeError(f"`radixserve up` exited:\n{seen[-3000:]}")
        seen += line
        if match := re.search(r"radixserve is up: (http://\S+)", line):
            url = match.group(1)
        if match := re.search(r"NATS: (nats://[\d.]+:\d+)", line):
            return proc, url, match.group(1)
    proc.kill()
    raise RuntimeError(f"`radixserve up` not ready:\n{seen[-3000:]}")


def timed(fn: Callable[[], object], runs: int) -> list[float]:
    for _ in range(WARMUP):
        fn()
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def http_figures(url: str, runs: int) -> dict[str, list[float]]:
    client = httpx.Client(base_url=url, timeout=30)

    def floor() -> None:
        body = {"input_ids": IDS, "sampling_params": {"max_new_tokens": 0}, "stream": True}
        with client.stream("POST", "/generate", json=body) as response:
            next(line for line in response.iter_lines() if line.startswith("data: {"))

    probe = SseProbe(url)
    body = {"input_ids": IDS, "sampling_params": {"max_new_tokens": 0}, "stream": True}
    raw: list[float] = []

    def raw_floor() -> None:
        raw.append(probe.first_event("/generate", body, lambda event: True))

    timed(raw_floor, runs)
    probe.close()
    return {"HTTP GET /health": timed(lambda: client.get("/health"), runs),
            "HTTP /generate floor (first SSE event)": timed(floor, runs),
            "the same, raw socket client": raw[WARMUP:]}


async def nats_figures(nats_url: str, runs: int) -> dict[str, list[float]]:
    nc = await nats.connect(nats_url)
    request = msgspec.msgpack.encode(
        NatsGenerateRequest(v=PROTOCOL_VERSION, input_ids=IDS, sampling=Sampling(max_new_tokens=0), stream=True)
    )

    async def floor() -> None:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish("rs.v1.generate", request, reply=inbox)
        await sub.next_msg(timeout=10)
        await sub.unsubscribe()

    async def many(fn: Callable[[], object]) -> list[float]:
        for _ in range(WARMUP):
            await fn()  # type: ignore[misc]
        out = []
        for _ in range(runs):
            start = time.perf_counter()
            await fn()  # type: ignore[misc]
            out.append(time.perf_counter() - start)
        return out

    result = {"NATS front door floor (first chunk)": await many(floor), "NATS round trip (flush)": await many(nc.flush)}
    await nc.close()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gateway-tokenizes", choices=GATEWAY_TOKENIZES, default="short", nargs="?", const="all",
                   help="`up --gateway-tokenizes` (default short)")
    p.add_argument("--runs", type=int, default=60)
    args = p.parse_args()
    up_args = ["--port", str(free_port()), "--max-total-tokens", "8192"]
    proc, url, nats_url = start_up(up_args + ["--gateway-tokenizes", args.gateway_tokenizes])
    try:
        figures = http_figures(url, args.runs)
        figures |= asyncio.run(nats_figures(nats_url, args.runs))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    print(f"\nload average {os.getloadavg()[0]:.2f}; gateway tokenizes: {args.gateway_tokenizes}; {args.runs} runs each")
    print(f"{'figure':42s} {'median ms':>10s} {'p25':>7s} {'p75':>7s}")
    for name, values in figures.items():
        q = statistics.quantiles(values, n=4)
        print(f"{name:42s} {statistics.median(values) * 1e3:10.2f} {q[0] * 1e3:7.2f} {q[2] * 1e3:7.2f}")


if __name__ == "__main__":
    main()
