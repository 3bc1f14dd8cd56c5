"""API keys in Redis for tests: a Redis namespace of a module's own (cleaned up after), and the
`radixserve keys` command line run in-process."""

from __future__ import annotations

import contextlib
import io
import os
import uuid
from collections.abc import Iterator

import redis

from services.cli import main as cli_main

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379")


def redis_namespace(label: str) -> Iterator[str]:
    """A subject prefix of its own, which is also a Redis namespace; its keys are deleted after (use
    with `yield from` in a fixture)."""
    name = f"{label}{uuid.uuid4().hex[:8]}"
    yield name
    client = redis.Redis.from_url(REDIS_URL)
    for key in client.scan_iter(f"radixserve:{name}:*"):
        client.delete(key)


def keys_cli(prefix: str, *args: str, redis_url: str = REDIS_URL) -> tuple[int, str]:
    """`radixserve keys --redis-url ... --subject-prefix prefix *args`: (exit code, what it printed)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main(["keys", "--redis-url", redis_url, "--subject-prefix", prefix, *args])
    return code, out.getvalue().strip()
