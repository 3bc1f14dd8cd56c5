"""TokenizerConfig: the tokenizer service's settings (flags and RS_* variables, see shared/flags.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.service import ServiceConfig


def _help(text: str, default: object) -> object:
    return field(default=default, metadata={"help": text})


@dataclass(frozen=True)
class TokenizerConfig(ServiceConfig):
    """One tokenizer replica; any number share the queue group."""

    model_path: str = _help("HF checkpoint directory or model name (default: the embedded model)", "")
    context_length: int | None = _help("the workers' context length, if they override the model's", None)
    queue_group: str = _help("NATS queue group the replicas share", "tokenizer")
    metrics_port: int | None = _help("Prometheus metrics port (0: any free port; none: no metrics)", 9401)
