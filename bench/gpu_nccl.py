"""What of the multi-GPU code can run on one GPU (issue #25): NCCL through the calls the worker makes.

NCCL refuses two ranks on one device, so on a one-GPU machine no TP or PP group of two can form. What
can run, and does here:
  1. init_tp on CUDA (so with NCCL) for a group of two whose second rank never comes: every rank must
     end with init_tp's clear error within its dist_timeout, never hang;
  2. a one-rank NCCL group and the collectives the worker issues on it (all_reduce eager and inside a
     CUDA graph capture, as TP decode does; all_gather; broadcast_object_list of a request-like object;
     all_gather_object, which check_same_everywhere uses), the symmetric-memory all-reduce (FastAllReduce)
     eager and captured, and destroy_tp(exiting=True), the abort path a rank process leaves by.

    python bench/gpu_nccl.py            (prints a table last; JSON to $OUT/gpu_nccl.json when OUT is set)
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from services.worker.runtime import distributed  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lone_rank(port: int, timeout_s: float, queue: mp.Queue) -> None:
    """Rank 0 of a group of two whose rank 1 never starts."""
    start = time.monotonic()
    try:
        distributed.init_tp(0, 2, f"tcp://127.0.0.1:{port}", torch.device("cuda:0"), timeout_s=timeout_s)
        queue.put(("formed", time.monotonic() - start, ""))
    except RuntimeError as exc:
        queue.put(("error", time.monotonic() - start, str(exc)))


def check_rendezvous_timeout(timeout_s: float = 8.0) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=lone_rank, args=(free_port(), timeout_s, queue))
    proc.start()
    proc.join(timeout_s + 60)
    hung = proc.is_alive()
    if hung:
        proc.kill()
    outcome, seconds, message = queue.get(timeout=5) if not hung else ("hung", timeout_s + 60, "")
    ok = outcome == "error" and "did not form" in message and seconds < timeout_s + 30
    return {"check": "NCCL group of 2, rank 1 never starts: clear error", "ok": ok,
            "seconds": round(seconds, 2), "detail": message[:160]}


def captured(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) replayed from a CUDA graph (warmed on a side stream first, as capture requires)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(x.clone())
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    static_in = x.clone()
    with torch.cuda.graph(graph):
        static_out = fn(static_in)
    static_in.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    return static_out.clone()


def one_rank_checks() -> list[dict]:
    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    results: list[dict] = []

    def record(name: str, fn) -> None:
        start = time.perf_counter()
        try:
            ok, detail = fn()
        except Exception as exc:  # noqa: BLE001 - a failed check is a row, not the end of the run
            ok, detail = False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
        results.append({"check": name, "ok": bool(ok), "seconds": round(time.perf_counter() - start, 3),
                        "detail": str(detail)[:200]})

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=device)
    x = torch.randn(1, 4096, dtype=torch.bfloat16, device=device)

    def all_reduce_eager():
        y = x.clone()
        dist.all_reduce(y)
        return torch.equal(y, x), "sum over one rank is the tensor"

    def all_reduce_graph():
        def fn(t):
            dist.all_reduce(t)
            return t
        return torch.equal(captured(fn, x), x), "captured all_reduce replays to the tensor"

    def all_gather():
        parts = [torch.empty_like(x)]
        dist.all_gather(parts, x)
        return torch.equal(parts[0], x), ""

    def broadcast_objects():
        box = [{"rid": "r1", "input_ids": list(range(100)), "params": {"temperature": 0.0}}]
        dist.broadcast_object_list(box, src=0)
        return box[0]["input_ids"][-1] == 99, ""

    def gather_objects():
        every: list[object] = [None]
        dist.all_gather_object(every, ("fingerprint", "node 0"))
        return every[0] == ("fingerprint", "node 0"), ""

    def fast_all_reduce():
        fast = distributed.FastAllReduce(torch.bfloat16, device, 1 << 20)
        eager = fast(x)
        graphed = captured(lambda t: fast(t), x)
        return eager is not None and torch.equal(eager, x) and torch.equal(graphed, x), "one_shot_all_reduce_copy"

    record("NCCL all_reduce, eager", all_reduce_eager)
    record("NCCL all_reduce inside a CUDA graph", all_reduce_graph)
    record("NCCL all_gather", all_gather)
    record("broadcast_object_list (requests)", broadcast_objects)
    record("all_gather_object (check_same_everywhere)", gather_objects)
    record("symmetric-memory all-reduce, eager and captured", fast_all_reduce)

    def abort():
        start = time.monotonic()
        distributed.destroy_tp(exiting=True)
        return not dist.is_initialized() and time.monotonic() - start < 10, "destroy_tp(exiting=True)"

    record("leave by abort (rank process exit path)", abort)
    return results


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a GPU")
        return 2
    rows = [check_rendezvous_timeout()]
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:  # its own process: the timeout check's group must not be this one
        rows += pool.apply(one_rank_checks)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_nccl.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "nccl": ".".join(map(str, torch.cuda.nccl.version())), "checks": rows}, f, indent=1)
    print(f"{'check':<52} {'ok':<5} {'s':>7}")
    for r in rows:
        print(f"{r['check']:<52} {'PASS' if r['ok'] else 'FAIL':<5} {r['seconds']:>7}")
        if not r["ok"]:
            print("   ", r["detail"])
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
