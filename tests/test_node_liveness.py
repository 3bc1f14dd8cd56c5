"""Node liveness (services/worker/frontend/node_liveness.py) on its own: node 0's server and node N's
client against each other, or against a raw socket playing the other node (one that says hello and then
nothing, hangs up, or reports a failure). Whole TP groups whose nodes freeze or die are in
tests/test_multinode_liveness.py."""

from __future__ import annotations

import queue
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
import pytest

from services.worker.config import EngineConfig
from services.worker.frontend.node_liveness import (
    Beat,
    Bye,
    Failed,
    Hello,
    NodeLivenessClient,
    NodeLivenessServer,
    liveness_address,
)
from tests.services_helpers import free_port

TIMEOUT_S = 0.5  # node_timeout where a loss is expected: it must come, however late
HEALTHY_TIMEOUT_S = 2.5  # node_timeout where none is: heartbeats every 0.5 s, room for a loaded machine
WAIT_S = 10.0  # how long a test waits for what must happen


def config(port: int, node_rank: int = 0, node_timeout: float = TIMEOUT_S, nnodes: int = 2) -> EngineConfig:
    """A group whose liveness port is `port` (dist_init_addr's port + 1)."""
    return EngineConfig(
        model_path="unused",
        tp_size=nnodes,
        nnodes=nnodes,
        node_rank=node_rank,
        dist_init_addr=f"127.0.0.1:{port - 1}",
        node_timeout=node_timeout,
        dist_timeout=30,
    )


class Fake:
    """A raw connection playing the other node: what it sends, and the messages it receives."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.settimeout(WAIT_S)
        self.reader = sock.makefile("rb")
        self.decoder = msgspec.json.Decoder(Hello | Beat | Failed | Bye)

    def send(self, msg: object) -> None:
        self.sock.sendall(msgspec.json.encode(msg) + b"\n")

    def until(self, kind: type) -> object:
        """The first message of `kind` (heartbeats before it skipped); AssertionError on EOF."""
        while line := self.reader.readline():
            msg = self.decoder.decode(line)
            if isinstance(msg, kind):
                return msg
        raise AssertionError(f"the connection closed before a {kind.__name__}")


@contextmanager
def server(
    nnodes: int = 2, node_timeout: float = TIMEOUT_S
) -> Iterator[tuple[NodeLivenessServer, queue.Queue[str]]]:
    lost: queue.Queue[str] = queue.Queue()
    node0 = NodeLivenessServer(config(free_port(), node_timeout=node_timeout, nnodes=nnodes), lost.put)
    try:
        yield node0, lost
    finally:
        node0.close()


def fake_node(node0: NodeLivenessServer, node: int = 1) -> Fake:
    fake = Fake(socket.create_connection(("127.0.0.1", node0.port), timeout=WAIT_S))
    fake.send(Hello(node, "host-b", 4242))
    return fake


def test_liveness_port_is_the_one_after_dist_init_addrs() -> None:
    assert liveness_address("tcp://10.0.0.1:5000") == ("10.0.0.1", 5001)
    assert liveness_address("tcp://[::1]:5000") == ("::1", 5001)


def test_node_0_reports_a_node_that_goes_silent_and_tells_it_why() -> None:
    with server() as (node0, lost):
        fake = fake_node(node0)
        assert isinstance(fake.until(Beat), Beat)  # node 0 beats; the fake never does
        message = lost.get(timeout=WAIT_S)
        assert message.startswith(
            "node 1 (host host-b, 127.0.0.1, pid 4242) sent no heartbeat for 0.5 s "
            "(--node-timeout): its processes are frozen or stopped"
        )
        assert message.endswith("; the TP group is down")
        assert fake.until(Failed) == Failed(message)


def test_node_0_reports_a_node_that_hangs_up() -> None:
    with server(node_timeout=60.0) as (node0, lost):
        fake_node(node0).sock.close()
        message = lost.get(timeout=WAIT_S)
    assert message.startswith(
        "node 1 (host host-b, 127.0.0.1, pid 4242) closed its connection to node 0: its "
        "`radixserve worker --node-rank 1` process exited or its host went down"
    )


def test_node_0_reports_a_nodes_failure_with_its_text_and_tells_the_others() -> None:
    with server(nnodes=3, node_timeout=60.0) as (node0, lost):
        one, two = fake_node(node0, 1), fake_node(node0, 2)
        two.until(Beat)  # both said hello before the report
        one.until(Beat)
        one.send(Failed("TP rank 3 (pid 7 on host-b) exited with code 1"))
        message = lost.get(timeout=WAIT_S)
        assert message == (
            "node 1 (host host-b, 127.0.0.1) reported: TP rank 3 (pid 7 on host-b) exited with "
            "code 1; the TP group is down"
        )
        assert two.until(Failed) == Failed(message)


def test_a_node_whose_hello_comes_after_the_group_ended_hears_why() -> None:
    # Node 2's connection is accepted (node 0 beats on it) but its hello is read only after node 1's
    # failure ended the group: it must still hear that failure, not heartbeats until its own timeout.
    with server(nnodes=3, node_timeout=60.0) as (node0, lost):
        late = Fake(socket.create_connection(("127.0.0.1", node0.port), timeout=WAIT_S))
        late.until(Beat)
        one = fake_node(node0, 1)
        one.until(Beat)
        one.send(Failed("TP rank 3 (pid 7 on host-b) exited with code 1"))
        message = lost.get(timeout=WAIT_S)
        late.send(Hello(2, "host-c", 4343))
        assert late.until(Failed) == Failed(message)


def test_node_0_reports_a_node_that_never_connects() -> None:
    with server() as (node0, lost):
        node0.expect_all()
        message = lost.get(timeout=WAIT_S)
    assert message.startswith(
        f"node(s) 1 joined the TP group but did not connect to node 0's port {node0.port}"
    )


def test_node_0_refuses_a_port_that_is_taken() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(
            RuntimeError, match=rf"node 0 cannot listen on port {port} \(dist_init_addr's port \+ 1\)"
        ):
            NodeLivenessServer(config(port), lambda message: None)


def test_a_node_reports_node_0_gone_silent() -> None:
    port = free_port()
    lost: queue.Queue[tuple[str, bool]] = queue.Queue()
    with socket.create_server(("127.0.0.1", port)) as listener:
        client = NodeLivenessClient(
            config(port, node_rank=1), lambda message, told: lost.put((message, told))
        )
        sock, _ = listener.accept()
        fake = Fake(sock)
        assert fake.until(Hello).node == 1  # type: ignore[attr-defined]
        message, told = lost.get(timeout=WAIT_S)
        client.close()
    assert message == (
        f"node 0 (127.0.0.1:{port}) sent no heartbeat for 0.5 s (--node-timeout): its processes are "
        "frozen or stopped, or the network between the nodes is down"
    )
    assert not told


def test_a_healthy_link_reports_nothing_and_a_clean_shutdown_is_no_loss() -> None:
    lost: queue.Queue[tuple[str, bool] | str] = queue.Queue()
    with server(node_timeout=HEALTHY_TIMEOUT_S) as (node0, lost0):
        client = NodeLivenessClient(
            config(node0.port, node_rank=1, node_timeout=HEALTHY_TIMEOUT_S),
            lambda message, told: lost.put((message, told)),
        )
        node0.expect_all()
        time.sleep(1.2 * HEALTHY_TIMEOUT_S)  # past node_timeout: the beats kept both sides content
        node0.close()  # Bye, then the connection closes
        time.sleep(1.0)  # a Bye then a hang-up: neither side takes the hang-up for a loss
        client.close()
    assert lost.empty() and lost0.empty()


def test_node_0s_failure_is_told_to_every_node() -> None:
    lost: queue.Queue[tuple[str, bool]] = queue.Queue()
    with server(node_timeout=60.0) as (node0, _):
        client = NodeLivenessClient(
            config(node0.port, node_rank=1, node_timeout=60.0),
            lambda message, told: lost.put((message, told)),
        )
        deadline = time.monotonic() + WAIT_S
        while not node0._links and time.monotonic() < deadline:  # connected: the failure has someone to reach
            time.sleep(0.01)
        node0.fail_others("TP rank 1 (pid 9) exited with code -9; the TP group is down")
        message, told = lost.get(timeout=WAIT_S)
        client.close()
    assert (
        message
        == "node 0 (127.0.0.1) ended the TP group: TP rank 1 (pid 9) exited with code -9; the TP group is down"
    )
    assert told


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"node_timeout": 0}, "node_timeout must be > 0, got 0"),
        ({"dist_init_addr": "127.0.0.1:65535"}, "dist_init_addr's port must be < 65535 with nnodes > 1"),
    ],
)
def test_bad_liveness_settings_are_refused(changes: dict[str, object], error: str) -> None:
    settings: dict[str, object] = {
        "tp_size": 2,
        "nnodes": 2,
        "node_rank": 1,
        "dist_init_addr": "127.0.0.1:5000",
    }
    with pytest.raises(ValueError, match=error):
        EngineConfig(model_path="unused", **{**settings, **changes})  # type: ignore[arg-type]
