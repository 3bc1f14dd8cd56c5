"""Shared fixtures: tiny seeded HF checkpoints (written once per test session), the offline Engine on
the default model (one per session, for every module that compares with it), and per test module for the gateway tests a
nats-server, a FakePipeline with worker w1, a gateway that has heard it and an HTTP client of it
(tests/gateway_helpers.py). A module overrides any of them by defining its own, as
test_gateway_faults.py does for a small max_payload and its gateway's first-output timeout."""

from __future__ import annotations

import os

# Triton kernels run on CPU tensors through Triton's interpreter in tests; the variable is read when
# a function is decorated, so it must be set before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Test processes run a gateway (and its gRPC server) in a thread and start services with fork + exec.
# gRPC's fork handlers then run in the child between the two while the parent's gRPC threads are busy, and
# CI saw a just-forked worker abort there (epoll_wait: Bad file descriptor, exit -6). The children exec at
# once and never use the parent's gRPC, so the handlers are off; set before anything imports grpc.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import httpx
import pytest

from shared.model_fetch import fetch_default_model
from shared.natsd import NatsServer, start_nats_server
from tests.checkpoints import (
    QWEN3_GENERATION,
    tiny_llama_config,
    tiny_qwen3_5_config,
    tiny_qwen3_5_moe_config,
    tiny_qwen3_config,
    tiny_qwen3_moe_config,
    write_checkpoint,
)
from tests.engine_helpers import EnginePool
from tests.gateway_helpers import FakePipeline, GatewayThread, serving_gateway

if TYPE_CHECKING:
    from services.worker.frontend.engine import Engine

# anyio imports its API lazily, on first use, and pytest rewrites anyio's modules (it is a pytest
# plugin), so the first FileResponse a gateway thread serves would parse anyio._core._fileio in that
# thread while the main thread may be parsing too; CPython 3.11's parser is not safe for that
# ("SystemError: AST constructor recursion depth mismatch", seen once in CI on GET /playground).
# Resolving every lazy name here, once, in the main thread, takes those imports out of the threads.
for _name in dir(anyio):
    getattr(anyio, _name)


@pytest.fixture(scope="session")
def qwen3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3, untied, single safetensors file, tokenizer, Qwen3-style generation_config.json."""
    path = tmp_path_factory.mktemp("qwen3")
    return write_checkpoint(path, tiny_qwen3_config(), generation=QWEN3_GENERATION, tokenizer=True)


@pytest.fixture(scope="session")
def qwen3_sharded_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same weights as qwen3_path, split over several safetensors files with an index."""
    path = tmp_path_factory.mktemp("qwen3_sharded")
    return write_checkpoint(path, tiny_qwen3_config(), max_shard_size="40KB", generation=QWEN3_GENERATION)


@pytest.fixture(scope="session")
def qwen3_tied_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3 with tie_word_embeddings (as the small Qwen3 models ship)."""
    path = tmp_path_factory.mktemp("qwen3_tied")
    return write_checkpoint(path, tiny_qwen3_config(tie_word_embeddings=True), seed=1)


@pytest.fixture(scope="session")
def qwen3_one_kv_head_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3 with a single KV head, so TP=2 must replicate it."""
    path = tmp_path_factory.mktemp("qwen3_kv1")
    return write_checkpoint(path, tiny_qwen3_config(num_key_value_heads=1), seed=2)


@pytest.fixture(scope="session")
def qwen3_moe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3-MoE: 8 experts top-2, layer 1 dense (mlp_only_layers), tokenizer."""
    path = tmp_path_factory.mktemp("qwen3_moe")
    return write_checkpoint(path, tiny_qwen3_moe_config(), seed=3, tokenizer=True)


@pytest.fixture(scope="session")
def llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-like Llama with tied embeddings and a tokenizer."""
    path = tmp_path_factory.mktemp("llama")
    return write_checkpoint(path, tiny_llama_config(), seed=4, tokenizer=True)


@pytest.fixture(scope="session")
def qwen3_5_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3.5 dense (hybrid): full, linear, linear, full attention; untied; tokenizer."""
    path = tmp_path_factory.mktemp("qwen3_5")
    return write_checkpoint(path, tiny_qwen3_5_config(), seed=5, tokenizer=True)


@pytest.fixture(scope="session")
def qwen3_5_tied_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3.5 dense, tied embeddings, layer kinds from full_attention_interval=2 (linear first)."""
    path = tmp_path_factory.mktemp("qwen3_5_tied")
    config = tiny_qwen3_5_config(layer_types=None, full_attention_interval=2, tie_word_embeddings=True)
    return write_checkpoint(path, config, seed=6)


@pytest.fixture(scope="session")
def qwen3_5_v16_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3.5 dense for the Triton interpreter: one linear and one full attention layer (its cost is per
    kernel launch), 16-wide value heads (the Triton kernels' smallest, for tl.dot); GQA in both kinds."""
    path = tmp_path_factory.mktemp("qwen3_5_v16")
    config = tiny_qwen3_5_config(
        num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], linear_value_head_dim=16
    )
    return write_checkpoint(path, config, seed=11)


@pytest.fixture(scope="session")
def qwen3_5_moe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen3.5-MoE: linear, full, linear attention; 8 experts top-2 plus a shared expert."""
    path = tmp_path_factory.mktemp("qwen3_5_moe")
    return write_checkpoint(path, tiny_qwen3_5_moe_config(), seed=7)


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The real default model in the user's RS_HOME, fetched on first use."""
    return fetch_default_model(progress=False)


@pytest.fixture(scope="session")
def engine(default_model_path: Path) -> Iterator[Engine]:
    """The offline Engine on the default model (4,096 tokens of KV), to compare the services with: one
    for the session, since loading it costs seconds per module; greedy answers do not depend on what
    its radix cache holds (tests/test_engine.py checks that), so the modules cannot disturb each other."""
    # Imported here: torch and the worker load only in the modules that use the engine.
    from services.worker.frontend.engine import Engine

    with Engine(str(default_model_path), max_total_tokens=4096) as eng:
        yield eng


@pytest.fixture(scope="module")
def engine_pool() -> Iterator[EnginePool]:
    """Engines shared by one module's tests, one per (model, options), each test's from an empty cache."""
    pool = EnginePool()
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def nats() -> Iterator[NatsServer]:
    """A nats-server of the test module's own, on a free port."""
    with start_nats_server() as server:
        yield server


@pytest.fixture(scope="module")
def pipeline(nats: NatsServer) -> Iterator[FakePipeline]:
    """The scripted tokenizer + worker w1 + detokenizer on the module's nats-server."""
    with FakePipeline(nats.url) as fake:
        yield fake


@pytest.fixture(scope="module")
def gateway(nats: NatsServer, pipeline: FakePipeline) -> Iterator[GatewayThread]:
    """A gateway with the default config that has heard the pipeline's worker."""
    with serving_gateway(nats.url) as gw:
        yield gw


@pytest.fixture(scope="module")
def http(gateway: GatewayThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=10) as client:
        yield client


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """torch single-threaded for a module (`pytestmark = pytest.mark.usefixtures("one_thread")`):
    transformers' depthwise conv1d (its torch fallback, in the Qwen3.5 references) took ~80 ms a call
    with two OpenMP threads on a busy 2-core machine, 0.2 ms with one."""
    import torch  # here, as in `engine`: only the modules that use it load torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
