"""GatewayConfig: the gateway's settings, one frozen dataclass (flags and RS_* variables through
shared/flags.py: `--port` / `RS_PORT`, `--grpc-port` / `RS_GRPC_PORT`, ...)."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field

from services.gateway.reasoning import PARSERS
from services.gateway.tool_calls import PARSERS as TOOL_PARSERS
from shared.service import ServiceConfig

# A gateway id becomes a NATS subject token ({prefix}.gateway.{id}.stream): no dots, spaces, wildcards.
_SUBJECT_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")
# A web origin as browsers send it in Origin: scheme://host[:port], no path.
_ORIGIN = re.compile(r"^[a-z][a-z0-9+.-]*://[^/?#\s]+$")


HTTP_IMPLS = ("auto", "httptools", "h11")


def _help(text: str, default: object) -> object:
    return field(default=default, metadata={"help": text})


def new_gateway_id() -> str:
    return f"gw-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class GatewayConfig(ServiceConfig):
    """One gateway process: HTTP (OpenAI + native), gRPC and the NATS front door. Its /metrics is on
    the HTTP port, so the shared metrics_port stays off by default."""

    gateway_id: str = _help("this gateway's id: its stream subject is {prefix}.gateway.{id}.stream (default: random)", "")
    host: str = _help("HTTP and gRPC bind address", "127.0.0.1")
    port: int = _help("HTTP port (0: any free port)", 8000)
    reuse_port: bool = _help(
        "bind the HTTP port with SO_REUSEPORT, so several gateway processes share one port and the kernel "
        "spreads new connections over them (Linux; needs a fixed --port)",
        False,
    )
    http: str = _help(
        "HTTP/1.1 parser: httptools (C, installed with the project), h11 (pure Python), or auto (httptools "
        "where it imports)",
        "auto",
    )
    grpc_port: int = _help("gRPC port (0: any free port)", 50051)
    enable_grpc: bool = _help("serve the gRPC API", True)
    enable_nats_frontdoor: bool = _help("serve {prefix}.v1.generate and {prefix}.v1.abort on NATS", True)
    worker_ttl: float = _help("seconds: route only to workers heard on {prefix}.workers.load this recently", 3.0)
    worker_dead_after: float = _help(
        "seconds: a worker that sends no report and answers no probe this long (its NATS connection still open) "
        "is given up: its requests are aborted there and moved. A worker whose connection is gone is caught "
        "within ~2 s whatever this is; a slow step never silences a worker", 30.0,
    )
    max_migrations: int = _help(
        "times a request may move to another worker when its worker is lost (0: never; the client gets a 503)", 1
    )
    api_key: str = _help(
        "comma-separated API keys (scope user) every request on HTTP (but /health, /metrics, docs), gRPC and the "
        "NATS front door must bring as a Bearer token",
        "",
    )
    admin_api_key: str = _help(
        "comma-separated API keys of scope admin: they may also flush caches, abort all requests and abort other "
        "keys' requests",
        "",
    )
    redis_url: str = _help(
        "Redis holding API keys with rate limits and usage (`radixserve keys ...`); empty: static keys only", ""
    )
    local_tokenizer: str = _help(
        "model directory or name whose tokenizer this gateway loads to tokenize requests for that model "
        "itself, sending them straight to the worker (one NATS hop less); empty: the tokenizer service does it",
        "",
    )
    local_tokenizer_max_chars: int | None = _help(
        "with --local-tokenizer: prompts of more characters (text, or chat roles and contents) go to the "
        "tokenizer service instead; none: every prompt for that model is tokenized here, long ones in a thread",
        None,
    )
    served_model_name: str | None = _help(
        "with --local-tokenizer: the name its model is served under (the workers' --served-model-name); "
        "default: the directory's name",
        None,
    )
    tokenizer_path: str | None = _help(
        "with --local-tokenizer: the tokenizer's directory, model name or hub id, when not the model's own", None
    )
    chat_template: str | None = _help(
        "with --local-tokenizer: a Jinja chat template (a file, or the template itself) instead of the model's", None
    )
    routing_policy: str = _help(
        "cache_aware (send a prompt where its prefix was sent before while loads are balanced) or least_loaded",
        "cache_aware",
    )
    cache_threshold: float = _help("cache_aware: the share of the prompt a worker must have seen to be preferred", 0.5)
    balance_abs_threshold: int = _help(
        "cache_aware: queues are imbalanced when longest - shortest exceeds this (and the relative threshold)", 32
    )
    balance_rel_threshold: float = _help(
        "cache_aware: queues are imbalanced when longest > shortest * this (and the absolute threshold)", 1.5
    )
    reasoning_parser: str | None = _help(
        "split chat answers into reasoning_content and content: qwen3, qwen3-thinking or deepseek-r1 (none: off; "
        "a request's separate_reasoning: false keeps its answer whole)",
        None,
    )
    tool_call_parser: str | None = _help(
        "read tool calls back from chat answers (hermes, or qwen3: the same <tool_call> format); none: requests "
        "with tools are refused",
        None,
    )
    wait_for_worker: float = _help("seconds a request waits for a first live worker before a 503", 2.0)
    first_output_timeout: float = _help("seconds: a request with no output at all by then ends with a 504", 300.0)
    control_timeout: float = _help("seconds to wait for a worker's reply to abort, flush_cache or get_info", 5.0)
    max_request_bytes: int = _help("largest HTTP body accepted (0: the NATS server's max_payload)", 0)
    max_batch_size: int = _help(
        "most prompts in one batch (a list in /generate's text or input_ids, or /v1/completions' prompt); each "
        "prompt's n choices are generations of their own", 128,
    )
    drain_timeout: float = _help("seconds in-flight requests may take to finish on SIGTERM", 30.0)
    allowed_origins: str = _help(
        "comma-separated web origins (https://app.example.com) whose pages may call the HTTP API from a browser "
        "(CORS; preflights answered), or * for any; empty: none (no CORS headers)",
        "",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.gateway_id:
            object.__setattr__(self, "gateway_id", new_gateway_id())
        if not _SUBJECT_TOKEN.match(self.gateway_id):
            raise ValueError(f"gateway_id must be letters, digits, '-' or '_', got {self.gateway_id!r}")
        for name in ("port", "grpc_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {getattr(self, name)}")
        if self.local_tokenizer_max_chars is not None and self.local_tokenizer_max_chars < 0:
            raise ValueError(f"local_tokenizer_max_chars must be >= 0, got {self.local_tokenizer_max_chars}")
        if self.reasoning_parser is not None and self.reasoning_parser not in PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(sorted(PARSERS))} or none, "
                             f"got {self.reasoning_parser!r}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)} or none, "
                             f"got {self.tool_call_parser!r}")
        if self.reuse_port and self.port == 0:
            raise ValueError("reuse_port needs a fixed port: with port 0 each gateway would get its own")
        for name in ("worker_ttl", "worker_dead_after", "first_output_timeout", "control_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.worker_dead_after < self.worker_ttl:
            raise ValueError(
                f"worker_dead_after ({self.worker_dead_after}) must be >= worker_ttl ({self.worker_ttl})"
            )
        if self.http not in HTTP_IMPLS:
            raise ValueError(f"http must be one of {', '.join(HTTP_IMPLS)}, got {self.http!r}")
        if self.routing_policy not in ("cache_aware", "least_loaded"):
            raise ValueError(f"routing_policy must be cache_aware or least_loaded, got {self.routing_policy!r}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError(
                "balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1, got "
                f"{self.balance_abs_threshold} and {self.balance_rel_threshold}"
            )
        if not 0 <= self.max_migrations <= 16:
            raise ValueError(f"max_migrations must be in [0, 16], got {self.max_migrations}")
        if self.wait_for_worker < 0:
            raise ValueError(f"wait_for_worker must be >= 0, got {self.wait_for_worker}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_request_bytes < 0:
            raise ValueError(f"max_request_bytes must be >= 0, got {self.max_request_bytes}")
        self.origins()

    def origins(self) -> tuple[str, ...]:
        """allowed_origins as a tuple (lower-cased, as browsers send them); ValueError for one that is
        neither * nor scheme://host[:port] (a path or trailing slash would never match an Origin)."""
        origins = tuple(o.strip().lower() for o in self.allowed_origins.split(",") if o.strip())
        if "*" in origins and len(origins) > 1:
            raise ValueError(f"allowed_origins: * allows every origin and cannot be listed with others, got "
                             f"{self.allowed_origins!r}")
        for origin in origins:
            if origin != "*" and not _ORIGIN.match(origin):
                raise ValueError(f"allowed_origins: {origin!r} is not an origin: scheme://host[:port] with no path "
                                 "(as https://app.example.com), or *")
        return origins
