"""API keys for every front door of the gateway: static keys (`--api-key`, `--admin-api-key`, as vLLM
has) and, with `--redis-url`, keys kept in Redis with per-key request-rate limits and usage counters
that every gateway replica shares (Redis is the control plane, never the data plane: DESIGN.md §2).

A request to any route but the open ones (/health, /metrics, the API docs, the playground page) must carry
`Authorization: Bearer <key>`: a missing or unknown key is a 401, a key over its requests-per-minute
limit a 429 with Retry-After, an unreachable Redis a 503. gRPC calls bring the key as `authorization`
metadata (UNAUTHENTICATED / RESOURCE_EXHAUSTED / UNAVAILABLE); NATS front-door messages bring it as an
`Authorization` message header (an error final "401: ...", "429: ..." with retry_after, "503: ...").
All three go through `authorize`, so a key's limit and usage are the same whatever door it uses.

A key has a scope, `user` or `admin`. Admin-only: /flush_cache, /abort_request with abort_all, and
aborting a request that another key made (services/gateway/aborts.py); a user key gets 403
(`permission_error`, gRPC PERMISSION_DENIED). With no keys configured the server is open and everything
is allowed, as in vLLM. Key management (`radixserve keys`) talks to Redis itself: whoever can write to
Redis manages keys.

Keys are stored hashed (SHA-256): Redis never holds a usable key. Redis layout under
`radixserve:{subject_prefix}:`
  apikeys           hash   key hash -> JSON {"name", "rpm", "scope"}
  apikey_names      hash   name -> key hash
  rl:{hash}:{minute} string requests counted in that minute (expires after two minutes)
  usage:{hash}      hash   requests, prompt_tokens, completion_tokens
`radixserve keys create|list|revoke` manages them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import hashlib
import json
import logging
import math
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.gateway.errors import FORBIDDEN, GatewayError

if TYPE_CHECKING:
    from fastapi.responses import JSONResponse
    from starlette.types import ASGIApp, Receive, Scope, Send

    from services.gateway.config import GatewayConfig

logger = logging.getLogger(__name__)

UNAUTHORIZED = 401
TOO_MANY_REQUESTS = 429
SERVICE_UNAVAILABLE = 503
# The playground's page and script are static; its API calls carry the key the user types in. /ping and
# /version are open as in vLLM (a probe, and what is running).
OPEN_PATHS = frozenset({
    "/health", "/ping", "/version", "/ready", "/metrics", "/docs", "/redoc", "/openapi.json",
    "/docs/oauth2-redirect", "/playground", "/playground/playground.js",
})
RATE_WINDOW_S = 60
ADMIN, USER = "admin", "user"

def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class ApiKey:
    """A known key: its hash (its id everywhere), its name, its requests-per-minute limit (0: none)
    and its scope (ADMIN or USER)."""

    key_id: str
    name: str
    rpm: int = 0
    scope: str = USER

    @property
    def is_admin(self) -> bool:
        return self.scope == ADMIN


# The key of the request being handled (set by the middleware, read when the request is submitted).
current_key: contextvars.ContextVar[ApiKey | None] = contextvars.ContextVar("radixserve_api_key", default=None)


class StoreUnavailable(Exception):
    """The key store (Redis) could not be reached."""


class KeyStore:
    """Static keys and, optionally, Redis-held ones."""

    def __init__(
        self, static_keys: list[str], redis_url: str = "", namespace: str = "rs", admin_keys: list[str] | None = None
    ) -> None:
        self.static = {key_hash(k): ApiKey(key_hash(k), f"static-{i}") for i, k in enumerate(static_keys)}
        # A key given as both stays an admin.
        admins = enumerate(admin_keys or [])
        self.static |= {key_hash(k): ApiKey(key_hash(k), f"admin-{i}", scope=ADMIN) for i, k in admins}
        self.redis: Any = None
        self.prefix = f"radixserve:{namespace}:"
        if redis_url:
            import redis.asyncio as aioredis

            self.redis = aioredis.from_url(redis_url, socket_connect_timeout=2, socket_timeout=2)

    @classmethod
    def from_config(cls, config: GatewayConfig) -> KeyStore:
        def split(keys: str) -> list[str]:
            return [k.strip() for k in keys.split(",") if k.strip()]

        return cls(split(config.api_key), config.redis_url, config.subject_prefix, split(config.admin_api_key))

    @property
    def enabled(self) -> bool:
        return bool(self.static) or self.redis is not None

    async def check(self) -> None:
        """At start-up: Redis answers, or a ConnectionError that says where it was looked for."""
        if self.redis is None:
            return
        try:
            await self.redis.ping()
        except Exception as exc:  # noqa: BLE001 - any failure to reach Redis is the same start-up error
            raise ConnectionError(f"the API-key store (Redis) is unreachable: {exc}") from None

    async def close(self) -> None:
        if self.redis is not None:
            await self.redis.aclose()

    async def lookup(self, key: str) -> ApiKey | None:
        digest = key_hash(key)
        if digest in self.static:
            return self.static[digest]
        if self.redis is None:
            return None
        raw = await self._call(self.redis.hget(self.prefix + "apikeys", digest))
        if raw is None:
            return None
        entry = json.loads(raw)
        return ApiKey(digest, entry["name"], int(entry.get("rpm", 0)), ADMIN if entry.get("scope") == ADMIN else USER)

    async def admit(self, key: ApiKey, now: float | None = None) -> float | None:
        """Count one request against the key's limit: None when admitted, else seconds to wait."""
        if self.redis is None or key.rpm <= 0:
            return None
        now = time.time() if now is None else now
        window = int(now // RATE_WINDOW_S)
        counter = f"{self.prefix}rl:{key.key_id}:{window}"
        pipe = self.redis.pipeline()
        pipe.incr(counter)
        pipe.expire(counter, 2 * RATE_WINDOW_S)
        count, _ = await self._call(pipe.execute())
        if count > key.rpm:
            return max(1.0, math.ceil((window + 1) * RATE_WINDOW_S - now))
        return None

    async def record_usage(self, key: ApiKey, prompt_tokens: int, completion_tokens: int) -> None:
        if self.redis is None or key.key_id in self.static:
            return
        pipe = self.redis.pipeline()
        usage = f"{self.prefix}usage:{key.key_id}"
        pipe.hincrby(usage, "requests", 1)
        pipe.hincrby(usage, "prompt_tokens", prompt_tokens)
        pipe.hincrby(usage, "completion_tokens", completion_tokens)
        await self._call(pipe.execute())

    # ---- management (radixserve keys ...) --------------------------------------------------------

    async def create(self, name: str, rpm: int = 0, admin: bool = False) -> str:
        """A new key named `name` (unique) with a requests-per-minute limit and a scope; returns the
        key itself, which is shown once and stored only hashed."""
        if not name or rpm < 0:
            raise ValueError(f"a key needs a name and rpm >= 0, got {name!r} and {rpm}")
        key = "rs-" + secrets.token_urlsafe(24)
        digest = key_hash(key)
        if not await self._call(self.redis.hsetnx(self.prefix + "apikey_names", name, digest)):
            raise ValueError(f"a key named {name!r} exists already")
        entry = {"name": name, "rpm": rpm, "scope": ADMIN if admin else USER}
        await self._call(self.redis.hset(self.prefix + "apikeys", digest, json.dumps(entry)))
        return key

    async def revoke(self, name: str) -> bool:
        digest = await self._call(self.redis.hget(self.prefix + "apikey_names", name))
        if digest is None:
            return False
        digest = digest.decode()
        pipe = self.redis.pipeline()
        pipe.hdel(self.prefix + "apikeys", digest)
        pipe.hdel(self.prefix + "apikey_names", name)
        await self._call(pipe.execute())
        return True

    async def list(self) -> list[dict[str, Any]]:
        names = await self._call(self.redis.hgetall(self.prefix + "apikey_names"))
        out = []
        for name, digest in sorted(names.items()):
            entry = json.loads(await self._call(self.redis.hget(self.prefix + "apikeys", digest)) or "{}")
            usage = await self._call(self.redis.hgetall(f"{self.prefix}usage:{digest.decode()}"))
            out.append({
                "name": name.decode(),
                "rpm": int(entry.get("rpm", 0)),
                "scope": ADMIN if entry.get("scope") == ADMIN else USER,
                **{k.decode(): int(v) for k, v in usage.items()},
            })
        return out

    async def _call(self, awaitable: Any) -> Any:
        import redis.exceptions

        try:
            return await awaitable
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
            raise StoreUnavailable(str(exc)) from None


def require_admin(store: KeyStore, key: ApiKey | None, action: str) -> None:
    """GatewayError 403 unless `key` may do what only admins may (with no keys configured, anyone may)."""
    if not store.enabled or (key is not None and key.is_admin):
        return
    name = f"key {key.name!r} has scope user" if key is not None else "this request has no key"
    raise GatewayError(FORBIDDEN, f"{action} needs an admin key; {name}")


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    kind = {UNAUTHORIZED: "authentication_error", TOO_MANY_REQUESTS: "rate_limit_error"}.get(status, "server_error")
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    # Imported here: `radixserve keys` and every other command's parser import this module, and only
    # a gateway needs fastapi (a second of CPU at each start of a worker, tokenizer or health check).
    from fastapi.responses import JSONResponse

    return JSONResponse(body, status_code=status, headers=headers)


@dataclass(frozen=True)
class Verdict:
    """What an Authorization value gets: the key when admitted, else the status, message and (429)
    seconds to wait."""

    key: ApiKey | None
    status: int = 200
    message: str = ""
    retry_after: int | None = None


async def authorize(store: KeyStore, authorization: str) -> Verdict:
    """Check `Authorization: Bearer <key>` against the store and count it against the key's limit;
    shared by the HTTP middleware and the gRPC servicer (metadata `authorization`)."""
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return Verdict(None, UNAUTHORIZED, "missing API key: send `Authorization: Bearer <key>`")
    try:
        known = await store.lookup(key.strip())
        wait = await store.admit(known) if known is not None else None
    except StoreUnavailable as exc:
        logger.warning("API-key store unreachable: %s", exc)
        return Verdict(None, SERVICE_UNAVAILABLE, "the API-key store is unreachable")
    if known is None:
        return Verdict(None, UNAUTHORIZED, "invalid API key")
    if wait is not None:
        message = f"rate limit of {known.rpm} requests per minute reached for key {known.name!r}"
        return Verdict(None, TOO_MANY_REQUESTS, message, int(wait))
    return Verdict(known)


class ApiKeyAuth:
    """ASGI middleware: every HTTP request outside OPEN_PATHS needs a known key within its limit."""

    def __init__(self, app: ASGIApp, store: KeyStore) -> None:
        self.app = app
        self.store = store

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        # Refused before routing: /metrics counts these under endpoint="auth".
        scope.setdefault("state", {})["endpoint"] = "auth"
        headers = dict(scope.get("headers") or [])
        verdict = await authorize(self.store, headers.get(b"authorization", b"").decode(errors="replace"))
        if verdict.key is None:
            extra = {"Retry-After": str(verdict.retry_after)} if verdict.retry_after is not None else None
            await _error(verdict.status, verdict.message, extra)(scope, receive, send)
            return
        known = verdict.key
        token = current_key.set(known)
        try:
            await self.app(scope, receive, send)
        finally:
            current_key.reset(token)


# ---- radixserve keys ----------------------------------------------------------------------------


def add_keys_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keys = subparsers.add_parser("keys", help="manage the gateway's API keys in Redis")
    keys.add_argument("--redis-url", default=None, help="Redis URL (env RS_REDIS_URL; default redis://127.0.0.1:6379)")
    keys.add_argument("--subject-prefix", "--namespace", dest="subject_prefix", default=None,
                      help="the deployment's namespace (env RS_SUBJECT_PREFIX or RS_NAMESPACE; default rs)")
    sub = keys.add_subparsers(dest="keys_command", required=True)
    create = sub.add_parser("create", help="create a key and print it (shown once)")
    create.add_argument("name")
    create.add_argument("--rpm", type=int, default=0, help="requests per minute (0: no limit)")
    create.add_argument("--admin", action="store_true", help="scope admin: may flush caches and abort any request")
    revoke = sub.add_parser("revoke", help="revoke a key by name")
    revoke.add_argument("name")
    sub.add_parser("list", help="names, limits, scopes and usage")
    keys.set_defaults(handler=run_keys)


def run_keys(args: argparse.Namespace) -> int:
    import os

    url = args.redis_url or os.environ.get("RS_REDIS_URL") or "redis://127.0.0.1:6379"
    from shared.flags import values_from
    from shared.nats_connection import NatsConnection

    try:
        # Either spelling, as every service reads it (two different values are an error).
        prefix = args.subject_prefix or values_from(
            NatsConnection, exclude=set(NatsConnection.__dataclass_fields__) - {"subject_prefix"}
        ).get("subject_prefix", "rs")
        NatsConnection(subject_prefix=prefix)
    except ValueError as exc:
        print(f"radixserve keys: {exc}")
        return 2

    async def main() -> int:
        store = KeyStore([], url, prefix)
        try:
            await store.check()
            if args.keys_command == "create":
                print(await store.create(args.name, args.rpm, args.admin))
            elif args.keys_command == "revoke":
                if not await store.revoke(args.name):
                    print(f"no key named {args.name!r}")
                    return 1
                print(f"revoked {args.name!r}")
            else:
                for entry in await store.list():
                    print(json.dumps(entry))
            return 0
        except (ValueError, ConnectionError, StoreUnavailable) as exc:
            print(f"radixserve keys: {exc}")
            return 1
        finally:
            await store.close()

    return asyncio.run(main())
