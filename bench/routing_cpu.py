"""Cache-aware routing vs least-loaded routing across two workers, on a shared-prefix workload.

    .venv/bin/python bench/routing_cpu.py [--groups 6] [--per-group 6] [--concurrency 4]

Starts `radixserve up --workers 2` (the embedded default model on the CPU, one compute thread per
worker) once per routing policy (RS_ROUTING_POLICY=cache_aware | least_loaded, read by the gateway),
then sends the same workload through native /generate: `groups` system prompts of ~300 tokens, each
followed by `per-group` distinct questions, shuffled (seeded), `concurrency` requests in flight, 1 new
token each (the figure is prefill work). Reported per policy: the share of prompt tokens the workers
served from their radix caches (meta_info cached_tokens / prompt_tokens) against the ideal (each
system prompt computed once in the whole deployment), and the wall time. A table closes the output.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.pipeline_floor import start_up  # noqa: E402
from bench.pipeline_overhead import free_port  # noqa: E402
from shared.progress import progress_bar, say  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
WORDS = ("river stone cloud ember harbor lantern meadow violet copper thunder orchard silver marble "
         "falcon willow compass glacier saffron canyon ivory").split()


def workload(groups: int, per_group: int, seed: int) -> list[tuple[int, str]]:
    rng = random.Random(seed)
    systems = [
        f"System {g}: you answer in the voice of archive {g}. " + " ".join(rng.choice(WORDS) for _ in range(220))
        for g in range(groups)
    ]
    items = [(g, f"{systems[g]}\nQuestion {g}.{q}: what does word {q} mean?") for g in range(groups)
             for q in range(per_group)]
    rng.shuffle(items)
    return items


def run(url: str, items: list[tuple[int, str]], concurrency: int) -> dict[str, float]:
    def one(item: tuple[int, str]) -> tuple[int, int, str]:
        body = {"text": item[1], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        response = httpx.post(f"{url}/generate", json=body, timeout=300)
        response.raise_for_status()
        meta = response.json()["meta_info"]
        return meta["prompt_tokens"], meta["cached_tokens"], response.headers["x-radixserve-worker"]

    # Both workers must be routable before the first request.
    deadline = time.monotonic() + 60
    while httpx.get(f"{url}/health", timeout=5).json().get("workers", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    start_t = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(progress_bar(pool.map(one, items), desc="requests", total=len(items), lines_when_piped=False,
                                    leave=False))
    wall = time.perf_counter() - start_t
    prompt = sum(r[0] for r in results)
    cached = sum(r[1] for r in results)
    per_worker = {w: sum(1 for r in results if r[2] == w) for w in {r[2] for r in results}}
    return {"prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt, "wall_s": wall,
            "requests_per_worker": statistics.mean(per_worker.values()), "workers_used": len(per_worker)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=6)
    p.add_argument("--per-group", type=int, default=6)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    items = workload(args.groups, args.per_group, args.seed)
    figures = {}
    for policy in progress_bar(("cache_aware", "least_loaded"), desc="routing policies", lines_when_piped=False):
        proc, url, _ = start_up(
            ["--workers", "2", "--port", str(free_port()), "--max-total-tokens", "16384"],
            {"RS_ROUTING_POLICY": policy},
        )
        try:
            figures[policy] = run(url, items, args.concurrency)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
        say(f"{policy} {figures[policy]}")
    # Ideal: every prompt's shared system part comes from a cache except the first of each group,
    # measured as the cache-aware run's prompt tokens minus one full prompt per group.
    per_prompt = figures["cache_aware"]["prompt_tokens"] / len(items)
    print(f"\nload average {os.getloadavg()[0]:.2f}; {len(items)} requests ({args.groups} system prompts x "
          f"{args.per_group} questions, ~{per_prompt:.0f} prompt tokens each), {args.concurrency} in flight, 2 workers")
    print(f"{'policy':14s} {'cache hit rate':>15s} {'wall s':>8s} {'workers used':>13s}")
    for policy, f in figures.items():
        print(f"{policy:14s} {f['hit_rate']:15.3f} {f['wall_s']:8.1f} {f['workers_used']:13d}")


if __name__ == "__main__":
    main()
