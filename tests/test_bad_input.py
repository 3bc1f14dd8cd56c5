"""Bad input gets a ValueError naming what is wrong, and never disturbs requests in flight."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

from services.worker.frontend.engine import Engine
from services.worker.runtime.model_config import ModelConfig
from tests.engine_helpers import GREEDY, hf_greedy


@pytest.fixture(scope="module")
def engine(qwen3_path: Path):  # noqa: ANN201
    with Engine(str(qwen3_path)) as eng:
        yield eng


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompt": ""}, "prompt"),
        ({"input_ids": []}, "input_ids"),
        ({"prompt": ["fine", ""]}, "prompt"),
        ({"input_ids": list(range(3, 259))}, "input_ids"),  # context is 256 tokens
        ({"input_ids": [5, 300]}, "input_ids"),  # vocab is 300
        ({"input_ids": [5, -1]}, "input_ids"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": -0.5}}, "temperature"),
        ({"input_ids": [1, 2], "sampling_params": {"top_p": 0.0}}, "top_p"),
        ({"input_ids": [1, 2], "sampling_params": {"top_p": 1.5}}, "top_p"),
        ({"input_ids": [1, 2], "sampling_params": {"top_k": 0}}, "top_k"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"input_ids": [1, 2], "sampling_params": {"min_p": 2.0}}, "min_p"),
        ({"input_ids": [1, 2], "sampling_params": {"tempreature": 1.0}}, "tempreature"),
        ({"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [999]}}, "stop_token_ids"),
        ({"input_ids": [1, 2], "top_logprobs_num": -2}, "top_logprobs_num"),
        ({"prompt": "a", "input_ids": [1]}, "input_ids"),
        ({"input_ids": [[1, 2], [3]], "sampling_params": [{}, {}, {}]}, "sampling_params"),
    ],
)
def test_bad_request_is_a_value_error_naming_the_field(engine: Engine, kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        engine.generate(**kwargs)


def test_bad_requests_leave_requests_in_flight_untouched(engine: Engine, qwen3_path: Path) -> None:
    prompt = [7, 8, 9, 10, 11]
    result: dict = {}
    worker = threading.Thread(
        target=lambda: result.update(
            engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 60})
        )
    )
    worker.start()
    for bad in ({"temperature": -1}, {"top_p": 2}, {"top_k": 0}, {"max_new_tokens": -3}):
        with pytest.raises(ValueError):
            engine.generate(input_ids=[3, 4], sampling_params=bad)
    with pytest.raises(ValueError):
        engine.generate(input_ids=[])
    # A good request submitted meanwhile is served as well.
    other = engine.generate(input_ids=[4, 5, 6], sampling_params={**GREEDY, "max_new_tokens": 8})
    worker.join(timeout=60)
    assert result["output_ids"] == hf_greedy(qwen3_path, prompt, 60)
    assert other["output_ids"] == hf_greedy(qwen3_path, [4, 5, 6], 8)


def test_unknown_architecture_is_a_value_error_naming_architectures(qwen3_path: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(qwen3_path, bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="architectures"):
        ModelConfig.from_path(bad)
    with pytest.raises(ValueError, match="architectures"):
        Engine(str(bad))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"schedule_policy": "shortest"}, "schedule_policy"),
        ({"radix_eviction_policy": "oldest"}, "radix_eviction_policy"),
        ({"chunked_prefill_size": 0}, "chunked_prefill_size"),
        ({"tp_size": 0}, "tp_size"),
        ({"max_total_tokens": 1}, "max_total_tokens"),
        ({"no_such_option": 1}, "no_such_option"),
    ],
)
def test_bad_engine_option_is_a_value_error_naming_it(qwen3_path: Path, kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Engine(str(qwen3_path), **kwargs)


def test_missing_model_points_at_model_fetch(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="radixserve model fetch"):
        Engine(str(tmp_path / "nowhere"))
