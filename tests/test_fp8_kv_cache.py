"""--kv-cache-dtype fp8_e4m3 / fp8_e5m2: the offline Engine with a float8 KV pool (CPU: torch backend,
float32 model; the triton kernels' float8 paths are in tests/kernels/test_fp8_kv.py and
tests/kernels/test_triton_backend.py).

The reference is transformers on the same checkpoint with its attention replaced by naive float32
attention over K and V rounded to float8 (scale 1.0, clipped to the finite range, nearest even), the
cache's contract: every key and value a query sees, its own included, is the float8 value. Our RoPE
and transformers' differ in float32 last bits, which can tip a key across a float8 rounding boundary
(one float8 step, 6 % of that element), and so can the summation order of torch's fused CPU attention
kernel (the prompt pass uses it). Measured over these prompts: Qwen3's log-probs within 1.7e-3 of the
reference's (exactly equal with the unfused attention), Qwen3.5's within 7e-6; LOGPROB_TOL leaves room
for such tipped keys, while
float8 rounding itself moves the log-probs by 0.46-1.5 nats at most (asserted to exceed 10x LOGPROB_TOL).
"""

from __future__ import annotations

import shutil
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from transformers import AttentionInterface, AutoModelForCausalLM

from services.worker.config import EngineConfig
from services.worker.frontend.engine import Engine
from services.worker.mem.memory_pool import TokenToKVPool
from services.worker.runtime import model_runner
from services.worker.runtime.kv_scales import read_kv_scales
from tests.engine_helpers import GREEDY, hf_model, output_ids, random_prompts

KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
LOGPROB_TOL = 5e-3


def _float8_kv_attention(dtype: torch.dtype) -> Any:
    """transformers' attention-function signature: naive causal attention over float8-rounded K/V."""

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):  # noqa: ANN001, ANN202, ARG001
        top = torch.finfo(dtype).max
        key = key.float().clamp(-top, top).to(dtype).float()
        value = value.float().clamp(-top, top).to(dtype).float()
        group = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
        q_len, k_len = query.shape[2], key.shape[2]
        scores = query.float() @ key.transpose(-1, -2) * scaling
        causal = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        return (probs @ value).transpose(1, 2).contiguous(), None

    return attention


@lru_cache(maxsize=4)
def reference_model(path: str, kv_cache_dtype: str) -> torch.nn.Module:
    name = f"float8_kv_reference_{kv_cache_dtype}"
    AttentionInterface.register(name, _float8_kv_attention(KV_DTYPES[kv_cache_dtype]))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=name).eval()


@torch.no_grad()
def reference_logprobs(model: torch.nn.Module, prompt: list[int]) -> list[float]:
    """Teacher-forced log-probs of prompt[1:]."""
    logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()


@torch.no_grad()
def reference_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def engine_logprobs_and_greedy(
    path: Path, prompts: list[list[int]], n: int = 16, **engine_kwargs: object
) -> tuple[list[list[float]], list[list[int]]]:
    with Engine(str(path), **engine_kwargs) as engine:
        scored = engine.generate(
            input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 1}, return_logprob=True,
            logprob_start_len=0,
        )  # fmt: skip
        greedy = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": n})
        assert engine.get_server_info()["kv_cache_dtype"] == str(
            KV_DTYPES.get(str(engine_kwargs.get("kv_cache_dtype")), torch.float32)
        ).removeprefix("torch.")
    logprobs = [[lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]] for out in scored]
    return logprobs, output_ids(greedy)


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb, strict=True))


def _mean_diff(a: list[list[float]], b: list[list[float]]) -> float:
    diffs = [abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb, strict=True)]
    return sum(diffs) / len(diffs)


@pytest.mark.parametrize("checkpoint", ["qwen3_path", "qwen3_5_path"])
@pytest.mark.parametrize("kv_cache_dtype", list(KV_DTYPES))
def test_float8_kv_engine_matches_transformers_over_float8_rounded_kv(
    request: pytest.FixtureRequest, checkpoint: str, kv_cache_dtype: str
) -> None:
    """Prompt log-probs (prefill) and 16 greedy tokens (decode over the cache) as the reference gives
    them; Qwen3.5 checks the hybrid model's KV pool (its full-attention layers) too."""
    path: Path = request.getfixturevalue(checkpoint)
    prompts = random_prompts(3, 20, 40, seed=5)
    ours, greedy = engine_logprobs_and_greedy(path, prompts, kv_cache_dtype=kv_cache_dtype)
    ref = reference_model(str(path), kv_cache_dtype)
    expected = [reference_logprobs(ref, p) for p in prompts]
    assert _max_diff(ours, expected) < LOGPROB_TOL
    assert greedy == [reference_greedy(ref, p, 16) for p in prompts]
    # Not vacuous: rounding K/V to float8 moves the log-probs well past the tolerance.
    plain = [reference_logprobs(hf_model(str(path)), p) for p in prompts]
    assert _max_diff(plain, expected) > 10 * LOGPROB_TOL


# Measured on the tiny Qwen3 (prompt log-probs around -7.0, 8 prompts of 20-60 tokens, K/V scale 1.0):
# float8 K/V moved the log-probs from the float32 cache's by 0.069 (e4m3) / 0.13 (e5m2) nats on
# average and 0.36 / 0.69 at most; greedy tokens agreed on 51 % / 42 % of the positions before the
# first difference (1 of 8 continuations identical). The tiny random model's larger-than-HF init makes
# its attention scores large and its next-token distributions flat and near-tied, so 3 (e4m3) or 2
# (e5m2) mantissa bits in K/V tip greedy choices easily; bench/gpu_fp8_kv.py measures a Qwen3-8B shape.
# The bounds are about twice the measured values.
LOGPROB_BOUNDS = {"fp8_e4m3": (0.15, 0.75), "fp8_e5m2": (0.3, 1.4)}


@pytest.mark.parametrize("kv_cache_dtype", list(KV_DTYPES))
def test_float8_kv_stays_close_to_the_full_precision_cache(qwen3_path: Path, kv_cache_dtype: str) -> None:
    prompts = random_prompts(8, 20, 60, seed=6)
    full, full_greedy = engine_logprobs_and_greedy(qwen3_path, prompts)
    fp8, fp8_greedy = engine_logprobs_and_greedy(qwen3_path, prompts, kv_cache_dtype=kv_cache_dtype)
    mean_bound, max_bound = LOGPROB_BOUNDS[kv_cache_dtype]
    mean, worst = _mean_diff(fp8, full), _max_diff(fp8, full)
    agreed = sum(
        next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
        for x, y in zip(fp8_greedy, full_greedy)
    ) / sum(len(x) for x in full_greedy)
    print(f"{kv_cache_dtype}: log-prob diff mean {mean:.4f} max {worst:.4f}; greedy agreement {agreed:.0%}")
    assert 0 < mean < mean_bound and worst < max_bound
    assert agreed >= 0.25


def test_float8_kv_gives_the_same_tokens_chunked_cached_overlapped_and_speculative(qwen3_path: Path) -> None:
    """Every stored key is float8 and every reader sees the stored value, so the scheduling paths agree
    with each other as they do on a full-precision cache."""
    shared = random_prompts(1, 24, 24, seed=7)[0]
    prompts = random_prompts(5, 4, 12, seed=8, prefix=shared)
    params = {**GREEDY, "max_new_tokens": 12}

    def run(**options: object) -> list[list[int]]:
        with Engine(str(qwen3_path), kv_cache_dtype="fp8_e4m3", **options) as engine:
            return output_ids(engine.generate(input_ids=prompts, sampling_params=params))

    reference = run(disable_radix_cache=True, chunked_prefill_size=None)
    with Engine(str(qwen3_path), kv_cache_dtype="fp8_e4m3", chunked_prefill_size=5) as engine:
        first = engine.generate(input_ids=prompts[0], sampling_params=params)
        rest = engine.generate(input_ids=prompts[1:], sampling_params=params)
    assert all(r["meta_info"]["cached_tokens"] >= len(shared) for r in rest)  # radix-cache hits
    assert output_ids([first, *rest]) == reference
    assert run(disable_overlap_schedule=False, enable_mixed_chunk=True, chunked_prefill_size=8) == reference
    assert run(speculative_algorithm="ngram", speculative_num_draft_tokens=3) == reference
    # A draft model gets a float8 pool of its own (the same kv_cache_dtype).
    assert run(speculative_algorithm="draft", speculative_draft_model_path=str(qwen3_path)) == reference


def test_float8_pool_holds_twice_the_tokens_of_bfloat16_in_the_same_memory(
    qwen3_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The CPU pool is sized from a share of available RAM: fix that reading, so both engines get the
    # same budget (2 MiB x CPU_MEM_SHARE).
    monkeypatch.setattr(model_runner, "_available_ram_bytes", lambda: 2 * 2**20)
    sizes = {}
    for kv_cache_dtype in ("auto", "fp8_e4m3"):
        with Engine(str(qwen3_path), dtype="bfloat16", kv_cache_dtype=kv_cache_dtype) as engine:
            info = engine.get_server_info()
            sizes[info["kv_cache_dtype"]] = info["max_total_tokens"]
    budget = 2 * 2**20 * model_runner.CPU_MEM_SHARE
    per_token_bf16 = TokenToKVPool.bytes_per_token(2, 2, 16, torch.bfloat16)
    assert sizes == {"bfloat16": budget // per_token_bf16, "float8_e4m3fn": 2 * (budget // per_token_bf16)}


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"kv_cache_dtype": "int8"}, "kv_cache_dtype must be one of"),
        (
            {"kv_cache_dtype": "fp8_e4m3", "attention_backend": "flashinfer"},
            "not supported with attention_backend",
        ),
    ],
)
def test_bad_kv_cache_dtype_options_are_clear_errors(qwen3_path: Path, options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(model_path=str(qwen3_path), **options)


@pytest.mark.parametrize(
    ("dtype", "scales", "match"),
    [
        (torch.float32, {"k_scales": [1.0, 1.0]}, "float8 pool only"),
        (torch.float8_e4m3fn, {"v_scales": [1.0]}, "expected 2 finite positive scales"),
        (torch.float8_e4m3fn, {"k_scales": [1.0, 0.0]}, "expected 2 finite positive scales"),
    ],
)
def test_bad_kv_scales_are_clear_errors(dtype: torch.dtype, scales: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TokenToKVPool(8, 2, 1, 16, dtype, "cpu", **scales)


def _with_kv_scales(src: Path, dst: Path, tensors: dict[str, float]) -> Path:
    """A copy of checkpoint src with these scalar tensors in a file of their own."""
    shutil.copytree(src, dst)
    save_file(
        {name: torch.tensor(value) for name, value in tensors.items()}, str(dst / "kv_scales.safetensors")
    )
    return dst


# Not powers of two: dividing by them changes which float8 value a key rounds to.
K_SCALES, V_SCALES = [0.37, 1.6], [2.3, 0.8]


def _scaled_float8_kv_attention(k_scales: list[float], v_scales: list[float]) -> Any:
    """As _float8_kv_attention for e4m3, with layer i's K/V stored as x / scale and read back times it."""

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):  # noqa: ANN001, ANN202, ARG001
        top = torch.finfo(torch.float8_e4m3fn).max

        def rounded(x: torch.Tensor, scale: float) -> torch.Tensor:
            return (x.float() * (1.0 / scale)).clamp(-top, top).to(torch.float8_e4m3fn).float() * scale

        key, value = rounded(key, k_scales[module.layer_idx]), rounded(value, v_scales[module.layer_idx])
        return _float8_kv_attention(torch.float32)(module, query, key, value, attention_mask, scaling)

    return attention


def test_checkpoint_kv_scales_become_the_float8_pool_scales(qwen3_path: Path, tmp_path: Path) -> None:
    names = {f"model.layers.{i}.self_attn.k_scale": s for i, s in enumerate(K_SCALES)}
    names |= {f"model.layers.{i}.self_attn.v_scale": s for i, s in enumerate(V_SCALES)}
    scaled = _with_kv_scales(qwen3_path, tmp_path / "scaled", names)
    prompts = random_prompts(3, 20, 40, seed=9)
    ours, _ = engine_logprobs_and_greedy(scaled, prompts, kv_cache_dtype="fp8_e4m3")
    AttentionInterface.register("float8_kv_reference_scaled", _scaled_float8_kv_attention(K_SCALES, V_SCALES))
    ref = AutoModelForCausalLM.from_pretrained(
        str(qwen3_path), dtype=torch.float32, attn_implementation="float8_kv_reference_scaled"
    ).eval()
    assert _max_diff(ours, [reference_logprobs(ref, p) for p in prompts]) < LOGPROB_TOL
    unscaled = [reference_logprobs(reference_model(str(qwen3_path), "fp8_e4m3"), p) for p in prompts]
    assert _max_diff(ours, unscaled) > 10 * LOGPROB_TOL  # the scales were used
    # A full-precision cache has no use for them: the checkpoint serves as the one without them.
    assert engine_logprobs_and_greedy(scaled, prompts) == engine_logprobs_and_greedy(qwen3_path, prompts)


def _read(
    tmp_path: Path, tensors: dict[str, float], layers: list[int]
) -> tuple[list[float], list[float]] | None:
    file = tmp_path / "scales.safetensors"
    save_file({name: torch.tensor([value]) for name, value in tensors.items()}, str(file))
    return read_kv_scales([file], layers)


def test_kv_scale_names_of_modelopt_and_autofp8_checkpoints(tmp_path: Path) -> None:
    modelopt = {
        "model.layers.0.self_attn.k_proj.k_scale": 0.5,
        "model.layers.0.self_attn.v_proj.v_scale": 2.0,
    }
    assert _read(tmp_path, modelopt, [0]) == ([0.5], [2.0])
    autofp8 = {"model.layers.3.self_attn.kv_scale": 0.25, "model.layers.0.self_attn.kv_scale": 4.0}
    assert _read(tmp_path, autofp8, [0, 3]) == ([4.0, 0.25], [4.0, 0.25])
    # Weight scales of an FP8 checkpoint are not KV scales.
    weights = {
        "model.layers.0.self_attn.k_proj.weight_scale": 0.5,
        "model.layers.0.self_attn.k_proj.input_scale": 1.0,
    }
    assert _read(tmp_path, weights, [0]) is None


@pytest.mark.parametrize(
    ("tensors", "match"),
    [
        ({"model.layers.0.self_attn.k_scale": 0.5}, "incomplete: no v_scale of layer 0"),
        ({"model.layers.0.self_attn.kv_scale": 0.0}, "one finite positive value"),
    ],
)
def test_bad_checkpoint_kv_scales_are_clear_errors(tmp_path: Path, tensors: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _read(tmp_path, tensors, [0])
