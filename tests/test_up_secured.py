"""`radixserve up --namespace NS` with the NATS it starts itself: every child serves under NS and logs
in as its role's generated user, the pipeline works end to end under those permissions, and NATS
listens on loopback and lets in nobody without credentials. The front door's `client` user (its
credentials in the run directory, readable by their owner only) gets answers on NS.v1.generate but
cannot forge a worker's load report. One `up` run serves those tests; a second one shows that `up` on a
NATS that already answers passes the credentials it was given to every child."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import stat
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import httpx
import nats
import openai
import pytest

from shared.natsd import start_nats_server
from shared.protocol import (
    PROTOCOL_VERSION,
    NatsGenerateChunk,
    NatsGenerateRequest,
    Sampling,
    WorkerLoad,
    decoder,
    encode,
)
from tests.services_helpers import children_of, free_port, start_up

NS = "blue"
MODEL = "SmolLM2-135M-Instruct"


@dataclass
class Up:
    url: str
    nats_url: str
    run_dir: Path
    log: Path
    proc: subprocess.Popen[bytes]

    def client_credentials(self) -> dict[str, str]:
        return json.loads((self.run_dir / "nats-client.json").read_text())

    def child_logs(self) -> dict[str, str]:
        return {p.stem: p.read_text(errors="replace") for p in self.run_dir.glob("*.log")}


@pytest.fixture(scope="module")
def up(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    tmp = tmp_path_factory.mktemp("up_secured")
    port = free_port()
    # An address nothing answers on, so that `up` starts (and secures) its own nats-server.
    env = {**os.environ, "RS_NATS_URL": "nats://127.0.0.1:1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("RS_SUBJECT_PREFIX", None)
    log = tmp / "up.out"
    proc = start_up(["--namespace", NS, "--port", str(port),
             "--grpc-port", str(free_port()), "--gateway-tokenizes", "none", "--max-total-tokens", "8192",
             "--model-path", str(default_model_path), "--run-dir", str(tmp / "run")], env, log)
    try:
        text = log.read_text()
        nats_url = re.search(r"NATS: (\S+)", text)
        assert nats_url, text
        yield Up(f"http://127.0.0.1:{port}", nats_url.group(1), tmp / "run", log, proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    assert code == 0, log.read_text()[-3000:]


def test_up_serves_end_to_end_under_role_permissions(up: Up) -> None:
    client = openai.OpenAI(base_url=f"{up.url}/v1", api_key="none")
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_tokens=16,
    )
    assert "Paris" in reply.choices[0].message.content
    assert not [name for name, text in up.child_logs().items() if "permissions violation" in text.lower()]


def test_up_namespace_reaches_every_child(up: Up) -> None:
    logs = up.child_logs()
    assert f"prefix '{NS}'" in logs["gateway"]
    assert f"on {NS}.tokenize" in logs["tokenizer"]
    assert f"on {NS}.worker.w0.requests" in logs["worker-0"]


def test_up_children_log_in_as_their_role_through_the_environment(up: Up) -> None:
    children = {}
    for pid in children_of(up.proc.pid):  # this `up`'s processes only: other tests may run their own
        entry = Path(f"/proc/{pid}")
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            if b"services.cli" in cmdline and len(cmdline) > 3 and cmdline[3] in (b"gateway", b"tokenizer", b"worker"):
                environ = dict(line.split(b"=", 1) for line in (entry / "environ").read_bytes().split(b"\0") if b"=" in line)
                children[cmdline[3].decode()] = (cmdline, environ)
        except OSError:
            continue
    assert set(children) == {"gateway", "tokenizer", "worker"}
    for role, (cmdline, environ) in children.items():
        assert environ[b"RS_NATS_USER"] == f"{NS}-{role}".encode()
        assert environ[b"RS_SUBJECT_PREFIX"] == NS.encode()
        assert not any(environ[b"RS_NATS_PASSWORD"] in arg for arg in cmdline)  # `ps` shows no password
    assert "RS_NATS_PASSWORD" not in up.log.read_text()


def test_up_nats_listens_on_loopback_and_refuses_anonymous_clients(up: Up) -> None:
    assert urlparse(up.nats_url).hostname == "127.0.0.1"

    async def main() -> None:
        await nats.connect(up.nats_url, allow_reconnect=False, connect_timeout=5)

    with pytest.raises(nats.errors.Error, match="(?i)authorization violation"):
        asyncio.run(main())


def test_up_client_credentials_are_readable_by_their_owner_only(up: Up) -> None:
    path = up.run_dir / "nats-client.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    creds = up.client_credentials()
    assert (creds["user"], creds["namespace"], creds["url"]) == (f"{NS}-client", NS, up.nats_url)


def test_the_client_user_gets_answers_from_the_front_door(up: Up) -> None:
    creds = up.client_credentials()

    async def main() -> NatsGenerateChunk:
        nc = await nats.connect(creds["url"], user=creds["user"], password=creds["password"])
        try:
            request = NatsGenerateRequest(v=PROTOCOL_VERSION, text="The capital of France is", stream=False,
                                          sampling=Sampling(max_new_tokens=4, temperature=0.0))
            reply = await nc.request(f"{NS}.v1.generate", encode(request), timeout=120)
            return decoder(NatsGenerateChunk).decode(reply.data)
        finally:
            await nc.close()

    chunk = asyncio.run(main())
    assert chunk.final and chunk.error is None and chunk.completion_tokens == 4
    assert "Paris" in chunk.text


def test_a_forged_worker_load_draws_no_requests(up: Up) -> None:
    creds = up.client_credentials()
    errors: list[str] = []

    async def forge() -> None:
        async def on_error(exc: Exception) -> None:
            errors.append(str(exc).lower())

        nc = await nats.connect(creds["url"], user=creds["user"], password=creds["password"], error_cb=on_error)
        load = WorkerLoad(v=PROTOCOL_VERSION, worker_id="evil", model=MODEL, num_running=0, num_waiting=0,
                          kv_usage=0.0, cache_hit_rate=1.0, max_total_tokens=1 << 20, context_len=8192,
                          timestamp=time.time())
        for _ in range(3):
            await nc.publish(f"{NS}.workers.load", encode(load))
            await nc.flush()
            await asyncio.sleep(0.2)
        await nc.close()

    asyncio.run(forge())
    assert f'nats: permissions violation for publish to "{NS}.workers.load"' in errors
    assert httpx.get(f"{up.url}/health", timeout=10).json()["workers"] == 1
    for _ in range(4):
        reply = httpx.post(f"{up.url}/v1/completions", timeout=120,
                           json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0})
        assert reply.status_code == 200, reply.text


def test_up_on_an_existing_nats_passes_its_credentials_to_every_child(default_model_path: Path, tmp_path: Path) -> None:
    with start_nats_server(users=[{"user": "ops", "password": "ops-password"}]) as server:
        env = {**os.environ, "RS_NATS_URL": server.url, "RS_NATS_USER": "ops", "RS_NATS_PASSWORD": "ops-password",
               "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        port = free_port()
        log = tmp_path / "up.out"
        proc = start_up(["--namespace", "green", "--port", str(port),
                 "--grpc-port", str(free_port()), "--max-total-tokens", "8192",
                 "--model-path", str(default_model_path), "--run-dir", str(tmp_path / "run")], env, log)
        try:
            assert f"using NATS at {server.url} as user 'ops'" in log.read_text()
            assert not (tmp_path / "run" / "nats-client.json").exists()  # nothing generated: not its NATS
            reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                               json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 2})
            assert reply.status_code == 200, reply.text
            assert "prefix 'green'" in (tmp_path / "run" / "gateway.log").read_text()
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=120) == 0
