"""The offline Engine's per-request state (no scheduler): a non-streamed request's text is decoded once
at its end, and must be exactly what the streamed path gives and what the tokenizer decodes."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from services.worker.frontend.request_state import RequestState
from services.worker.scheduler.output import ReqOutput
from services.worker.scheduler.req import FinishReason, Req
from shared.sampling_params import SamplingParams
from tests.checkpoints import IM_END_ID

TEXT = "naïve café — 東京 🚀 done."


@pytest.fixture(scope="module")
def tokenizer(llama_path: Path):  # noqa: ANN201
    return AutoTokenizer.from_pretrained(llama_path)


class CountingTokenizer:
    """Counts decode calls of the tokenizer it wraps."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner, self.calls = inner, 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.calls += 1
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def feed(tokenizer, ids: list[int], finish: FinishReason, stream: bool, **params: object) -> RequestState:  # noqa: ANN001
    """One ReqOutput per token, as the scheduler sends them; the last carries the finish."""
    req = Req("r", [1, 2, 3], SamplingParams(**params), seed=0)
    state = RequestState(req, tokenizer, stream=stream)
    for i, tid in enumerate(ids):
        last = i == len(ids) - 1
        state.push(ReqOutput("r", [tid], finished_reason=finish if last else None))
    return state


def streamed_text(state: RequestState) -> str:
    return "".join(chunk["text"] for chunk in state.iter_chunks())


def test_non_streamed_text_is_the_tokenizers_decode_and_the_streamed_text(tokenizer) -> None:  # noqa: ANN001
    ids = tokenizer.encode(TEXT)
    counting = CountingTokenizer(tokenizer)
    plain = feed(counting, ids, FinishReason("length", len(ids)), stream=False)
    # Decoded once at the end (two decodes of the window, none per token), not twice per token.
    assert counting.calls <= 3
    streamed = feed(tokenizer, ids, FinishReason("length", len(ids)), stream=True)
    assert plain.result()["text"] == streamed_text(streamed) == tokenizer.decode(ids) == TEXT
    assert plain.result()["output_ids"] == ids


def test_non_streamed_text_is_cut_at_a_stop_string(tokenizer) -> None:  # noqa: ANN001
    ids = tokenizer.encode("one two. three")
    finish = FinishReason("stop", ".")
    plain = feed(tokenizer, ids, finish, stream=False, stop=["."])
    streamed = feed(tokenizer, ids, finish, stream=True, stop=["."])
    assert plain.result()["text"] == streamed_text(streamed) == "one two"


def test_a_matched_stop_token_is_not_in_the_non_streamed_text(tokenizer) -> None:  # noqa: ANN001
    ids = [*tokenizer.encode("café"), IM_END_ID]
    plain = feed(tokenizer, ids, FinishReason("stop", IM_END_ID), stream=False, skip_special_tokens=False)
    assert plain.result()["text"] == "café"
    assert plain.result()["output_ids"] == ids


def test_a_last_character_cut_in_half_reads_as_the_tokenizer_decodes_it(tokenizer) -> None:  # noqa: ANN001
    ids = tokenizer.encode("🚀")
    assert len(ids) > 1  # the emoji's bytes span several tokens
    cut = ids[:-1]
    plain = feed(tokenizer, cut, FinishReason("length", len(cut)), stream=False)
    streamed = feed(tokenizer, cut, FinishReason("length", len(cut)), stream=True)
    assert plain.result()["text"] == streamed_text(streamed) == tokenizer.decode(cut)
    assert plain.result()["text"].endswith("\ufffd")
