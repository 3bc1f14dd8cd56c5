"""Helpers for tests that run radixserve services as real processes against a real nats-server.

    with start_nats_server() as nats:
        worker = ServiceProcess.start("worker", ["--nats-url", nats.url, "--worker-id", "w1"], log_dir)
        worker.wait_ready()
        async with FakeGateway.connect(nats.url, "g1") as gateway:
            result = await gateway.generate(TokenizeRequest(...))

A ServiceProcess is `python -m services.cli <service> ...` with its stdout and stderr in a log file; it is
ready when it logs shared.service.ready_line. FakeGateway is what a gateway does on NATS: it publishes
TokenizeRequests and collects its stream subject's BatchStreamOut messages per request.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import nats
from nats.aio.client import Client as NATSClient

from shared.protocol import (
    PROTOCOL_VERSION,
    BatchStreamOut,
    ControlReply,
    ControlRequest,
    Finish,
    StreamOut,
    Subjects,
    TokenizeRequest,
    decoder,
    encode,
)
from shared.service import die_with_parent, ready_line

REPO_ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 180.0
STREAM_TIMEOUT_S = 60.0


# Ports handed out below the kernel's ephemeral range (32768-60999 by default): a port the kernel picks for
# bind(0) is also what it picks as the local port of an outgoing connection, so a test's service could
# find "its" free port taken by some other test's NATS client before it listens (CI saw a worker's
# metrics port go that way: "Address already in use").
_PORTS = range(20000, 32000)
_port_rng = random.Random(os.getpid() ^ time.monotonic_ns())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago, drawn at random below the ephemeral
    range (so no outgoing connection takes it in the meantime)."""
    for _ in range(64):
        port = _port_rng.choice(_PORTS)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_port_pair() -> int:
    """A port P on 127.0.0.1 such that P and P + 1 were both free a moment ago (a multi-node TP group's
    --dist-init-addr port: the nodes' heartbeats use the next one)."""
    while True:
        port = free_port()
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


class ServiceProcess:
    """One service (`tokenizer`, `worker` or `detokenizer`) as a child process."""

    def __init__(self, service: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        self.service = service
        self.proc = proc
        self.log_path = log_path

    @classmethod
    def start(
        cls, service: str, args: list[str], log_dir: Path, label: str | None = None, env: dict[str, str] | None = None
    ) -> ServiceProcess:
        log_path = log_dir / f"{label or service}.log"
        # One compute thread each: test machines are small and shared, and OpenMP threads that spin
        # on an oversubscribed CPU slow every process down many times over.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "services.cli", service, *args],
                cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent,
            )
        return cls(service, proc, log_path)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Until the ready line appears; AssertionError with the log if the process dies or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready_line(self.service) in self.log():
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.service} exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            time.sleep(0.1)
        raise AssertionError(f"{self.service} not ready after {timeout:.0f} s:\n{self.log()[-4000:]}")

    def metrics_url(self) -> str:
        """The /metrics URL the service logged (start it with --metrics-port 0)."""
        match = re.search(r"metrics at http://[^:]+:(\d+)/metrics", self.log())
        assert match, f"{self.service} logged no metrics address:\n{self.log()[-2000:]}"
        return f"http://127.0.0.1:{match.group(1)}/metrics"

    def scrape(self) -> str:
        with urllib.request.urlopen(self.metrics_url(), timeout=10) as response:
            return response.read().decode()

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait for the exit code (AssertionError with the log if it does not exit)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{self.service} ignored SIGTERM for {timeout:.0f} s:\n{self.log()[-4000:]}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def start_up(args: list[str], env: dict[str, str], log: Path, timeout: float = READY_TIMEOUT_S * 2) -> subprocess.Popen[bytes]:
    """`radixserve up *args` with `env`, its output in `log`; returns once it says it is up
    (AssertionError with its output if it exits first or takes longer than `timeout`)."""
    with log.open("wb") as out:
        # SIGTERM to `up` if the test run dies first: it then stops all it started.
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", *args],
            cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
        )
    deadline = time.monotonic() + timeout
    while "radixserve is up" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"up did not come up (exit {proc.poll()}):\n{log.read_text()[-4000:]}")
        time.sleep(0.1)
    return proc


def children_of(pid: int) -> set[int]:
    """Every descendant of pid, from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def metric_value(text: str, name: str, labels: str = "") -> float:
    """A sample's value from Prometheus text format (`labels` as written, e.g. 'status="ok"')."""
    wanted = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(wanted + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no sample {wanted} in the metrics")


@dataclass
class Result:
    """Everything a gateway received for one request."""

    rid: str
    chunks: list[StreamOut] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def token_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]

    @property
    def final(self) -> StreamOut:
        assert self.chunks and self.chunks[-1].finish is not None, f"request {self.rid} has no final"
        return self.chunks[-1]

    @property
    def finish(self) -> Finish:
        assert self.final.finish is not None
        return self.final.finish


class FakeGateway:
    """A gateway's NATS side, nothing more: publish TokenizeRequests, collect its stream subject."""

    def __init__(self, nc: NATSClient, gateway_id: str, prefix: str) -> None:
        self.nc = nc
        self.gateway_id = gateway_id
        self.subjects = Subjects(prefix)
        self.messages: list[BatchStreamOut] = []
        self._queues: defaultdict[str, asyncio.Queue[StreamOut]] = defaultdict(asyncio.Queue)
        self._decode = decoder(BatchStreamOut)

    @classmethod
    async def connect(cls, url: str, gateway_id: str, prefix: str = "rs") -> FakeGateway:
        gateway = cls(await nats.connect(url), gateway_id, prefix)
        await gateway.nc.subscribe(gateway.subjects.gateway_stream(gateway_id), cb=gateway._on_stream)
        await gateway.nc.flush()
        return gateway

    async def __aenter__(self) -> FakeGateway:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.nc.close()

    async def _on_stream(self, raw: Any) -> None:
        message = self._decode.decode(raw.data)
        self.messages.append(message)
        for item in message.items:
            self._queues[item.rid].put_nowait(item)

    def tokenize_request(self, rid: str, worker_id: str, **fields: Any) -> TokenizeRequest:
        return TokenizeRequest(v=PROTOCOL_VERSION, rid=rid, gateway_id=self.gateway_id, worker_id=worker_id, **fields)

    async def send(self, req: TokenizeRequest) -> None:
        await self.nc.publish(self.subjects.tokenize, encode(req))

    async def next_chunk(self, rid: str, timeout: float = STREAM_TIMEOUT_S) -> StreamOut:
        return await asyncio.wait_for(self._queues[rid].get(), timeout)

    def pending(self, rid: str) -> int:
        """Chunks of `rid` received but not yet taken."""
        return self._queues[rid].qsize()

    async def collect(self, rid: str, timeout: float = STREAM_TIMEOUT_S, first: StreamOut | None = None) -> Result:
        """Chunks of `rid` until its final (asyncio.TimeoutError if none comes within `timeout` s)."""
        result = Result(rid, [first] if first is not None else [])
        while not result.chunks or result.chunks[-1].finish is None:
            result.chunks.append(await self.next_chunk(rid, timeout))
        return result

    async def generate(self, req: TokenizeRequest, timeout: float = STREAM_TIMEOUT_S) -> Result:
        await self.send(req)
        return await self.collect(req.rid, timeout)

    async def control(self, worker_id: str, command: str, rid: str | None = None) -> ControlReply:
        raw = await self.nc.request(
            self.subjects.worker_control(worker_id),
            encode(ControlRequest(v=PROTOCOL_VERSION, command=command, rid=rid)),
            timeout=30,
        )
        return decoder(ControlReply).decode(raw.data)


def run(coro: Any) -> Any:
    """Run one test's coroutine (the tests use no asyncio plugin)."""
    return asyncio.run(coro)
