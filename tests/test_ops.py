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
suffixes = {"counter": ["_total", "_created"], "histogram": ["_bucket", "_sum", "_count", "_created"],
            "gauge": [""], "summary": ["_sum", "_count", "_created"]}
names = set()
for registry in (REGISTRY, gateway.registry):
    for family in registry.collect():
        names.update(family.name + s for s in suffixes.get(family.type, [""]))
print(json.dumps(sorted(names)))
"""


def exported_metric_names() -> set[str]:
    done = subprocess.run([sys.executable, "-c", EXPORTED], capture_output=True, text=True, timeout=120,
                          cwd=OPS.parent)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def test_prometheus_scrapes_each_service_on_its_default_port() -> None:
    config = yaml.safe_load((OPS / "prometheus.yml").read_text())
    ports = {job["job_name"]: [c["port"] for c in job["dns_sd_configs"]] for job in config["scrape_configs"]}
    assert ports == {
        "radixserve-gateway": [GatewayConfig().port],
        "radixserve-tokenizer": [TokenizerConfig().metrics_port],
        "radixserve-worker": [WorkerServiceConfig().metrics_port],
        "radixserve-detokenizer": [DetokenizerConfig().metrics_port],
    }


def test_every_metric_on_the_dashboard_is_exported() -> None:
    dashboard = json.loads((OPS / "grafana" / "radixserve.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"\brs_[a-z0-9_]+", expr)}
    assert len(used) >= 15
    exported = exported_metric_names()
    assert used <= exported, f"not exported by any service: {sorted(used - exported)}"
    # And the check can fail: a misspelt name is caught.
    assert "rs_worker_kv_usage_ratio" not in exported
