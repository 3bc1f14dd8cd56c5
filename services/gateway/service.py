"""The gateway process: HTTP (uvicorn), gRPC and the NATS front door over one Dispatcher, in one event
loop. `radixserve gateway` runs it.

Drain on SIGTERM, in order: stop taking work on every door at once (uvicorn closes its listener,
gRPC refuses new calls, the front door unsubscribes) -> let in-flight requests finish within
`drain_timeout` -> stop the watchdog -> drain NATS (which the in-flight requests needed until then).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import grpc
import uvicorn

from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from services.gateway.dispatch import Dispatcher
from services.gateway.metrics import GatewayMetrics
from services.gateway.nats_frontdoor import NatsFrontDoor
from shared.bus import Bus
from shared.metrics import MetricsServer, start_metrics_server
from shared.service import Service, connect_bus, drain_bus

logger = logging.getLogger(__name__)

HTTP_START_TIMEOUT_S = 30.0


def http_impl(choice: str) -> str:
    """uvicorn's HTTP protocol for GatewayConfig.http: auto is httptools (a C parser, installed with the
    project) where it imports, else h11. httptools costs a gateway ~0.35 ms less CPU per streamed request
    on a 2-vCPU host (bench/HISTORY.md, the CPU pipeline's tenth-session notes)."""
    if choice != "auto":
        return choice
    try:
        import httptools  # noqa: F401
    except ImportError:
        return "h11"
    return "httptools"


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) with SO_REUSEPORT: every gateway process that binds the same
    way shares the port, and the kernel hands each new connection to one of them."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise OSError("reuse_port: this platform has no SO_REUSEPORT")
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


class _HttpServer(uvicorn.Server):
    """uvicorn without its own signal handling: the service decides the shutdown order."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class GatewayService(Service):
    """One gateway: every front door of radixserve over NATS."""

    name = "gateway"

    def __init__(self, config: GatewayConfig) -> None:
        super().__init__()
        self.config = config
        self.metrics = GatewayMetrics()
        self.bus: Bus | None = None
        self.dispatcher: Dispatcher | None = None
        self.frontdoor: NatsFrontDoor | None = None
        self.grpc: grpc.aio.Server | None = None
        self.http: _HttpServer | None = None
        self.http_impl = http_impl(config.http)  # the uvicorn protocol that parses requests
        self._http_task: asyncio.Task[None] | None = None
        self._metrics_server: MetricsServer | None = None
        self.http_port = 0
        self.grpc_port = 0

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.http_port}"

    async def start(self) -> None:
        cfg = self.config
        # Bounded like every service's: an unreachable NATS is a clear exit 1, not a retry for ever.
        self.bus = await connect_bus(cfg, f"gateway-{cfg.gateway_id}")
        self.dispatcher = Dispatcher(self.bus, cfg, self.metrics)
        await self.dispatcher.start()
        await self._start_http()
        if cfg.enable_grpc:
            from services.gateway.grpc_server import start_grpc_server

            self.grpc, self.grpc_port = await start_grpc_server(self.dispatcher, cfg.host, cfg.grpc_port)
        if cfg.enable_nats_frontdoor:
            self.frontdoor = NatsFrontDoor(self.dispatcher)
            await self.frontdoor.start()
        # /metrics is on the HTTP port; a separate metrics port serves the same registry when asked for.
        self._metrics_server = start_metrics_server(cfg.metrics_port, cfg.metrics_host, self.metrics.registry)
        logger.info(
            "gateway %s: HTTP on %s (%s), gRPC %s, NATS front door %s (NATS %s, prefix %r)",
            cfg.gateway_id,
            self.url,
            self.http_impl,
            f"on {cfg.host}:{self.grpc_port}" if self.grpc else "off",
            f"on {self.bus.subjects.v1_generate}" if self.frontdoor else "off",
            cfg.nats_url_for_logs,
            cfg.subject_prefix,
        )

    async def _start_http(self) -> None:
        assert self.dispatcher is not None
        cfg = self.config
        app = create_app(self.dispatcher, cfg.max_request_bytes)
        self.http = _HttpServer(
            uvicorn.Config(
                app,
                host=cfg.host,
                port=cfg.port,
                log_config=None,
                log_level=cfg.log_level.lower(),
                access_log=False,
                lifespan="off",
                http=self.http_impl,
                timeout_graceful_shutdown=max(int(cfg.drain_timeout), 1),
            )
        )
        sockets = [reuse_port_socket(cfg.host, cfg.port)] if cfg.reuse_port else None
        self._http_task = asyncio.create_task(self.http.serve(sockets=sockets), name="gateway-http")
        deadline = asyncio.get_running_loop().time() + HTTP_START_TIMEOUT_S
        while not self.http.started:
            if self._http_task.done():
                self._http_task.result()
                raise OSError(f"the HTTP server did not start on {cfg.host}:{cfg.port}")
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"the HTTP server did not start within {HTTP_START_TIMEOUT_S:g} s")
            await asyncio.sleep(0.02)
        self.http_port = int(self.http.servers[0].sockets[0].getsockname()[1])

    async def drain(self) -> None:
        grace = self.config.drain_timeout
        stops = []
        if self.frontdoor is not None:
            await self.frontdoor.stop_taking()
            stops.append(self.frontdoor.wait(grace))
        if self.grpc is not None:
            stops.append(self.grpc.stop(grace))
        if self.http is not None and self._http_task is not None:
            self.http.should_exit = True
            stops.append(asyncio.wait_for(asyncio.shield(self._http_task), grace + 5))
        results = await asyncio.gather(*stops, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                logger.warning("gateway: a front door did not stop cleanly: %r", result)
        if self.dispatcher is not None:
            if not await self.dispatcher.wait_idle(grace):
                logger.warning("gateway: %d request(s) still in flight after %g s", len(self.dispatcher.hub), grace)
            await self.dispatcher.stop()
        await drain_bus(self.bus, grace)
        if self._metrics_server is not None:
            self._metrics_server.stop()
