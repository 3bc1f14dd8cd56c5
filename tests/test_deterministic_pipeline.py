"""--enable-deterministic-inference through the service pipeline (issue 26): `radixserve up` with the flag on
the tiny seeded Qwen3 in bfloat16, 12 requests sent at once as native /generate calls with their ids (even
ones greedy, odd ones sampled with a seed), then the same burst again (the prompts now in the worker's
prefix cache), answer each with the tokens the offline Engine with the flag gives that request run alone.
`up` hands the flag to its worker as RS_ENABLE_DETERMINISTIC_INFERENCE, the worker's own command line
takes it as --enable-deterministic-inference, and `up` refuses a combination the worker would refuse
before it starts anything.

The control, measured where this was written (not asserted: it depends on how the bursts fall into the
worker's steps): a stack and an Engine without the flag gave 2 of the 12 requests other tokens than alone,
in each of 4 bursts on 2 stacks; a stack without the flag against the flag's lone runs (what this test
sees if the flag does not reach the worker) 6 of 12; with the flag, 0 in each of 6 bursts on 3 stacks."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
from pathlib import Path

import httpx
import pytest

from services.launch import add_up_commands, model_settings, run_up
from services.worker.frontend.engine import Engine
from services.worker.frontend.service_config import WorkerServiceConfig
from tests.engine_helpers import greedy_and_seeded, random_prompts
from tests.services_helpers import free_port, start_up

# 12, not 16: 16 rows is the shape the CPU's batch-invariant product always uses (CPU_ROW_BLOCK), so a
# flagless stack's batches of 16 multiply as the flag's do (with 16 requests it gave the flag's tokens).
PROMPTS = random_prompts(12, 5, 90, seed=26)
PARAMS = greedy_and_seeded(len(PROMPTS))
# Both sides: bfloat16 (where the ordinary products differ with the batch), one compute thread each.
ENGINE_OPTIONS = {"dtype": "bfloat16", "cpu_threads": 1, "max_total_tokens": 2048}


def up_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_up_commands(parser.add_subparsers())
    return parser.parse_args(["up", *argv])


def test_the_flag_reaches_the_worker_from_up_and_from_its_own_command_line(qwen3_path: Path) -> None:
    model = ["--model-path", str(qwen3_path)]
    engine, env = model_settings(up_args([*model, "--enable-deterministic-inference"]))
    assert engine.enable_deterministic_inference
    assert env["RS_ENABLE_DETERMINISTIC_INFERENCE"] == "True"
    # What `up` hands its worker in the environment builds an engine with the flag there.
    assert WorkerServiceConfig.from_args(None, env).engine.enable_deterministic_inference
    _, env = model_settings(up_args(model))
    assert not WorkerServiceConfig.from_args(None, env).engine.enable_deterministic_inference

    parser = argparse.ArgumentParser()
    WorkerServiceConfig.add_arguments(parser)
    on = WorkerServiceConfig.from_args(parser.parse_args([*model, "--enable-deterministic-inference"]), {})
    assert on.engine.enable_deterministic_inference
    off = WorkerServiceConfig.from_args(
        parser.parse_args([*model, "--no-enable-deterministic-inference"]),
        {"RS_ENABLE_DETERMINISTIC_INFERENCE": "1"},
    )
    assert not off.engine.enable_deterministic_inference  # the flag beats the variable


def test_up_refuses_what_deterministic_inference_cannot_keep_before_starting(
    qwen3_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "--model-path",
        str(qwen3_path),
        "--enable-deterministic-inference",
        "--kv-cache-dtype",
        "fp8",
        "--run-dir",
        str(tmp_path / "run"),
    ]
    assert run_up(up_args(argv)) == 2
    assert "enable_deterministic_inference needs kv_cache_dtype 'auto'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


async def _burst(url: str) -> list[list[int]]:
    """Every request at once, each its own /generate call, so the worker batches them as they come."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        replies = await asyncio.gather(
            *(
                client.post("/generate", json={"input_ids": prompt, "sampling_params": params})
                for prompt, params in zip(PROMPTS, PARAMS)
            )
        )
    for reply in replies:
        reply.raise_for_status()
    return [reply.json()["output_ids"] for reply in replies]


def test_pipeline_gives_each_request_the_tokens_it_gets_alone(qwen3_path: Path, tmp_path: Path) -> None:
    env = {**os.environ, "RS_NATS_URL": "nats://127.0.0.1:1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    run_dir = tmp_path / "run"
    proc = start_up(
        [
            "--model-path",
            str(qwen3_path),
            "--enable-deterministic-inference",
            "--dtype",
            "bfloat16",
            "--cpu-threads",
            "1",
            "--max-total-tokens",
            "2048",
            "--gateways",
            "1",
            "--port",
            str(free_port()),
            "--grpc-port",
            str(free_port()),
            "--run-dir",
            str(run_dir),
        ],
        env,
        tmp_path / "up.out",
    )
    try:
        url = re.search(r"radixserve is up: (http://\S+)", (tmp_path / "up.out").read_text()).group(1)
        bursts = [asyncio.run(_burst(url)) for _ in range(2)]
        # The worker's model runner switched its products (services/worker/runtime/model_runner.py).
        assert re.search(
            r"deterministic inference: [1-9]\d* modules use batch-invariant products",
            (run_dir / "worker-0.log").read_text(),
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    with Engine(str(qwen3_path), enable_deterministic_inference=True, **ENGINE_OPTIONS) as engine:
        alone = [
            engine.generate(input_ids=prompt, sampling_params=params)["output_ids"]
            for prompt, params in zip(PROMPTS, PARAMS)
        ]
    assert [len(ids) for ids in alone] == [p["max_new_tokens"] for p in PARAMS]
    assert bursts[0] == alone
    assert bursts[1] == alone, "the prompts from the prefix cache"
