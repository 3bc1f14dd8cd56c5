"""Who may say what on NATS: one user per service role, each allowed exactly the subjects it uses.

`radixserve up` starts its nats-server with these users (generated passwords) and hands each child
its role's credentials; docs/OPERATIONS.md shows the same table as a config for an operator's NATS.

    role         publishes                                          subscribes
    gateway      {p}.tokenize(.text), {p}.worker.*.requests,        {p}.workers.load, {p}.gateway.*.stream,
                 {p}.worker.*.control, {p}.gateway.abort,            {p}.v1.generate, {p}.v1.abort,
                 _INBOX.> and _R_.> (front-door replies)             {p}.gateway.abort, {p}._INBOX.>
    tokenizer    {p}.worker.*.requests, {p}.gateway.*.stream,       {p}.tokenize, {p}.tokenize.text
                 {p}._INBOX.> (replies)
    worker       {p}.workers.load, {p}.detok.*, {p}.gateway.*.stream, {p}.worker.*.requests,
                 {p}.worker.*.control (its start-up id check),      {p}.worker.*.control, {p}._INBOX.>
                 {p}._INBOX.> (control replies)
    detokenizer  {p}.gateway.*.stream                               {p}.detok.*
    client       {p}.v1.generate, {p}.v1.abort                      _INBOX.>

So only a worker can report load (no forged worker draws requests), only a gateway can send work or
control a worker, and an external client reaches the front door and its own replies and nothing else:
not another user's stream, prompt or cache. Services' own request/reply inboxes are `{p}._INBOX.>`
(shared/nats_connection.py), out of the clients' `_INBOX.>`.

accounts_layout() puts the same users in an account of their own that exports only the front door, and
external clients in another account that imports it: there a client cannot even name another subject.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.nats_connection import INBOX_TOKEN

SERVICE_ROLES = ("gateway", "tokenizer", "worker", "detokenizer")
CLIENT_ROLE = "client"
ROLES = (*SERVICE_ROLES, CLIENT_ROLE)
CLIENT_INBOX = "_INBOX.>"


@dataclass(frozen=True)
class Permissions:
    """The subjects one role may publish to and subscribe to (NATS wildcards allowed)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]

    def server_form(self) -> dict[str, Any]:
        """nats-server's `permissions` block: these subjects allowed, every other one denied."""
        return {"publish": {"allow": list(self.publish)}, "subscribe": {"allow": list(self.subscribe)}}


def role_permissions(role: str, prefix: str = "rs") -> Permissions:
    """What `role` may do in the namespace `prefix`; ValueError for an unknown role."""
    p = prefix
    inbox = f"{p}.{INBOX_TOKEN}.>"
    streams = f"{p}.gateway.*.stream"
    table = {
        "gateway": Permissions(
            # Front-door replies go to the client's inbox, or to `_R_.>` when the client is in another
            # account that imports the front door (accounts_layout).
            publish=(f"{p}.tokenize", f"{p}.tokenize.text", f"{p}.worker.*.requests", f"{p}.worker.*.control",
                     f"{p}.gateway.abort", CLIENT_INBOX, "_R_.>"),
            subscribe=(f"{p}.workers.load", streams, f"{p}.v1.generate", f"{p}.v1.abort", f"{p}.gateway.abort",
                       inbox),
        ),
        "tokenizer": Permissions(
            publish=(f"{p}.worker.*.requests", streams, inbox),
            subscribe=(f"{p}.tokenize", f"{p}.tokenize.text"),
        ),
        "worker": Permissions(
            # worker.*.control: at start a worker pings its own id to refuse a live worker's (the reply
            # comes to its inbox); NATS cannot narrow a shared role to "its own id".
            publish=(f"{p}.workers.load", f"{p}.detok.*", streams, f"{p}.worker.*.control", inbox),
            subscribe=(f"{p}.worker.*.requests", f"{p}.worker.*.control", inbox),
        ),
        "detokenizer": Permissions(publish=(streams,), subscribe=(f"{p}.detok.*",)),
        CLIENT_ROLE: Permissions(publish=(f"{p}.v1.generate", f"{p}.v1.abort"), subscribe=(CLIENT_INBOX,)),
    }
    if role not in table:
        raise ValueError(f"unknown NATS role {role!r}: one of {', '.join(ROLES)}")
    return table[role]


@dataclass(frozen=True)
class RoleUser:
    """One role's NATS user and its generated password."""

    role: str
    user: str
    password: str

    def server_entry(self, prefix: str) -> dict[str, Any]:
        """This user as an entry of nats-server's `authorization { users }`."""
        return {"user": self.user, "password": self.password,
                "permissions": role_permissions(self.role, prefix).server_form()}

    def env(self) -> dict[str, str]:
        """The RS_* variables that log a service in as this user (variables, not argv: `ps` shows argv)."""
        return {"RS_NATS_USER": self.user, "RS_NATS_PASSWORD": self.password, "RS_NATS_TOKEN": "",
                "RS_NATS_CREDS": "", "RS_NATS_NKEY_SEED": ""}


def generate_users(prefix: str = "rs", roles: tuple[str, ...] = ROLES) -> dict[str, RoleUser]:
    """A user per role, named `{prefix}-{role}`, with a fresh random password (256 bits)."""
    return {role: RoleUser(role, f"{prefix}-{role}", secrets.token_urlsafe(32)) for role in roles}


def write_client_credentials(path: Path, url: str, prefix: str, client: RoleUser) -> None:
    """The client user's credentials as JSON (url, user, password, namespace), readable by its owner only."""
    data = {"url": url, "user": client.user, "password": client.password, "namespace": prefix,
            "publish": list(role_permissions(CLIENT_ROLE, prefix).publish), "inbox": CLIENT_INBOX}
    path.unlink(missing_ok=True)
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
        json.dump(data, out, indent=2)
        out.write("\n")


def accounts_layout(users: dict[str, RoleUser], prefix: str, clients: list[dict[str, Any]]) -> dict[str, Any]:
    """nats-server's `accounts` block: the service roles in account RADIXSERVE, which exports
    {prefix}.v1.generate (streamed replies) and {prefix}.v1.abort; `clients` (user entries) in account
    CLIENTS, which imports those two and nothing else."""
    front_door = [f"{prefix}.v1.generate", f"{prefix}.v1.abort"]
    return {
        "RADIXSERVE": {
            "users": [users[role].server_entry(prefix) for role in SERVICE_ROLES if role in users],
            "exports": [{"service": front_door[0], "response_type": "stream"}, {"service": front_door[1]}],
        },
        "CLIENTS": {
            "users": clients,
            "imports": [{"service": {"account": "RADIXSERVE", "subject": subject}} for subject in front_door],
        },
    }
