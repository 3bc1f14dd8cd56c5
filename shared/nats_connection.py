"""How a process reaches NATS: the server, the namespace its subjects live under, who it is, and TLS.

Every service config extends NatsConnection, so each of these is a flag and an RS_* variable
(`--nats-user` / RS_NATS_USER). One way of proving who we are at a time:

    --nats-user U --nats-password P     user and password (nats-server `authorization { users }`)
    --nats-token T                      a token (nats-server `authorization { token }`)
    --nats-creds FILE                   a .creds file: a user JWT and its nkey seed (operator/accounts mode)
    --nats-nkey-seed FILE               a file holding an nkey seed (nats-server `users = [{nkey: U...}]`)

TLS: a `tls://` URL, or any of --nats-tls-ca (verify the server against this CA), --nats-tls-cert and
--nats-tls-key (a client certificate, for servers that `verify` clients). A missing file is a ValueError
naming its flag, before anything connects. Secrets never appear in a repr or a log line.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
# The inbox of services' own request/reply lives under the namespace ({p}._INBOX.>), apart from the
# `_INBOX.>` that external NATS clients use: a client allowed its own replies cannot read a control reply.
INBOX_TOKEN = "_INBOX"

# The settings child processes inherit from `radixserve up` (each an RS_* variable).
CREDENTIAL_FIELDS = ("nats_user", "nats_password", "nats_token", "nats_creds", "nats_nkey_seed")
TLS_FIELDS = ("nats_tls_ca", "nats_tls_cert", "nats_tls_key")
_FILE_FIELDS = ("nats_creds", "nats_nkey_seed", *TLS_FIELDS)


def _help(text: str, default: object, **meta: Any) -> Any:
    return field(default=default, metadata={"help": text, **meta})


def _secret(text: str) -> Any:
    return field(default=None, repr=False, metadata={"help": text})


def is_subject_token(value: str) -> bool:
    """Whether `value` can be one token of a NATS subject (worker and gateway ids are)."""
    return bool(value) and not any(c in value for c in " \t\r\n.*>")


def redact_url(url: str) -> str:
    """`url` fit for a log line: a password or token in it (nats://user:secret@host) shown as ***."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    userinfo, host = parts.netloc.rsplit("@", 1)
    user = userinfo.split(":", 1)[0] + ":***" if ":" in userinfo else "***"
    return urlunsplit(parts._replace(netloc=f"{user}@{host}"))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class NatsConnection:
    """Where NATS is, under which namespace, and how to prove who we are to it."""

    nats_url: str = _help("NATS server URL (tls://... for TLS)", DEFAULT_NATS_URL)
    subject_prefix: str = _help(
        "the namespace: prefix of every NATS subject and of the Redis keys, so deployments can share one "
        "NATS and one Redis", "rs", aliases=("namespace",),
    )
    nats_user: str | None = _help("NATS user name (with --nats-password)", None)
    nats_password: str | None = _secret("NATS password (with --nats-user; prefer RS_NATS_PASSWORD: argv is public)")
    nats_token: str | None = _secret("NATS authorization token (prefer RS_NATS_TOKEN: argv is public)")
    nats_creds: str | None = _help("NATS .creds file: user JWT and nkey seed (operator/accounts mode)", None)
    nats_nkey_seed: str | None = _help("file holding an NATS nkey seed (SU...) for nkey authentication", None)
    nats_tls_ca: str | None = _help("CA bundle that the NATS server's certificate must chain to", None)
    nats_tls_cert: str | None = _help("client certificate for NATS servers that verify clients (with --nats-tls-key)", None)
    nats_tls_key: str | None = _help("private key of --nats-tls-cert", None)

    def __post_init__(self) -> None:
        if not all(is_subject_token(part) for part in self.subject_prefix.split(".")):
            raise ValueError(
                f"subject_prefix (--namespace) must be dot-separated NATS tokens (no spaces, * or >), "
                f"got {self.subject_prefix!r}"
            )
        if (self.nats_user is None) != (self.nats_password is None):
            raise ValueError("--nats-user and --nats-password (RS_NATS_USER, RS_NATS_PASSWORD) go together")
        ways = [name for name in ("nats_user", "nats_token", "nats_creds", "nats_nkey_seed") if getattr(self, name)]
        if len(ways) > 1:
            raise ValueError(f"give one way to authenticate to NATS, not {' and '.join(map(_flag, ways))}")
        if self.nats_tls_key is not None and self.nats_tls_cert is None:
            raise ValueError("--nats-tls-key needs --nats-tls-cert")
        for name in _FILE_FIELDS:
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{_flag(name)} (RS_{name.upper()}): no such file: {path}")

    @property
    def nats_url_for_logs(self) -> str:
        return redact_url(self.nats_url)

    @property
    def nats_identity(self) -> str:
        """Who this connection claims to be, for log lines (never the secret itself)."""
        if self.nats_user:
            return f"user {self.nats_user!r}"
        if self.nats_creds:
            return f"credentials {self.nats_creds}"
        if self.nats_nkey_seed:
            return f"nkey seed {self.nats_nkey_seed}"
        return "a token" if self.nats_token else "no credentials"

    def tls_context(self) -> ssl.SSLContext | None:
        """The client TLS context the TLS options describe (None: none given; a tls:// URL alone
        still gets nats-py's default context, which checks the server against the system CAs)."""
        if self.nats_tls_ca is None and self.nats_tls_cert is None:
            return None
        context = ssl.create_default_context(cafile=self.nats_tls_ca)
        if self.nats_tls_cert is not None:
            context.load_cert_chain(self.nats_tls_cert, self.nats_tls_key)
        return context

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for nats-py's connect: credentials, TLS and the namespaced inbox."""
        options: dict[str, Any] = {"inbox_prefix": f"{self.subject_prefix}.{INBOX_TOKEN}"}
        if self.nats_user is not None:
            options.update(user=self.nats_user, password=self.nats_password)
        if self.nats_token is not None:
            options["token"] = self.nats_token
        if self.nats_creds is not None:
            options["user_credentials"] = self.nats_creds
        if self.nats_nkey_seed is not None:
            options["nkeys_seed"] = self.nats_nkey_seed
        tls = self.tls_context()
        if tls is not None:
            options["tls"] = tls
        return options

    def env(self) -> dict[str, str]:
        """These settings as RS_* variables, for a child process (none set: the variable is empty)."""
        env = {"RS_NAMESPACE": ""}  # the alias, emptied so that it cannot disagree with RS_SUBJECT_PREFIX
        for f in fields(NatsConnection):
            value = getattr(self, f.name)
            env[f"RS_{f.name.upper()}"] = "" if value is None else str(value)
        return env
