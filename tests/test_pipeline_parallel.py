"""Pipeline parallelism on CPU with gloo: stages give the logits and greedy tokens of one process.

Model level (PP=2, the stages chained in one process): each stage's model holds only its layers (the
first the embedding, the last the norm and LM head; a tied head its own embedding copy) and runs on a
KV pool of its layers; prefill, a chunked extend over a cached prefix and decodes give the last stage
the logits of the one-process model, for Qwen3, Llama (tied) and Qwen3-MoE (3 layers: stages of 2, 1).
Engine level (rank processes over gloo): PP=2 and PP=2 x TP=2 engines give the greedy tokens of a TP=1
engine, with chunked prefill, a prefix cache hit, an abort and retraction (a small KV pool), steps of
several requests going through as two micro-batches, and the last stage's prompt log-probs reach rank 0. Bad configurations fail at start with a clear error.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.worker.config import EngineConfig
from services.worker.frontend.engine import Engine
from services.worker.frontend.scheduler_loop import group_fingerprint
from services.worker.mem.memory_pool import TokenToKVPool
from services.worker.runtime import distributed
from services.worker.runtime.forward_batch import ForwardBatch
from services.worker.runtime.model_config import ModelConfig
from services.worker.runtime.model_loader import load_model
from services.worker.runtime.pipeline import stage_layers
from tests.engine_helpers import GREEDY, output_ids, random_prompts
from tests.forward_helpers import BatchDriver, run_mixed_steps
from tests.services_helpers import free_port_pair

PP_SIZE = 2
REPO = Path(__file__).resolve().parent.parent
# One Engine option set for the pipelined engines and their TP=1 reference: 8-token prefill chunks and
# a KV pool small enough that 16 requests of 40 tokens retract.
SMALL = {
    "dtype": "float32", "device": "cpu", "chunked_prefill_size": 8, "max_total_tokens": 160, "cpu_threads": 1,
    "cpu_weight_prepack": False,
}


# ---- model level: each stage's model, chained in one process -------------------------------------


def assert_close(ours: torch.Tensor, ref: torch.Tensor, rel_tol: float = 1e-5) -> None:
    rel = (ours - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert rel.max().item() <= rel_tol, f"relative error per row: {rel.tolist()}"


def stage_model(path: Path, stage: int, monkeypatch: pytest.MonkeyPatch) -> torch.nn.Module:
    """The model as pipeline stage `stage` of PP_SIZE builds and loads it (the process group's stage
    is set as init_tp sets it; the activations are handed over in-process here, and through gloo in
    the engine tests below)."""
    monkeypatch.setattr(distributed, "_PP", distributed.PPGroup(rank=stage, size=PP_SIZE))
    try:
        return load_model(ModelConfig.from_path(path), "cpu")
    finally:
        monkeypatch.undo()


def stage_drivers(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, BatchDriver], list[dict[str, int]]]:
    """Drivers of the one-process model ("reference") and of each stage ("stage0", ...: each with a KV
    pool of its own layers only, the last returning logits), run in that order on each step; and each
    stage's parameter sizes by name."""
    config = ModelConfig.from_path(path)
    drivers = {"reference": BatchDriver(load_model(config, "cpu"), config)}
    handed: list[tuple[torch.Tensor, torch.Tensor] | None] = [None]
    params = []
    for stage in range(PP_SIZE):
        model = stage_model(path, stage, monkeypatch)
        params.append({name: p.numel() for name, p in model.named_parameters()})
        driver = BatchDriver(model, config)
        own = stage_layers(config.num_layers, stage, PP_SIZE)
        driver.kv_pool = TokenToKVPool(512, len(own), config.num_kv_heads, config.head_dim, config.dtype, "cpu")

        def run(ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch, model=model, stage=stage):
            proxy = handed[0] if stage > 0 else None
            out = model(ids, positions, batch) if proxy is None else model(ids, positions, batch, proxy)
            if stage < PP_SIZE - 1:
                handed[0] = out
                return None
            return out

        driver.model = run  # type: ignore[assignment]
        drivers[f"stage{stage}"] = driver
    return drivers, params


def test_stage_layers_split_contiguously_and_refuse_more_stages_than_layers() -> None:
    assert [stage_layers(3, s, 2) for s in range(2)] == [range(0, 2), range(2, 3)]
    assert [stage_layers(10, s, 4) for s in range(4)] == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    with pytest.raises(ValueError, match="pp_size 3 needs at least as many decoder layers; the model has 2"):
        stage_layers(2, 0, 3)


@pytest.mark.parametrize("fixture", ["qwen3_path", "llama_path", "qwen3_moe_path"])
def test_each_stage_holds_its_layers_and_the_last_gets_one_process_logits(
    fixture: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    path: Path = request.getfixturevalue(fixture)
    config = ModelConfig.from_path(path)
    drivers, (first, last) = stage_drivers(path, monkeypatch)
    full = {name: p.numel() for name, p in drivers["reference"].model.named_parameters()}
    for stage, params in enumerate((first, last)):
        layers = {int(name.split(".")[2]) for name in params if name.startswith("model.layers.")}
        assert layers == set(stage_layers(config.num_layers, stage, PP_SIZE))
        assert all(params[name] == full[name] for name in params)
    assert "model.embed_tokens.weight" in first and not any(n.startswith(("model.norm.", "lm_head.")) for n in first)
    assert "model.norm.weight" in last
    # A tied head keeps the embedding on the last stage; an untied one loads lm_head there instead.
    assert ("model.embed_tokens.weight" in last) == config.tie_word_embeddings
    assert ("lm_head.weight" in last) != config.tie_word_embeddings
    assert set(first) | set(last) == set(full)

    steps: list[dict[str, torch.Tensor]] = []
    run_mixed_steps(drivers, steps.append)
    assert len(steps) == 5
    for logits in steps:
        assert logits["stage0"] is None
        assert logits["stage1"].shape == logits["reference"].shape
        assert_close(logits["stage1"], logits["reference"])
        assert torch.equal(logits["stage1"].argmax(-1), logits["reference"].argmax(-1))


# ---- engine level ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(qwen3_path: Path) -> Iterator[Engine]:
    with Engine(str(qwen3_path), dtype="float32", device="cpu") as engine:
        yield engine


@pytest.fixture(scope="module")
def pp2(qwen3_path: Path) -> Iterator[Engine]:
    with Engine(str(qwen3_path), pp_size=PP_SIZE, **SMALL) as engine:
        yield engine


def greedy(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    return output_ids(engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": n}))


def stats(engine: Engine) -> dict[str, int]:
    return engine.get_server_info()["stats"]


def test_pp2_greedy_tokens_match_tp1_with_chunked_prefill(pp2: Engine, reference: Engine) -> None:
    prompts = random_prompts(4, 5, 30, seed=21)
    long_prompt = random_prompts(1, 40, 40, seed=22)
    before = stats(pp2)["num_prefill_steps"]
    assert greedy(pp2, long_prompt, 6) == greedy(reference, long_prompt, 6)
    assert stats(pp2)["num_prefill_steps"] - before == 5  # 40 prompt tokens in chunks of 8
    assert greedy(pp2, prompts, 12) == greedy(reference, prompts, 12)


def test_pp2_steps_of_several_requests_go_as_two_micro_batches(pp2: Engine, reference: Engine) -> None:
    prompts = random_prompts(4, 2, 2, seed=28)
    before = stats(pp2)
    assert greedy(pp2, prompts, 10) == greedy(reference, prompts, 10)
    after = stats(pp2)
    steps = after["num_steps"] - before["num_steps"]
    split = after["num_micro_batches"] - before["num_micro_batches"] - steps  # steps that went as 2
    # The requests may reach the scheduler over a step or two, but most steps run several of them.
    assert 5 <= split <= steps
    # A lone request stays whole.
    assert greedy(pp2, prompts[:1], 3) == greedy(reference, prompts[:1], 3)
    assert stats(pp2)["num_micro_batches"] - after["num_micro_batches"] == stats(pp2)["num_steps"] - after["num_steps"]


def test_pp2_prefix_cache_hit_gives_the_same_tokens(pp2: Engine, reference: Engine) -> None:
    shared = random_prompts(1, 24, 24, seed=23)[0]
    prompts = random_prompts(3, 2, 6, seed=24, prefix=shared)
    params = {**GREEDY, "max_new_tokens": 8}
    first = pp2.generate(input_ids=prompts[0], sampling_params=params)
    rest = pp2.generate(input_ids=prompts[1:], sampling_params=params)
    assert all(r["meta_info"]["cached_tokens"] >= 24 for r in rest)
    assert [first["output_ids"], *output_ids(rest)] == greedy(reference, prompts, 8)


def test_pp2_abort_ends_a_request_on_every_stage(pp2: Engine, reference: Engine) -> None:
    result: dict = {}
    worker = threading.Thread(
        target=lambda: result.update(
            pp2.generate(input_ids=[3, 4, 5], sampling_params={**GREEDY, "max_new_tokens": 120}, rid="pp-long")
        )
    )
    worker.start()
    while pp2.get_server_info()["num_running"] == 0:
        time.sleep(0.01)
    pp2.abort("pp-long")
    worker.join(timeout=60)
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(result["output_ids"]) < 120
    info = pp2.get_server_info()
    assert info["num_running"] == 0 and info["kv_in_use"] == 0
    # The stages are still in step: the next request decodes as on one process.
    prompt = random_prompts(1, 10, 10, seed=25)
    assert greedy(pp2, prompt, 8) == greedy(reference, prompt, 8)


def test_pp2_small_pool_retracts_and_still_matches_tp1(pp2: Engine, reference: Engine) -> None:
    prompts = random_prompts(16, 10, 20, seed=6)
    before = stats(pp2)["num_retractions"]
    got = greedy(pp2, prompts, 40)
    assert stats(pp2)["num_retractions"] > before
    assert got == greedy(reference, prompts, 40)


def test_pp2_prompt_logprobs_come_from_the_last_stage(pp2: Engine, reference: Engine) -> None:
    prompt = random_prompts(1, 12, 12, seed=26)[0]
    kwargs = {"input_ids": prompt, "sampling_params": {**GREEDY, "max_new_tokens": 3}, "return_logprob": True,
              "top_logprobs_num": 2, "logprob_start_len": 0}
    ours, ref = pp2.generate(**kwargs)["meta_info"], reference.generate(**kwargs)["meta_info"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        assert [t[1] for t in ours[key]] == [t[1] for t in ref[key]]
        got = [t[0] for t in ours[key] if t[0] is not None]
        want = [t[0] for t in ref[key] if t[0] is not None]
        assert got == pytest.approx(want, abs=1e-4)
    assert [[i for _, i, *_ in row] for row in ours["input_top_logprobs"][1:]] == [
        [i for _, i, *_ in row] for row in ref["input_top_logprobs"][1:]
    ]


def test_pp2_tp2_greedy_tokens_match_tp1(qwen3_path: Path, reference: Engine) -> None:
    prompts = random_prompts(3, 5, 30, seed=27)
    with Engine(str(qwen3_path), pp_size=PP_SIZE, tp_size=2, **SMALL) as engine:
        assert engine.get_server_info()["max_total_tokens"] == SMALL["max_total_tokens"]
        got = greedy(engine, prompts, 10)
    assert got == greedy(reference, prompts, 10)


def test_pp2_over_two_nodes_matches_tp1(qwen3_path: Path, reference: Engine) -> None:
    """Stage 1 on "node 1" (a `radixserve worker --node-rank 1` process, no NATS), stage 0 on node 0;
    both nodes take the same scheduling flags (the ranks compare them). Node 0's pool (160 tokens) is
    the smaller, so the group's."""
    port = free_port_pair()  # the nodes' heartbeats take the next port
    prompts = random_prompts(2, 5, 20, seed=29)
    other = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "worker", "--model-path", str(qwen3_path), "--pp-size", "2",
         "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", f"127.0.0.1:{port}", "--dist-timeout", "60",
         "--device", "cpu", "--dtype", "float32", "--no-cpu-weight-prepack", "--chunked-prefill-size", "8"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        with Engine(str(qwen3_path), pp_size=2, nnodes=2, node_rank=0, dist_init_addr=f"127.0.0.1:{port}",
                    dist_timeout=60, **SMALL) as engine:
            assert engine.get_server_info()["max_total_tokens"] == SMALL["max_total_tokens"]
            got = greedy(engine, prompts, 8)
        out, _ = other.communicate(timeout=60)
    finally:
        if other.poll() is None:
            other.kill()
        other.wait()
    assert got == greedy(reference, prompts, 8)
    assert other.returncode == 0, out
    assert "pp_size 2 x tp_size 1: global ranks 1-1 of 2" in out and "the TP group ended (node 0 shut it down)" in out


# ---- configurations refused at start -----------------------------------------------------------


def test_bad_pipeline_configs_fail_at_start(qwen3_path: Path, qwen3_5_path: Path) -> None:
    with pytest.raises(ValueError, match="pp_size 3 is larger than the model's 2 decoder layers"):
        Engine(str(qwen3_path), pp_size=3)
    with pytest.raises(ValueError, match="speculative_algorithm='ngram' is not supported with pp_size 2"):
        EngineConfig(model_path=str(qwen3_path), pp_size=2, speculative_algorithm="ngram")
    with pytest.raises(ValueError, match="pp_size 2 is not supported for Qwen3_5ForCausalLM"):
        EngineConfig(model_path=str(qwen3_5_path), pp_size=2)
    with pytest.raises(ValueError, match="pp_size must be >= 1, got 0"):
        EngineConfig(model_path=str(qwen3_path), pp_size=0)
    with pytest.raises(ValueError, match="pp_size x tp_size 2 is not divisible by nnodes 4"):
        EngineConfig(model_path=str(qwen3_path), pp_size=2, nnodes=4, dist_init_addr="127.0.0.1:5000")
    # Ranks per node count every stage: 2 stages x 2 TP ranks over 2 nodes, node 1 runs global ranks 2-3.
    config = EngineConfig(model_path=str(qwen3_path), pp_size=2, tp_size=2, nnodes=2, node_rank=1,
                          dist_init_addr="127.0.0.1:5000")
    assert (config.world_size(), config.local_ranks()) == (4, range(2, 4))
    assert not config.overlap_enabled("cuda")


def test_ranks_with_other_scheduling_flags_do_not_agree(qwen3_path: Path) -> None:
    """Every rank replays the same scheduler: a node started with another chunk size or running limit
    would take other decisions, so the ranks' start-up comparison (check_same_everywhere) includes them."""
    model = ModelConfig.from_path(qwen3_path)
    base = EngineConfig(model_path=str(qwen3_path), pp_size=2)
    assert group_fingerprint(base, model) == group_fingerprint(base.replace(max_total_tokens=64, cpu_threads=1), model)
    for change in ({"chunked_prefill_size": 8}, {"max_running_requests": 4}, {"schedule_policy": "lpm"},
                   {"pp_size": 1}, {"disable_radix_cache": True}):
        assert group_fingerprint(base, model) != group_fingerprint(base.replace(**change), model), change
