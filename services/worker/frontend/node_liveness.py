"""Node liveness for a TP group over several nodes, whatever backend its collectives use.

gloo sees a peer process that died at once (its TCP connections close), but a collective waiting for a
peer that froze (SIGSTOP, a network partition) waits dist_timeout on gloo, and NCCL waits that long for
a peer that died too. So the parents of the nodes watch each other on a channel of their own: every
node's `serve_node` parent connects to node 0's parent (the SchedulerClient of its worker or Engine) at
node 0's address, port dist_init_addr's + 1, and both ends send a heartbeat every node_timeout / 5 s.
A node that closes the connection (its process died, its host went down), sends nothing for
node_timeout seconds (frozen, cut off), or reports that one of its ranks failed, is lost: node 0 ends
the group (its ranks killed, its requests failed, the worker out of the gateways' routing) and tells
the other nodes why; a node that loses node 0 ends its own ranks.

Why a TCP connection of our own rather than keys in the group's TCPStore (at dist_init_addr): the store
lives in rank 0's process, not in the parent that serves; a closed connection is seen at once where a
key would only stop changing; and messages arrive in order, so a clean shutdown (Bye) is never taken
for a loss, and a failure arrives with its text. The cost is one more port, as SGLang's multi-node
mode also opens the ports after --dist-init-addr's. Messages are newline-delimited JSON:

    Hello(node, host, pid)  node N -> node 0, first    Beat()  both ways, every beat_s
    Failed(message)         both ways: the sender's part of the group failed
    Bye()                   node 0 -> node N: node 0 shuts the group down cleanly
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

import msgspec

from services.worker.config import EngineConfig

logger = logging.getLogger(__name__)

BEATS_PER_TIMEOUT = 5  # heartbeats a node sends within node_timeout


class Hello(msgspec.Struct, tag=True):
    node: int
    host: str
    pid: int


class Beat(msgspec.Struct, tag=True):
    pass


class Failed(msgspec.Struct, tag=True):
    message: str


class Bye(msgspec.Struct, tag=True):
    pass


Message = Hello | Beat | Failed | Bye
_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(Message)


def liveness_address(dist_init_addr: str) -> tuple[str, int]:
    """Node 0's host and its liveness port (dist_init_addr's port + 1) from 'tcp://host:port'."""
    host, _, port = dist_init_addr.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), int(port) + 1


class _Link:
    """One node-to-node connection: `serve` sends a Beat every beat_s, hands the peer's messages to
    `on_message` and returns why the peer is lost ('closed', 'silent'), or None once `on_message`
    returned False or the link was closed here."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        self.sock = sock
        self.timeout_s = timeout_s
        self.beat_s = timeout_s / BEATS_PER_TIMEOUT
        sock.settimeout(self.beat_s)
        self._lock = threading.Lock()
        self._closed = False

    def send(self, msg: Message) -> None:
        """From any thread; a broken link is the reader's to report, so send errors are not raised."""
        data = _ENCODER.encode(msg) + b"\n"
        with self._lock, contextlib.suppress(OSError):
            self.sock.sendall(data)

    def close(self, last: Message | None = None) -> None:
        if last is not None:
            self.send(last)
        self._closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def serve(self, on_message: Callable[[Message], bool]) -> str | None:
        buffer = b""
        heard = next_beat = time.monotonic()
        while not self._closed:
            now = time.monotonic()
            if now >= next_beat:
                self.send(Beat())
                next_beat = now + self.beat_s
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                data = None
            except OSError:
                return None if self._closed else "closed"
            now = time.monotonic()
            if data == b"":
                return None if self._closed else "closed"
            if data:
                heard = now
                buffer += data
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    try:
                        msg = _DECODER.decode(line)
                    except msgspec.DecodeError:
                        return None if self._closed else "closed"  # not a radixserve node: a garbled stream
                    if not on_message(msg):
                        return None
            elif now - heard > self.timeout_s:
                return None if self._closed else "silent"
        return None


def _silent(timeout_s: float) -> str:
    return (
        f"sent no heartbeat for {timeout_s:g} s (--node-timeout): its processes are frozen or stopped, "
        "or the network between the nodes is down"
    )


class NodeLivenessServer:
    """Node 0's end: listens for the other nodes and calls `on_lost(message)` once, naming the first node
    lost (or never connected: `expect_all`). Start it before the ranks, so nodes connect while the group
    forms; `close` (a clean shutdown) and `fail_others` tell the other nodes."""

    def __init__(self, config: EngineConfig, on_lost: Callable[[str], None]) -> None:
        assert config.dist_init_addr is not None
        self.config = config
        self._on_lost = on_lost
        _, self.port = liveness_address(config.dist_init_addr)
        self._links: dict[int, _Link] = {}
        self._lock = threading.Lock()
        self._done = False  # lost, failed or closed: later findings are not reported
        self._last: Message | None = None  # what every node was told when _done was set (None: nothing)
        self._lost_event = threading.Event()
        self.lost_message: str | None = None  # the finding reported, once there is one
        try:
            if socket.has_dualstack_ipv6():
                self._listener = socket.create_server(
                    ("", self.port), family=socket.AF_INET6, dualstack_ipv6=True
                )
            else:
                self._listener = socket.create_server(("", self.port))
        except OSError as exc:
            raise RuntimeError(
                f"node 0 cannot listen on port {self.port} (dist_init_addr's port + 1), where the other nodes "
                f"send their heartbeats: {exc}. Pick a dist_init_addr whose next port is free too"
            ) from None
        threading.Thread(target=self._accept, name="radixserve-liveness", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return  # closed
            host = addr[0].removeprefix("::ffff:")  # an IPv4 peer of the dual-stack socket
            threading.Thread(
                target=self._serve, args=(sock, host), name="radixserve-liveness-node", daemon=True
            ).start()

    def _serve(self, sock: socket.socket, addr: str) -> None:
        link = _Link(sock, self.config.node_timeout)
        hello: list[Hello] = []

        def on_message(msg: Message) -> bool:
            if not hello:
                if not isinstance(msg, Hello) or not 0 < msg.node < self.config.nnodes:
                    logger.warning(
                        "node liveness: %s sent %r first, not a Hello from a node in [1, %d]; closing it",
                        addr,
                        msg,
                        self.config.nnodes - 1,
                    )
                    return False
                hello.append(msg)
                with self._lock:
                    done, last = self._done, self._last
                    if not done:
                        self._links[msg.node] = link
                if done:
                    # The group ended before this node's hello was read (another node was lost first):
                    # it hears what the others heard.
                    if last is not None:
                        link.send(last)
                    link.close()
                    return False
                logger.info(
                    "node liveness: node %d (host %s, %s, pid %d) connected",
                    msg.node,
                    msg.host,
                    addr,
                    msg.pid,
                )
                return True
            if isinstance(msg, Failed):
                self._lost(f"node {hello[0].node} (host {hello[0].host}, {addr}) reported: {msg.message}")
                return False
            return True

        seen = link.serve(on_message)
        if seen is not None and hello:
            node = hello[0]
            what = (
                _silent(self.config.node_timeout)
                if seen == "silent"
                else f"closed its connection to node 0: its `radixserve worker --node-rank {node.node}` process "
                "exited or its host went down"
            )
            self._lost(f"node {node.node} (host {node.host}, {addr}, pid {node.pid}) {what}")
        if not hello:
            link.close()

    def expect_all(self) -> None:
        """The group has formed: every other node must be connected within node_timeout from now."""

        def check() -> None:
            with self._lock:
                missing = [n for n in range(1, self.config.nnodes) if n not in self._links]
            if missing:
                self._lost(
                    f"node(s) {', '.join(map(str, missing))} joined the TP group but did not connect to node 0's "
                    f"port {self.port} (dist_init_addr's port + 1) within {self.config.node_timeout:g} s "
                    "(--node-timeout): that port must be open from every node"
                )

        timer = threading.Timer(self.config.node_timeout, check)
        timer.daemon = True
        timer.start()

    def _lost(self, message: str) -> None:
        message = f"{message}; the TP group is down"
        with self._lock:
            if self._done:
                return
            self._done, self._last = True, Failed(message)
        logger.error("node liveness: %s", message)
        self.lost_message = message
        self._lost_event.set()
        self._close_all(Failed(message))  # the other nodes first: ending this node's ranks takes a moment
        self._on_lost(message)

    def wait_lost(self, timeout_s: float) -> str | None:
        """The finding on a lost node, waiting up to `timeout_s` for one (None: no node was lost)."""
        self._lost_event.wait(timeout_s)
        return self.lost_message

    def fail_others(self, message: str) -> None:
        """Node 0's part of the group failed: the other nodes end their ranks, told why."""
        with self._lock:
            if self._done:
                return
            self._done, self._last = True, Failed(message)
        self._close_all(self._last)

    def close(self) -> None:
        """A clean shutdown: the other nodes' ranks end with the group and their nodes exit 0."""
        with self._lock:
            done, self._done = self._done, True
            if not done:
                self._last = Bye()
        self._close_all(None if done else self._last)

    def _close_all(self, last: Message | None) -> None:
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            links = list(self._links.values())
        for link in links:
            link.close(last)


class NodeLivenessClient:
    """Node N's end (serve_node): connects to node 0 (retrying: node 0 may start later)
    and calls `on_lost(message, told)` once if node 0 is lost (told False) or ends the group as failed
    (told True); after node 0's Bye it reports nothing (its ranks end with the group)."""

    def __init__(self, config: EngineConfig, on_lost: Callable[[str, bool], None]) -> None:
        assert config.dist_init_addr is not None
        self.config = config
        self._on_lost = on_lost
        self.host, self.port = liveness_address(config.dist_init_addr)
        self._link: _Link | None = None
        self._lock = threading.Lock()
        self._done = False
        threading.Thread(target=self._run, name="radixserve-liveness", daemon=True).start()

    def _connect(self) -> socket.socket | None:
        """Node 0's liveness port, retried until this client closes: a node 0 that never comes is the
        ranks' rendezvous timeout to report (a deadline here would start earlier than theirs), and one
        whose port is closed to this node is node 0's (expect_all)."""
        wait_s = self.config.node_timeout / BEATS_PER_TIMEOUT
        while not self._done:
            try:
                return socket.create_connection((self.host, self.port), timeout=wait_s)
            except OSError:
                time.sleep(wait_s)
        return None

    def _run(self) -> None:
        sock = self._connect()
        if sock is None:
            return
        link = _Link(sock, self.config.node_timeout)
        with self._lock:
            if self._done:
                link.close()
                return
            self._link = link
        link.send(Hello(self.config.node_rank, socket.gethostname(), os.getpid()))
        logger.info(
            "node %d: connected to node 0 at %s:%d for heartbeats (--node-timeout %g s)",
            self.config.node_rank,
            self.host,
            self.port,
            self.config.node_timeout,
        )

        def on_message(msg: Message) -> bool:
            if isinstance(msg, Failed):
                self._lost(f"node 0 ({self.host}) ended the TP group: {msg.message}", told=True)
                return False
            if isinstance(msg, Bye):
                with self._lock:
                    self._done = True
                return False
            return True

        seen = link.serve(on_message)
        if seen == "silent":
            self._lost(f"node 0 ({self.host}:{self.port}) {_silent(self.config.node_timeout)}")
        elif seen == "closed":
            self._lost(
                f"node 0 ({self.host}:{self.port}) closed its connection: its worker exited or its host "
                "went down"
            )

    def _lost(self, message: str, told: bool = False) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        self._on_lost(message, told)

    def report_failed(self, message: str) -> None:
        """This node's part of the group failed: node 0 ends the group at once, told why."""
        self._finish(Failed(message))

    def close(self) -> None:
        self._finish(None)

    def _finish(self, last: Message | None) -> None:
        with self._lock:
            self._done = True
            link, self._link = self._link, None
        if link is not None:
            link.close(last)
