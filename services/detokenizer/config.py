"""DetokenizerConfig: the detokenizer service's settings (flags and RS_* variables, see shared/flags.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.service import ServiceConfig, is_subject_token


def _help(text: str, default: object, aliases: tuple[str, ...] = ()) -> object:
    return field(default=default, metadata={"help": text, "aliases": aliases})


@dataclass(frozen=True)
class DetokenizerConfig(ServiceConfig):
    """One detokenizer: for one worker (`worker_id`), or for every worker of a deployment (none)."""

    model_path: str = _help(
        "HF checkpoint directory, model name or hub id whose tokenizer decodes (default: embedded)", "",
        aliases=("model",),
    )
    revision: str | None = _help("hub id only: the branch, tag or commit of the repository; default: main", None)
    tokenizer_path: str | None = _help("the tokenizer's directory, model name or hub id; default: the model's", None)
    worker_id: str | None = _help("serve this worker's {p}.detok.<id>; none: every worker ({p}.detok.*)", None)
    silent_worker_timeout: float = _help("free a worker's requests after this many seconds without a step", 60.0)
    metrics_port: int | None = _help("Prometheus metrics port (0: any free port; none: no metrics)", 9403)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.worker_id is not None and not is_subject_token(self.worker_id):
            raise ValueError(f"worker_id must be one NATS token (no spaces, dots, * or >), got {self.worker_id!r}")
        if self.silent_worker_timeout <= 0:
            raise ValueError(f"silent_worker_timeout must be > 0, got {self.silent_worker_timeout}")
