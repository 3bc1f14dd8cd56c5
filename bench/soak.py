"""Soak: a real deployment under mixed traffic while its workers are killed and restarted.

    python bench/soak.py --duration-s 1800 --restart-every-s 240 --workers 2 --concurrency 8 \
        --out bench/results/soak_cpu_<date>.json

Starts nats-server, a tokenizer, `--workers` workers and `--gateways` gateways as processes
(bench/soak_stack.py; the embedded default model unless --model-path), then `--concurrency` threads
send requests until `--duration-s` ends: chat and completions, streaming and not, n=2, JSON-schema
constrained, streams the client closes, native streams aborted by rid, and bad requests (kinds and how
each outcome is judged: bench/soak_traffic.py). Every `--restart-every-s` one worker (round robin) is
SIGKILLed and started again under its id; the gateways migrate its in-flight requests.

Passes (exit 0) when:
- no request failed: each was answered, cleanly failed, or aborted as asked, and every request sent
  has an outcome;
- each service's RSS grew by at most max(--rss-bound-pct % of its baseline, --rss-bound-mb MB) from its
  baseline (taken once the service has been up --warmup-s seconds under traffic; a restarted worker
  counts from its restart) to the end;
- at the end, with no traffic, every worker's KV pool is whole: kv_in_use == 0, kv_free + kv_cached ==
  max_total_tokens, no running or waiting request (get_info over NATS), and no gateway has a request
  in flight.
The JSON report holds the outcome counts per kind, the failures, migrations, restarts, RSS per service,
the invariant per worker, and the command, machine and date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.soak_stack import ServiceStartError, SoakStack, rss_mb  # noqa: E402
from bench.soak_traffic import CLEAN_ERROR, FAILED, KINDS, OUTCOMES, Client, Outcome, run_one  # noqa: E402
from shared.model_fetch import fetch_default_model  # noqa: E402
from shared.progress import progress_bar  # noqa: E402
from shared.protocol import WorkerInfo  # noqa: E402

KILL_WAIT_S = 10.0
# The gateway's line when it learns a worker is gone (services/gateway/migration.py's worker_lost).
LOST_LINE = re.compile(r"; (\d+) in-flight request\(s\) here")
SETTLE_S = 30.0  # how long the end-of-run checks wait for aborted requests to leave the workers


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 1800.0  # seconds of traffic
    restart_every_s: float = 240.0  # seconds between worker kills (0: none)
    workers: int = 2
    gateways: int = 1
    concurrency: int = 8  # traffic threads, spread over the gateways
    model_path: str | None = None  # default: the embedded default model
    request_timeout_s: float = 120.0  # client timeout of every request
    warmup_s: float = 60.0  # seconds a service runs under traffic before its RSS baseline
    rss_bound_pct: float = 15.0
    rss_bound_mb: float = 50.0
    max_total_tokens: int = 8192  # each worker's KV pool
    seed: int = 0
    log_dir: str | None = None  # service logs (default: a new temporary directory)
    progress: bool = True


@dataclass
class SoakReport:
    config: dict[str, Any]
    passed: bool
    reasons: list[str]
    sent: int
    outcomes: dict[str, int]
    by_kind: dict[str, dict[str, int]]
    failures: list[dict[str, Any]]
    server_errors: list[dict[str, Any]]  # the clean 5xx answers (each near a worker kill or restart)
    migrations: float
    lost_in_flight: int  # requests the gateways found in flight on a worker that was gone (their logs)
    restarts: list[dict[str, Any]]
    rss: dict[str, dict[str, Any]]
    invariant: dict[str, dict[str, Any]]
    settle_s: float  # seconds after the traffic until the invariant held and no gateway had a request
    gateways_in_flight: list[float]
    tracebacks: dict[str, int]
    traffic_s: float
    startup_s: float
    log_dir: str
    machine: dict[str, Any] = field(default_factory=dict)
    command: str = ""
    date: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


class RssTracker:
    """Baseline (once a service has served `warmup_s` s under traffic; a restarted worker from its
    restart), peak and last RSS per label."""

    def __init__(self, warmup_s: float, pct: float, mb: float) -> None:
        self.warmup_s, self.pct, self.mb = warmup_s, pct, mb
        self.baseline: dict[str, float] = {}
        self.peak: dict[str, float] = {}
        self.last: dict[str, float] = {}

    def sample(self, stack: SoakStack, traffic_started: float) -> None:
        now = time.monotonic()
        for label, (pid, ready_at) in stack.services().items():
            mb = rss_mb(pid)
            if mb is None:
                continue
            self.last[label] = mb
            self.peak[label] = max(mb, self.peak.get(label, 0.0))
            if label not in self.baseline and ready_at is not None and now - max(ready_at, traffic_started) >= self.warmup_s:
                self.baseline[label] = mb

    def report(self, live: set[str]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for label, last in self.last.items():
            row: dict[str, Any] = {"end_mb": round(last, 1), "peak_mb": round(self.peak[label], 1), "live": label in live}
            base = self.baseline.get(label)
            if base is None or label not in live:
                row["checked"] = False
                row["note"] = "killed" if label not in live else "younger than the warm-up at the end"
            else:
                bound = max(base * self.pct / 100, self.mb)
                row.update(checked=True, baseline_mb=round(base, 1), growth_mb=round(last - base, 1),
                           growth_pct=round(100 * (last - base) / base, 1), bound_mb=round(bound, 1),
                           within_bound=last - base <= bound)
            out[label] = row
        return out


class Restarter:
    """Every `every_s` seconds SIGKILL the next worker (round robin) and start it again under its id.
    Driven by the main thread's loop (tick): a service gets SIGTERM when the thread that started it
    exits, so no short-lived thread may start one."""

    def __init__(self, stack: SoakStack, every_s: float, started: float) -> None:
        self.stack, self.every_s, self.started = stack, every_s, started
        self.order = sorted(stack.workers)
        self.next_at = started + every_s if every_s > 0 else float("inf")
        self.pending: dict[str, Any] | None = None
        self.done: list[dict[str, Any]] = []
        self.disruptions: list[float] = []  # monotonic times of kills and of restarted workers ready

    def tick(self) -> None:
        now = time.monotonic()
        if self.pending is not None:
            try:
                ready = self.stack.restart_ready(self.pending["worker"])
            except ServiceStartError as exc:
                self.pending["error"], ready = str(exc)[-500:], True
            if ready:
                killed = self.pending.pop("killed")
                self.pending["ready_after_s"] = round(now - killed, 1)
                self.disruptions.append(now)
                self.done.append(self.pending)
                self.pending = None
        elif now >= self.next_at:
            wid = self.order[len(self.done) % len(self.order)]
            # A kill should catch requests in flight: an idle victim is given up to KILL_WAIT_S to get one.
            # Counted by the scheduler itself just before the kill: the worker's running-requests gauge
            # can be seconds old under load, and a kill it called busy then caught nothing to move.
            running = self.stack.requests_on(wid)
            if running == 0 and time.monotonic() < self.next_at + KILL_WAIT_S:
                return
            self.stack.kill_and_start(wid)
            killed = time.monotonic()
            self.disruptions.append(killed)
            self.pending = {"worker": wid, "killed_at_s": round(killed - self.started, 1), "killed": killed,
                            "running_at_kill": running, "error": None}
            self.next_at += self.every_s

    def finish(self) -> None:
        """Wait for a restart in progress (its worker must be up for the end-of-run checks)."""
        while self.pending is not None:
            self.tick()
            time.sleep(0.2)


def kv_invariant(info: WorkerInfo | str) -> dict[str, Any]:
    if isinstance(info, str):
        return {"holds": False, "error": info}
    holds = (info.kv_in_use == 0 and info.kv_free + info.kv_cached == info.max_total_tokens
             and info.num_running == 0 and info.num_waiting == 0)
    return {"holds": holds, "kv_free": info.kv_free, "kv_cached": info.kv_cached, "kv_in_use": info.kv_in_use,
            "max_total_tokens": info.max_total_tokens, "num_running": info.num_running,
            "num_waiting": info.num_waiting}


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.split(" ")[0].split("{")[0] == name)


def run_soak(config: SoakConfig) -> SoakReport:
    """Start the deployment, drive the traffic and the restarts, check everything, stop it."""
    model = Path(config.model_path) if config.model_path else fetch_default_model(progress=config.progress)
    log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="soak_"))
    began = time.monotonic()
    with SoakStack.start(model, config.workers, config.gateways, log_dir, config.max_total_tokens) as stack:
        startup_s = time.monotonic() - began
        return _drive(config, stack, model.name, startup_s)


def _drive(config: SoakConfig, stack: SoakStack, model: str, startup_s: float) -> SoakReport:
    stop = threading.Event()
    lock = threading.Lock()
    sent: Counter[str] = Counter()
    outcomes: list[Outcome] = []
    names, weights = list(KINDS), [w for _, w in KINDS.values()]

    def traffic(i: int) -> None:
        rng = random.Random(config.seed * 1000 + i)
        client = Client(stack.gateway_urls[i % len(stack.gateway_urls)], model, config.request_timeout_s, rng)
        try:
            while not stop.is_set():
                kind = rng.choices(names, weights)[0]
                with lock:
                    sent[kind] += 1
                try:
                    outcome = run_one(kind, client, lambda: list(disruptions))
                except Exception as exc:  # noqa: BLE001 - a client-side surprise is a failed request, not a crash
                    now = time.monotonic()
                    outcome = Outcome(kind, FAILED, now, now, f"client error {type(exc).__name__}: {exc}")
                with lock:
                    outcomes.append(outcome)
        finally:
            client.close()

    rss = RssTracker(config.warmup_s, config.rss_bound_pct, config.rss_bound_mb)
    traffic_started = time.monotonic()
    restarter = Restarter(stack, config.restart_every_s, traffic_started)
    disruptions = restarter.disruptions
    threads = [threading.Thread(target=traffic, args=(i,), daemon=True) for i in range(config.concurrency)]
    for thread in threads:
        thread.start()
    # A line per tenth of the run when logged to a file: a soak runs for many minutes unattended.
    with progress_bar(desc="soak", total=int(config.duration_s), unit="s", enabled=config.progress) as bar:
        while (elapsed := time.monotonic() - traffic_started) < config.duration_s:
            restarter.tick()
            rss.sample(stack, traffic_started)
            with lock:
                counts = Counter(o.outcome for o in outcomes)
            bar.set_postfix(sent=sum(sent.values()), restarts=len(restarter.done), **{k: counts[k] for k in OUTCOMES})
            bar.update(min(int(elapsed), int(config.duration_s)) - bar.n)
            time.sleep(1.0)
    stop.set()
    for thread in threads:
        thread.join(config.request_timeout_s + 30)
    traffic_s = time.monotonic() - traffic_started
    restarter.finish()
    restarts = restarter.done
    with lock:
        done = list(outcomes)
        sent_total = sum(sent.values())
    # A thread still inside a request past its timeout plus 30 s: that request hung.
    done += [Outcome("unknown", FAILED, 0, 0, "never returned") for _ in range(sent_total - len(done))]

    invariant, in_flight, settle_s = _settle(stack)
    rss.sample(stack, traffic_started)
    rss_report = rss.report(set(stack.services()))
    migrations = sum(metric(url, "rs_gateway_migrations_total") for url in stack.gateway_urls)
    tracebacks = {p.name: n for p in sorted(stack.log_dir.glob("*.log"))
                  if (n := p.read_text(errors="replace").count("Traceback"))}
    lost_in_flight = sum(
        int(n)
        for p in sorted(stack.log_dir.glob("g*.log"))
        for n in LOST_LINE.findall(p.read_text(errors="replace"))
    )

    by_kind = {kind: dict(Counter(o.outcome for o in done if o.kind == kind)) for kind in sorted({o.kind for o in done})}
    counts = Counter(o.outcome for o in done)
    def row(o: Outcome) -> dict[str, Any]:
        return {"kind": o.kind, "at_s": round(o.started - traffic_started, 1), "took_s": round(o.ended - o.started, 1),
                "status": o.status, "detail": o.detail}

    failures = [row(o) for o in done if o.outcome == FAILED]
    server_errors = [row(o) for o in done if o.outcome == CLEAN_ERROR and (o.status or 0) >= 500]
    reasons = []
    if failures:
        reasons.append(f"{len(failures)} request(s) failed")
    if sent_total != len(done):
        reasons.append(f"{sent_total} sent but {len(done)} outcomes")
    reasons += [f"RSS of {label} grew {row['growth_mb']} MB, over its bound of {row['bound_mb']} MB"
                for label, row in rss_report.items() if row.get("within_bound") is False]
    reasons += [f"KV pool invariant false on worker {wid}: {row}" for wid, row in invariant.items() if not row["holds"]]
    reasons += [f"a gateway still has {n:.0f} request(s) in flight" for n in in_flight if n]
    reasons += [f"restart of {r['worker']} failed: {r['error']}" for r in restarts if r["error"]]
    return SoakReport(
        config=asdict(config), passed=not reasons, reasons=reasons, sent=sent_total,
        outcomes={k: counts[k] for k in OUTCOMES}, by_kind=by_kind, failures=failures[:50],
        server_errors=server_errors[:50], migrations=migrations, lost_in_flight=lost_in_flight,
        restarts=restarts, rss=rss_report, invariant=invariant, settle_s=settle_s, gateways_in_flight=in_flight,
        tracebacks=tracebacks,
        traffic_s=round(traffic_s, 1), startup_s=round(startup_s, 1), log_dir=str(stack.log_dir),
        machine={"host": platform.node(), "cpus": os.cpu_count(), "platform": platform.platform(),
                 "python": platform.python_version(), "loadavg_end": os.getloadavg()},
        command=" ".join(sys.argv), date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )


def _settle(stack: SoakStack) -> tuple[dict[str, dict[str, Any]], list[float], float]:
    """The KV invariant per worker, the gateways' in-flight counts, and the seconds until both held
    (aborts and migrations finish asynchronously; at most SETTLE_S)."""
    began = time.monotonic()
    deadline = began + SETTLE_S
    while True:
        invariant = {wid: kv_invariant(info) for wid, info in stack.worker_info().items()}
        in_flight = [metric(url, "rs_gateway_requests_in_flight") for url in stack.gateway_urls]
        settled = all(row["holds"] for row in invariant.values()) and not any(in_flight)
        if settled or time.monotonic() > deadline:
            return invariant, in_flight, round(time.monotonic() - began, 1)
        time.sleep(1.0)


def print_table(report: SoakReport) -> None:
    print(
        f"\nsoak: {report.sent} requests in {report.traffic_s:.0f} s, {len(report.restarts)} restart(s), "
        f"{report.lost_in_flight} request(s) in flight on a lost worker, {report.migrations:.0f} migration(s)"
    )
    print(f"{'kind':<18}" + "".join(f"{k:>12}" for k in OUTCOMES))
    for kind, row in report.by_kind.items():
        print(f"{kind:<18}" + "".join(f"{row.get(k, 0):>12}" for k in OUTCOMES))
    print(f"{'all':<18}" + "".join(f"{report.outcomes[k]:>12}" for k in OUTCOMES))
    print(f"\n{'service':<24}{'baseline MB':>12}{'end MB':>10}{'growth MB':>10}{'bound MB':>10}  ok")
    for label, row in report.rss.items():
        ok = row.get("within_bound", "-") if row["checked"] else row["note"]
        print(f"{label:<24}{row.get('baseline_mb', '-'):>12}{row['end_mb']:>10}{row.get('growth_mb', '-'):>10}"
              f"{row.get('bound_mb', '-'):>10}  {ok}")
    for wid, row in report.invariant.items():
        print(f"KV pool of {wid}: {'holds' if row['holds'] else 'FALSE'} {row}")
    for failure in report.failures[:10]:
        print(f"FAILED {failure}")
    print("PASS" if report.passed else "FAIL: " + "; ".join(report.reasons))


def main() -> None:
    defaults = SoakConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration-s", type=float, default=defaults.duration_s, help="seconds of traffic")
    p.add_argument("--restart-every-s", type=float, default=defaults.restart_every_s, help="seconds between SIGKILLs of a worker (round robin; each restarted under its id; 0: none)")
    p.add_argument("--workers", type=int, default=defaults.workers, help="worker processes")
    p.add_argument("--gateways", type=int, default=defaults.gateways, help="gateway processes (g0 uses the tokenizer service, the others tokenize locally)")
    p.add_argument("--concurrency", type=int, default=defaults.concurrency, help="client threads, spread over the gateways")
    p.add_argument("--model-path", default=None, help="model directory (default: the embedded default model)")
    p.add_argument("--request-timeout-s", type=float, default=defaults.request_timeout_s, help="client timeout of every request: a request past it is a FAILED (hung) one")
    p.add_argument("--warmup-s", type=float, default=defaults.warmup_s, help="seconds of traffic before each service's RSS baseline")
    p.add_argument("--rss-bound-pct", type=float, default=defaults.rss_bound_pct, help="allowed RSS growth after warm-up, percent (the larger of this and --rss-bound-mb)")
    p.add_argument("--rss-bound-mb", type=float, default=defaults.rss_bound_mb, help="allowed RSS growth after warm-up, MB")
    p.add_argument("--max-total-tokens", type=int, default=defaults.max_total_tokens, help="each worker's KV pool, tokens")
    p.add_argument("--seed", type=int, default=defaults.seed, help="traffic seed")
    p.add_argument("--log-dir", default=None, help="where the services' logs go (default: a new temporary directory)")
    p.add_argument("--out", default=f"bench/results/soak_{datetime.date.today().isoformat()}.json", help="the JSON report")
    args = vars(p.parse_args())
    out = Path(args.pop("out"))
    report = run_soak(SoakConfig(**args))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report.to_json() + "\n")
    print_table(report)
    print(f"report: {out}; service logs: {report.log_dir}")
    sys.exit(0 if report.passed else 1)


if __name__ == "__main__":
    main()
