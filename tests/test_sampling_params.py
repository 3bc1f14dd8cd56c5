from __future__ import annotations

import pytest

from shared.sampling_params import SamplingParams

VOCAB = 100


def test_defaults_are_valid_and_match_sglang() -> None:
    p = SamplingParams()
    p.verify(VOCAB)
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 1.0, 1.0, -1, 0.0)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.seed is None and p.n == 1 and not p.ignore_eos and p.skip_special_tokens


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", "hot"),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", 0),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("max_new_tokens", -1),
        ("min_new_tokens", -1),
        ("frequency_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("presence_penalty", 3.0),
        ("presence_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("n", 0),
        ("stop_token_ids", [VOCAB]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1, "2"]),
        ("stop", [1]),
        ("stop", ["ok", 2]),
        ("stop", ""),
        ("seed", 1.5),
        ("seed", "42"),
        ("seed", True),
        ("logit_bias", {VOCAB: 1.0}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"3": 1.0}),
        ("logit_bias", {3: 100.5}),
        ("logit_bias", {3: float("nan")}),
        ("logit_bias", {3: "high"}),
        ("logit_bias", [3, 1.0]),
    ],
)
def test_bad_value_is_a_value_error_naming_the_field(field: str, value: object) -> None:
    params = SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=field):
        params.verify(VOCAB)


def test_min_new_tokens_above_max_new_tokens_is_rejected() -> None:
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingParams(max_new_tokens=5, min_new_tokens=6).verify(VOCAB)


def test_boundary_values_are_accepted() -> None:
    for params in (
        SamplingParams(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, max_new_tokens=0),
        SamplingParams(top_p=1e-6, top_k=1, min_p=1.0, frequency_penalty=-2.0, presence_penalty=2.0),
        SamplingParams(stop="x", stop_token_ids=[0, VOCAB - 1], seed=-7, min_new_tokens=128),
    ):
        params.verify(VOCAB)


def test_logit_bias_keys_may_be_json_strings_of_token_ids() -> None:
    params = SamplingParams.from_dict({"logit_bias": {"5": -100, 7: 100, " 9": 0.5}})
    assert params.logit_bias == {5: -100, 7: 100, 9: 0.5}
    params.verify(VOCAB)
    with pytest.raises(ValueError, match="logit_bias key 'five' is not a token id"):
        SamplingParams.from_dict({"logit_bias": {"five": 1}}).verify(VOCAB)


def test_from_dict_rejects_an_unknown_key_by_name() -> None:
    with pytest.raises(ValueError, match="temprature"):
        SamplingParams.from_dict({"temprature": 0.5})


def test_from_dict_reads_every_field() -> None:
    p = SamplingParams.from_dict({"max_new_tokens": 7, "top_k": 5, "stop": ["\n"], "seed": 3, "n": 2})
    assert (p.max_new_tokens, p.top_k, p.stop, p.seed, p.n) == (7, 5, ["\n"], 3, 2)
    assert SamplingParams.from_dict(None) == SamplingParams()


def test_generation_defaults_fill_only_unset_fields() -> None:
    defaults = {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "min_p": 0.05,
        "eos_token_id": 2,
        "do_sample": True,
    }
    p = SamplingParams.from_dict({"temperature": 0.3, "top_p": None}, defaults)
    assert p.temperature == 0.3
    assert p.top_p == 0.95
    assert p.top_k == 20
    assert p.min_p == 0.05
    assert p.repetition_penalty == 1.0
    assert SamplingParams.from_dict({"max_new_tokens": 4}, defaults).max_new_tokens == 4


def test_generation_default_keys_outside_the_sampling_set_are_ignored() -> None:
    p = SamplingParams.from_dict(
        {}, {"max_new_tokens": 3, "presence_penalty": 1.0, "repetition_penalty": 1.1}
    )
    assert p.max_new_tokens == 128 and p.presence_penalty == 0.0
    assert p.repetition_penalty == 1.1


def test_hf_top_k_zero_default_means_off() -> None:
    assert SamplingParams.from_dict({}, {"top_k": 0}).top_k == -1


def test_zero_temperature_normalizes_to_greedy_top_k_one() -> None:
    p = SamplingParams(temperature=0.0, top_k=40)
    p.verify(VOCAB)
    assert p.is_greedy
    p.normalize()
    assert (p.temperature, p.top_k) == (1.0, 1)
    assert p.is_greedy


def test_normalize_keeps_sampling_settings_and_lists_stop() -> None:
    p = SamplingParams(temperature=0.7, top_k=40, stop="END").normalize()
    assert (p.temperature, p.top_k, p.stop, p.stop_token_ids) == (0.7, 40, ["END"], [])
    assert not p.is_greedy
    assert SamplingParams().normalize().stop == []
