"""What the service pipeline costs over the in-process Engine, on this CPU, with the embedded default model.

    .venv/bin/python bench/pipeline_overhead.py        (from the repository root; about 3 minutes)

--model-path, --device, --dtype and --attention-backend reach both sides alike (bench/gpu_pipeline.py
runs this on a GPU with a random checkpoint).

The pipeline is `radixserve up` as a child process (its own nats-server, gateway, tokenizer, and a worker
with its detokenizer); the peer is `Engine` in this process. Both get the same compute threads
(--threads, default 2: OMP_NUM_THREADS for the pipeline, torch.set_num_threads here) and KV pool size.
Prompts are random token ids, fresh for every batch, so no prefix cache ever helps.

1. Throughput: --batch requests (--prompt-len ids, greedy, ignore_eos, --new-tokens each) as concurrent
   native `/generate` calls (one connection each, all written at once: bench/http_burst.py), and as one
   `Engine.generate` call; output tokens / wall seconds, sides alternating. loss = 1 - gateway / engine, median over repeats (target <= 5%).
   Each repeat also counts both sides' scheduler steps, split into prefills and decodes (the Engine's
   stats; the worker's rs_worker_prefill_steps_total / rs_worker_decode_steps_total, read after its
   next refresh): a burst that reaches the worker spread out takes more steps than the Engine's.
2. TTFT at low load: one streamed request at a time, time to the first token; --ttft-runs pairs, sides
   alternating; added TTFT = median of the per-pair differences (target <= 2 ms); the same again for
   each of --ttft-prompt-lens (other prompt lengths, e.g. 512).
3. The floor: the same round trip with max_new_tokens=0, which the worker answers without the model:
   the transport alone (HTTP, NATS messages, the processes), free of the prefill's noise.
4. TTFT with text prompts (--text-runs pairs): the same, the prompts as text (random ids decoded), which
   the Engine tokenizes in-process and the pipeline where `up --gateway-tokenizes` says: by default
   (short) the gateway tokenizes prompts up to 1,024 characters itself and sends longer ones to the
   tokenizer service; `--gateway-tokenizes none` sends every text prompt through the service (one NATS
   hop and one process more). A prompt of ids goes from the gateway straight to the worker either way.

The 2-core machine is shared, so each figure records the cores other people's processes kept busy
meanwhile (/proc/stat less this benchmark's process tree). On the CPU a throughput repeat counts only if
that stayed under CLEAN_FOREIGN_CORES on both sides; a disturbed one stays in the JSON and is replaced
(at most twice) while THROUGHPUT_BUDGET_S lasts. On a GPU the compute is not on the cores, so every
repeat counts (the figures are still recorded). A table closes the output; a JSON copy goes to
bench/out/pipeline_cpu.json (--out), never over a recorded file in bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script: make the repository's packages importable without an install.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.http_burst import HttpBurst, SseProbe  # noqa: E402
from services.launch import GATEWAY_TOKENIZES  # noqa: E402
from services.worker.cpu_placement import CLAIMS_DIR_ENV  # noqa: E402
from shared import trace  # noqa: E402
from shared.flags import flag_name  # noqa: E402
from shared.model_path import resolve_model_path  # noqa: E402
from shared.progress import progress_bar, say  # noqa: E402
from shared.service import die_with_parent  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "out" / "pipeline_cpu.json"
# Nothing answers here, so `up` starts its own nats-server instead of joining someone else's.
UNREACHABLE_NATS = "nats://127.0.0.1:1"
STACK_READY_TIMEOUT_S = 240.0
LOSS_TARGET = 0.05
ADDED_TTFT_TARGET_MS = 2.0
# The first token is timed; a second keeps the first chunk from also being the final one.
TTFT_NEW_TOKENS = 2
CLEAN_FOREIGN_CORES = 0.15
# No throughput repeat starts after this (once one is done), so a run stays under 4 minutes even
# when other people's work slows every batch down.
THROUGHPUT_BUDGET_S = 140.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# A worker answers get_info (which its WorkerLoad needs) only between scheduler steps, and on this
# CPU one prefill step of the batch takes 3-13 s: longer than the gateway's default 3 s routing TTL
# and 5 s death timeout, which would end every request in flight with an error. Liveness is not what
# is measured here, so the gateway's two timeouts are raised; the data path is untouched.
LIVENESS_ENV = {"RS_WORKER_TTL": "120", "RS_WORKER_DEAD_AFTER": "120"}
# The worker's step counters follow the scheduler's at each get_info refresh (every load_interval, 1 s
# under `up`): read this long after a burst, they include all of it.
STEP_COUNTS_WAIT_S = 1.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _busy_ticks() -> int:
    """Ticks all CPUs of the machine spent busy (steal included) since boot."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return sum(values) - values[3] - values[4]  # less idle and iowait


def process_stats() -> dict[int, list[str]]:
    """Every live process's /proc/<pid>/stat fields after the command name (index 1: the parent,
    11 and 12: user and system ticks)."""
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stats[int(entry.name)] = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
    return stats


def process_tree(root: int, stats: dict[int, list[str]]) -> set[int]:
    """`root` and its live descendants, by the parents in `stats` (process_stats())."""
    parents = {pid: int(fields[1]) for pid, fields in stats.items()}
    found, frontier = {root}, {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _tree_ticks(root: int) -> int:
    """CPU ticks of `root` and its live descendants (this benchmark and the pipeline it started)."""
    stats = process_stats()
    return sum(int(stats[pid][11]) + int(stats[pid][12]) for pid in process_tree(root, stats) if pid in stats)


class ForeignCpu:
    """Cores kept busy by processes outside this benchmark since it was made."""

    def __init__(self) -> None:
        self._t, self._busy, self._own = time.perf_counter(), _busy_ticks(), _tree_ticks(os.getpid())

    def cores(self) -> float:
        foreign = (_busy_ticks() - self._busy) - (_tree_ticks(os.getpid()) - self._own)
        return max(0.0, foreign / CLOCK_TICKS / (time.perf_counter() - self._t))


def add_stack_flags(p: argparse.ArgumentParser) -> None:
    """The `radixserve up` flags the measured stack starts with (bench/gpu_pipeline.py passes them on)."""
    p.add_argument("--gateway-tokenizes", choices=GATEWAY_TOKENIZES, default="short", nargs="?", const="all",
                   help="`up --gateway-tokenizes`: which text prompts the gateway tokenizes itself (default short)")
    p.add_argument("--gateways", default="auto",
                   help="`up --gateways N`: gateway processes sharing the port (default auto, as `up`: one per 4 cores, <= 4)")
    p.add_argument("--busy-poll-ms", type=float, default=float(os.environ.get("RS_BUSY_POLL_MS") or 0),
                   help="`up --busy-poll-ms`: the services' polling window (default: RS_BUSY_POLL_MS, else 0: off)")


def engine_options(args: argparse.Namespace, max_total_tokens: int) -> dict[str, Any]:
    """The engine options both sides get: the Engine's keywords, and `up`'s flags through up_flags."""
    options = {"device": args.device, "dtype": args.dtype, "attention_backend": args.attention_backend,
               "max_total_tokens": max_total_tokens}
    if args.device == "cpu":
        # The same fixed count on both sides, pinned, no core held back: a worker service's default keeps
        # one core for the services (on 2 vCPUs, one compute thread), the offline Engine's does not.
        options |= {"cpu_threads": args.threads, "cpu_reserved_cores": 0}
    return {name: value for name, value in options.items() if value is not None}


def up_flags(model_path: Path, options: dict[str, Any]) -> list[str]:
    """`up`'s spelling of the Engine's options (it hands them to its worker as RS_* variables); a boolean
    is `--name` or `--no-name`."""
    flags = [flag_name("model_path"), str(model_path)]
    for name, value in options.items():
        if isinstance(value, bool):
            flags.append(flag_name(name) if value else "--no-" + flag_name(name)[2:])
        else:
            flags += [flag_name(name), str(value)]
    return flags


class Stack:
    """`radixserve up` as a child process; stopped with SIGTERM (it stops its own children)."""

    def __init__(
        self, threads: int, engine_flags: list[str], run_dir: Path, gateway_tokenizes: str = "short",
        gateways: int | str = "auto", busy_poll_ms: float = 0.0,
    ) -> None:
        self.port, grpc_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.run_dir = run_dir
        self.log_path = run_dir / "up.out"
        # Claims of its own (cpu_placement.py): the in-process Engine, loaded first, has claimed the cores,
        # and the worker would compute unpinned ("placed by the OS") where the Engine computes pinned. The
        # two sides take turns, so each pins its threads to the same cores, as it would alone on the host.
        env = {**os.environ, "RS_NATS_URL": UNREACHABLE_NATS, "OMP_NUM_THREADS": str(threads),
               "PYTHONUNBUFFERED": "1", CLAIMS_DIR_ENV: str(run_dir / "cpu-claims"), **LIVENESS_ENV}
        with self.log_path.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "services.cli", "up", "--port", str(self.port), "--grpc-port",
                 str(grpc_port), "--run-dir", str(run_dir), *engine_flags,
                 "--gateway-tokenizes", gateway_tokenizes, "--gateways", str(gateways), "--busy-poll-ms", f"{busy_poll_ms:g}"],
                cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STACK_READY_TIMEOUT_S
        while "radixserve is up" not in self.log():
            if self.proc.poll() is not None:
                raise RuntimeError(f"`radixserve up` exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"`radixserve up` not ready in {STACK_READY_TIMEOUT_S:.0f} s:\n{self.log()[-3000:]}")
            time.sleep(0.2)
        port = self.worker_logged(r"metrics at http://[^:]+:(\d+)/metrics")
        self.worker_metrics = f"http://127.0.0.1:{port}/metrics" if port else None

    def worker_logged(self, pattern: str) -> str | None:
        """The first group of `pattern` in the worker's log, else None."""
        found = re.search(pattern, (self.run_dir / "worker-0.log").read_text())
        return found.group(1) if found else None

    def event_loop(self) -> str | None:
        """The event loop the worker service runs on (uvloop or asyncio), else None."""
        return self.worker_logged(r"runs on the (\w+) event loop")

    def single_row(self) -> str | None:
        """The single-row product the worker's load chose on the CPU, else None."""
        return self.worker_logged(r"single rows use the (\w+) product")

    def gateways(self) -> int | None:
        """How many gateways `up` started (its --gateways auto picks by cores), else None."""
        found = re.search(r"(\d+) gateway\(s\)", self.log())
        return int(found.group(1)) if found else None

    def worker_steps(self) -> dict[str, float]:
        """The worker's step counters so far: steps with output (the step publisher's, at once), and the
        scheduler's prefill and decode steps (as of the worker's last refresh: STEP_COUNTS_WAIT_S); NaN
        for what it does not report (no metrics port logged)."""
        names = {"output": "rs_worker_steps_total", "prefill": "rs_worker_prefill_steps_total",
                 "decode": "rs_worker_decode_steps_total"}
        if self.worker_metrics is None:
            return {key: float("nan") for key in names}
        with urllib.request.urlopen(self.worker_metrics, timeout=10) as response:
            text = response.read().decode()
        counts = {}
        for key, name in names.items():
            # One sample each, labelled with the worker's model_name.
            found = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
            counts[key] = float(found.group(1)) if found else float("nan")
        return counts

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def make_prompts(rng: random.Random, count: int, length: int, vocab: int) -> list[list[int]]:
    # Ids away from both ends of the vocabulary: the specials sit at the start.
    return [[rng.randrange(256, vocab - 256) for _ in range(length)] for _ in range(count)]


def sampling(new_tokens: int) -> dict[str, Any]:
    return {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": new_tokens}


# ---- throughput -------------------------------------------------------------------------------------


def engine_batch(engine: Any, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds for one Engine.generate call over the batch, and each prompt's output ids."""
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=sampling(new_tokens))
    return time.perf_counter() - start, [out["output_ids"] for out in outs]


async def _gateway_batch(url: str, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    # Connections opened and requests encoded before the clock (bench/http_burst.py: httpx's pool
    # costs ~10 ms of client CPU per request at this concurrency, which spread the batch over a second).
    burst = await HttpBurst.open(url, len(prompts), warm_path="/health")
    try:
        bodies = [{"input_ids": ids, "sampling_params": sampling(new_tokens)} for ids in prompts]
        seconds, answers = await burst.post_json("/generate", bodies)
    finally:
        await burst.close()
    return seconds, [answer["output_ids"] for answer in answers]


def gateway_batch(url: str, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds for the batch as concurrent /generate calls, and each prompt's output ids."""
    return asyncio.run(_gateway_batch(url, prompts, new_tokens))


def throughput_repeat(engine: Any, stack: Stack, prompts: list[list[int]], new_tokens: int,
                      engine_first: bool, clean_limit: float) -> dict[str, Any]:
    run: dict[str, Any] = {}
    outputs: dict[str, list[list[int]]] = {}
    for side in ("engine", "gateway") if engine_first else ("gateway", "engine"):
        foreign = ForeignCpu()
        if side == "engine":
            before = engine.get_server_info()["stats"]
            seconds, outputs[side] = engine_batch(engine, prompts, new_tokens)
            after = engine.get_server_info()["stats"]
            run["engine_steps"] = after["num_steps"] - before["num_steps"]
            run["engine_prefill_steps"] = after["num_prefill_steps"] - before["num_prefill_steps"]
            run["engine_decode_steps"] = after["num_decode_steps"] - before["num_decode_steps"]
        else:
            time.sleep(STEP_COUNTS_WAIT_S)  # the counters include everything before this burst
            before_w = stack.worker_steps()
            seconds, outputs[side] = gateway_batch(stack.url, prompts, new_tokens)
            time.sleep(STEP_COUNTS_WAIT_S)
            after_w = stack.worker_steps()
            counts = {key: after_w[key] - before_w[key] for key in after_w}
            run["gateway_prefill_steps"], run["gateway_decode_steps"] = counts["prefill"], counts["decode"]
            run["gateway_output_steps"] = counts["output"]
            # The Engine's num_steps counts every prefill and decode step alike.
            steps = counts["prefill"] + counts["decode"]
            run["gateway_steps"] = steps if not math.isnan(steps) else counts["output"]
        run[f"{side}_s"] = seconds
        run[f"{side}_tok_s"] = sum(len(ids) for ids in outputs[side]) / seconds
        run[f"{side}_foreign_cores"] = foreign.cores()
    run["loss"] = 1.0 - run["gateway_tok_s"] / run["engine_tok_s"]
    run["identical_outputs"] = sum(a == b for a, b in zip(outputs["engine"], outputs["gateway"]))
    run["clean"] = max(run["engine_foreign_cores"], run["gateway_foreign_cores"]) < clean_limit
    return run


STEP_KEYS = ("engine_steps", "engine_prefill_steps", "engine_decode_steps", "gateway_steps", "gateway_prefill_steps",
             "gateway_decode_steps")


def bench_throughput(engine: Any, stack: Stack, args: argparse.Namespace, rng: random.Random, vocab: int) -> dict[str, Any]:
    warm = make_prompts(rng, args.batch, args.prompt_len, vocab)
    # Both sides' first batch at once (the first big prefill pays torch's one-off costs), untimed.
    with ThreadPoolExecutor(1) as pool:
        engine_warm = pool.submit(engine_batch, engine, warm, 4)
        gateway_batch(stack.url, warm, 4)
        engine_warm.result()
    # Other processes' CPU time only disturbs a CPU run.
    clean_limit = CLEAN_FOREIGN_CORES if args.device == "cpu" else math.inf
    runs: list[dict[str, Any]] = []
    deadline = time.perf_counter() + THROUGHPUT_BUDGET_S
    bar = progress_bar(desc="clean throughput repeats", total=args.repeats, lines_when_piped=False)
    while sum(r["clean"] for r in runs) < args.repeats and len(runs) < args.repeats + 2:
        if runs and time.perf_counter() > deadline:
            say(f"  time budget ({THROUGHPUT_BUDGET_S:.0f} s) spent: no more repeats")
            break
        prompts = make_prompts(rng, args.batch, args.prompt_len, vocab)
        run = throughput_repeat(engine, stack, prompts, args.new_tokens, engine_first=len(runs) % 2 == 0,
                                clean_limit=clean_limit)
        runs.append(run)
        bar.update(int(run["clean"]))
        say(f"  repeat {len(runs)}: engine {run['engine_tok_s']:6.1f} tok/s ({run['engine_steps']} steps: "
            f"{run['engine_prefill_steps']} prefill + {run['engine_decode_steps']} decode), "
            f"gateway {run['gateway_tok_s']:6.1f} tok/s ({run['gateway_steps']:.0f} steps: "
            f"{run['gateway_prefill_steps']:.0f} + {run['gateway_decode_steps']:.0f}), loss "
            f"{run['loss'] * 100:+5.1f}%, identical outputs {run['identical_outputs']}/{args.batch}, others' CPU "
            f"{run['engine_foreign_cores']:.2f} / {run['gateway_foreign_cores']:.2f} cores"
            f"{'' if run['clean'] else ' (disturbed: not counted)'}")
    bar.close()
    counted = [r for r in runs if r["clean"]] or runs
    losses = [r["loss"] for r in counted]
    return {
        "runs": runs,
        "counted": len(counted),
        "all_disturbed": not any(r["clean"] for r in runs),
        "engine_tok_s": statistics.median(r["engine_tok_s"] for r in counted),
        "gateway_tok_s": statistics.median(r["gateway_tok_s"] for r in counted),
        "loss_median": statistics.median(losses),
        **{f"{key}_median": statistics.median(r[key] for r in counted) for key in STEP_KEYS},
        "loss_min": min(losses),
        "loss_max": max(losses),
    }


# ---- TTFT -------------------------------------------------------------------------------------------


Prompt = list[int] | str


def engine_first_chunk(engine: Any, prompt: Prompt, new_tokens: int, rid: str | None = None) -> float:
    """Seconds from the streamed call to its first chunk with a token (new_tokens=0: its only chunk).
    With RS_TRACE_DIR set, `rid` names the request in the trace (client.sent, client.first)."""
    given = {"prompt": prompt} if isinstance(prompt, str) else {"input_ids": prompt}
    if rid is not None:
        given["rid"] = rid
        trace.mark(rid, "client.sent")
    start = time.perf_counter()
    first: float | None = None
    for chunk in engine.generate(**given, sampling_params=sampling(new_tokens), stream=True):
        if first is None and (chunk["output_ids"] or not new_tokens):
            first = time.perf_counter() - start
            if rid is not None:
                trace.mark(rid, "client.first")
    assert first is not None, "the engine streamed no chunk"
    return first


def gateway_first_chunk(probe: SseProbe, prompt: Prompt, new_tokens: int, rid: str | None = None) -> float:
    """Seconds from sending a streamed /generate to the read that delivered its first SSE event with a
    token (new_tokens=0: its first event), off the socket by bench/http_burst.py's SseProbe (no client
    library on the clock: the Engine side has none either). With RS_TRACE_DIR set, `rid` names the
    request in the trace, whose client.sent and client.first are the same two moments."""
    body = {"text" if isinstance(prompt, str) else "input_ids": prompt, "sampling_params": sampling(new_tokens),
            "stream": True}
    if rid is not None:
        body["rid"] = rid
    seconds = probe.first_event("/generate", body, lambda event: bool(event["output_ids"]) or not new_tokens)
    if rid is not None:
        trace.mark(rid, "client.sent", probe.sent_ns)
        trace.mark(rid, "client.first", probe.first_ns)
    return seconds


def paired_first_chunk(engine: Any, client: SseProbe, prompts: list[Prompt], new_tokens: int,
                       warmup: int, name: str = "ttft", gap_s: float = 0.0) -> dict[str, Any]:
    """Each prompt on both sides (each has its own cache, so neither hits it), in alternating order;
    the added time is the median of the per-prompt differences. `gap_s` of idle time goes before each
    request, so each finds the machine at rest rather than in the tail of the other side's last one."""
    engine_ms: list[float] = []
    gateway_ms: list[float] = []
    foreign = ForeignCpu()
    for i, ids in enumerate(progress_bar(prompts, desc=f"{name} pairs", lines_when_piped=False, leave=False)):
        # Traced pairs are named <name>-engine-<i> / <name>-gateway-<i> (bench/pipeline_trace.py).
        e_rid, g_rid = (f"{name}-engine-{i}", f"{name}-gateway-{i}") if trace.TRACE_DIR else (None, None)

        def on_engine(ids: Prompt = ids, rid: str | None = e_rid) -> float:
            time.sleep(gap_s)
            return engine_first_chunk(engine, ids, new_tokens, rid)

        def on_gateway(ids: Prompt = ids, rid: str | None = g_rid) -> float:
            time.sleep(gap_s)
            return gateway_first_chunk(client, ids, new_tokens, rid)

        if i % 2 == 0:
            e, g = on_engine(), on_gateway()
        else:
            g, e = on_gateway(), on_engine()
        if i >= warmup:
            engine_ms.append(e * 1e3)
            gateway_ms.append(g * 1e3)
    quartiles = statistics.quantiles([g - e for g, e in zip(gateway_ms, engine_ms)], n=4)
    return {
        "engine_ms": engine_ms,
        "gateway_ms": gateway_ms,
        "engine_median_ms": statistics.median(engine_ms),
        "gateway_median_ms": statistics.median(gateway_ms),
        "added_median_ms": quartiles[1],
        "added_p25_ms": quartiles[0],
        "added_p75_ms": quartiles[2],
        "foreign_cores": foreign.cores(),
    }


def text_prompts(tokenizer: Any, rng: random.Random, count: int, length: int, vocab: int) -> list[str]:
    """Random ids decoded to text (about `length` tokens once encoded again)."""
    return [tokenizer.decode(ids) for ids in make_prompts(rng, count, length, vocab)]


def bench_ttft(
    engine: Any, url: str, args: argparse.Namespace, rng: random.Random, vocab: int
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None, dict[str, dict[str, Any]]]:
    """TTFT, the floor (max_new_tokens=0: the worker answers without the model), TTFT with text
    prompts (None without a tokenizer or with --text-runs 0), and TTFT with prompts of each of
    --ttft-prompt-lens tokens (by length)."""
    client = SseProbe(url)  # the keep-alive connection every request then reuses
    tokenizer = engine.tokenizer
    try:
        runs = {"TTFT": (args.ttft_runs, TTFT_NEW_TOKENS, False), "floor (max_new_tokens=0)": (args.floor_runs, 0, False)}
        trace_names = {"TTFT": "ttft", "floor (max_new_tokens=0)": "floor", "TTFT, text prompts": "text"}
        if args.text_runs and tokenizer is not None:
            runs["TTFT, text prompts"] = (args.text_runs, TTFT_NEW_TOKENS, True)
        lengths = {name: args.prompt_len for name in runs}
        for length in args.ttft_prompt_lens:
            name = f"TTFT, {length}-token prompts"
            runs[name], lengths[name], trace_names[name] = (args.ttft_runs, TTFT_NEW_TOKENS, False), length, f"ttft{length}"
        results = {}
        for name, (count, new_tokens, text) in runs.items():
            total = count + args.ttft_warmup
            prompts: list[Prompt] = (text_prompts(tokenizer, rng, total, lengths[name], vocab) if text
                                     else make_prompts(rng, total, lengths[name], vocab))
            r = paired_first_chunk(engine, client, prompts, new_tokens, args.ttft_warmup, trace_names[name],
                                   args.pair_gap_ms / 1e3)
            say(f"  {name} over {count} pairs: engine {r['engine_median_ms']:.2f} ms, gateway "
                f"{r['gateway_median_ms']:.2f} ms, added {r['added_median_ms']:+.2f} ms (IQR "
                f"{r['added_p25_ms']:+.2f} .. {r['added_p75_ms']:+.2f}), others' CPU {r['foreign_cores']:.2f} cores")
            results[name] = r
    finally:
        client.close()
    by_length = {str(length): results[f"TTFT, {length}-token prompts"] for length in args.ttft_prompt_lens}
    return results["TTFT"], results["floor (max_new_tokens=0)"], results.get("TTFT, text prompts"), by_length


# ---- main -------------------------------------------------------------------------------------------


def prompt_lens(text: str) -> tuple[int, ...]:
    """--ttft-prompt-lens: comma-separated positive token counts ('' for none)."""
    try:
        lengths = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None
    if any(length < 1 for length in lengths):
        raise argparse.ArgumentTypeError(f"prompt lengths must be >= 1, got {text!r}")
    return lengths


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2, help="compute threads of the worker and of the Engine")
    p.add_argument("--batch", type=int, default=32, help="concurrent requests of the throughput workload")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt length in tokens")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per throughput request")
    p.add_argument("--repeats", type=int, default=5, help="clean throughput repeats (each runs both sides)")
    p.add_argument("--ttft-runs", type=int, default=60, help="timed TTFT pairs")
    p.add_argument("--ttft-warmup", type=int, default=3, help="TTFT pairs before timing")
    p.add_argument("--floor-runs", type=int, default=50, help="timed pairs with max_new_tokens=0")
    p.add_argument("--pair-gap-ms", type=float, default=0.0,
                   help="idle milliseconds before each TTFT/floor request (0: back to back, as recorded before)")
    p.add_argument("--text-runs", type=int, default=60, help="timed TTFT pairs with text prompts (0: none)")
    p.add_argument("--ttft-prompt-lens", type=prompt_lens, default=(),
                   help="other prompt lengths (tokens, comma-separated, e.g. 512) to time TTFT pairs at (--ttft-runs each)")
    p.add_argument("--seed", type=int, default=0, help="prompt RNG seed")
    add_stack_flags(p)
    p.add_argument("--model-path", default=None, help="HF checkpoint directory (default: the embedded model)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N, for both sides")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 for both sides (default: the engine's)")
    p.add_argument("--attention-backend", default=None, choices=("torch", "triton"),
                   help="both sides' attention backend (default: the engine's: torch on CPU, triton on CUDA)")
    p.add_argument("--out", type=Path, default=RESULTS, help="JSON results path")
    args = p.parse_args(argv)
    least = {"threads": 1, "batch": 1, "prompt_len": 1, "new_tokens": 1, "repeats": 1, "ttft_runs": 2, "ttft_warmup": 0,
             "floor_runs": 2, "text_runs": 0, "pair_gap_ms": 0, "busy_poll_ms": 0}
    for name, low in least.items():
        if getattr(args, name) < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    return args


def print_table(t: dict[str, Any], tt: dict[str, Any], fl: dict[str, Any], tx: dict[str, Any] | None,
                args: argparse.Namespace, by_length: dict[str, dict[str, Any]] | None = None) -> None:
    def row(figure: str, gateway: str, engine: str = "", ratio: str = "", spread: str = "", target: str = "",
            met: bool | None = None) -> None:
        status = "" if met is None else ("met" if met else "missed")
        print(f"{figure:34s} {gateway:>9s} {engine:>9s} {ratio:>7s}  {spread:20s} {target:>7s}  {status}")

    row("figure", "gateway", "engine", "ratio", "spread", "target")
    row(f"output tok/s (median of {t['counted']})", f"{t['gateway_tok_s']:.1f}", f"{t['engine_tok_s']:.1f}",
        f"{t['gateway_tok_s'] / t['engine_tok_s']:.3f}")
    row("throughput loss (median)", f"{t['loss_median'] * 100:.1f}%",
        spread=f"{t['loss_min'] * 100:.1f} .. {t['loss_max'] * 100:.1f}%", target="<= 5%",
        met=t["loss_median"] <= LOSS_TARGET)
    row("scheduler steps (median)", f"{t['gateway_steps_median']:.0f}", f"{t['engine_steps_median']:.0f}",
        f"{t['gateway_steps_median'] / t['engine_steps_median']:.3f}")
    row("  of them prefill steps", f"{t['gateway_prefill_steps_median']:.0f}", f"{t['engine_prefill_steps_median']:.0f}")
    row(f"TTFT ms (median of {args.ttft_runs})", f"{tt['gateway_median_ms']:.1f}", f"{tt['engine_median_ms']:.1f}",
        f"{tt['gateway_median_ms'] / tt['engine_median_ms']:.3f}")
    row("added TTFT ms (median of pairs)", f"{tt['added_median_ms']:.2f}",
        spread=f"IQR {tt['added_p25_ms']:.2f} .. {tt['added_p75_ms']:.2f}", target="<= 2",
        met=tt["added_median_ms"] <= ADDED_TTFT_TARGET_MS)
    row(f"floor ms, 0 new tokens ({args.floor_runs})", f"{fl['gateway_median_ms']:.2f}",
        f"{fl['engine_median_ms']:.2f}")
    row("added floor ms (median of pairs)", f"{fl['added_median_ms']:.2f}",
        spread=f"IQR {fl['added_p25_ms']:.2f} .. {fl['added_p75_ms']:.2f}")
    for length, r in (by_length or {}).items():
        row(f"TTFT ms, {length}-token prompts", f"{r['gateway_median_ms']:.1f}", f"{r['engine_median_ms']:.1f}",
            f"{r['gateway_median_ms'] / r['engine_median_ms']:.3f}")
        row(f"added TTFT ms, {length}-token", f"{r['added_median_ms']:.2f}",
            spread=f"IQR {r['added_p25_ms']:.2f} .. {r['added_p75_ms']:.2f}", target="<= 2",
            met=r["added_median_ms"] <= ADDED_TTFT_TARGET_MS)
    if tx is not None:
        row(f"text TTFT ms (median of {args.text_runs})", f"{tx['gateway_median_ms']:.1f}",
            f"{tx['engine_median_ms']:.1f}", f"{tx['gateway_median_ms'] / tx['engine_median_ms']:.3f}")
        row("added text TTFT ms (median)", f"{tx['added_median_ms']:.2f}",
            spread=f"IQR {tx['added_p25_ms']:.2f} .. {tx['added_p75_ms']:.2f}", target="<= 2",
            met=tx["added_median_ms"] <= ADDED_TTFT_TARGET_MS)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # Before torch is imported, so its OpenMP pool has the same size as the pipeline worker's.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    from services.worker.frontend.engine import Engine

    torch.set_num_threads(args.threads)
    model_path = resolve_model_path(args.model_path)
    max_total_tokens = args.batch * (args.prompt_len + args.new_tokens) + max((1024, *args.ttft_prompt_lens))
    options = engine_options(args, max_total_tokens)
    gpu = torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else None
    print(f"torch {torch.__version__}, {args.threads} compute threads on each side (OMP_NUM_THREADS / "
          f"torch.set_num_threads), {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}"
          f"{f', {gpu}' if gpu else ''}, load average {os.getloadavg()[0]:.2f}; model {model_path.name}; "
          f"engine options {options}", flush=True)
    started = time.perf_counter()
    run_dir = Path(tempfile.mkdtemp(prefix="rs-pipeline-bench-"))
    # One after the other: on the CPU a model's load times its single-row products both ways and keeps
    # the faster (layers/linear_calibration.py calibrate_single_row); a load beside another would time a disturbed
    # pass and could keep the slower product for the rest of the run (seen here: a 40 ms instead of a
    # 20 ms decode step, and 8 ms more per prefill through the LM head's single row).
    engine = Engine(str(model_path), **options)
    try:
        stack = Stack(args.threads, up_flags(model_path, options), run_dir, args.gateway_tokenizes, args.gateways,
                      args.busy_poll_ms)
        try:
            stack.wait_ready()
            print(f"pipeline up at {stack.url} (logs in {run_dir}), engine loaded: "
                  f"{time.perf_counter() - started:.0f} s", flush=True)
            single_row = {"engine": engine.get_server_info().get("cpu_single_row"), "worker": stack.single_row()}
            event_loop = stack.event_loop()
            print(f"the services run on the {event_loop} event loop", flush=True)
            if single_row["engine"] is not None:
                print(f"single-row product (CPU): engine {single_row['engine']['product']}, worker "
                      f"{single_row['worker']}", flush=True)
            vocab = engine.model_config.vocab_size
            rng = random.Random(args.seed)
            print(f"throughput: {args.batch} requests x {args.prompt_len} prompt tokens -> {args.new_tokens} "
                  "new tokens, greedy, ignore_eos", flush=True)
            throughput = bench_throughput(engine, stack, args, rng, vocab)
            print(f"TTFT: one streamed request at a time, {args.prompt_len} prompt tokens", flush=True)
            ttft, floor, ttft_text, ttft_by_len = bench_ttft(engine, stack.url, args, rng, vocab)
            gateways = stack.gateways()
        finally:
            stack.stop()
    finally:
        engine.shutdown()
    elapsed = time.perf_counter() - started

    workload = {**{k: v for k, v in vars(args).items() if k != "out"}, "ttft_new_tokens": TTFT_NEW_TOKENS,
                "max_total_tokens": max_total_tokens}
    targets = {"loss_max": LOSS_TARGET, "loss_met": throughput["loss_median"] <= LOSS_TARGET,
               "added_ttft_max_ms": ADDED_TTFT_TARGET_MS,
               "added_ttft_met": ttft["added_median_ms"] <= ADDED_TTFT_TARGET_MS,
               "added_text_ttft_met": None if ttft_text is None else ttft_text["added_median_ms"] <= ADDED_TTFT_TARGET_MS,
               "added_ttft_met_by_prompt_len": {length: r["added_median_ms"] <= ADDED_TTFT_TARGET_MS
                                                for length, r in ttft_by_len.items()}}
    result = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "gpu": gpu, "torch": torch.__version__,
              "model": model_path.name, "engine_options": options, "workload": workload, "gateway_env": LIVENESS_ENV,
              "single_row": single_row, "event_loop": event_loop, "gateways_started": gateways, "throughput": throughput, "ttft": ttft, "floor": floor, "ttft_text": ttft_text,
              "ttft_by_prompt_len": ttft_by_len,
              "targets": targets, "wall_s": elapsed}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\ndone in {elapsed:.0f} s; JSON in {args.out}"
          f"{'; WARNING: every throughput repeat was disturbed' if throughput['all_disturbed'] else ''}")
    print_table(throughput, ttft, floor, ttft_text, args, ttft_by_len)


if __name__ == "__main__":
    main()
