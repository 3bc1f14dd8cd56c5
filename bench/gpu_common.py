"""What the GPU benchmarks share: random Qwen3-shaped checkpoints (no weights can be downloaded on the
device machine) and the two ceilings every figure is divided by, measured in the same run."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

SHAPES = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}
OUT = Path(os.environ.get("OUT", "bench/out"))


def batch1_decode_tok_s(engine: object, steps: int) -> float:
    """Batch-1 decode tok/s of an open Engine: a 128-token prompt warmed once, then `steps` new tokens,
    the prefill (timed alone on a prompt of the same length) taken out of the wall time."""
    prompt = list(range(1000, 1128))
    engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
    t0 = time.perf_counter()
    engine.generate(input_ids=prompt[:-1] + [7], sampling_params={"temperature": 0, "max_new_tokens": 1})
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.generate(
        input_ids=prompt[:-2] + [9, 9],
        sampling_params={"temperature": 0, "max_new_tokens": steps, "ignore_eos": True},
    )
    return (steps - 1) / max(time.perf_counter() - t0 - ttft, 1e-9)


def build_checkpoint(name: str, dtype: torch.dtype, initializer_range: float = 0.1) -> Path:
    """A seeded random Qwen3 checkpoint of the named shape under /tmp (built once per machine). The
    speed benches use initializer_range 0.1; the TP numerics use Qwen3's own 0.02, whose activations
    stay in the range a trained model's do."""
    init = "" if initializer_range == 0.1 else f"-init{initializer_range}"
    path = Path(f"/tmp/rs-qwen3-{name}-{str(dtype).split('.')[-1]}{init}")
    if (path / "config.json").exists():
        return path
    config = Qwen3Config(vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                         initializer_range=initializer_range, **SHAPES[name])
    return save_random(path, Qwen3ForCausalLM, config, dtype)


def build_moe_checkpoint(name: str, dtype: torch.dtype, initializer_range: float, **shape: object) -> Path:
    """A seeded random Qwen3-MoE checkpoint at /tmp/rs-qwen3-moe-{name} (built once per machine):
    `shape` gives the widths, layer and expert counts; every MoE layer sparse, top-k renormalised."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    path = Path(f"/tmp/rs-qwen3-moe-{name}")
    if (path / "config.json").exists():
        return path
    config = Qwen3MoeConfig(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
                            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                            initializer_range=initializer_range, tie_word_embeddings=False, **shape)
    return save_random(path, Qwen3MoeForCausalLM, config, dtype)


def save_random(path: Path, model_class: type, config: object, dtype: torch.dtype) -> Path:
    """Build `model_class(config)` on the GPU from torch seed 0, in `dtype`, and save it to `path`."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = model_class(config).to(dtype)
    model.save_pretrained(str(path))
    del model
    torch.cuda.empty_cache()
    return path


def copy_bandwidth() -> float:
    """Device-to-device copy of 1 GiB, bytes read + written per second (median of 10 after 3 warm-ups)."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n / sorted(times)[len(times) // 2]


def matmul_rate() -> float:
    """bf16 8192^3 matrix products per second, in FLOP/s, on random data."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * 10 / (start.elapsed_time(end) / 1e3)


def weight_bytes(path: Path) -> int:
    """Bytes one decode step reads: every weight once (a tied embedding table once, as the LM head)."""
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))
