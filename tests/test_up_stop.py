"""`radixserve up` stops within its --stop-timeout of SIGINT and leaves nothing behind: a service that
takes no SIGTERM (stopped here with SIGSTOP, as a hung process would be) is killed once the bound is
spent, and a SIGINT while the services are still starting stops those started so far. On the tiny
seeded Qwen3, with `up`'s own nats-server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from shared.service import die_with_parent
from tests.services_helpers import REPO_ROOT, alive, children_of, start_up

STOP_TIMEOUT_S = 3.0
# Past the stop timeout: nats-server's own stop and the processes' exits.
MARGIN_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def up_args(model: Path, tmp_path: Path) -> list[str]:
    return ["--model-path", str(model), "--max-total-tokens", "2048", "--port", str(free_port()),
            "--grpc-port", str(free_port()), "--run-dir", str(tmp_path / "run"), "--stop-timeout", str(STOP_TIMEOUT_S)]


def up_env() -> dict[str, str]:
    # An address nothing answers on: `up` starts its own nats-server.
    return {**os.environ, "RS_NATS_URL": "nats://127.0.0.1:1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def service_pid(up_pid: int, service: str) -> int | None:
    """The pid of `up`'s child running `radixserve SERVICE`, if it has started."""
    for pid in children_of(up_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[1:4] == [b"-m", b"services.cli", service.encode()]:
            return pid
    return None


def interrupt(proc: subprocess.Popen[bytes]) -> tuple[int, float, set[int]]:
    """SIGINT to `up`: its exit code, the seconds it took to exit, and every process it had started."""
    started = children_of(proc.pid)
    began = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(timeout=STOP_TIMEOUT_S + 60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return code, time.monotonic() - began, started


def assert_all_gone(pids: set[int]) -> None:
    deadline = time.monotonic() + 2.0  # an orphan's exit is reaped by init, not by the test
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if alive(pid)], "processes left behind"


def test_a_service_that_takes_no_sigterm_is_killed_once_the_stop_timeout_is_spent(qwen3_path: Path, tmp_path: Path) -> None:
    proc = start_up(up_args(qwen3_path, tmp_path), up_env(), tmp_path / "up.out")
    worker = service_pid(proc.pid, "worker")
    assert worker is not None
    os.kill(worker, signal.SIGSTOP)
    code, took, started = interrupt(proc)
    assert code == 0, (tmp_path / "up.out").read_text()[-3000:]
    assert len(started) >= 4  # nats-server, gateway, tokenizer, worker
    assert STOP_TIMEOUT_S <= took < STOP_TIMEOUT_S + MARGIN_S
    assert "worker-0 did not stop in time: killed" in (tmp_path / "up.out").read_text()
    assert_all_gone(started)


def test_sigint_while_the_services_start_stops_those_started(qwen3_path: Path, tmp_path: Path) -> None:
    log = tmp_path / "up.out"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", *up_args(qwen3_path, tmp_path)],
                                cwd=REPO_ROOT, env=up_env(), stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=die_with_parent)
    deadline = time.monotonic() + 60
    while service_pid(proc.pid, "worker") is None:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.02)
    code, took, started = interrupt(proc)
    assert "radixserve is up" not in log.read_text()
    assert code == 0, log.read_text()[-3000:]
    assert took < STOP_TIMEOUT_S + MARGIN_S
    assert_all_gone(started)
