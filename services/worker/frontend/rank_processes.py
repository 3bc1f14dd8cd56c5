"""The TP rank processes of one node: spawning them, and serving a node other than node 0.

A TP group of tp_size ranks (pp_size x tp_size with pipeline stages) spans nnodes machines,
pp_size x tp_size / nnodes ranks each (SGLang's --nnodes, --node-rank, --dist-init-addr). Node 0 runs
the SchedulerClient (scheduler_client.py), whose rank 0 alone takes requests (from the Engine, or from NATS in the worker service); every other node runs
`serve_node`: its ranks join the group at node 0's address and follow rank 0's broadcasts until the
group ends. Such a node has no NATS connection and no HTTP port.

    sys.exit(serve_node(EngineConfig.resolved(path, tp_size=16, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:5000")))
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from services.worker.config import EngineConfig
from services.worker.frontend.node_liveness import NodeLivenessClient
from shared.service import die_with_parent, setup_logging

logger = logging.getLogger(__name__)

# How long a node's other ranks get to end on their own once one rank has failed, or node 0 ended the
# group as failed (gloo notices a lost peer at once, an idle rank within scheduler_loop.IDLE_BEAT_S),
# before they are killed: an NCCL collective waiting for a peer that is gone would wait dist_timeout.
RANK_EXIT_GRACE_S = 5.0


def run_rank_process(
    config: EngineConfig, rank: int, init_method: str, inbox: Any, outbox: Any, log_level: str
) -> None:
    """A TP rank's process; its exit code is 1 when its loop failed. Ctrl-C reaches the whole process
    group, but draining is the parent's job (it shuts the ranks down after), so ranks ignore SIGINT;
    they die with their parent, so a killed worker leaves no rank behind. `log_level`: configure
    logging here at that level (the parent's)."""
    # Imported here: torch and the model code load in the rank processes, not in a node's parent.
    from services.worker.frontend.scheduler_loop import run_scheduler_loop

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL)
    setup_logging(log_level)
    ok = run_scheduler_loop(config, rank, init_method, inbox, outbox, own_process=True)
    # The loop has left the group and released what it held. Leave without the interpreter's
    # finalization: a Llama rank whose group ended within a second of its start aborted there in 3
    # of 8 runs ("terminate called without an active exception", no Python frame left), after
    # matching tokens and a clean shutdown. What must outlive the process is flushed first.
    if outbox is not None:
        outbox.wait_written()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)


def start_ranks(config: EngineConfig, init_method: str, inbox: Any = None, outbox: Any = None) -> list[Any]:
    """Spawn this node's ranks (config.local_ranks()); global rank 0, on node 0, gets the inbox and outbox."""
    ctx = mp.get_context("spawn")
    # The ranks log at the parent's level (a worker service's INFO: the model load, the thread choices;
    # an offline Engine's default WARNING keeps them quiet).
    log_level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    procs = []
    for rank in config.local_ranks():
        io = (inbox, outbox) if rank == 0 else (None, None)
        proc = ctx.Process(
            target=run_rank_process, args=(config, rank, init_method, *io, log_level), daemon=True,
            name=f"radixserve-tp-rank-{rank}",
        )
        proc.start()
        procs.append(proc)
    return procs


def wait_for_exit(procs: list[Any], timeout: float | None = None) -> Any | None:
    """The first of `procs` to exit within `timeout` seconds (None: wait for one), else None."""
    by_sentinel = {proc.sentinel: proc for proc in procs}
    ready = multiprocessing.connection.wait(list(by_sentinel), timeout)
    if not ready:
        return None
    proc = by_sentinel[ready[0]]  # type: ignore[index]
    proc.join()  # reaps it: exitcode is set
    return proc


def end_group(procs: list[Any], grace_s: float = RANK_EXIT_GRACE_S) -> None:
    """After a rank failed: the others get `grace_s` to end on their own, then are killed."""
    for proc in procs:
        proc.join(timeout=grace_s)
        if proc.is_alive():
            proc.kill()
            proc.join()


def serve_node(config: EngineConfig) -> int:
    """Run the ranks of node config.node_rank (> 0) until the group ends: 0 when node 0 shut it down,
    1 when a rank of this node failed (a group that did not form, a mismatched model, a lost peer), node 0
    was lost or ended the group as failed (node_liveness.py: its ranks are killed, as a collective would
    wait dist_timeout for node 0), or this process was told to stop (SIGTERM/SIGINT: the group ends with
    these ranks). Node 0 hears of every failure here at once."""
    if config.node_rank == 0:
        raise ValueError("node 0 serves requests: run it as a worker (or an Engine), not with serve_node")
    assert config.dist_init_addr is not None  # EngineConfig requires it for nnodes > 1
    ranks = config.local_ranks()
    logger.info(
        "node %d of %d: %s ranks %d-%d of %d (%s), joining the group at %s within %g s; node 0 serves "
        "requests, this node runs ranks only (no NATS, no HTTP)",
        config.node_rank, config.nnodes, "TP" if config.pp_size == 1 else f"pp_size {config.pp_size} x tp_size "
        f"{config.tp_size}: global", ranks.start, ranks.stop - 1, config.world_size(), config.model_path,
        config.dist_init_addr, config.dist_timeout,
    )
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda signum, frame: stop.set())
    lost: list[tuple[str, bool]] = []  # (what was seen, whether node 0 said so), once
    liveness = NodeLivenessClient(config, lambda message, told: lost.append((message, told)))
    procs = start_ranks(config, config.dist_init_addr)
    rank_of = dict(zip(procs, ranks))
    running = list(procs)
    host = socket.gethostname()
    try:
        while True:
            if lost:
                message, told = lost[0]
                # Node 0 ending the group as failed: these ranks are likely failing too, and say why.
                grace_s = RANK_EXIT_GRACE_S if told else 0.0
                logger.error("node %d: %s; ending the node's ranks (in %g s at most)", config.node_rank, message, grace_s)
                _end_reporting(running, rank_of, grace_s, config.node_rank)
                return 1
            if stop.is_set():
                logger.warning("node %d: stopping its ranks on a signal; the TP group ends with them", config.node_rank)
                liveness.report_failed(f"its `radixserve worker --node-rank {config.node_rank}` was stopped by a signal")
                end_group(running, grace_s=0.0)
                return 1
            if not running:
                break
            proc = wait_for_exit(running, timeout=0.5)
            if proc is None:
                continue
            running.remove(proc)
            if proc.exitcode != 0:
                logger.error(
                    "node %d: TP rank %d exited with code %s (its error is above); ending the node's other ranks",
                    config.node_rank, rank_of[proc], proc.exitcode,
                )
                if lost:
                    continue  # node 0 was lost first (this rank saw it too): said at the loop's top
                liveness.report_failed(f"TP rank {rank_of[proc]} (pid {proc.pid} on {host}) exited with code "
                                       f"{proc.exitcode}")
                end_group(running)
                return 1
        logger.info("node %d: the TP group ended (node 0 shut it down)", config.node_rank)
        return 0
    finally:
        liveness.close()
        for proc in running:
            if proc.is_alive():
                proc.kill()


def _end_reporting(running: list[Any], rank_of: dict[Any, int], grace_s: float, node_rank: int) -> None:
    """End the ranks after a lost node 0: each gets `grace_s` to end on its own (a failing rank's exit
    code is logged), then is killed."""
    deadline = time.monotonic() + grace_s
    while running:
        proc = wait_for_exit(running, timeout=max(0.0, deadline - time.monotonic()))
        if proc is None:
            break
        running.remove(proc)
        if proc.exitcode != 0:
            logger.error("node %d: TP rank %d exited with code %s", node_rank, rank_of[proc], proc.exitcode)
    end_group(running, grace_s=0.0)
