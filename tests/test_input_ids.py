"""shared/input_ids.validate_input_ids, what every front door's prompt ids go through before a Req is built:
plain ints pass (int subclasses such as an IntEnum too), anything else gets a PromptError naming the field."""

from __future__ import annotations

import enum

import pytest

from shared.input_ids import PromptError, validate_input_ids


class Token(enum.IntEnum):
    HELLO = 7


@pytest.mark.parametrize("ids", [[1, 2, 3], [0, 99], [Token.HELLO, 3], list(range(60))])
def test_integer_ids_pass(ids: list[int]) -> None:
    validate_input_ids(ids, vocab_size=100, context_len=100, pool_tokens=1000)


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([1, True], "must be a list of integers"),
        ([1, "2"], "must be a list of integers"),
        ([1, 2.0], "must be a list of integers"),
        ((1, 2), "must be a list of integers"),
        ([], "the prompt is empty"),
        ([1, 100], r"outside \[0, 100\): 100"),
        ([-1, 3], r"outside \[0, 100\): -1"),
        (list(range(100)), "the model's context is 100"),
    ],
)
def test_anything_else_is_refused_naming_the_field(ids: object, message: str) -> None:
    with pytest.raises(PromptError, match=message) as err:
        validate_input_ids(ids, vocab_size=100, context_len=100, pool_tokens=1000, field="prompt")
    assert "`prompt`" in str(err.value)
