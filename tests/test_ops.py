"""ops/: the Prometheus scrape configuration (docker-compose.yml's) points at the services' default
metrics ports, and every metric the Grafana dashboard queries is one the services really export (so no
panel is empty for a misspelt name). The exported names come from the services' own metric classes, instantiated in a
fresh process (they register in prometheus_client's global registry)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

from services.detokenizer.config import DetokenizerConfig
from services.gateway.config import GatewayConfig
from services.tokenizer.config import TokenizerConfig
from services.worker.frontend.service_config import WorkerServiceConfig

OPS = Path(__file__).resolve().parents[1] / "ops"

EXPORTED = r"""
import json
from prometheus_client import REGISTRY
from services.detokenizer.service import DetokenizerMetrics
from services.gateway.metrics import GatewayMetrics
from services.tokenizer.service import TokenizerMetrics
from services.worker.frontend.metrics import WorkerMetrics

gateway = GatewayMetrics()
WorkerMetrics("tiny", 4), TokenizerMetrics("tiny"), DetokenizerMetrics("tiny")
# Every sample name a scrape can show (counter_total, histogram_bucket, ...) and the labels it has.
labels = {}
for registry in (REGISTRY, gateway.registry):
    for name, collector in registry._names_to_collectors.items():
        extra = ["le"] if name.endswith("_bucket") else []
        labels[name] = sorted([*getattr(collector, "_labelnames", ()), *extra])
print(json.dumps(labels))
"""


def exported_metrics() -> dict[str, set[str]]:
    """Each metric sample name the services export, with its label names."""
    done = subprocess.run([sys.executable, "-c", EXPORTED], capture_output=True, text=True, timeout=120,
                          cwd=OPS.parent)
    assert done.returncode == 0, done.stderr
    return {name: set(labels) for name, labels in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((OPS / "grafana" / "radixserve.json").read_text())
    return [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]


def expr_labels(expr: str) -> set[str]:
    """The label names an expression groups by or selects on."""
    grouped = {name.strip() for group in re.findall(r"\bby \(([^)]*)\)", expr) for name in group.split(",")}
    selected = {name for sel in re.findall(r"\{([^}]*)\}", expr) for name in re.findall(r"(\w+)\s*=~?", sel)}
    return {name for name in grouped | selected if name}


def test_prometheus_scrapes_each_service_on_its_default_port() -> None:
    config = yaml.safe_load((OPS / "prometheus.yml").read_text())
    ports = {job["job_name"]: [c["port"] for c in job["dns_sd_configs"]] for job in config["scrape_configs"]}
    assert ports == {
        "radixserve-gateway": [GatewayConfig().port],
        "radixserve-tokenizer": [TokenizerConfig().metrics_port],
        "radixserve-worker": [WorkerServiceConfig().metrics_port],
        "radixserve-detokenizer": [DetokenizerConfig().metrics_port],
    }


def test_every_metric_on_the_dashboard_is_exported_with_the_labels_it_uses() -> None:
    exprs = dashboard_exprs()
    exported = exported_metrics()
    used = {name for expr in exprs for name in re.findall(r"\brs_[a-z0-9_]+", expr)}
    assert len(used) >= 15
    assert used <= set(exported), f"not exported by any service: {sorted(used - set(exported))}"
    # Each expression groups and selects only by labels every metric in it has (model_name, le, ...).
    for expr in exprs:
        for name in re.findall(r"\brs_[a-z0-9_]+", expr):
            assert expr_labels(expr) <= exported[name], (expr, name, sorted(exported[name]))
    # And the checks can fail: a misspelt name, a label a metric lacks.
    assert "rs_worker_kv_usage_ratio" not in exported
    assert not expr_labels('sum by (model_name, gpu) (rs_worker_kv_usage{model_name=~"$model_name"})') <= exported[
        "rs_worker_kv_usage"]


def test_every_rs_metric_carries_model_name() -> None:
    exported = exported_metrics()
    rs = {name: labels for name, labels in exported.items() if name.startswith("rs_")}
    assert len(rs) > 40
    assert {name for name, labels in rs.items() if "model_name" not in labels} == set()


def test_the_dashboard_shows_sglangs_scheduler_metrics() -> None:
    """Throughput, KV tokens used and total, queue time, retractions and the speculative accept length
    gauge each have a panel, filtered by the dashboard's model_name variable."""
    exprs = dashboard_exprs()
    for name in ("rs_worker_gen_throughput", "rs_worker_num_used_tokens", "rs_worker_max_total_num_tokens",
                 "rs_worker_queue_time_seconds_bucket", "rs_worker_retractions_total",
                 "rs_worker_spec_accept_length_recent"):
        assert any(name in expr for expr in exprs), name
    assert all('model_name=~"$model_name"' in expr for expr in exprs)
