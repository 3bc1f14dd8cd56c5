"""Where models live on disk, and how a `--model-path` value becomes a directory.

`RS_HOME` (default `~/.cache/radixserve`) holds radixserve's downloads; models sit in `RS_HOME/models`,
one HF checkpoint directory each. The embedded default, SmolLM2-135M-Instruct, is written there by
`radixserve model fetch`.

A value that is neither a directory nor such a name, but has the shape of a Hugging Face hub id
(`Qwen/Qwen3-8B`), is a snapshot of that repository (at `revision`, default main) in the hub's own cache
(`HF_HUB_CACHE`, else `HF_HOME/hub`), downloaded through `huggingface_hub` when absent. With
`HF_HUB_OFFLINE=1` only the cache is read. Every service resolves a model through `resolve_model_path`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

RS_HOME_ENV = "RS_HOME"
DEFAULT_RS_HOME = "~/.cache/radixserve"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# Written last by `radixserve model fetch`: a directory without it is not a finished fetch.
COMPLETE_MARKER = ".radixserve-complete"
# `owner/name` as the hub spells repository ids (huggingface_hub's validate_repo_id, without the length).
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
# What a checkpoint needs from a hub repository: config, weights, tokenizer and chat template files
# (not the .bin/.pt/.gguf/.onnx copies many repositories carry beside the safetensors).
HUB_FILES = ("*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja")
_TRUE = {"1", "true", "yes", "on"}


def rs_home(home: Path | str | None = None) -> Path:
    """The radixserve home: `home` if given, else `$RS_HOME`, else `~/.cache/radixserve`."""
    if home is None:
        home = os.environ.get(RS_HOME_ENV) or DEFAULT_RS_HOME
    return Path(home).expanduser()


def models_dir(home: Path | str | None = None) -> Path:
    """The directory that holds one subdirectory per fetched model."""
    return rs_home(home) / "models"


def default_model_dir(home: Path | str | None = None) -> Path:
    """Where the default model lives once fetched (the path may not exist yet)."""
    return models_dir(home) / DEFAULT_MODEL_NAME


def is_complete(model_dir: Path) -> bool:
    """Whether `model_dir` is a finished fetch (it carries the completion marker)."""
    return (model_dir / COMPLETE_MARKER).is_file()


def hub_cache_dir() -> Path:
    """The hub cache as huggingface_hub places it, read from the environment now (the library reads it
    once, at import, so a later HF_HOME would otherwise be missed)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(os.environ.get("HF_HOME") or os.path.join(xdg, "huggingface")).expanduser() / "hub"


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as huggingface_hub reads it, now."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in _TRUE


def is_hub_id(value: str) -> bool:
    """Whether `value` has the shape of a hub repository id (`owner/name`), not of a path."""
    return bool(_HUB_ID.match(value)) and not value.startswith((".", "~")) and ".." not in value


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The directory of hub repository `repo_id` at `revision` in the hub cache, downloaded when it is
    absent unless offline; ValueError naming the id when it cannot be had."""
    # Imported here: only a hub id needs it (it comes with transformers).
    from huggingface_hub import snapshot_download

    cache = hub_cache_dir()
    offline = hub_offline()
    at = f" at revision {revision!r}" if revision else ""
    try:
        return Path(snapshot_download(
            repo_id, revision=revision, cache_dir=cache, local_files_only=offline, allow_patterns=list(HUB_FILES)
        ))
    except (OSError, ValueError) as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        where = (f"is not in the hub cache {cache} (HF_HUB_OFFLINE is set: nothing is downloaded)" if offline
                 else f"is not in the hub cache {cache} and could not be downloaded ({detail})")
        raise ValueError(
            f"model_path: {repo_id!r} is not a local directory, and Hugging Face hub model {repo_id}{at} {where}; "
            "download it with network access (HF_TOKEN for gated models) or pass an HF model directory"
        ) from None


def served_name(name_or_path: str | None, resolved: Path) -> str:
    """The name a model is served under unless one is given: a hub id as the user typed it (as vLLM and
    SGLang name it), else the directory's name."""
    if name_or_path and is_hub_id(name_or_path) and not Path(name_or_path).expanduser().is_dir():
        return name_or_path
    return resolved.name


def resolve_model_path(
    name_or_path: str | None, home: Path | str | None = None, revision: str | None = None
) -> Path:
    """Turn a `--model-path` value into an existing model directory.

    An existing directory is used as is; a bare name is looked up under the models directory; an
    `owner/name` hub id is a snapshot in the hub cache (at `revision`); None means the default model.
    Anything else is a ValueError that says how to get a model.
    """
    if name_or_path is None:
        target = default_model_dir(home)
        if is_complete(target):
            return target
        raise ValueError(
            f"model_path: the default model {DEFAULT_MODEL_NAME} is not at {target}; "
            "run `radixserve model fetch` first, or pass an HF model directory or hub id"
        )
    if not name_or_path.strip():
        # Path("") is the current directory, which would silently be taken as a model.
        raise ValueError("model_path: must not be empty; pass a model name, an HF model directory or a hub id")
    candidate = Path(name_or_path).expanduser()
    if candidate.is_dir():
        return candidate
    # Only a bare name (no separators) may refer to the models directory; a path stays a path.
    if candidate.name == name_or_path:
        named = models_dir(home) / name_or_path
        if named.is_dir():
            return named
    if is_hub_id(name_or_path):
        return hub_snapshot(name_or_path, revision)
    raise ValueError(
        f"model_path: {name_or_path!r} is neither a directory, a model under {models_dir(home)} nor a hub id "
        "(owner/name); run `radixserve model fetch` to get the default model, or pass an HF model directory"
    )
