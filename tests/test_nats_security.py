"""NATS security against a real nats-server: the per-role users of shared/nats_roles.py let every
message the protocol sends through and nothing else. A connection without credentials is refused (a
service exits 1 saying so); the external `client` user reaches only the front door and its own replies:
it cannot read another user's stream or prompt, report load for a worker, or control one. Services also
log in with an nkey seed, and verify a TLS server against the CA they are given."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATSClient

from shared.bus import Bus, NatsAuthError
from shared.nats_roles import RoleUser, generate_users
from shared.natsd import NatsServer, start_nats_server
from shared.service import ServiceConfig, connect_bus

NS = "sec"
REPO_ROOT = Path(__file__).resolve().parents[1]
# How long a message that should not arrive is waited for (one that should ends the wait at once).
WAIT_S = 1.0
# A message that should arrive is sent again until it does: now and then (1 in ~60 here, with or without
# authorization) a fresh connection's first message in these tests is not delivered.
RETRY_S, RETRIES = 0.2, 25

# Every flow of the protocol (shared/protocol.py's subject list): who publishes, who subscribes, on what.
FLOWS = [
    ("gateway", "tokenizer", f"{NS}.tokenize"),
    ("gateway", "tokenizer", f"{NS}.tokenize.text"),
    ("tokenizer", "worker", f"{NS}.worker.w0.requests"),
    ("gateway", "worker", f"{NS}.worker.w0.requests"),
    ("gateway", "worker", f"{NS}.worker.w0.control"),
    ("worker", "worker", f"{NS}.worker.w0.control"),  # a starting worker checks its id is free
    ("worker", "worker", f"{NS}._INBOX.abc.3"),  # the live holder's reply to that check
    ("gateway", "gateway", f"{NS}.gateway.abort"),  # a user key's abort of another replica's request
    ("worker", "gateway", f"{NS}._INBOX.abc.1"),  # a control reply
    ("tokenizer", "gateway", f"{NS}._INBOX.abc.2"),  # a /tokenize reply
    ("worker", "detokenizer", f"{NS}.detok.w0"),
    ("worker", "gateway", f"{NS}.workers.load"),
    ("detokenizer", "gateway", f"{NS}.gateway.g1.stream"),
    ("worker", "gateway", f"{NS}.gateway.g1.stream"),  # --with-detokenizer, and errors
    ("tokenizer", "gateway", f"{NS}.gateway.g1.stream"),  # errors
    ("client", "gateway", f"{NS}.v1.generate"),
    ("client", "gateway", f"{NS}.v1.abort"),
    ("gateway", "client", "_INBOX.xyz.1"),  # a front-door reply
]


@pytest.fixture(scope="module")
def users() -> dict[str, RoleUser]:
    return generate_users(NS)


@pytest.fixture(scope="module")
def secured(users: dict[str, RoleUser]) -> Iterator[NatsServer]:
    with start_nats_server(users=[user.server_entry(NS) for user in users.values()]) as server:
        yield server


def denied(action: str, subject: str) -> str:
    """The error nats-py reports for a publish or subscription the server refused."""
    return f'nats: permissions violation for {action} to "{subject}"'.lower()


async def login(url: str, user: RoleUser, errors: list[str]) -> NATSClient:
    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())  # nats-py lowercases some of them

    return await nats.connect(url, user=user.user, password=user.password, error_cb=on_error, allow_reconnect=False)


async def delivered(
    url: str, users: dict[str, RoleUser], sender: str, receiver: str, subject: str, tries: int = 1
) -> tuple[list[bytes], list[str]]:
    """What `receiver` gets on `subject` when `sender` publishes there (up to `tries` times, until one
    arrives), and the errors both saw."""
    errors: list[str] = []
    rx, tx = await login(url, users[receiver], errors), await login(url, users[sender], errors)
    got: list[bytes] = []
    arrived = asyncio.Event()

    async def on_message(msg: object) -> None:
        got.append(msg.data)  # type: ignore[attr-defined]
        arrived.set()

    try:
        await rx.subscribe(subject, cb=on_message)
        await rx.flush()
        for _ in range(tries):
            await tx.publish(subject, b"hello")
            await tx.flush()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(arrived.wait(), WAIT_S if tries == 1 else RETRY_S)
            if arrived.is_set():
                break
        await asyncio.sleep(0.05)  # an error that the server sends after the message
    finally:
        await tx.close()
        await rx.close()
    return got, errors


@pytest.mark.parametrize(("sender", "receiver", "subject"), FLOWS)
def test_every_protocol_flow_is_allowed_for_its_roles(
    secured: NatsServer, users: dict[str, RoleUser], sender: str, receiver: str, subject: str
) -> None:
    got, errors = asyncio.run(delivered(secured.url, users, sender, receiver, subject, tries=RETRIES))
    assert got and set(got) == {b"hello"}
    assert errors == []


@pytest.mark.parametrize("sender", ["client", "gateway", "tokenizer", "detokenizer"])
def test_only_a_worker_can_report_load(secured: NatsServer, users: dict[str, RoleUser], sender: str) -> None:
    got, errors = asyncio.run(delivered(secured.url, users, sender, "gateway", f"{NS}.workers.load"))
    assert got == []
    assert errors == [denied("publish", f"{NS}.workers.load")]


@pytest.mark.parametrize("subject", [f"{NS}.worker.w0.control", f"{NS}.worker.w0.requests"])
def test_the_client_user_cannot_control_or_feed_a_worker(
    secured: NatsServer, users: dict[str, RoleUser], subject: str
) -> None:
    got, errors = asyncio.run(delivered(secured.url, users, "client", "worker", subject))
    assert got == []
    assert errors == [denied("publish", subject)]


@pytest.mark.parametrize(
    ("subject", "publisher"),
    [
        (f"{NS}.gateway.*.stream", "detokenizer"),  # another user's answer
        (f"{NS}.worker.*.requests", "tokenizer"),  # another user's prompt
        (f"{NS}.detok.*", "worker"),
        (f"{NS}._INBOX.>", "worker"),  # the services' control replies
        (f"{NS}.v1.generate", "client"),  # another client's request
    ],
)
def test_the_client_user_cannot_read_what_is_not_its_own(
    secured: NatsServer, users: dict[str, RoleUser], subject: str, publisher: str
) -> None:
    concrete = subject.replace("*", "x").replace(">", "y")

    async def main() -> tuple[list[bytes], list[str]]:
        errors: list[str] = []
        spy, tx = await login(secured.url, users["client"], errors), await login(secured.url, users[publisher], [])
        got: list[bytes] = []

        async def on_message(msg: object) -> None:
            got.append(msg.data)  # type: ignore[attr-defined]

        await spy.subscribe(subject, cb=on_message)
        await spy.flush()
        await tx.publish(concrete, b"secret")
        await tx.flush()
        await asyncio.sleep(WAIT_S)
        await tx.close()
        await spy.close()
        return got, errors

    got, errors = asyncio.run(main())
    assert got == []
    assert errors == [denied("subscription", subject)]


def test_a_connection_without_credentials_is_refused(secured: NatsServer) -> None:
    async def main() -> None:
        await Bus.connect(secured.url, "anonymous")

    with pytest.raises(NatsAuthError, match="Authorization Violation"):
        asyncio.run(main())


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({}, "refused no credentials: Authorization Violation"),
        ({"RS_NATS_USER": f"{NS}-tokenizer", "RS_NATS_PASSWORD": "wrong"},
         f"refused user '{NS}-tokenizer': Authorization Violation"),
    ],
)
def test_a_service_refused_by_nats_exits_1_saying_why(
    secured: NatsServer, tmp_path: Path, env: dict[str, str], says: str
) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RS_")}
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "tokenizer", "--nats-url", secured.url, "--namespace", NS,
         "--metrics-port", "none"],
        cwd=REPO_ROOT, env={**clean, **env}, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    assert says in proc.stderr
    assert "wrong" not in proc.stderr  # the password is never logged


def test_a_service_logs_in_with_an_nkey_seed(tmp_path: Path) -> None:
    import nkeys
    from nacl.signing import SigningKey

    raw = bytes(SigningKey.generate())
    seed = nkeys.encode_seed(raw, nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    seed_file = tmp_path / "user.nk"
    seed_file.write_bytes(seed)
    with start_nats_server(users=[{"nkey": public}]) as server:

        async def main() -> bool:
            bus = await connect_bus(ServiceConfig(nats_url=server.url, nats_nkey_seed=str(seed_file)), "nkey")
            connected = bus.nc.is_connected
            await bus.nc.close()
            return connected

        assert asyncio.run(main())


def make_certificates(directory: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, both signed by the CA."""

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=radixserve test CA")
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "1", "-extfile", "san.ext")
    return {name: str(directory / name) for name in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NatsServer, dict[str, str]]]:
    files = make_certificates(tmp_path_factory.mktemp("tls"))
    tls = {"cert_file": files["server.pem"], "key_file": files["server.key"], "ca_file": files["ca.pem"], "verify": True}
    with start_nats_server(tls=tls) as server:
        yield server, files


def test_a_service_reaches_a_tls_nats_with_its_ca_and_client_certificate(tls_server: tuple[NatsServer, dict[str, str]]) -> None:
    server, files = tls_server
    config = ServiceConfig(nats_url=server.url, nats_tls_ca=files["ca.pem"], nats_tls_cert=files["client.pem"],
                           nats_tls_key=files["client.key"])

    async def main() -> bool:
        bus = await connect_bus(config, "tls")
        connected = bus.nc.is_connected
        await bus.nc.close()
        return connected

    assert asyncio.run(main())


def test_a_service_without_the_ca_does_not_trust_a_tls_nats(tls_server: tuple[NatsServer, dict[str, str]]) -> None:
    server, files = tls_server
    config = ServiceConfig(nats_url=server.url, nats_tls_cert=files["client.pem"], nats_tls_key=files["client.key"],
                           nats_connect_timeout=2)
    with pytest.raises(ConnectionError, match="unreachable .*last error: .*CERTIFICATE_VERIFY_FAILED"):
        asyncio.run(connect_bus(config, "untrusting"))


def test_services_log_in_with_creds_files_in_operator_mode(tmp_path: Path) -> None:
    """An operator's NATS in accounts mode (docs/OPERATIONS.md): each role a user JWT of one account,
    with its role's permissions; a worker's .creds reports load, a client's .creds cannot."""
    import nkeys

    from shared.nats_roles import role_permissions
    from tests.nats_jwt import NKey, operator_settings, write_creds

    account = NKey.new(nkeys.PREFIX_BYTE_ACCOUNT)
    settings = operator_settings(NKey.new(nkeys.PREFIX_BYTE_OPERATOR), account)
    for role in ("gateway", "worker", "client"):
        write_creds(tmp_path / f"{role}.creds", account, role_permissions(role, NS), role)
    with start_nats_server(settings=settings) as server:

        async def main() -> tuple[list[bytes], list[str]]:
            def config(role: str) -> ServiceConfig:
                return ServiceConfig(nats_url=server.url, subject_prefix=NS, nats_creds=str(tmp_path / f"{role}.creds"))

            gateway, worker = await connect_bus(config("gateway"), "gateway"), await connect_bus(config("worker"), "worker")
            errors: list[str] = []
            client = await Bus.connect(server.url, "client", NS, errors=errors, **config("client").connect_options())
            got: list[bytes] = []
            arrived = asyncio.Event()

            async def on_load(msg: object) -> None:
                got.append(msg.data)  # type: ignore[attr-defined]
                arrived.set()

            await gateway.nc.subscribe(f"{NS}.workers.load", cb=on_load)
            await gateway.nc.flush()
            await client.nc.publish(f"{NS}.workers.load", b"forged")
            await client.nc.flush()
            for _ in range(RETRIES):
                await worker.nc.publish(f"{NS}.workers.load", b"real")
                await worker.nc.flush()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(arrived.wait(), RETRY_S)
                if arrived.is_set():
                    break
            await asyncio.sleep(0.05)
            for bus in (gateway, worker, client):
                await bus.nc.close()
            with pytest.raises(NatsAuthError):  # no creds, no entry
                await Bus.connect(server.url, "anonymous")
            return got, [str(e).lower() for e in errors]

        got, errors = asyncio.run(main())
    assert got and set(got) == {b"real"}
    assert denied("publish", f"{NS}.workers.load") in errors


def test_a_client_account_reaches_only_the_imported_front_door(users: dict[str, RoleUser]) -> None:
    """docs/OPERATIONS.md's accounts layout: streamed front-door replies cross into the CLIENTS
    account; load reports published there reach no gateway, and a client (even one without
    permissions of its own) sees no service subject."""
    from shared.nats_roles import accounts_layout

    app = {"user": "app", "password": "app-password"}
    with start_nats_server(settings={"accounts": accounts_layout(users, NS, [app])}) as server:

        async def main() -> tuple[list[bytes], list[bytes], list[bytes], list[str]]:
            errors: list[str] = []
            gateway = await login(server.url, users["gateway"], errors)
            worker = await login(server.url, users["worker"], errors)
            client = await nats.connect(server.url, user="app", password="app-password", allow_reconnect=False)
            loads: list[bytes] = []
            seen: list[bytes] = []

            async def serve(msg: object) -> None:
                for i in range(3):  # a streamed answer: three replies to one request
                    await gateway.publish(msg.reply, f"chunk {i}".encode())  # type: ignore[attr-defined]

            async def on_load(msg: object) -> None:
                loads.append(msg.data)  # type: ignore[attr-defined]

            async def spy(msg: object) -> None:
                seen.append(msg.data)  # type: ignore[attr-defined]

            await gateway.subscribe(f"{NS}.v1.generate", queue="gateway", cb=serve)
            await gateway.subscribe(f"{NS}.workers.load", cb=on_load)
            await gateway.flush()
            await client.subscribe(f"{NS}.>", cb=spy)
            await client.flush()
            await client.publish(f"{NS}.workers.load", b"forged")
            chunks: list[bytes] = []
            for _ in range(RETRIES):  # a fresh connection's first message is now and then not delivered
                inbox = client.new_inbox()
                replies = await client.subscribe(inbox)
                await client.publish(f"{NS}.v1.generate", b"request", reply=inbox)
                await client.flush()
                with contextlib.suppress(nats.errors.TimeoutError):
                    chunks = [(await replies.next_msg(timeout=RETRY_S)).data]
                if chunks:
                    chunks += [(await replies.next_msg(timeout=5)).data for _ in range(2)]
                    break
                await replies.unsubscribe()
            await worker.publish(f"{NS}.detok.w0", b"tokens")
            await worker.flush()
            await asyncio.sleep(WAIT_S)
            for nc in (client, worker, gateway):
                await nc.close()
            return chunks, loads, seen, errors

        chunks, loads, seen, errors = asyncio.run(main())
    assert chunks == [b"chunk 0", b"chunk 1", b"chunk 2"]
    assert loads == [] and errors == []
    # Only what was published in its own account (its own messages): nothing of the services'. Clients
    # of one account see each other's requests unless each also gets the client role's permissions.
    assert set(seen) == {b"forged", b"request"}
