"""The deployment bench/soak.py runs against: real service processes on this machine.

    with SoakStack.start(model, workers=2, gateways=1, log_dir=...) as stack:
        stack.gateway_urls          # HTTP addresses read from the gateways' logs
        stack.restart_worker("w0")  # SIGKILL, then a new process under the same id
        stack.rss_mb()              # {service label: resident set size in MB}
        stack.worker_info()         # {worker id: WorkerInfo}, asked over NATS (get_info)

Its own nats-server (shared/natsd.py), one tokenizer, N workers (each detokenizing in-process) and
one or more gateways, each `python -m services.cli <service>` (what `radixserve <service>` runs) with
its output in a log file under `log_dir`, one compute thread each (OMP_NUM_THREADS=1: a small host
shares its cores between all of them and the traffic).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import nats
import nats.errors

from shared.natsd import NatsServer, start_nats_server
from shared.protocol import (
    PROTOCOL_VERSION,
    ControlReply,
    ControlRequest,
    Subjects,
    WorkerInfo,
    decoder,
    encode,
)
from shared.service import die_with_parent, ready_line

REPO_ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 180.0
PREFIX = "rs"
_ADDRESS = re.compile(r"HTTP on (http://[\d.]+:\d+)")
_METRICS = re.compile(r"metrics at http://[^:]+:(\d+)/metrics")


class ServiceStartError(RuntimeError):
    """A service exited or did not log its ready line in time (the message ends with its log)."""


@dataclass
class Service:
    """One service process; `started` is when it was (re)started, for RSS counted from a restart."""

    service: str
    label: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    started: float = field(default_factory=time.monotonic)
    ready_at: float | None = None  # when it was first seen ready

    @classmethod
    def start(cls, service: str, args: list[str], log_dir: Path, label: str) -> Service:
        log_path = log_dir / f"{label}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "services.cli", service, *args],
                cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent,
            )
        return cls(service, label, proc, log_path)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""

    def is_ready(self) -> bool:
        if self.ready_at is None and ready_line(self.service) in self.log():
            self.ready_at = time.monotonic()
        return self.ready_at is not None

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.is_ready():
                return
            if self.proc.poll() is not None:
                raise ServiceStartError(f"{self.label} exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            time.sleep(0.1)
        raise ServiceStartError(f"{self.label} not ready after {timeout:.0f} s:\n{self.log()[-3000:]}")

    def metric(self, name: str) -> float | None:
        """A metric of the service's /metrics, summed over its label sets (it logged the address:
        --metrics-port 0), None if unknown."""
        match = _METRICS.search(self.log())
        if match is None:
            return None
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{match.group(1)}/metrics", timeout=5) as response:
                text = response.read().decode()
        except OSError:
            return None
        # Summed over its label sets (a worker's metrics have one: its model_name).
        values = [float(line.split()[-1]) for line in text.splitlines() if line.split(" ")[0].split("{")[0] == name]
        return sum(values) if values else None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM (the service drains), then SIGKILL if it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()


def rss_mb(pid: int) -> float | None:
    """A process's resident set size in MB from /proc (None once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    return int(match.group(1)) / 1024 if match else None


def gateway_url(gateway: Service) -> str:
    match = _ADDRESS.search(gateway.log())
    if match is None:
        raise ServiceStartError(f"{gateway.label} logged no HTTP address:\n{gateway.log()[-3000:]}")
    return match.group(1)


class SoakStack:
    """nats-server, a tokenizer, workers w0..w{n-1} and gateways g0..g{m-1}, as processes."""

    def __init__(self, nats_server: NatsServer, model: Path, log_dir: Path, worker_args: list[str]) -> None:
        self.nats = nats_server
        self.model = model
        self.log_dir = log_dir
        self.worker_args = worker_args
        self.tokenizer: Service | None = None
        self.workers: dict[str, Service] = {}
        self.gateways: list[Service] = []
        self.gateway_urls: list[str] = []
        self.restarts = 0
        self.started = time.monotonic()

    @classmethod
    def start(cls, model: Path, workers: int, gateways: int, log_dir: Path, max_total_tokens: int) -> SoakStack:
        log_dir.mkdir(parents=True, exist_ok=True)
        stack = cls(start_nats_server(), model, log_dir, ["--max-total-tokens", str(max_total_tokens)])
        try:
            stack._start_services(workers, gateways)
        except BaseException:
            stack.close()
            raise
        return stack

    def _common(self) -> list[str]:
        return ["--nats-url", self.nats.url, "--subject-prefix", PREFIX, "--metrics-port", "0"]

    def _start_services(self, workers: int, gateways: int) -> None:
        model = ["--model-path", str(self.model)]
        self.tokenizer = Service.start("tokenizer", [*self._common(), *model], self.log_dir, "tokenizer")
        for i in range(workers):
            self.workers[f"w{i}"] = self._start_worker(f"w{i}", f"w{i}")
        for i in range(gateways):
            # g0 asks the tokenizer service; further gateways tokenize themselves, so both paths soak.
            local = ["--local-tokenizer", str(self.model)] if i else []
            args = [*self._common(), "--gateway-id", f"g{i}", "--port", "0", "--grpc-port", "0", *local]
            self.gateways.append(Service.start("gateway", args, self.log_dir, f"g{i}"))
        for service in [self.tokenizer, *self.workers.values(), *self.gateways]:
            service.wait_ready()
        self.gateway_urls = [gateway_url(g) for g in self.gateways]

    def _start_worker(self, wid: str, label: str) -> Service:
        args = [*self._common(), "--model-path", str(self.model), "--worker-id", wid, "--with-detokenizer",
                *self.worker_args]
        return Service.start("worker", args, self.log_dir, label)

    def kill_and_start(self, wid: str) -> Service:
        """SIGKILL worker `wid` and start a new process under its id (not waiting for it: see
        restart_ready). The caller's thread must live until the end, since a service gets SIGTERM when
        the thread that started it exits (die_with_parent)."""
        self.workers[wid].kill()
        self.restarts += 1
        self.workers[wid] = self._start_worker(wid, f"{wid}-restart{self.restarts}")
        return self.workers[wid]

    def restart_ready(self, wid: str) -> bool:
        """Whether the restarted `wid` is ready. Its start is refused while the killed process still
        counts as live on NATS (until the server has seen its connection close): then it starts again."""
        worker = self.workers[wid]
        if worker.is_ready():
            return True
        if worker.proc.poll() is None:
            if time.monotonic() - worker.started > READY_TIMEOUT_S:
                raise ServiceStartError(
                    f"{worker.label} not ready after {READY_TIMEOUT_S:.0f} s:\n{worker.log()[-3000:]}")
            return False
        if "already served by a live worker" not in worker.log() or worker.label.count("-again") >= 5:
            raise ServiceStartError(f"{worker.label} exited with {worker.proc.returncode}:\n{worker.log()[-3000:]}")
        self.workers[wid] = self._start_worker(wid, f"{worker.label}-again")
        return False

    def services(self) -> dict[str, tuple[int, float | None]]:
        """{label: (pid, monotonic time it was seen ready or None)} of every service process, nats-server included."""
        pids: dict[str, tuple[int, float | None]] = {"nats-server": (self.nats.process.pid, self.started)}
        for service in [self.tokenizer, *self.gateways, *self.workers.values()]:
            if service is not None:
                pids[service.label] = (service.proc.pid, service.ready_at)
        return pids

    def worker_info(self, timeout: float = 10.0, wids: list[str] | None = None) -> dict[str, WorkerInfo | str]:
        """get_info of every worker (or of `wids`) over NATS: its WorkerInfo, or why there is none."""
        return asyncio.run(self._worker_info(timeout, list(self.workers) if wids is None else wids))

    def requests_on(self, wid: str, timeout: float = 5.0) -> int:
        """Requests worker `wid`'s scheduler holds now (running and waiting), asked over NATS: unlike the
        rs_worker_running_requests gauge, which the worker refreshes once per load interval (seconds
        behind under load), this is what a SIGKILL right after catches. 0 when it does not answer."""
        info = self.worker_info(timeout, [wid])[wid]
        return 0 if isinstance(info, str) else info.num_running + info.num_waiting

    async def _worker_info(self, timeout: float, wids: list[str]) -> dict[str, WorkerInfo | str]:
        subjects = Subjects(PREFIX)
        nc = await nats.connect(self.nats.url)
        answers: dict[str, WorkerInfo | str] = {}
        try:
            for wid in wids:
                request = encode(ControlRequest(v=PROTOCOL_VERSION, command="get_info"))
                try:
                    raw = await nc.request(subjects.worker_control(wid), request, timeout=timeout)
                except (asyncio.TimeoutError, nats.errors.Error) as exc:
                    answers[wid] = f"no get_info reply: {type(exc).__name__}"
                    continue
                reply = decoder(ControlReply).decode(raw.data)
                answers[wid] = reply.info if reply.ok and reply.info is not None else f"get_info: {reply.message}"
        finally:
            await nc.close()
        return answers

    def close(self) -> None:
        for service in [*self.gateways, *self.workers.values(), self.tokenizer]:
            if service is not None:
                service.stop()
        self.nats.stop()

    def __enter__(self) -> SoakStack:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
