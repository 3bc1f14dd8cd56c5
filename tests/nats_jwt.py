"""Minting NATS operator, account and user JWTs for tests (what `nsc` does), so that nats-server's
operator/accounts mode and `.creds` logins can be tested without the nsc binary.

    operator = NKey.new(nkeys.PREFIX_BYTE_OPERATOR); account = NKey.new(nkeys.PREFIX_BYTE_ACCOUNT)
    settings = operator_settings(operator, account)            # nats.conf: operator, resolver, preload
    write_creds(path, account, permissions, "worker")          # a user of that account, as a .creds file

A JWT is base64url(header).base64url(claims).base64url(ed25519 signature by the issuer's nkey).
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nkeys
from nacl.signing import SigningKey

from shared.nats_roles import Permissions

_UNLIMITED = {"subs": -1, "data": -1, "payload": -1}


@dataclass(frozen=True)
class NKey:
    """An nkey pair: its seed (SO/SA/SU...) and public key (O/A/U...)."""

    seed: bytes
    public: str

    @classmethod
    def new(cls, prefix: int) -> NKey:
        seed = nkeys.encode_seed(bytes(SigningKey.generate()), prefix)
        return cls(seed, nkeys.from_seed(bytearray(seed)).public_key.decode())

    def sign(self, data: bytes) -> bytes:
        return nkeys.from_seed(bytearray(self.seed)).sign(data)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def mint(issuer: NKey, subject: str, name: str, nats: dict[str, Any]) -> str:
    """A JWT of `subject` signed by `issuer`, with the `nats` claims (type, version and the rest)."""
    claims: dict[str, Any] = {"iat": int(time.time()), "iss": issuer.public, "name": name, "sub": subject,
                              "nats": {**nats, "version": 2}}
    claims["jti"] = base64.b32encode(hashlib.sha256(json.dumps(claims, sort_keys=True).encode()).digest()).decode().rstrip("=")
    signed = f"{_b64(json.dumps({'typ': 'JWT', 'alg': 'ed25519-nkey'}).encode())}.{_b64(json.dumps(claims).encode())}"
    return f"{signed}.{_b64(issuer.sign(signed.encode()))}"


def operator_settings(operator: NKey, account: NKey) -> dict[str, Any]:
    """nats.conf settings for operator mode with one account held in memory."""
    account_jwt = mint(operator, account.public, "radixserve", {
        "type": "account",
        "limits": {**_UNLIMITED, "imports": -1, "exports": -1, "wildcards": True, "conn": -1, "leaf": -1},
        "default_permissions": {"pub": {}, "sub": {}},
    })
    return {
        "operator": mint(operator, operator.public, "test-operator", {"type": "operator"}),
        "resolver": "MEMORY",
        "resolver_preload": {account.public: account_jwt},
    }


def write_creds(path: Path, account: NKey, permissions: Permissions, name: str) -> None:
    """A .creds file for a new user of `account` allowed `permissions`, as `nsc generate creds` writes it."""
    user = NKey.new(nkeys.PREFIX_BYTE_USER)
    user_jwt = mint(account, user.public, name, {
        "type": "user", **_UNLIMITED,
        "pub": {"allow": list(permissions.publish)}, "sub": {"allow": list(permissions.subscribe)},
    })
    path.write_text(
        f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{user.seed.decode()}\n------END USER NKEY SEED------\n"
    )
