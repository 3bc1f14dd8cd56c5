"""/openapi.json describes the API as it behaves: schemathesis, with every check it has (statuses,
content types, error bodies, schema-valid bodies accepted, schema-violating ones refused, no 5xx,
405 with Allow for other methods), finds nothing against a gateway over the scripted pipeline
(tests/gateway_helpers.FakePipeline, which here also answers {p}.tokenize.text). The few rules JSON
Schema cannot state are kept by tests/schemathesis_hooks.py."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from nats.aio.msg import Msg

from shared.natsd import NatsServer
from shared.protocol import PROTOCOL_VERSION, TextTokenize, TextTokenized
from tests.gateway_helpers import FAKE_CONTEXT, FakePipeline, GatewayThread, serving_gateway

ROOT = Path(__file__).resolve().parent.parent
# Bounded so the run takes well under a minute on a 2-vCPU host; the seed makes it repeatable.
MAX_EXAMPLES = 8
SEED = 20


@pytest.fixture(scope="module")
def gateway(nats: NatsServer, pipeline: FakePipeline) -> Iterator[GatewayThread]:
    async def tokenize_text(msg: TextTokenize, raw: Msg) -> None:
        if msg.input_ids is not None:
            answer = TextTokenized(v=PROTOCOL_VERSION, text=" ".join(f"t{i}" for i in msg.input_ids))
        else:
            words = (msg.text or " ".join(m.content for m in msg.messages or [])).split()
            answer = TextTokenized(v=PROTOCOL_VERSION, input_ids=list(range(len(words))), context_len=FAKE_CONTEXT)
        await pipeline.bus.respond(raw, answer)

    pipeline.thread.run(pipeline.bus.subscribe(pipeline.bus.subjects.tokenize_text, (TextTokenize,), tokenize_text))
    with serving_gateway(nats.url, tool_call_parser="hermes") as gw:
        yield gw


def test_the_openapi_document_states_every_status_and_error_body(gateway: GatewayThread) -> None:
    document = httpx.get(f"{gateway.url}/openapi.json").json()
    generate = document["paths"]["/generate"]["post"]["responses"]
    assert sorted(generate) == ["200", "400", "401", "404", "413", "429", "500", "503", "504"]
    assert generate["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorBody"}
    assert "text/event-stream" in generate["200"]["content"]
    assert set(document["paths"]["/flush_cache"]) == {"get", "post"}


def test_schemathesis_finds_no_failure_with_all_checks(gateway: GatewayThread, tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "schemathesis.cli", "run", f"{gateway.url}/openapi.json", "--checks", "all",
        "--phases", "examples,coverage,fuzzing", "--max-examples", str(MAX_EXAMPLES), "--seed", str(SEED),
        "--workers", "1", "--request-timeout", "15", "--suppress-health-check", "all", "--no-color",
    ]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks", "PYTHONPATH": str(ROOT)}
    # Run elsewhere than the repository: schemathesis keeps its examples database in the working directory.
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    failures = run.stdout[run.stdout.find("FAILURES"):]
    assert run.returncode == 0, failures[:20000] + run.stderr[-2000:]
