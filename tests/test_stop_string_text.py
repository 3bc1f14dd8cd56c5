"""The worker's stop strings match the output's finished text: a stop string containing U+FFFD stops
a request where the decoded output really contains U+FFFD, never at the U+FFFD a decode of the
last few ids shows for a character whose bytes are still coming or were cut off at the window's start.
The reference is the tokenizer's own decode of the whole output."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from services.worker.scheduler.req import FinishReason, Req
from shared.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(llama_path: Path):  # noqa: ANN201
    return AutoTokenizer.from_pretrained(llama_path)


def generate(tokenizer, ids: list[int], stop: list[str]) -> Req:  # noqa: ANN001
    """A request fed `ids` one at a time as the scheduler does, up to its finish."""
    req = Req("r", [1, 2, 3], SamplingParams(max_new_tokens=len(ids) + 1, stop=stop), seed=0)
    for token in ids:
        req.append_output_token(token, tokenizer.decode)
        if req.finished():
            break
    return req


@pytest.mark.parametrize(("text", "stop"), [
    ("東京 🚀 done.", "\ufffd"),  # each multi-byte character decodes to U+FFFD until its last byte
    ("🚀b", "\ufffdb"),  # a window of the last ids starts inside the 4 bytes of the rocket
    ("a東", "a\ufffd"),
])
def test_a_stop_string_with_u_fffd_never_matches_an_incomplete_character(tokenizer, text: str, stop: str) -> None:  # noqa: ANN001
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text and "\ufffd" in "".join(tokenizer.decode([t]) for t in ids)
    req = generate(tokenizer, ids, [stop])
    assert req.finished_reason is None
    assert req.output_ids == ids


def test_a_real_u_fffd_in_the_output_stops_the_request(tokenizer) -> None:  # noqa: ANN001
    ids = tokenizer.encode("東a\ufffdb 京")
    req = generate(tokenizer, ids, ["\ufffd", "a\ufffd", "\ufffdb"])
    assert req.finished_reason == FinishReason("stop", "\ufffd")
    # It is seen whole once the token after its last byte shows no U+FFFD at the end: here "b".
    assert tokenizer.decode(req.output_ids) == "東a\ufffdb"
    req = generate(tokenizer, ids, ["\ufffdb"])
    assert req.finished_reason == FinishReason("stop", "\ufffdb")
    assert tokenizer.decode(req.output_ids) == "東a\ufffdb"


def test_a_stop_string_matches_however_many_tokens_its_characters_span(tokenizer) -> None:  # noqa: ANN001
    ids = tokenizer.encode("x 東京 y")
    req = generate(tokenizer, ids, ["東京"])  # 2 characters, 6 tokens
    assert req.finished_reason == FinishReason("stop", "東京")
    assert tokenizer.decode(req.output_ids) == "x 東京"


def test_a_migrated_requests_earlier_tokens_are_part_of_the_text(tokenizer) -> None:  # noqa: ANN001
    ids = tokenizer.encode("東京 x")
    split = 2  # inside 東: the new worker's first token completes it
    req = Req("r", [1], SamplingParams(max_new_tokens=99, stop=["東"]), seed=0, output_ids=ids[:split])
    for token in ids[split:]:
        req.append_output_token(token, tokenizer.decode)
        if req.finished():
            break
    assert req.finished_reason == FinishReason("stop", "東")
    assert req.output_ids == ids[:3]
