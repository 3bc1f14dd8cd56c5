"""Where models live on disk, and how a `--model-path` value becomes a directory.

`RS_HOME` (default `~/.cache/radixserve`) holds radixserve's downloads; models sit in `RS_HOME/models`,
one HF checkpoint directory each. The embedded default, SmolLM2-135M-Instruct, is written there by
`radixserve model fetch`.
"""

from __future__ import annotations

import os
from pathlib import Path

RS_HOME_ENV = "RS_HOME"
DEFAULT_RS_HOME = "~/.cache/radixserve"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# Written last by `radixserve model fetch`: a directory without it is not a finished fetch.
COMPLETE_MARKER = ".radixserve-complete"


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


def resolve_model_path(name_or_path: str | None, home: Path | str | None = None) -> Path:
    """Turn a `--model-path` value into an existing model directory.

    An existing directory is used as is; a bare name is looked up under the models directory; None
    means the default model. Anything else is a ValueError that says how to get a model.
    """
    if name_or_path is None:
        target = default_model_dir(home)
        if is_complete(target):
            return target
        raise ValueError(
            f"model_path: the default model {DEFAULT_MODEL_NAME} is not at {target}; "
            "run `radixserve model fetch` first, or pass an HF model directory"
        )
    if not name_or_path.strip():
        # Path("") is the current directory, which would silently be taken as a model.
        raise ValueError("model_path: must not be empty; pass a model name or an HF model directory")
    candidate = Path(name_or_path).expanduser()
    if candidate.is_dir():
        return candidate
    # Only a bare name (no separators) may refer to the models directory; a path stays a path.
    if candidate.name == name_or_path:
        named = models_dir(home) / name_or_path
        if named.is_dir():
            return named
    raise ValueError(
        f"model_path: {name_or_path!r} is neither a directory nor a model under {models_dir(home)}; "
        "run `radixserve model fetch` to get the default model, or pass an HF model directory"
    )
