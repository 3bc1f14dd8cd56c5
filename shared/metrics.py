"""Prometheus helpers every service uses: the metrics HTTP server, shared histogram buckets, and the
`model_name` label's value.

Metric names start with `rs_` and the service (`rs_tokenizer_...`, `rs_worker_...`); each service
declares its own metrics in its package, on the registry passed here (the default one in a service
process, so the process and Python collectors come along). Every rs_ metric carries a `model_name`
label, as vLLM's do: the served model name (docs/API.md maps each to its sglang:/vllm: name).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

from shared.model_path import default_model_dir, is_hub_id, models_dir

logger = logging.getLogger(__name__)

MODEL_LABEL = "model_name"


def model_label(model_path: str | None) -> str:
    """The `model_name` a tokenizer or detokenizer labels its metrics with: the name a worker serves
    `model_path` under by default (shared.model_path.served_name: a hub id as given, else the model
    directory's name), found without reading the model."""
    if not model_path:
        return default_model_dir().name
    path = Path(model_path).expanduser()
    if is_hub_id(model_path) and not path.is_dir() and not (models_dir() / model_path).is_dir():
        return model_path
    return path.name


# Handling one NATS message: tens of microseconds (a small batch) to tens of milliseconds.
MESSAGE_LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
)
# Request-level latencies (TTFT, end to end): milliseconds on a GPU to minutes for long CPU generations.
REQUEST_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)
# Time between two tokens of one stream.
INTER_TOKEN_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5,
)


@dataclass
class MetricsServer:
    """A running /metrics endpoint."""

    host: str
    port: int
    _server: WSGIServer
    _thread: threading.Thread

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def start_metrics_server(
    port: int | None, host: str = "0.0.0.0", registry: CollectorRegistry = REGISTRY
) -> MetricsServer | None:
    """Serve `registry` at http://host:port/metrics (port 0: any free port, logged); None: no server."""
    if port is None:
        return None
    server, thread = start_http_server(port, addr=host, registry=registry)
    bound = int(server.server_port)
    logger.info("metrics at http://%s:%d/metrics", host, bound)
    return MetricsServer(host, bound, server, thread)
