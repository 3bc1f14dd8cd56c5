"""`radixserve up` as a vLLM or SGLang user starts it: a hub id read offline from the hub cache, the
aliases (--model, --tp, --max-model-len), --dtype half, --chunked-prefill-size -1, a chat template file,
a served model name and an API key. Every service takes the same model: the workers serve it under the
given name, the gateway tokenizes for it itself, and prompts go through the given template."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import httpx
import openai
from transformers import AutoTokenizer

from tests.services_helpers import free_port, start_up
from tests.test_model_hub import COMMIT, place_in_hub_cache

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}: {{ m['content'] }}]{% endfor %}"


def test_up_serves_a_hub_model_with_the_flags_users_type(qwen3_path: Path, tmp_path: Path) -> None:
    place_in_hub_cache(qwen3_path, tmp_path / "hf", "TinyOrg/Tiny-Qwen3", COMMIT)
    (tmp_path / "brackets.jinja").write_text(TEMPLATE)
    port = free_port()
    env = {**os.environ, "RS_NATS_URL": "nats://127.0.0.1:1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    run_dir = tmp_path / "run"
    proc = start_up([
        "--model", "TinyOrg/Tiny-Qwen3", "--tp", "1", "--max-model-len", "256", "--dtype", "half",
        "--chunked-prefill-size", "-1", "--max-total-tokens", "2048", "--chat-template", str(tmp_path / "brackets.jinja"),
        "--served-model-name", "tiny", "--api-key", "sk-test", "--log-level", "info",
        "--port", str(port), "--grpc-port", str(free_port()), "--run-dir", str(run_dir),
    ], env, tmp_path / "up.out")
    try:
        url = re.search(r"radixserve is up: (http://\S+)", (tmp_path / "up.out").read_text()).group(1)
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test")
        assert [m.id for m in client.models.list().data] == ["tiny"]
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello there"}], temperature=0, max_tokens=4
        )
        assert reply.usage.completion_tokens == 4
        # The prompt went through the given template, not the checkpoint's.
        expected = AutoTokenizer.from_pretrained(qwen3_path).encode("[user: hello there]", add_special_tokens=False)
        assert reply.usage.prompt_tokens == len(expected)
        gateway_log = (run_dir / "gateway.log").read_text()
        assert f"tokenizes prompts for {COMMIT} itself" in gateway_log
        worker_log = (run_dir / "worker-0.log").read_text()
        assert f"models--TinyOrg--Tiny-Qwen3/snapshots/{COMMIT}" in worker_log
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
