"""What one hop of the service pipeline costs on this host: a NATS round trip between two processes
(the receiver idle in epoll, or keeping its event loop busy), and the tokenizer service's hop
(gateway -> tokenizer -> worker subject) against a direct publish to the worker subject.

    .venv/bin/python bench/pipeline_hops.py            (this machine)
    python bench/pipeline_hops.py                      (the device: wheels on PYTHONPATH, see gpu_pipeline.py)

It starts its own nats-server and, for the tokenizer hop, a real `radixserve tokenizer` on the tiny
checkpoint of bench/gpu_pipeline.py (the embedded model's tokenizer). Prints the host's CPU idle states
too: a wake-up from a deep one is what a hop costs on a mostly idle many-core host.
JSON to $OUT/pipeline_hops.json (default bench/out/; recorded copies live in bench/results/).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shared.natsd import start_nats_server  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]


def host_info() -> dict:
    """Cores, the CPU model and the cpuidle states (name and exit latency) of cpu0."""
    info: dict = {"cpus": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    states = []
    base = Path("/sys/devices/system/cpu/cpu0/cpuidle")
    for state in sorted(base.glob("state*")) if base.is_dir() else []:
        try:
            states.append(f"{(state / 'name').read_text().strip()}:{(state / 'latency').read_text().strip()}us")
        except OSError:
            continue
    info["cpuidle"] = states
    for name, path in (("governor", "/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor"),
                       ("idle_driver", "/sys/devices/system/cpu/cpuidle/current_driver")):
        try:
            info[name] = Path(path).read_text().strip()
        except OSError:
            info[name] = None
    return info


def summary(samples_us: list[float]) -> dict:
    deciles = statistics.quantiles(samples_us, n=10)
    return {"median_us": statistics.median(samples_us), "p10_us": deciles[0], "p90_us": deciles[-1],
            "n": len(samples_us)}


# ---- the responder (a child process) ----------------------------------------------------------------


async def respond(url: str, spin: bool) -> None:
    import nats

    nc = await nats.connect(url)

    async def on_ping(msg) -> None:
        await nc.publish("hops.pong", msg.data)

    await nc.subscribe("hops.ping", cb=on_ping)
    await nc.flush()
    print("ready", flush=True)
    if spin:
        while True:
            await asyncio.sleep(0)
    else:
        await asyncio.Event().wait()


# ---- the measurements --------------------------------------------------------------------------------


async def round_trips(url: str, count: int, gap_s: float) -> list[float]:
    import nats

    nc = await nats.connect(url)
    arrivals: asyncio.Queue[float] = asyncio.Queue()
    await nc.subscribe("hops.pong", cb=_arrival_handler(arrivals))
    await nc.flush()
    out = []
    payload = b"x" * 256
    for _ in range(count):
        await asyncio.sleep(gap_s)
        start = time.perf_counter()
        await nc.publish("hops.ping", payload)
        out.append((await arrivals.get() - start) * 1e6)
    await nc.close()
    return out


def _arrival_handler(queue: asyncio.Queue[float]):
    async def on_message(_msg) -> None:
        queue.put_nowait(time.perf_counter())

    return on_message


async def tokenizer_hops(url: str, count: int, gap_s: float, text: str) -> dict[str, list[float]]:
    """One-way times to the worker subject: through the tokenizer service, and published there directly."""
    import nats

    from shared.protocol import PROTOCOL_VERSION, Sampling, Subjects, TokenizeRequest, encode

    subjects = Subjects("rs")
    sender, receiver = await nats.connect(url), await nats.connect(url)
    arrivals: asyncio.Queue[float] = asyncio.Queue()
    await receiver.subscribe(subjects.worker_requests("w0"), cb=_arrival_handler(arrivals))
    await receiver.flush()
    await sender.flush()
    out: dict[str, list[float]] = {"tokenizer": [], "direct": []}
    for i in range(count):
        data = encode(TokenizeRequest(v=PROTOCOL_VERSION, rid=f"r{i}", gateway_id="g0", worker_id="w0",
                                      sampling=Sampling(max_new_tokens=8), text=text))
        for kind, subject in (("tokenizer", subjects.tokenize), ("direct", subjects.worker_requests("w0"))):
            await asyncio.sleep(gap_s)
            start = time.perf_counter()
            await sender.publish(subject, data)
            out[kind].append((await arrivals.get() - start) * 1e6)
    await sender.close()
    await receiver.close()
    return out


def tokenize_in_process(model: Path, text: str, count: int, gap_s: float) -> dict[str, dict]:
    """What the tokenizer service does with one request, timed here: back to back, and after an idle gap."""
    from shared.prompt_tokenizer import PromptTokenizer
    from shared.protocol import PROTOCOL_VERSION, Sampling, TokenizeRequest

    prompts = PromptTokenizer.load(str(model))
    req = TokenizeRequest(v=PROTOCOL_VERSION, rid="r", gateway_id="g0", worker_id="w0",
                          sampling=Sampling(max_new_tokens=8), text=text)
    out = {}
    for name, gap in (("to_generate_hot", 0.0), ("to_generate_after_gap", gap_s)):
        samples = []
        for _ in range(count):
            if gap:
                time.sleep(gap)
            start = time.perf_counter()
            prompts.to_generate(req)
            samples.append((time.perf_counter() - start) * 1e6)
        out[name] = summary(samples[20:])
    encode = prompts.tokenizer._tokenizer.encode  # the Rust tokenizer under transformers' wrapper
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        encode(text)
        samples.append((time.perf_counter() - start) * 1e6)
    out["rust_encode_hot"] = summary(samples[20:])
    return out


def run_responder(url: str, spin: bool) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, __file__, "--respond", url] + (["--spin"] if spin else []),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        raise SystemExit("the responder did not start")
    return proc


def start_tokenizer(url: str, model: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "tokenizer", "--nats-url", url, "--model-path",
                             str(model), "--metrics-port", "none"], stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env=env, cwd=REPO_ROOT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if "tokenizer ready" in log.read_text():
            return proc
        if proc.poll() is not None:
            raise SystemExit(f"the tokenizer service exited:\n{log.read_text()[-2000:]}")
        time.sleep(0.2)
    raise SystemExit("the tokenizer service did not start in 120 s")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=400, help="timed messages per measurement")
    p.add_argument("--gap-ms", type=float, default=3.0, help="idle time before each message")
    p.add_argument("--respond", help=argparse.SUPPRESS)
    p.add_argument("--spin", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        import uvloop
    except ImportError:
        uvloop = None
    if args.respond:
        (uvloop.run if uvloop else asyncio.run)(respond(args.respond, args.spin))
        return
    run = uvloop.run if uvloop else asyncio.run
    import torch

    from bench.gpu_pipeline import build_checkpoint, put_nats_server_on_path

    put_nats_server_on_path()
    out_dir = Path(os.environ.get("OUT") or REPO_ROOT / "bench" / "out")
    out_dir.mkdir(parents=True, exist_ok=True)
    info = host_info()
    print(json.dumps(info), flush=True)
    warm = 20
    results: dict = {"host": info, "event_loop": "uvloop" if uvloop else "asyncio"}
    with start_nats_server() as server:
        for spin in (False, True):
            responder = run_responder(server.url, spin)
            try:
                samples = run(round_trips(server.url, args.count + warm, args.gap_ms / 1e3))[warm:]
            finally:
                responder.kill()
                responder.wait()
            results["round_trip_spin" if spin else "round_trip"] = summary(samples)
        model = build_checkpoint(True, torch.float32, "cpu")
        text = "The quick brown fox jumps over the lazy dog. " * 6
        results.update(tokenize_in_process(model, text, args.count, args.gap_ms / 1e3))
        log = out_dir / "pipeline_hops_tokenizer.log"
        tokenizer = start_tokenizer(server.url, model, log)
        try:
            hops = run(tokenizer_hops(server.url, args.count + warm, args.gap_ms / 1e3, text))
        finally:
            tokenizer.terminate()
            tokenizer.wait(timeout=30)
        for kind, samples in hops.items():
            results[f"to_worker_{kind}"] = summary(samples[warm:])
    print(f"{'measurement':<34}{'median us':>10}{'p10':>8}{'p90':>8}")
    for key in ("round_trip", "round_trip_spin", "to_worker_direct", "to_worker_tokenizer", "to_generate_hot",
                "to_generate_after_gap", "rust_encode_hot"):
        r = results[key]
        print(f"{key:<34}{r['median_us']:>10.0f}{r['p10_us']:>8.0f}{r['p90_us']:>8.0f}")
    (out_dir / "pipeline_hops.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
