"""CPU time each process of the pipeline spends on one request at the floor (a streamed /generate the
worker answers without the model: max_new_tokens=0, a 64-token prompt of ids), and where the gateway's
share goes.

    .venv/bin/python bench/pipeline_cpu.py [--requests 1500] [--runs 2] [--profile gateway]

Starts `radixserve up` (bench/pipeline_floor.py's start_up: its own nats-server, the CPU, one compute
thread), sends --requests sequential floor requests from a raw-socket client, and reads each process's
user and system time from /proc before and after. With --profile, py-spy samples that process during a
further run and the table lists the functions with the most time (inclusive, then self) per request.
py-spy is not a project dependency: `.venv/bin/pip install py-spy`.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.http_burst import SseProbe  # noqa: E402
from bench.pipeline_floor import IDS, start_up  # noqa: E402
from bench.pipeline_overhead import free_port, process_stats, process_tree  # noqa: E402
from shared.progress import progress_bar  # noqa: E402

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
SAMPLE_HZ = 2000  # py-spy's sampling rate
BODY = {"input_ids": IDS, "sampling_params": {"max_new_tokens": 0}, "stream": True}


def descendants(root: int) -> dict[int, str]:
    """pid -> role of `root`'s descendants: the service a `radixserve` process runs, or the program."""
    roles = {}
    for pid in process_tree(root, process_stats()) - {root}:
        try:
            argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [a.decode(errors="replace") for a in argv if a]
        if "services.cli" in words:
            roles[pid] = words[words.index("services.cli") + 1]
        else:
            roles[pid] = Path(words[0]).name if words else str(pid)
    return roles


def cpu_ticks(pid: int) -> tuple[int, int]:
    fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])


def floor_requests(probe: SseProbe, count: int) -> list[float]:
    return [probe.first_event("/generate", BODY, lambda event: True)
            for _ in progress_bar(range(count), desc="floor requests", lines_when_piped=False, leave=False)]


def measure(probe: SseProbe, roles: dict[int, str], count: int) -> tuple[dict[str, tuple[float, float]], float]:
    """Per role, (user, system) ms per request over `count` requests; and the median latency in ms."""
    before = {pid: cpu_ticks(pid) for pid in roles}
    latencies = floor_requests(probe, count)
    after = {pid: cpu_ticks(pid) for pid in roles}
    per: dict[str, tuple[float, float]] = {}
    for pid, role in roles.items():
        user = (after[pid][0] - before[pid][0]) / CLOCK_TICKS * 1e3 / count
        system = (after[pid][1] - before[pid][1]) / CLOCK_TICKS * 1e3 / count
        u, s = per.get(role, (0.0, 0.0))
        per[role] = (u + user, s + system)
    return per, statistics.median(latencies) * 1e3


def profile(probe: SseProbe, pid: int, count: int, top: int, native: bool) -> None:
    """py-spy samples `pid` while `count` floor requests run; the functions with the most samples."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        raise SystemExit("--profile needs py-spy: .venv/bin/pip install py-spy")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "stacks.txt"
        proc = subprocess.Popen([spy, "record", "--pid", str(pid), "--rate", str(SAMPLE_HZ), "--format", "raw",
                                 "--output", str(out), *(["--native"] if native else ["--nonblocking"])],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        floor_requests(probe, count)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        inclusive: collections.Counter[str] = collections.Counter()
        own: collections.Counter[str] = collections.Counter()
        total = 0
        for line in out.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            frames = [f.split(" (")[0] + " " + f.rsplit("/", 1)[-1].rstrip(")") for f in stack.split(";")]
            samples = int(n)
            total += samples
            for frame in set(frames):
                inclusive[frame] += samples
            own[frames[-1]] += samples
    rate = SAMPLE_HZ / 1e3  # samples per ms
    print(f"\npy-spy on pid {pid}: {total} samples over {count} requests; ms per request (wall samples)")
    for title, counter in (("inclusive", inclusive), ("self", own)):
        print(f"-- {title}")
        for frame, n in counter.most_common(top):
            print(f"{n / rate / count:8.3f}  {frame}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=1500)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--profile", help="a role (gateway, worker, tokenizer) to sample with py-spy")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--native", action="store_true", help="py-spy --native: C frames too")
    p.add_argument("--up-args", default="", help="more `radixserve up` flags, one string")
    args = p.parse_args()
    up_args = ["--port", str(free_port()), "--max-total-tokens", "8192", *args.up_args.split()]
    proc, url, _ = start_up(up_args)
    try:
        roles = descendants(proc.pid)
        probe = SseProbe(url)
        floor_requests(probe, 200)  # warm-up
        rows = [measure(probe, roles, args.requests) for _ in range(args.runs)]
        if args.profile:
            pid = next(pid for pid, role in roles.items() if role == args.profile)
            profile(probe, pid, args.requests, args.top, args.native)
        probe.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    print(f"\n{args.requests} floor requests per run; CPU ms per request, user+system (system); latency median")
    names = sorted({role for per, _ in rows for role in per})
    for run, (per, latency) in enumerate(rows):
        cells = "  ".join(f"{role} {u + s:.3f} ({s:.3f})" for role in names for u, s in [per[role]])
        print(f"run {run}: latency {latency:.2f} ms | {cells}")


if __name__ == "__main__":
    main()
