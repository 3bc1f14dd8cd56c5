"""FP8-resident weights (layers/fp8_weights.py) on the CPU, where the FP8 product is the dequantizing
reference: an FP8 checkpoint kept in FP8 against the same checkpoint dequantized at load, and
`--quantization fp8` on bf16/f32 checkpoints against a naive quantize -> dequantize of their weights."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from services.worker.config import EngineConfig
from services.worker.frontend.engine import Engine
from services.worker.runtime import distributed
from services.worker.runtime.distributed import TPGroup, destroy_tp, init_tp
from services.worker.runtime.layers.fp8 import dequantize_blocks
from services.worker.runtime.layers.fp8_weights import weight_bytes
from services.worker.runtime.model_config import ModelConfig
from services.worker.runtime.model_loader import load_model
from tests.checkpoints import tiny_qwen3_config, tiny_qwen3_moe_config, write_checkpoint
from tests.engine_helpers import GREEDY, random_prompts
from tests.forward_helpers import BatchDriver, assert_rows_close
from tests.fp8_helpers import quantize_blocks, write_fp8_pair
from tests.services_helpers import free_port

PROMPT = [12, 250, 7, 99, 31, 160, 4, 288, 55, 73, 19, 140, 201, 8]
DECODE_STEPS = 8
# The resident path multiplies by exactly the dequantized weights, in float32 like the float32 model,
# so only the order of the sums may differ.
REL_TOL = 1e-5


def run_greedy(model: nn.Module, config: ModelConfig, prompt: list[int] = PROMPT) -> dict[str, object]:
    """Prefill (all logits) and DECODE_STEPS greedy decode steps on a BatchDriver."""
    driver = BatchDriver(model, config)
    row = driver.new_request()
    prefill = driver.extend([(row, prompt)], return_all_logits=True)
    tokens, logits = driver.greedy_decode(row, int(prefill[-1].argmax()), DECODE_STEPS)
    return {"prefill": prefill, "decode": torch.stack(logits), "tokens": tokens}


def assert_same_run(ours: dict[str, object], ref: dict[str, object]) -> None:
    assert_rows_close(ours["prefill"], ref["prefill"], rel_tol=REL_TOL)
    assert_rows_close(ours["decode"], ref["decode"], rel_tol=REL_TOL)
    assert ours["tokens"] == ref["tokens"]


def fp8_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p for name, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn}


def load(path: Path, **kwargs: object) -> tuple[nn.Module, ModelConfig]:
    config = ModelConfig.from_path(path, **kwargs)
    return load_model(config, "cpu"), config


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def fp8_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(FP8 checkpoint in 16x16 blocks, the plain checkpoint of its dequantized weights)."""
    original = request.getfixturevalue(f"{request.param}_path")
    return write_fp8_pair(original, tmp_path_factory.mktemp(f"fp8_{request.param}"), (16, 16))


@pytest.fixture(scope="module")
def fp8_moe_pair(qwen3_moe_path: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The Qwen3-MoE fp8_pair alone: it has every kind of FP8 layer (fused q/k/v and gate/up, row-parallel,
    experts) for the slower tests that need only one model."""
    return write_fp8_pair(qwen3_moe_path, tmp_path_factory.mktemp("fp8_moe"), (16, 16))


# -- an FP8 checkpoint, resident ----------------------------------------------------------------------


def test_resident_fp8_checkpoint_matches_dequantized_at_load(fp8_pair: tuple[Path, Path]) -> None:
    fp8_dir, deq_dir = fp8_pair
    resident, config = load(fp8_dir, quantization="fp8")
    dequantized, deq_config = load(fp8_dir)
    assert (
        config.quantization.resident and not deq_config.quantization.resident
    )  # CPU: dequantized by default
    ref = dict(dequantized.named_parameters())
    quantized = fp8_params(resident)
    # The checkpoint's quantized weights, fused (q/k/v, gate/up, experts) and no others (router, norms, heads).
    assert set(quantized) == {n for n in ref if n.endswith(("_proj.weight", ".w13_weight", ".w2_weight"))}
    params = dict(resident.named_parameters())
    for name, weight in quantized.items():
        block = (16, 16)
        assert torch.equal(dequantize_blocks(weight, params[name + "_scale_inv"], block), ref[name]), name
    assert_same_run(run_greedy(resident, config), run_greedy(dequantized, deq_config))


def engine_run(path: Path, **kwargs: object) -> tuple[int, list[list[int]], list[float]]:
    """An Engine on `path`: (its weight bytes, greedy tokens of 3 prompts x 12, their prompt log-probs)."""
    prompts = random_prompts(3, 6, 20, seed=5)
    with Engine(str(path), **kwargs) as engine:
        size = engine.get_server_info()["weight_bytes"]
        greedy = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 12})
        scored = engine.generate(
            input_ids=prompts,
            sampling_params={**GREEDY, "max_new_tokens": 1},
            return_logprob=True,
            logprob_start_len=0,
        )
    logprobs = [lp for out in scored for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]]
    return size, [out["output_ids"] for out in greedy], logprobs


def test_engine_with_quantization_fp8_serves_the_fp8_weights(fp8_moe_pair: tuple[Path, Path]) -> None:
    """Through the Engine (EngineConfig.quantization -> the scheduler's ModelConfig): the same greedy tokens
    and prompt log-probs as the dequantized-at-load default."""
    size, tokens, logprobs = engine_run(fp8_moe_pair[0], quantization="fp8")
    ref_size, ref_tokens, ref_logprobs = engine_run(fp8_moe_pair[0])
    assert tokens == ref_tokens
    assert logprobs == pytest.approx(ref_logprobs, abs=1e-4)
    assert size < ref_size  # the worker reports the FP8 model's smaller weights


# -- --quantization fp8 on an unquantized checkpoint ----------------------------------------------------


@pytest.fixture(scope="module", params=["qwen3-f32", "qwen3-bf16", "qwen3_moe-f32", "qwen3_moe-bf16"])
def plain_checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, dtype = request.param.split("-")
    config = tiny_qwen3_config() if model == "qwen3" else tiny_qwen3_moe_config()
    path = tmp_path_factory.mktemp(request.param)
    return write_checkpoint(path, config, seed=3, dtype=torch.float32 if dtype == "f32" else torch.bfloat16)


def naive_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """tests/fp8_helpers.py's block-by-block quantizer, expert by expert for stacked experts."""
    if weight.dim() == 2:
        return quantize_blocks(weight.float(), block)
    pairs = [quantize_blocks(w.float(), block) for w in weight]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def test_quantization_fp8_quantizes_a_plain_checkpoint_at_load(plain_checkpoint: Path) -> None:
    """Every linear and expert weight becomes the naive quantizer's fp8 values and scales (128x128 blocks
    over this rank's fused matrix), and the model runs like the unquantized one holding those weights
    dequantized. Greedy agreement with the unquantized model is reported, not asserted."""
    ours, config = load(plain_checkpoint, quantization="fp8")
    assert config.quantization.block_size == (128, 128) and not config.quantization.from_checkpoint
    reference, ref_config = load(plain_checkpoint)
    unquantized = {name: p.detach().clone() for name, p in reference.named_parameters()}
    params = dict(ours.named_parameters())
    quantized = fp8_params(ours)
    assert set(quantized) == {
        n for n in unquantized if n.endswith(("_proj.weight", ".w13_weight", ".w2_weight"))
    }
    ref_params = dict(reference.named_parameters())
    for name, weight in quantized.items():
        values, scale = naive_fp8(unquantized[name], (128, 128))
        assert torch.equal(weight.float(), values.float()), name
        assert torch.equal(params[name + "_scale_inv"], scale), name
        with torch.no_grad():
            ref_params[name].copy_(dequantize_blocks(values, scale, (128, 128)))
    run = run_greedy(ours, config)
    assert_same_run(run, run_greedy(reference, ref_config))
    with torch.no_grad():
        for name, value in unquantized.items():
            ref_params[name].copy_(value)
    plain = run_greedy(reference, ref_config)
    top1 = (run["prefill"].argmax(-1) == plain["prefill"].argmax(-1)).float().mean().item()
    same = next(
        (i for i, (a, b) in enumerate(zip(run["tokens"], plain["tokens"])) if a != b), len(plain["tokens"])
    )
    drift = ((run["prefill"] - plain["prefill"]).norm(dim=-1) / plain["prefill"].norm(dim=-1)).max().item()
    print(
        f"\n{plain_checkpoint.name} --quantization fp8 vs unquantized: top-1 equal at {top1:.0%} of the prompt's "
        f"positions, greedy tokens equal for the first {same} of {len(plain['tokens'])}, prompt logits' largest "
        f"relative change {drift:.3f}"
    )
    assert drift > 0  # the weights did change


def test_fp8_weights_take_half_of_bf16_and_a_quarter_of_f32(qwen3_moe_path: Path) -> None:
    """Each quantized layer's parameters: one byte per weight plus a float32 scale per 128x128 block."""
    sizes = {
        label: dict(load(qwen3_moe_path, dtype=dtype, quantization=quant)[0].named_parameters())
        for label, dtype, quant in (
            ("f32", "float32", None),
            ("bf16", "bfloat16", None),
            ("fp8", "bfloat16", "fp8"),
        )
    }
    fp8 = sizes["fp8"]
    for name, weight in fp8_params(load(qwen3_moe_path, quantization="fp8")[0]).items():
        *lead, n, k = weight.shape
        scales = math.prod(lead) * math.ceil(n / 128) * math.ceil(k / 128)
        ours = fp8[name].numel() + fp8[name + "_scale_inv"].numel() * 4
        assert ours == weight.numel() + 4 * scales
        bf16, f32 = (
            sizes[label][name].numel() * sizes[label][name].element_size() for label in ("bf16", "f32")
        )
        assert 0.5 <= ours / bf16 <= 0.51 and 0.25 <= ours / f32 <= 0.26, (name, ours, bf16, f32)
    models = {
        label: load(qwen3_moe_path, dtype=d, quantization=q)[0]
        for label, d, q in (("bf16", "bfloat16", None), ("fp8", "bfloat16", "fp8"))
    }
    assert weight_bytes(models["fp8"]) < weight_bytes(models["bf16"])


# -- tensor parallel ----------------------------------------------------------------------------------

TP_SIZE = 2
SPAWN_DEADLINE_S = 120


def _tp_rank_main(rank: int, port: int, path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_tp(rank, TP_SIZE, f"tcp://127.0.0.1:{port}", torch.device("cpu"))
    try:
        config = ModelConfig.from_path(path, quantization="fp8")
        model = load_model(config, "cpu")
        assert fp8_params(model), "the ranks hold FP8 weights"
        driver = BatchDriver(model, config, tp_size=TP_SIZE)
        row = driver.new_request()
        prefill = driver.extend([(row, PROMPT)], return_all_logits=True)
        tokens, logits = driver.greedy_decode(row, int(prefill[-1].argmax()), DECODE_STEPS)
        torch.save(
            {"prefill": prefill, "decode": torch.stack(logits), "tokens": tokens},
            Path(out_dir) / f"rank{rank}.pt",
        )
    finally:
        destroy_tp()


def test_tp2_with_resident_fp8_weights_matches_tp1(fp8_moe_pair: tuple[Path, Path], tmp_path: Path) -> None:
    """TP=2 (gloo): each rank copies its 16-row/column-aligned slices of the fp8 weights and scales (q/k/v
    and gate/up shards, row-parallel columns, the experts' intermediate rows and columns)."""
    reference = run_greedy(*load(fp8_moe_pair[0], quantization="fp8"))
    context = mp.spawn(
        _tp_rank_main, args=(free_port(), str(fp8_moe_pair[0]), str(tmp_path)), nprocs=TP_SIZE, join=False
    )
    deadline = time.monotonic() + SPAWN_DEADLINE_S
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"TP ranks did not finish within {SPAWN_DEADLINE_S} s")
    for rank in range(TP_SIZE):
        assert_same_run(torch.load(tmp_path / f"rank{rank}.pt"), reference)


# -- bad input ----------------------------------------------------------------------------------------


def test_an_unknown_quantization_is_refused(qwen3_path: Path) -> None:
    with pytest.raises(ValueError, match=r"quantization must be one of \('fp8',\) or None, got 'awq'"):
        EngineConfig(model_path="unused", quantization="awq")
    with pytest.raises(ValueError, match="quantization='int8' is not supported"):
        ModelConfig.from_path(qwen3_path, quantization="int8")


def test_a_tp_split_off_the_fp8_blocks_is_refused(
    fp8_pair: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 of TP=2 with 24-row blocks: its slices start mid-block (down_proj's columns [64, 128), the
    experts' rows [16, 32), q's rows [32, 64)). The layers are built as that rank builds them (no process
    group is needed before the first all-reduce)."""
    fp8_dir, _ = write_fp8_pair(fp8_pair[1], tmp_path, (24, 24))
    monkeypatch.setattr(distributed, "_GROUP", TPGroup(rank=1, size=2))
    with pytest.raises(
        ValueError,
        match=r"this rank's (rows|columns) \[\d+, \d+\) of \d+ do not align "
        r"with the FP8 weight_block_size 24: the tensor-parallel split must fall on block boundaries",
    ):
        load(fp8_dir, quantization="fp8")


def test_fused_shards_off_the_fp8_blocks_are_refused(fp8_pair: tuple[Path, Path], tmp_path: Path) -> None:
    """One rank, 24-row blocks: q fills rows [0, 64) of the fused q/k/v matrix, so k would start mid-block
    (gate_up's up at 128, an expert's up at 32).
    The default CPU path (dequantized at load) still runs such a checkpoint."""
    fp8_dir, _ = write_fp8_pair(fp8_pair[1], tmp_path, (24, 24))
    with pytest.raises(
        ValueError,
        match=r"shard ('k'|1|'w3') starts at row (64|128|32) of the fused FP8 matrix, not "
        r"on a boundary of its 24-row blocks",
    ):
        load(fp8_dir, quantization="fp8")
    load(fp8_dir)
