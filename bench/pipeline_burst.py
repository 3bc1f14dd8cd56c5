"""How one burst reaches the scheduler, through the service pipeline and through the in-process Engine:
each hop's spread (first, median and last request) and the groups in which the scheduler took the
requests in, from the RS_TRACE_DIR marks (shared/trace.py), beside both sides' steps (prefill + decode).

    .venv/bin/python bench/pipeline_burst.py              (the tiny checkpoint of bench/gpu_pipeline.py --tiny)
    python bench/pipeline_burst.py --device cuda --dtype bfloat16 --model-path CKPT --gateways 1

A burst the scheduler takes in one group runs in the Engine's steps; one taken in several (a first
request prefilled alone, the rest after the gateway has read them) takes more. The scheduler runs in a
process of its own on both sides, as on CUDA. The marks go to RS_TRACE_DIR (a new temporary directory
when unset). JSON to $OUT/pipeline_burst.json when OUT is set.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

# Before shared.trace is imported, here and in every child (the Engine's spawned scheduler re-imports
# this module: it must find the variable set, not make a directory of its own).
if not os.environ.get("RS_TRACE_DIR"):
    os.environ["RS_TRACE_DIR"] = tempfile.mkdtemp(prefix="rs-burst-trace-")
TRACE = Path(os.environ["RS_TRACE_DIR"])

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import pipeline_overhead as po  # noqa: E402
from bench.http_burst import HttpBurst  # noqa: E402

HOPS = (
    "gateway.http",
    "gateway.published",
    "worker.received",
    "worker.queued",
    "engine.queued",
    "scheduler.added",
)


def first_marks(prefix: str) -> dict[str, dict[str, int]]:
    """stage -> rid -> its first timestamp, for the rids starting with `prefix`."""
    marks: dict[str, dict[str, int]] = defaultdict(dict)
    for path in TRACE.glob("*.trace"):
        for line in path.read_text().splitlines():
            rid, stage, ns = line.split()
            if rid.startswith(prefix) and (rid not in marks[stage] or int(ns) < marks[stage][rid]):
                marks[stage][rid] = int(ns)
    return marks


def arrival(prefix: str, sent_ns: int) -> dict[str, Any]:
    """Each hop's spread in ms after the burst was sent, and the scheduler's intake groups: the requests
    it took in before one step share their scheduler.added timestamp (services/worker/frontend/
    scheduler_loop.py)."""
    marks = first_marks(prefix)
    hops = {}
    for stage in HOPS:
        if marks.get(stage):
            ms = sorted((ns - sent_ns) / 1e6 for ns in marks[stage].values())
            hops[stage] = {"first": ms[0], "median": statistics.median(ms), "last": ms[-1]}
    taken = sorted(marks.get("scheduler.added", {}).values())
    groups = {ns: taken.count(ns) for ns in taken}
    return {
        "hops": hops,
        "groups": list(groups.values()),
        "group_ms": [(ns - sent_ns) / 1e6 for ns in groups],
    }


async def pipeline_burst(url: str, prompts: list[list[int]], new_tokens: int, prefix: str) -> int:
    burst = await HttpBurst.open(url, len(prompts), warm_path="/health")
    try:
        bodies = [
            {"input_ids": ids, "sampling_params": po.sampling(new_tokens), "rid": f"{prefix}{i}"}
            for i, ids in enumerate(prompts)
        ]
        sent_ns = time.monotonic_ns()  # the trace's clock
        await burst.post_json("/generate", bodies)
    finally:
        await burst.close()
    return sent_ns


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument(
        "--new-tokens", type=int, default=16, help="enough to count steps; the intake is the point"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gateways", default="auto", help="`up --gateways`")
    p.add_argument(
        "--model-path", type=Path, help="default: bench/gpu_pipeline.py's tiny checkpoint (built once)"
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    import torch

    from bench import gpu_pipeline
    from services.worker.frontend.engine import Engine

    path = args.model_path or gpu_pipeline.build_checkpoint(True, torch.float32, "cpu")
    options = {
        "device": args.device,
        "dtype": args.dtype,
        "max_total_tokens": args.batch * (args.prompt_len + args.new_tokens) + 1024,
    }
    engine = Engine(str(path), **options, scheduler_process=True)
    stack = po.Stack(
        1,
        [*po.up_flags(path, options), "--scheduler-process"],
        Path(tempfile.mkdtemp(prefix="rs-burst-")),
        "short",
        args.gateways,
    )
    rng, rows = random.Random(0), []
    try:
        stack.wait_ready()
        vocab = engine.model_config.vocab_size
        po.engine_batch(engine, po.make_prompts(rng, args.batch, args.prompt_len, vocab), 2)  # warm both
        asyncio.run(
            pipeline_burst(stack.url, po.make_prompts(rng, args.batch, args.prompt_len, vocab), 2, "warm-")
        )
        for rep in range(args.repeats):
            prompts = po.make_prompts(rng, args.batch, args.prompt_len, vocab)
            before = engine.get_server_info()["stats"]
            sent = time.monotonic_ns()
            outs = engine.generate(
                input_ids=prompts,
                sampling_params=po.sampling(args.new_tokens),
                rid=[f"e{rep}-{i}" for i in range(len(prompts))],
            )
            assert len(outs) == len(prompts)
            after = engine.get_server_info()["stats"]
            row = {
                "engine": {
                    "steps": (
                        after["num_prefill_steps"] - before["num_prefill_steps"],
                        after["num_decode_steps"] - before["num_decode_steps"],
                    ),
                    **arrival(f"e{rep}-", sent),
                }
            }
            time.sleep(po.STEP_COUNTS_WAIT_S)
            w0 = stack.worker_steps()
            sent = asyncio.run(pipeline_burst(stack.url, prompts, args.new_tokens, f"g{rep}-"))
            time.sleep(po.STEP_COUNTS_WAIT_S)
            w1 = stack.worker_steps()
            row["pipeline"] = {
                "steps": (w1["prefill"] - w0["prefill"], w1["decode"] - w0["decode"]),
                **arrival(f"g{rep}-", sent),
            }
            rows.append(row)
    finally:
        stack.stop()
        engine.shutdown()
    print(
        f"\n{args.batch} x {args.prompt_len} -> {args.new_tokens}, {stack.gateways()} gateway(s); ms after the burst "
        "was sent (first / median / last request); intake groups: requests per scheduler intake"
    )
    for rep, row in enumerate(rows):
        for side in ("engine", "pipeline"):
            r = row[side]
            hops = "  ".join(
                f"{stage} {h['first']:.1f}/{h['median']:.1f}/{h['last']:.1f}"
                for stage, h in r["hops"].items()
            )
            print(
                f"repeat {rep} {side:8s} steps {r['steps'][0]:.0f} prefill + {r['steps'][1]:.0f} decode; "
                f"intake groups {r['groups']} at {[round(t, 1) for t in r['group_ms']]} ms; {hops}"
            )
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "pipeline_burst.json"
        out.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "repeats": rows}, indent=2)
        )
        print(f"JSON in {out}")


if __name__ == "__main__":
    main()
