"""The detokenizer's core (no NATS): worker steps in, per-gateway text deltas out, by the offline
Engine's text rules, checked against the tokenizer's own decode of the whole output."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from services.detokenizer.detokenizer import Detokenizer
from shared.protocol import PROTOCOL_VERSION, BatchTokenOut, Finish, Logprobs, TokenOut, TopLogprob
from tests.checkpoints import IM_END_ID

TEXT = "naïve café — 東京 🚀 done."


@pytest.fixture(scope="module")
def tokenizer(llama_path: Path):  # noqa: ANN201
    return AutoTokenizer.from_pretrained(llama_path)


def step(n: int, *items: TokenOut, worker: str = "w1") -> BatchTokenOut:
    return BatchTokenOut(v=PROTOCOL_VERSION, worker_id=worker, step=n, items=list(items))


def token_outs(ids: list[int], rid: str = "r", gateway: str = "g", finish: Finish | None = None, **first: object) -> list[TokenOut]:
    """One TokenOut per token, as a worker sends them; the last one carries `finish`."""
    outs = [TokenOut(rid=rid, gateway_id=gateway, token_ids=[t]) for t in ids]
    outs[0].first = True
    for key, value in first.items():
        setattr(outs[0], key, value)
    outs[-1].finish = finish or Finish("length", matched=len(ids))
    return outs


def stream_text(detok: Detokenizer, outs: list[TokenOut]) -> list[str]:
    deltas = []
    for i, out in enumerate(outs):
        for message in detok.process(step(i, out)).values():
            deltas.extend(item.text for item in message.items)
    return deltas


def test_deltas_add_up_to_the_decoded_text_and_never_split_a_character(tokenizer) -> None:  # noqa: ANN001
    ids = tokenizer.encode(TEXT)
    assert len(ids) > len(TEXT) // 2  # multi-byte characters span several tokens
    deltas = stream_text(Detokenizer(tokenizer), token_outs(ids))
    assert "".join(deltas) == tokenizer.decode(ids) == TEXT
    assert all("\ufffd" not in d for d in deltas)


def test_a_length_finish_keeps_its_last_tokens_text(tokenizer) -> None:  # noqa: ANN001
    ids = tokenizer.encode("done.")
    deltas = stream_text(Detokenizer(tokenizer), token_outs(ids, finish=Finish("length", matched=len(ids))))
    assert "".join(deltas) == "done."


def test_a_matched_stop_token_stays_in_token_ids_but_not_in_the_text(tokenizer) -> None:  # noqa: ANN001
    ids = [*tokenizer.encode("café"), IM_END_ID]
    detok = Detokenizer(tokenizer)
    outs = token_outs(ids, finish=Finish("stop", matched=IM_END_ID), skip_special_tokens=False)
    deltas = stream_text(detok, outs)
    assert "".join(deltas) == "café"


def test_a_stop_string_is_held_back_mid_stream_and_cut_at_the_end(tokenizer) -> None:  # noqa: ANN001
    ids = tokenizer.encode("café — 東京")
    outs = token_outs(ids, finish=Finish("stop", matched="— 東"), stop=["— 東"])
    deltas = stream_text(Detokenizer(tokenizer), outs)
    assert "".join(deltas) == "café "
    assert not any("—" in d for d in deltas)


def test_one_message_per_gateway_per_step_with_each_requests_item(tokenizer) -> None:  # noqa: ANN001
    detok = Detokenizer(tokenizer)
    a, b = tokenizer.encode("ab"), tokenizer.encode("xy")
    batch = step(
        1,
        TokenOut(rid="a1", gateway_id="ga", token_ids=a[:1], first=True),
        TokenOut(rid="b1", gateway_id="gb", token_ids=b[:1], first=True),
        TokenOut(rid="a2", gateway_id="ga", token_ids=b[:1], first=True),
    )
    out = detok.process(batch)
    assert sorted(out) == ["ga", "gb"]
    assert [i.rid for i in out["ga"].items] == ["a1", "a2"] and [i.rid for i in out["gb"].items] == ["b1"]


def test_state_is_freed_on_the_final_and_for_silent_workers(tokenizer) -> None:  # noqa: ANN001
    detok = Detokenizer(tokenizer)
    ids = tokenizer.encode("hello")
    detok.process(step(1, TokenOut(rid="done", gateway_id="g", token_ids=ids[:1], first=True)), now=0.0)
    detok.process(step(1, TokenOut(rid="orphan", gateway_id="g", token_ids=ids[:1], first=True), worker="dead"), now=0.0)
    assert len(detok) == 2
    detok.process(step(2, TokenOut(rid="done", gateway_id="g", token_ids=ids[1:2], finish=Finish("length", matched=2))), now=50.0)
    assert len(detok) == 1
    assert detok.forget_silent_workers(60.0, now=55.0) == []
    assert detok.forget_silent_workers(60.0, now=61.0) == ["orphan"]
    assert len(detok) == 0


def test_logprob_requests_get_each_tokens_own_text(tokenizer) -> None:  # noqa: ANN001
    ids = tokenizer.encode("café")
    item = TokenOut(
        rid="r", gateway_id="g", token_ids=ids[:1], first=True,
        logprobs=Logprobs([-0.1], top=[[TopLogprob(ids[0], -0.1), TopLogprob(IM_END_ID, -3.0)]]),
    )
    (out,) = Detokenizer(tokenizer).process(step(1, item))["g"].items
    assert out.logprobs.texts == [tokenizer.decode(ids[:1])]
    assert out.logprobs.top_texts == [[tokenizer.decode(ids[:1]), tokenizer.decode([IM_END_ID])]]


@pytest.mark.parametrize(("text", "n_cut", "expected"), [
    ("ab\ufffd", 0, "ab"),  # a real U+FFFD, the last character
    ("ab 🚀", 3, "ab "),  # the request ends inside the rocket's 4 bytes: U+FFFD is its final text
])
def test_a_stop_string_in_the_last_text_is_cut_from_the_stream_too(tokenizer, text: str, n_cut: int, expected: str) -> None:  # noqa: ANN001
    # Text ending in U+FFFD is held back until the final; the final's stop cut must cover it too.
    ids = tokenizer.encode(text)
    ids = ids[: len(ids) - n_cut]
    assert tokenizer.decode(ids) == expected + "\ufffd"
    deltas = stream_text(Detokenizer(tokenizer), token_outs(ids, stop=["\ufffd"]))
    assert "".join(deltas) == expected


def test_a_real_u_fffd_stop_string_is_cut_where_the_text_has_it(tokenizer) -> None:  # noqa: ANN001
    ids = tokenizer.encode("東a\ufffdb 京")
    outs = token_outs(ids, finish=Finish("stop", matched="\ufffd"), stop=["\ufffd"])
    deltas = stream_text(Detokenizer(tokenizer), outs)
    assert "".join(deltas) == "東a"
