"""A node of a TP group over two nodes that freezes or dies is noticed within --node-timeout, on any
backend (node_liveness.py), not after --dist-timeout: a frozen gloo peer blocks a collective as long as
an NCCL one does, so these run on CPU with a dist_timeout far above the time they allow. Node 1 is a
`radixserve worker --node-rank 1` process (its ranks in its own process group, which os.killpg
freezes); node 0 is a worker on NATS behind a gateway, an Engine in this process, or one in a script."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from services.cli import main
from services.worker.frontend.engine import Engine
from tests.engine_helpers import GREEDY
from tests.services_helpers import ServiceProcess, free_port_pair
from tests.test_multinode_tp import PROMPTS, REPO, node, node0

NODE_TIMEOUT_S = 3.0  # short, with room for a loaded machine: no loss is seen before the freeze
DIST_TIMEOUT_S = 300.0  # a collective waiting for a frozen peer: these tests would fail long before
# A loss must be seen within node_timeout plus a few seconds; allowed here, with room for a loaded machine.
NOTICED_WITHIN_S = 30.0
LONG = 200  # new tokens: the request is still running when its node freezes


def test_a_frozen_node_1_fails_the_request_in_flight_and_takes_node_0_out_of_routing(
    qwen3_path: Path, tmp_path: Path
) -> None:
    """SIGSTOP of node 1's whole process group mid-stream: node 0's worker names node 1 and what it saw,
    the stream ends with that error, the worker leaves the gateway's routing and exits 1; node 1, once
    continued, finds node 0's verdict waiting and exits 1."""
    from shared.natsd import start_nats_server
    from tests.gateway_helpers import GatewayThread, wait_for_workers

    port = free_port_pair()
    gateway = None
    with (
        start_nats_server() as server,
        node(qwen3_path, port, tp_size=2, timeout_s=DIST_TIMEOUT_S, node_timeout=NODE_TIMEOUT_S) as other,
    ):
        worker = ServiceProcess.start(
            "worker",
            [
                "--nats-url",
                server.url,
                "--worker-id",
                "mn0",
                "--model-path",
                str(qwen3_path),
                "--device",
                "cpu",
                "--metrics-port",
                "none",
                "--with-detokenizer",
                "--load-interval",
                "0.2",
                "--tp-size",
                "2",
                "--nnodes",
                "2",
                "--node-rank",
                "0",
                "--dist-init-addr",
                f"127.0.0.1:{port}",
                "--dist-timeout",
                str(DIST_TIMEOUT_S),
                "--node-timeout",
                str(NODE_TIMEOUT_S),
            ],
            tmp_path,
        )
        try:
            worker.wait_ready()
            gateway = GatewayThread(server.url, local_tokenizer=str(qwen3_path), max_migrations=0)
            wait_for_workers(gateway.url, 1, timeout=30)
            body = {
                "model": qwen3_path.name,
                "prompt": "a b c",
                "max_tokens": LONG,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            # The read timeout bounds how long the error may take: a hang fails here.
            with httpx.stream(
                "POST", f"{gateway.url}/v1/completions", json=body, timeout=NOTICED_WITHIN_S
            ) as answer:
                lines = answer.iter_lines()
                assert next(line for line in lines if line.startswith("data: {"))
                os.killpg(other.pid, signal.SIGSTOP)
                events = [line[6:] for line in lines if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]["message"]
            assert re.search(
                rf"worker mn0 failed: node 1 \(host [^,]+, 127\.0\.0\.1, pid {other.pid}\) sent no "
                rf"heartbeat for {NODE_TIMEOUT_S:g} s \(--node-timeout\)",
                error,
            ), error
            # Its last load report says draining: the gateway stops routing to it within moments, not a TTL.
            registry = gateway.service.dispatcher.registry
            deadline = time.monotonic() + 2.0
            while registry.live() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not registry.live()
            assert worker.proc.wait(timeout=NOTICED_WITHIN_S) == 1
            os.killpg(other.pid, signal.SIGCONT)
            out, _ = other.communicate(timeout=NOTICED_WITHIN_S)
        finally:
            if gateway is not None:
                gateway.close()
            worker.kill()
            if other.poll() is None:
                os.killpg(other.pid, signal.SIGKILL)
    assert other.returncode == 1, out
    assert "node 1: node 0 (127.0.0.1) ended the TP group: node 1 (host" in out
    assert (
        f"sent no heartbeat for {NODE_TIMEOUT_S:g} s (--node-timeout): its processes are frozen or stopped"
        in out
    )


def test_a_killed_node_1_fails_node_0s_request_naming_the_node(qwen3_path: Path) -> None:
    """SIGKILL of node 1's `radixserve worker` (its ranks die with it): the request in flight fails with
    an error that names node 1, its host and its pid, seen on the nodes' own connection."""
    port = free_port_pair()
    with (
        node(qwen3_path, port, tp_size=2, timeout_s=DIST_TIMEOUT_S, node_timeout=NODE_TIMEOUT_S) as other,
        node0(qwen3_path, port, tp_size=2, timeout_s=DIST_TIMEOUT_S, node_timeout=NODE_TIMEOUT_S) as engine,
    ):
        chunks = engine.generate(
            input_ids=PROMPTS[0], sampling_params={**GREEDY, "max_new_tokens": LONG}, stream=True
        )
        next(chunks)  # type: ignore[call-overload]
        other.kill()
        with pytest.raises(
            RuntimeError,
            match=rf"node 1 \(host [^,]+, 127\.0\.0\.1, pid {other.pid}\) closed its "
            "connection to node 0",
        ) as failed:
            for _ in chunks:  # type: ignore[union-attr]
                pass
        assert "the TP group is down" in str(failed.value)
        with pytest.raises(RuntimeError, match="the engine is not running: node 1"):
            engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)


NODE0_SCRIPT = """
import sys, time
from services.worker.frontend.engine import Engine
path, addr, node_timeout, dist_timeout = sys.argv[1:]
engine = Engine(path, tp_size=2, nnodes=2, node_rank=0, dist_init_addr=addr, device="cpu", cpu_threads=1,
                node_timeout=float(node_timeout), dist_timeout=float(dist_timeout))
print("node 0 serves", flush=True)
time.sleep(600)
"""


def test_a_frozen_node_0_ends_node_1(qwen3_path: Path) -> None:
    """SIGSTOP of node 0 (an Engine in a script: its process and its ranks) while node 1 idles in the
    group's broadcast: node 1 names node 0 and exits 1."""
    port = free_port_pair()
    with node(qwen3_path, port, tp_size=2, timeout_s=DIST_TIMEOUT_S, node_timeout=NODE_TIMEOUT_S) as other:
        first = subprocess.Popen(
            [
                sys.executable,
                "-c",
                NODE0_SCRIPT,
                str(qwen3_path),
                f"127.0.0.1:{port}",
                str(NODE_TIMEOUT_S),
                str(DIST_TIMEOUT_S),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            process_group=0,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        try:
            assert first.stdout is not None
            printed = []
            for line in first.stdout:  # until it serves, or its output ends with its failure
                printed.append(line)
                if line.startswith("node 0 serves"):
                    break
            assert printed and printed[-1].startswith("node 0 serves"), "".join(printed)
            os.killpg(first.pid, signal.SIGSTOP)
            out, _ = other.communicate(timeout=NOTICED_WITHIN_S)
        finally:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    assert other.returncode == 1, out
    assert re.search(
        rf"node 1: node 0 \(127\.0\.0\.1:{port + 1}\) sent no heartbeat for {NODE_TIMEOUT_S:g} s "
        r"\(--node-timeout\): its processes are frozen or stopped, or the network between the nodes is "
        r"down; ending the node's ranks",
        out,
    ), out


def test_a_bad_node_timeout_is_a_usage_error(qwen3_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "worker",
                "--model-path",
                str(qwen3_path),
                "--tp-size",
                "2",
                "--nnodes",
                "2",
                "--node-rank",
                "1",
                "--dist-init-addr",
                "127.0.0.1:5000",
                "--node-timeout",
                "0",
            ]
        )
        == 2
    )
    assert "node_timeout must be > 0, got 0" in capsys.readouterr().err


def test_a_node_frozen_while_the_group_forms_fails_node_0s_start(qwen3_path: Path) -> None:
    """Node 1 connected to node 0, then froze before its ranks joined: node 0's Engine fails to start
    naming it, within node_timeout rather than after the rendezvous's dist_timeout."""
    port = free_port_pair()
    with node(qwen3_path, port, tp_size=2, timeout_s=DIST_TIMEOUT_S, node_timeout=NODE_TIMEOUT_S) as other:
        started: queue.Queue[BaseException | Engine] = queue.Queue()

        def start() -> None:
            try:
                started.put(
                    node0(qwen3_path, port, tp_size=2, timeout_s=DIST_TIMEOUT_S, node_timeout=NODE_TIMEOUT_S)
                )
            except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
                started.put(exc)

        threading.Thread(target=start, daemon=True).start()
        assert other.stdout is not None
        printed = []
        for line in other.stdout:  # until node 1 has said hello to node 0
            printed.append(line)
            if "node 1: connected to node 0" in line:
                break
        assert "node 1: connected to node 0" in printed[-1], "".join(printed)
        os.killpg(other.pid, signal.SIGSTOP)
        outcome = started.get(timeout=NOTICED_WITHIN_S)
        if isinstance(outcome, Engine):
            outcome.shutdown()
    assert isinstance(outcome, RuntimeError), outcome
    assert re.search(
        rf"the TP group failed to start: node 1 \(host [^,]+, 127\.0\.0\.1, pid {other.pid}\) sent no "
        rf"heartbeat for {NODE_TIMEOUT_S:g} s",
        str(outcome),
    ), outcome
