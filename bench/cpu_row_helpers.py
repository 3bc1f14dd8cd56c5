"""The Engine beside busy neighbours with and without row helpers (kernels/cpu/row_helpers.h): batch-1 decode
and a prompt pass, the two settings alternating in fresh processes.

    .venv/bin/python bench/cpu_row_helpers.py [--busy 2] [--rounds 2] [--passes 4] [--served]

`--busy` processes spin (`while True: pass`) for the whole run, as bench/peers_cpu.py's loaded rows have them.
Each round runs one Engine process per `--settings` value of RS_CPU_ROW_HELPERS (default 0 and 1; `always` keeps
helpers on without the probe; the order alternating by round), and prints the rank's thread and helper decisions.
An Engine first decodes 64 tokens so its adaptive thread count (services/worker/cpu_threads.py) has given a
core back, then times `--passes` prompt passes (256 random ids + 1 token, prefix cache flushed) and one batch-1
decode of 128 tokens after a 64-token prompt, and reports the chunks its helpers committed and took over.
`--served` times the served stack instead (`radixserve up`, as bench/peers_cpu.py starts it, with the setting
in its environment): after 48 streamed warm-up completions (the adaptive count gives a core back), `--passes`
streamed completions one at a time of a ~256-token prompt (each its own words: no prefix-cache hit) and 32 new
tokens, timing the first text chunk (TTFT) and the tokens after it.
Medians per setting close the output; JSON goes to bench/results/cpu_row_helpers_<date>_<n>.json (`--served`:
cpu_row_helpers_served_<date>_<n>.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"


def child(model: str, passes: int) -> None:
    sys.path.insert(0, str(REPO))
    import logging

    logging.basicConfig(level=logging.INFO, format="%(relativeCreated).0f ms %(message)s", stream=sys.stderr)
    from kernels.cpu_matvec import row_helper_stats
    from services.worker.frontend.engine import Engine

    engine = Engine(model, dtype="float32", max_total_tokens=8192)
    rng = random.Random(256)
    prompt = [rng.randrange(100, 49000) for _ in range(256)]
    short = [rng.randrange(100, 49000) for _ in range(64)]

    def run(ids: list[int], new: int) -> float:
        engine.flush_cache()
        t0 = time.perf_counter()
        engine.generate(input_ids=[ids], sampling_params={"temperature": 0.0, "max_new_tokens": new,
                                                          "min_new_tokens": new})
        return time.perf_counter() - t0

    run(short, 64)  # long enough for the adaptive count to give a core back beside busy neighbours
    prompt_s = [run(prompt, 1) for _ in range(passes)]
    decode_tok_s = 128 / run(short, 128)
    helped, taken = row_helper_stats()
    print("@@" + json.dumps({"prompt_pass_s": prompt_s, "bs1_tok_s": decode_tok_s, "helped": helped,
                             "taken": taken}), flush=True)
    engine.shutdown()


def streamed(url: str, prompt: str, tokens: int) -> tuple[float, float, int]:
    """One streamed completion: (seconds to the first text chunk, seconds after it, chunks with text)."""
    import httpx

    body = {"model": "peers", "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    start = time.perf_counter()
    first, chunks = None, 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if json.loads(line[6:])["choices"][0].get("text"):
                chunks += 1
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    if first is None:
        raise RuntimeError("the stream ended without text")
    return first - start, end - first, chunks


def served_child(model: str, passes: int, log_dir: Path) -> dict[str, Any]:
    """One served stack with this process's RS_CPU_ROW_HELPERS: TTFTs of `passes` ~256-token prompts."""
    sys.path.insert(0, str(REPO))
    from bench.peers_cpu_served import start_server

    rng = random.Random(256)
    words = ["river", "stone", "lamp", "orchard", "signal", "harbor", "ledger", "copper", "meadow", "engine",
             "violet", "canyon", "thread", "window", "marble", "falcon"]
    server = start_server("radixserve", Path(sys.executable), Path(model), None, log_dir)
    try:
        for i in range(48):
            streamed(server.url, f"Warm-up {i}: write about a {rng.choice(words)}.", 16)
        ttft, after = [], []
        for i in range(passes):
            prompt = f"Request {i}. " + " ".join(rng.choice(words) for _ in range(240))
            first, rest, chunks = streamed(server.url, prompt, 32)
            ttft.append(first)
            after.append(chunks / rest if rest > 0 else 0.0)
        return {"ttft_s": ttft, "decode_tok_s": after}
    finally:
        server.stop()


def write_results(prefix: str, busy: int, runs: dict[str, Any], summary: dict[str, Any]) -> None:
    """bench/results/<prefix>_<date>_<n>.json, n the first number free."""
    stamp = datetime.datetime.now(datetime.timezone.utc)
    RESULTS.mkdir(parents=True, exist_ok=True)
    n = 1
    while (path := RESULTS / f"{prefix}_{stamp:%Y-%m-%d}_{n}.json").exists():
        n += 1
    path.write_text(json.dumps({"date": stamp.isoformat(), "busy": busy, "cpus": len(os.sched_getaffinity(0)),
                                "runs": runs, "summary": summary}, indent=1))  # fmt: skip
    print(f"\nwrote {path.relative_to(REPO)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--busy", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--model-path", default=str(Path.home() / ".cache/radixserve/models/SmolLM2-135M-Instruct"))
    parser.add_argument("--settings", default="0,1", help="RS_CPU_ROW_HELPERS values to alternate (0, 1, always)")
    parser.add_argument("--served", action="store_true", help="time the served stack's TTFT instead")
    parser.add_argument("--own-session", action="store_true",
                        help="run each Engine in a session of its own (its own scheduler autogroup)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.model_path, args.passes)
        return
    if args.served:
        served_main(args)
        return
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    settings = args.settings.split(",")
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in settings}
    try:
        time.sleep(1.0)
        for r in range(args.rounds):
            for setting in settings if r % 2 == 0 else settings[::-1]:
                env = dict(os.environ, RS_CPU_ROW_HELPERS=setting)
                out = subprocess.run(
                    [sys.executable, __file__, "--child", "--model-path", args.model_path, "--passes",
                     str(args.passes)],
                    env=env, capture_output=True, text=True, check=True, cwd=REPO,
                    start_new_session=args.own_session,
                )  # fmt: skip
                line = next(x for x in out.stdout.splitlines() if x.startswith("@@"))
                decisions = [x for x in out.stderr.splitlines() if "CPU compute threads" in x or "row helpers" in x]
                result = json.loads(line[2:]) | {"load": os.getloadavg()[0], "decisions": decisions}
                runs[setting].append(result)
                passes = " ".join(f"{s:.2f}" for s in result["prompt_pass_s"])
                print(f"round {r + 1} helpers={setting}  prompt pass {passes} s  batch 1 {result['bs1_tok_s']:.1f} "
                      f"tok/s  helped {result['helped']} taken {result['taken']}  load {result['load']:.2f}",
                      flush=True)  # fmt: skip
                for d in decisions:
                    print(f"    {d}", flush=True)
    finally:
        for p in busy:
            p.kill()
    summary = {
        s: {
            "prompt_pass_median_s": statistics.median(x for run in rs for x in run["prompt_pass_s"]),
            "bs1_median_tok_s": statistics.median(run["bs1_tok_s"] for run in rs),
        }
        for s, rs in runs.items()
    }
    write_results("cpu_row_helpers", args.busy, runs, summary)
    print("RS_CPU_ROW_HELPERS  prompt pass (median s)  batch 1 (median tok/s)")
    for s in settings:
        print(f"{s:18}  {summary[s]['prompt_pass_median_s']:22.2f}  {summary[s]['bs1_median_tok_s']:22.1f}")


def served_main(args: argparse.Namespace) -> None:
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    settings = args.settings.split(",")
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in settings}
    log_dir = Path("/tmp/cpu_row_helpers_served")
    log_dir.mkdir(exist_ok=True)
    try:
        time.sleep(1.0)
        for r in range(args.rounds):
            for setting in settings if r % 2 == 0 else settings[::-1]:
                os.environ["RS_CPU_ROW_HELPERS"] = setting  # the stack's processes inherit it
                result = served_child(args.model_path, args.passes, log_dir) | {"load": os.getloadavg()[0]}
                runs[setting].append(result)
                ttft = " ".join(f"{1000 * s:.0f}" for s in result["ttft_s"])
                print(f"round {r + 1} helpers={setting}  TTFT {ttft} ms  decode "
                      f"{statistics.median(result['decode_tok_s']):.1f} tok/s  load {result['load']:.2f}", flush=True)
    finally:
        os.environ.pop("RS_CPU_ROW_HELPERS", None)
        for p in busy:
            p.kill()
    summary = {
        s: {
            "ttft_median_ms": 1000 * statistics.median(x for run in rs for x in run["ttft_s"]),
            "decode_median_tok_s": statistics.median(x for run in rs for x in run["decode_tok_s"]),
        }
        for s, rs in runs.items()
    }
    write_results("cpu_row_helpers_served", args.busy, runs, summary)
    print("RS_CPU_ROW_HELPERS  TTFT, ~256-token prompt (median ms)  decode after it (median tok/s)")
    for s in settings:
        print(f"{s:18}  {summary[s]['ttft_median_ms']:38.0f}  {summary[s]['decode_median_tok_s']:30.1f}")


if __name__ == "__main__":
    main()
