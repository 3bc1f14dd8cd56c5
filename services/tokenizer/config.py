"""TokenizerConfig: the tokenizer service's settings (flags and RS_* variables, see shared/flags.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.service import ServiceConfig


def _help(text: str, default: object, aliases: tuple[str, ...] = ()) -> object:
    return field(default=default, metadata={"help": text, "aliases": aliases})


@dataclass(frozen=True)
class TokenizerConfig(ServiceConfig):
    """One tokenizer replica; any number share the queue group."""

    model_path: str = _help(
        "HF checkpoint directory, model name or hub id (default: the embedded model)", "", aliases=("model",)
    )
    revision: str | None = _help("hub id only: the branch, tag or commit of the repository; default: main", None)
    tokenizer_path: str | None = _help("the tokenizer's directory, model name or hub id; default: the model's", None)
    chat_template: str | None = _help("a Jinja chat template (a file, or the template itself) instead of the model's", None)
    context_length: int | None = _help(
        "the workers' context length, if they override the model's", None, aliases=("max_model_len",)
    )
    queue_group: str = _help("NATS queue group the replicas share", "tokenizer")
    metrics_port: int | None = _help("Prometheus metrics port (0: any free port; none: no metrics)", 9401)
