"""`radixserve up` (what `make run` calls): starts NATS and every service, serves the default model at
the printed URL, and on SIGTERM stops everything it started. Here with two gateway processes sharing
the HTTP port (`--gateways 2`)."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx
import openai
import yaml

from tests.services_helpers import alive, children_of, free_port, start_up


def assert_every_metrics_port_answers(scrape_config: Path, gateways: int) -> None:
    """The Prometheus configuration `up` wrote lists each process's own metrics port under
    ops/prometheus.yml's job names (compose's, which adds the standalone detokenizer); each answers with
    its service's rs_ metrics, each with a model_name label."""
    config = yaml.safe_load(scrape_config.read_text())
    jobs = {job["job_name"]: [t for c in job["static_configs"] for t in c["targets"]] for job in config["scrape_configs"]}
    ops = yaml.safe_load((Path(__file__).resolve().parents[1] / "ops" / "prometheus.yml").read_text())
    assert set(jobs) == {job["job_name"] for job in ops["scrape_configs"]} - {"radixserve-detokenizer"}
    assert {job: len(targets) for job, targets in jobs.items()} == {
        "radixserve-gateway": gateways, "radixserve-tokenizer": 1, "radixserve-worker": 1}
    model = 'model_name="SmolLM2-135M-Instruct"'
    for job, targets in jobs.items():
        for target in targets:
            text = httpx.get(f"http://{target}/metrics", timeout=10).text
            services = ["worker", "detokenizer"] if job == "radixserve-worker" else [job.removeprefix("radixserve-")]
            for service in services:  # the worker's process runs its detokenizer
                samples = [line for line in text.splitlines() if line.startswith(f"rs_{service}_")]
                # Every sample has a model_name; a gateway's about no model (/health) have it empty.
                assert samples and all('model_name="' in line for line in samples), (target, service)
                assert any(model in line for line in samples), (target, service)
    # The gateways' own ports are distinct processes, not the shared HTTP port twice.
    assert len(set(jobs["radixserve-gateway"])) == gateways


def test_up_serves_the_default_model_and_stops_everything(default_model_path: Path, tmp_path: Path) -> None:
    port, grpc_port = free_port(), free_port()
    # An address nothing answers on: `up` must start its own nats-server.
    env = {**os.environ, "RS_NATS_URL": "nats://127.0.0.1:1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "up.out"
    proc = start_up(["--port", str(port), "--grpc-port", str(grpc_port),
             "--gateways", "2", "--run-dir", str(tmp_path / "run")], env, log)
    try:
        text = log.read_text()
        assert "started nats-server" in text
        url = re.search(r"radixserve is up: (http://\S+)", text).group(1)
        assert url == f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=24,
        )
        assert "Paris" in reply.choices[0].message.content
        # By default (--gateway-tokenizes short) the gateways tokenize short prompts themselves.
        for name in ("gateway", "gateway-1"):
            assert "itself up to 1024 characters" in (tmp_path / "run" / f"{name}.log").read_text()
        # New connections are spread over both gateways by the kernel (SO_REUSEPORT).
        answered_by = {httpx.get(f"{url}/health", timeout=10).headers["x-radixserve-gateway"] for _ in range(24)}
        assert len(answered_by) == 2, answered_by
        assert_every_metrics_port_answers(tmp_path / "run" / "prometheus.yml", gateways=2)
        started = children_of(proc.pid)
        assert len(started) >= 5  # nats-server, two gateways, tokenizer, worker
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    assert code == 0
    time.sleep(0.5)
    assert not [pid for pid in started if alive(pid)], "processes left behind"


def test_gateways_auto_is_one_per_four_cores_up_to_four_and_one_on_a_random_port() -> None:
    from services.launch import gateway_count

    assert [gateway_count("auto", 8000, cores) for cores in (1, 2, 7, 8, 16, 128)] == [1, 1, 1, 2, 4, 4]
    assert gateway_count("auto", 0, 16) == 1  # several gateways need a fixed port
    assert gateway_count("3", 8000) == 3
    assert gateway_count("three", 8000) == gateway_count("-2", 8000) == -1  # refused by run_up
