"""Where `radixserve up`'s Prometheus metrics are. Every process `up` starts serves its metrics on a
port of its own, picked free and logged ("metrics at http://HOST:PORT/metrics"): the gateways too (their
/metrics on the shared HTTP port reaches whichever gateway the kernel picks). `up` gathers them into
RUN_DIR/prometheus.yml, a Prometheus configuration with ops/prometheus.yml's job names, so
`prometheus --config.file RUN_DIR/prometheus.yml` scrapes exactly what `up` exposes. There is no
detokenizer job: `up`'s workers run theirs in their own process, and its metrics are the worker's.
"""

from __future__ import annotations

import json
import re

METRICS_LINE = re.compile(r"metrics at http://(\S+?):(\d+)/metrics")
# ops/prometheus.yml's job of each service `up` starts.
JOBS = {"gateway": "radixserve-gateway", "tokenizer": "radixserve-tokenizer", "worker": "radixserve-worker"}
ANY_ADDRESS = ("0.0.0.0", "::", "[::]")


def metrics_target(log: str, name: str) -> str:
    """HOST:PORT of the metrics a service logged in `log` (the wildcard address as 127.0.0.1)."""
    match = METRICS_LINE.search(log)
    if match is None:
        raise RuntimeError(f"{name} logged no metrics port")
    host = "127.0.0.1" if match.group(1) in ANY_ADDRESS else match.group(1)
    return f"{host}:{match.group(2)}"


def prometheus_config(targets: dict[str, list[str]]) -> str:
    """A Prometheus configuration scraping `targets` (service -> HOST:PORT list) under JOBS' names."""
    lines = [
        "# Written by `radixserve up`: every metrics port of this deployment (services/up_metrics.py).",
        "global:",
        "  scrape_interval: 5s",
        "scrape_configs:",
    ]
    for service, addresses in targets.items():
        lines += [
            f"  - job_name: {JOBS[service]}",
            "    metrics_path: /metrics",
            "    static_configs:",
            f"      - targets: {json.dumps(sorted(addresses))}",
        ]
    return "\n".join(lines) + "\n"
