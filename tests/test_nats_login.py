"""NATS takes any login in both deployments. nats-server is started here exactly as docker-compose.yml
says (its `command` after compose's substitution of the shell's variables, its mounted nats.conf) and
as the rendered chart says (the StatefulSet's args with Kubernetes' $(NAME) expansion from the
container's env, the password from the Secret, the ConfigMap's nats.conf), with users and passwords
that nats-server's config parser cannot take from a `$VAR` reference: digits first and exponent-like
(what `openssl rand -hex 16` and `randAlphaNum 32` give a good share of the time), a number, a boolean,
`-` first (`secrets.token_urlsafe`), quotes, `#`, braces, spaces, backslashes, `$`. A client with the
login gets in; one without it, with another password or as another user is refused."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import nats
import pytest

from shared.natsd import server_info
from tests.deploy_helpers import load_compose
from tests.helm_helpers import find, render_chart
from tests.services_helpers import free_port
from tests.wiring_helpers import compose_nats, helm_nats, http_status, http_text, start_nats

NATS_SECRET = "rs-test-nats"
POD_NAME = "1e5-radixserve-nats-0"  # the pod of a release named 1e5: a server name that looks like a number
LOGINS = [
    ("radixserve", "1e5f3c0a9b7d2e4f6a8b0c1d3e5f7a9b"),  # openssl rand -hex 16
    ("radixserve", "4e2"),
    ("radixserve", "3Kab9xQ2mP"),
    ("radixserve", "12345"),
    ("radixserve", "true"),
    ("radixserve", "-Zq_8mW3vR"),
    ("radixserve", "q\"uo'te"),
    ("radixserve", "h#sh and  spaces "),
    ("radixserve", "br}ace{[x],y;z=w:v"),
    ("radixserve", "back\\slash\\n"),
    ("radixserve", "$dollar $(RS_NATS_USER) ${RS_NATS_USER} $$"),
    ("1e5", "3e9"),
    ("a user # with} spaces", "0x1F"),
]


async def _login(url: str, auth: Mapping[str, str]) -> str:
    """'' when a client logging in with `auth` gets in, else the error it gets."""

    async def quiet(_: Exception) -> None:
        pass

    try:
        client = await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=3,
                                    error_cb=quiet, **auth)
    except Exception as exc:  # noqa: BLE001 - the error is the answer
        return f"{type(exc).__name__}: {exc}"
    await client.close()
    return ""


def login(url: str, **auth: str) -> str:
    return asyncio.run(_login(url, auth))


@contextmanager
def running_nats(argv: list[str], env: Mapping[str, str], log: Path) -> Iterator[tuple[str, str]]:
    """The deployment's nats-server command started here: (client URL, monitoring URL) once /healthz
    answers; the server's log in the failure if it exits or does not answer."""
    port, monitor_port = free_port(), free_port()
    proc = start_nats(argv, env, port, monitor_port, log)
    monitor = f"http://127.0.0.1:{monitor_port}"
    try:
        deadline = time.monotonic() + 15
        while http_status(f"{monitor}/healthz") != 200:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-2000:]
            time.sleep(0.05)
        yield f"nats://127.0.0.1:{port}", monitor
    finally:
        proc.kill()
        proc.wait()


def assert_only_the_login_gets_in(url: str, user: str, password: str) -> None:
    assert (server_info(url) or {}).get("auth_required") is True
    assert login(url, user=user, password=password) == ""
    for wrong in ({}, {"user": user, "password": password + "x"}, {"user": user, "password": password[:-1]},
                  {"user": user + "x", "password": password}):
        assert "authorization" in login(url, **wrong).lower(), wrong


@pytest.mark.parametrize(("user", "password"), LOGINS)
def test_compose_nats_lets_in_its_login_only(user: str, password: str, tmp_path: Path) -> None:
    compose = load_compose({"RS_NATS_USER": user, "RS_NATS_PASSWORD": password, "RS_API_KEY": "k"})
    argv, env = compose_nats(compose)
    with running_nats(argv, env, tmp_path / "nats.log") as (url, _):
        assert_only_the_login_gets_in(url, user, password)


def helm_values(user: str | None) -> dict[str, Any]:
    nats_values: dict[str, Any] = {"replicas": 1}
    if user is not None:
        nats_values.update(user=user, existingSecret=NATS_SECRET)
    return {"nats": nats_values}


@pytest.mark.parametrize(("user", "password"), LOGINS)
def test_helm_nats_lets_in_its_login_only(user: str, password: str, tmp_path: Path) -> None:
    objects = render_chart(helm_values(user))
    argv, env = helm_nats(objects, {(NATS_SECRET, "password"): password}, POD_NAME, tmp_path, free_port())
    with running_nats(argv, env, tmp_path / "nats.log") as (url, monitor):
        assert_only_the_login_gets_in(url, user, password)
        assert json.loads(http_text(f"{monitor}/varz"))["server_name"] == POD_NAME


def test_helm_nats_lets_in_the_login_of_the_charts_own_secret(tmp_path: Path) -> None:
    objects = render_chart(helm_values(None))
    secret = find(objects, "Secret", "nats")
    password = base64.b64decode(secret["data"]["password"]).decode()
    secret_values = {(secret["metadata"]["name"], "password"): password}
    argv, env = helm_nats(objects, secret_values, POD_NAME, tmp_path, free_port())
    with running_nats(argv, env, tmp_path / "nats.log") as (url, _):
        assert_only_the_login_gets_in(url, "radixserve", password)


def test_neither_deployment_starts_nats_with_an_empty_user() -> None:
    """`--user ""` turns nats-server's login off (any client gets in), so neither file may give one."""
    env = {"RS_NATS_USER": "", "RS_NATS_PASSWORD": "1e5", "RS_API_KEY": "k"}
    argv, _ = compose_nats(load_compose(env))
    assert argv[argv.index("--user") + 1] == "radixserve"  # compose's ${RS_NATS_USER:-radixserve}
    with pytest.raises(Exception, match="nats.user is needed"):
        render_chart({"nats": {"user": ""}})
