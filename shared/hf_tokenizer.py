"""A model's Hugging Face tokenizer as every service loads it: from `--tokenizer-path` when given, else
from the model, with `--chat-template` (a file, or the Jinja text itself) in place of the checkpoint's.

The paths resolve through shared/model_path.py, so a directory, a model name or a hub id is taken the
same way by the worker, the tokenizer, the detokenizer and a gateway's local tokenizer.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from shared.model_path import resolve_model_path

# A template is Jinja text: it has a tag or an expression. Anything else names a file.
_JINJA_MARKS = ("{%", "{{")
# The files a tokenizer is read from (fast, sentencepiece, byte-level BPE, tiktoken).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json", "tokenizer.tiktoken")


def keep_torch_out() -> None:
    """Make `import torch` fail in this process, as it does in the edge image (which has no torch): for
    the processes that only tokenize, the gateway, the tokenizer and the detokenizer. transformers imports
    torch for a tokenizer whenever it is installed, and that cost each of them seconds of CPU at start
    (8.4 s instead of 2.8 s to load the default model's tokenizer) and 240 MB of memory for nothing. Call
    it before anything imports transformers; a process that has imported torch already keeps it."""
    if "torch" not in sys.modules:
        # importlib.util.find_spec, what transformers asks, then answers None: it sees no torch.
        sys.modules["torch"] = None  # type: ignore[assignment]


def chat_template_text(value: str | None) -> str | None:
    """`--chat-template`: the contents of the file it names, or the template itself; None when unset.
    ValueError when it is neither an existing file nor Jinja text."""
    if not value:
        return None
    path = Path(value).expanduser()
    if any(mark in value for mark in _JINJA_MARKS):
        return value
    if path.is_file():
        try:
            return path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"chat_template: cannot read {value!r}: {exc}") from None
    raise ValueError(
        f"chat_template: {value!r} is neither a file nor a Jinja template (text with {{% ... %}} or {{{{ ... }}}})"
    )


def tokenizer_dir(model_path: str | None, tokenizer_path: str | None = None, revision: str | None = None) -> Path:
    """The directory the tokenizer is read from: `tokenizer_path` when given, else the model's (ValueError
    when it cannot be found). `revision` applies to the model's hub id, not to a separate tokenizer's."""
    if tokenizer_path:
        return resolve_model_path(tokenizer_path)
    return resolve_model_path(model_path or None, revision=revision)


def load_hf_tokenizer(
    model_path: str | None,
    tokenizer_path: str | None = None,
    chat_template: str | None = None,
    revision: str | None = None,
) -> Any:
    """transformers' tokenizer for a model, with `chat_template` set when given. ValueError (naming the
    directory) when there is no usable tokenizer there."""
    # Imported here: transformers is heavy, and only the services that tokenize need it.
    from transformers import AutoTokenizer

    path = tokenizer_dir(model_path, tokenizer_path, revision)
    template = chat_template_text(chat_template)
    # transformers builds an empty tokenizer from a directory without tokenizer files; one asked for by
    # name must really be there.
    if tokenizer_path and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"tokenizer_path {str(path)!r} has no usable tokenizer: none of {', '.join(TOKENIZER_FILES)}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as exc:
        setting = "tokenizer_path" if tokenizer_path else "model_path"
        raise ValueError(f"{setting} {str(path)!r} has no usable tokenizer: {exc}") from exc
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer
