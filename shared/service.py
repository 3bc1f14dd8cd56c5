"""What every radixserve service process shares: its common settings, logging, the ready line, and the
run → signal → ordered drain → exit life cycle.

    sys.exit(run_service(TokenizerService(config)))

`start()` connects and subscribes; the service then logs "<name> ready" (launchers and tests wait for
that line). The first SIGTERM or SIGINT calls `drain()` (stop taking work, finish in-flight work within
the service's bound, drain NATS) and the process exits 0; a second Ctrl-C (SIGINT) exits at once with 1,
a repeated SIGTERM changes nothing. A service that fails on its own calls `stop(code)`.
"""

from __future__ import annotations

import abc
import asyncio
import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.bus import Bus, NatsAuthError, PayloadTooLarge
from shared.busy_poll import BusyPoll
from shared.nats_connection import DEFAULT_NATS_URL, NatsConnection, is_subject_token
from shared.protocol import PROTOCOL_VERSION, BatchStreamOut, Finish, StreamOut

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
__all__ = ["DEFAULT_NATS_URL", "ServiceConfig", "is_subject_token"]


def _help(text: str, default: object) -> object:
    return field(default=default, metadata={"help": text})


@dataclass(frozen=True)
class ServiceConfig(NatsConnection):
    """Settings every service has (its NATS connection among them, shared/nats_connection.py); each
    service's config extends it (and may change a default)."""

    metrics_host: str = _help("address the Prometheus metrics server binds", "0.0.0.0")
    metrics_port: int | None = _help("Prometheus metrics port (0: any free port; none: no metrics)", None)
    nats_connect_timeout: float = _help("seconds to reach NATS at start before giving up (exit 1)", 10.0)
    drain_timeout: float = _help("seconds to finish in-flight work on SIGTERM before closing", 5.0)
    log_level: str = _help("DEBUG, INFO, WARNING or ERROR", "INFO")
    busy_poll_ms: float = _help("after each NATS message or request, keep the event loop polling instead of "
                                "sleeping for this many ms, so the next one finds the process awake (holds a "
                                "core while it polls; 0: off)", 0.0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535] or none, got {self.metrics_port}")
        if self.nats_connect_timeout <= 0:
            raise ValueError(f"nats_connect_timeout must be > 0, got {self.nats_connect_timeout}")
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be >= 0, got {self.drain_timeout}")
        if not 0 <= self.busy_poll_ms <= 60_000:
            raise ValueError(f"busy_poll_ms must be in [0, 60000], got {self.busy_poll_ms:g}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(f"log_level must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")


def ready_line(name: str) -> str:
    """The log line a service writes once it serves (what launchers and tests wait for)."""
    return f"{name} ready"


async def publish_error(
    bus: Bus, gateway_id: str, rid: str, message: str, status: int | None = None, param: str | None = None,
) -> None:
    """End request `rid` at its gateway with an error final (what a gateway shows the client; `status`:
    Finish.status, None for the request's own fault; `param`: Finish.param, the field at fault)."""
    final = StreamOut(rid=rid, text="", token_ids=[], finish=Finish(type="error", message=message, status=status,
                                                                   param=param))
    try:
        await bus.publish(bus.subjects.gateway_stream(gateway_id), BatchStreamOut(v=PROTOCOL_VERSION, items=[final]))
    except PayloadTooLarge:
        # Only an absurdly long message can do this; the short form always fits.
        final.finish = Finish(type="error", message=message[:1000], status=status, param=param)
        await bus.publish(bus.subjects.gateway_stream(gateway_id), BatchStreamOut(v=PROTOCOL_VERSION, items=[final]))


async def connect_bus(config: ServiceConfig, name: str) -> Bus:
    """Bus.connect bounded by config.nats_connect_timeout (an unreachable NATS would otherwise be
    retried for ever); ConnectionError naming the URL."""
    errors: list[Exception] = []
    try:
        bus = await asyncio.wait_for(
            Bus.connect(config.nats_url, name, config.subject_prefix, errors=errors, **config.connect_options()),
            timeout=config.nats_connect_timeout,
        )
    except NatsAuthError as exc:  # before OSError: it is one
        raise ConnectionError(
            f"{name}: NATS at {config.nats_url_for_logs} refused {config.nats_identity}: {exc} (see --nats-user, "
            "--nats-password, --nats-token, --nats-creds, --nats-nkey-seed)"
        ) from exc
    except (asyncio.TimeoutError, OSError) as exc:
        last = f"; last error: {errors[-1]}" if errors else ""  # a refused connection, a TLS certificate...
        raise ConnectionError(
            f"{name}: NATS at {config.nats_url_for_logs} is unreachable (nats_url; waited {config.nats_connect_timeout:g} s{last})"
        ) from exc
    bus.poller = BusyPoll(config.busy_poll_ms / 1000)
    if bus.poller.enabled:
        logger.info("%s busy-polls for %g ms after each message or request", name, config.busy_poll_ms)
    return bus


async def drain_bus(bus: Bus | None, timeout: float) -> None:
    """NATS drain (stop receiving, let handlers of received messages finish, flush, close), bounded:
    past `timeout` seconds the connection is closed anyway."""
    if bus is None or bus.nc.is_closed:
        return
    bus.poller.close()
    try:
        await asyncio.wait_for(bus.drain(), timeout=max(timeout, 0.1))
    except asyncio.TimeoutError:
        logger.warning("%s: NATS drain took over %.1f s; closing", bus.name, timeout)
        await bus.nc.close()


def setup_logging(level: str = "INFO") -> None:
    """One line per record on stderr, with the time and the logger name."""
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """In a child process (or as subprocess `preexec_fn`): get `signum` when the parent dies, so a
    crashed launcher or test run leaves no process behind (Linux; a no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signum))
        except OSError:
            pass


class Service(abc.ABC):
    """A service process: `start` (connect, subscribe), then `drain` when told to stop."""

    name: str = "service"

    def __init__(self) -> None:
        self.exit_code = 0
        self._stop: asyncio.Event | None = None

    @abc.abstractmethod
    async def start(self) -> None:
        """Connect and begin serving; raising here exits the process with 1."""

    @abc.abstractmethod
    async def drain(self) -> None:
        """Stop taking work, finish what is in flight within a bound, close the NATS connection."""

    def stop(self, code: int = 0) -> None:
        """Ask the process to drain and exit with `code` (called from the event loop)."""
        self.exit_code = max(self.exit_code, code)
        if self._stop is not None:
            self._stop.set()

    async def serve(self) -> int:
        """Run until a signal or stop(), then drain; the process's exit code."""
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        signals_seen = 0

        def on_signal(signum: int) -> None:
            nonlocal signals_seen
            signals_seen += 1
            name = signal.Signals(signum).name
            if signals_seen == 1:
                logger.info("%s: %s received, draining", self.name, name)
                self.stop(0)
            elif signum == signal.SIGINT:
                logger.warning("%s: SIGINT while draining, exiting at once", self.name)
                os._exit(1)
            else:
                logger.info("%s: %s received, already draining", self.name, name)

        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, on_signal, signum)
        try:
            await self.start()
        except Exception as exc:  # noqa: BLE001 - a service that cannot start reports why and exits 1
            if isinstance(exc, (ConnectionError, ValueError)):
                logger.error("%s failed to start: %s", self.name, exc)  # the message says it all
            else:
                logger.exception("%s failed to start", self.name)
            self.exit_code = 1
            await self.drain()
            return 1
        # Which loop serves, since uvloop is optional and shortens every NATS hop (bench/HISTORY.md, CPU pipeline).
        logger.info("%s runs on the %s event loop", self.name, type(loop).__module__.split(".")[0])
        logger.info(ready_line(self.name))
        await self._stop.wait()
        await self.drain()
        logger.info("%s stopped", self.name)
        return self.exit_code


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when it is installed (it cuts the per-message cost of every NATS hop) unless
    RS_EVENT_LOOP=asyncio asks for the standard one; None means asyncio's default."""
    choice = os.environ.get("RS_EVENT_LOOP", "auto")
    if choice not in ("auto", "asyncio", "uvloop"):
        raise ValueError(f"RS_EVENT_LOOP must be auto, asyncio or uvloop, got {choice!r}")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ValueError("RS_EVENT_LOOP=uvloop but uvloop is not installed") from None
        return None
    return uvloop.new_event_loop


def run_service(service: Service, log_level: str = "INFO") -> int:
    """Set up logging and run `service` to completion on the event loop event_loop_factory picks;
    returns its exit code. The root logger's handlers and level are put back after: run in-process
    (tests call the CLI's main), its handler is on the caller's sys.stderr, which the caller may close
    (pytest's capture), and every later record of the process would fail on it."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    for handler in handlers:  # set aside, not closed (setup_logging's force would close them)
        root.removeHandler(handler)
    setup_logging(log_level)
    try:
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            return runner.run(service.serve())
    finally:
        for handler in root.handlers[:]:
            root.removeHandler(handler)
            handler.close()
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
