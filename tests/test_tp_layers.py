"""Tensor parallelism: two gloo ranks (two processes) give the same logits and greedy tokens as one.

Exercises head-split QKV, replicated KV heads (a 1-KV-head model), row-parallel all-reduce,
vocab-parallel embedding and LM head (300 ids padded and split unevenly), and MoE experts split by
intermediate dimension.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from services.worker.runtime.distributed import destroy_tp, init_tp
from services.worker.runtime.model_config import ModelConfig
from services.worker.runtime.model_loader import load_model
from tests.forward_helpers import BatchDriver, assert_rows_close
from tests.services_helpers import free_port

TP_SIZE = 2
DECODE_STEPS = 6
# Far above the few seconds a run takes, even on a loaded machine.
SPAWN_DEADLINE_S = 120
PROMPT = [12, 250, 7, 99, 31, 160, 4, 288, 55, 73, 19, 140, 201, 8]


def run_model(path: Path, tp_size: int) -> dict[str, object]:
    """Prefill PROMPT (all logits), then greedy-decode DECODE_STEPS tokens on this process's TP rank."""
    config = ModelConfig.from_path(path)
    driver = BatchDriver(load_model(config, "cpu"), config, tp_size=tp_size)
    row = driver.new_request()
    prefill = driver.extend([(row, PROMPT)], return_all_logits=True)
    tokens, logits = driver.greedy_decode(row, int(prefill[-1].argmax()), DECODE_STEPS)
    return {"prefill": prefill, "decode": torch.stack(logits), "tokens": tokens}


def _tp_rank_main(rank: int, port: int, path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_tp(rank, TP_SIZE, f"tcp://127.0.0.1:{port}", torch.device("cpu"))
    try:
        torch.save(run_model(Path(path), TP_SIZE), Path(out_dir) / f"rank{rank}.pt")
    finally:
        destroy_tp()


def run_tp2(path: Path, out_dir: Path) -> list[dict[str, object]]:
    """Run both ranks in spawned processes; a rank that hangs fails the test instead of blocking it."""
    context = mp.spawn(_tp_rank_main, args=(free_port(), str(path), str(out_dir)), nprocs=TP_SIZE, join=False)
    deadline = time.monotonic() + SPAWN_DEADLINE_S
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"TP ranks did not finish within {SPAWN_DEADLINE_S} s")
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(TP_SIZE)]


@pytest.mark.parametrize("fixture", ["qwen3_path", "qwen3_one_kv_head_path", "qwen3_moe_path"])
def test_tp2_matches_tp1_logits_and_greedy_tokens(
    fixture: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    path: Path = request.getfixturevalue(fixture)
    reference = run_model(path, tp_size=1)
    ranks = run_tp2(path, tmp_path)
    for result in ranks:
        assert result["prefill"].shape == reference["prefill"].shape
        assert_rows_close(result["prefill"], reference["prefill"], rel_tol=1e-5)
        assert_rows_close(result["decode"], reference["decode"], rel_tol=1e-5)
        assert result["tokens"] == reference["tokens"]
    # Every rank returns the full, identical logits (the scheduler samples on each rank).
    assert torch.equal(ranks[0]["prefill"], ranks[1]["prefill"])
