"""Where a request's time to first token goes, stage by stage, through the pipeline and through the
in-process Engine: reads the RS_TRACE_DIR files (shared/trace.py) that a traced
bench/pipeline_overhead.py run leaves (its TTFT pairs are named <kind>-engine-<i> / <kind>-gateway-<i>).

    RS_TRACE_DIR=/tmp/trace python bench/gpu_pipeline.py ...   (or pipeline_overhead.py)
    python bench/pipeline_trace.py /tmp/trace [--json OUT]

Each row is the median time from one stage to the next, over the pairs that reached both; every process
writes with the host's CLOCK_MONOTONIC, so stages in different processes line up.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

RID = re.compile(r"^(ttft\d*|floor|text)-(engine|gateway)-(\d+)$")  # ttft512-...: --ttft-prompt-lens
ORDER = {
    "gateway": [
        "client.sent",
        "gateway.http",
        "gateway.submit",
        "gateway.published",
        "worker.received",
        "worker.queued",
        "scheduler.added",
        "scheduler.launched",
        "scheduler.synced",
        "scheduler.outputs",
        "worker.outputs",
        "worker.published",
        "gateway.stream",
        "client.first",
    ],
    "engine": [
        "client.sent",
        "engine.queued",
        "scheduler.added",
        "scheduler.launched",
        "scheduler.synced",
        "scheduler.outputs",
        "engine.outputs",
        "client.first",
    ],
}


def read(trace_dir: Path) -> dict[tuple[str, str, int], dict[str, int]]:
    """(kind, side, index) -> stage -> its first timestamp (ns)."""
    stages: dict[tuple[str, str, int], dict[str, int]] = defaultdict(dict)
    for path in trace_dir.glob("*.trace"):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) != 3:
                continue
            match = RID.match(parts[0])
            if match is None:
                continue
            key = (match.group(1), match.group(2), int(match.group(3)))
            t = int(parts[2])
            if parts[1] not in stages[key] or t < stages[key][parts[1]]:
                stages[key][parts[1]] = t
    return stages


def breakdown(stages: dict[tuple[str, str, int], dict[str, int]]) -> dict[str, dict[str, dict[str, float]]]:
    """kind -> side -> 'a -> b' -> median microseconds (stages a request did not reach are skipped)."""
    out: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)
    kinds = sorted({k for k, _, _ in stages})
    for kind in kinds:
        for side, order in ORDER.items():
            runs = [s for (k, sd, _), s in stages.items() if k == kind and sd == side]
            rows: dict[str, float] = {}
            for run in runs:
                present = [name for name in order if name in run]
                for a, b in zip(present, present[1:]):
                    rows.setdefault(f"{a} -> {b}", [])  # type: ignore[arg-type]
                    rows[f"{a} -> {b}"].append((run[b] - run[a]) / 1e3)  # type: ignore[union-attr]
                if "client.sent" in run and "client.first" in run:
                    rows.setdefault("total", [])  # type: ignore[arg-type]
                    rows["total"].append((run["client.first"] - run["client.sent"]) / 1e3)  # type: ignore[union-attr]
            out[kind][side] = {name: statistics.median(v) for name, v in rows.items()}  # type: ignore[arg-type]
            out[kind][side]["pairs"] = len(runs)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace_dir", type=Path)
    p.add_argument("--json", type=Path, help="write the medians here too")
    args = p.parse_args(argv)
    result = breakdown(read(args.trace_dir))
    for kind, sides in result.items():
        for side, rows in sides.items():
            print(f"\n{kind}, {side} side ({rows.get('pairs', 0):.0f} requests): median us")
            for name, value in rows.items():
                if name != "pairs":
                    print(f"  {name:<44}{value:>9.0f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
