"""One request contract (shared.protocol.Sampling): every other form of a request's sampling fields — the
worker's SamplingParams, the HTTP bodies (native and OpenAI), the gRPC message in proto/radixserve.proto
— has the same fields, so a field added to Sampling but forgotten in one of them fails here. And the
checks happen at the edge (Sampling.validate) and in the worker, not in the tokenizer."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import msgspec
import pytest
from transformers import AutoTokenizer

from services.gateway.grpc_server import sampling_from_proto
from services.gateway.native_api import NativeSampling
from services.gateway.openai_protocol import OPENAI_NAMES, ChatCompletionRequest, SamplingFields
from services.gateway.protos import radixserve_pb2
from services.tokenizer.prompt_tokenizer import PromptTokenizer, generate_request
from shared.protocol import PROTOCOL_VERSION, GenerateRequest, Sampling, TokenizeRequest
from shared.request_contract import prompt_field
from shared.sampling_params import SamplingParams
from tests.services_helpers import REPO_ROOT

SAMPLING_FIELDS = set(Sampling.__struct_fields__)
# proto3 scalar types as the Python types Sampling declares for them.
_PROTO_TYPES = {"int32": int, "int64": int, "double": float, "float": float, "string": str, "bool": bool}


def proto_sampling_fields() -> dict[str, object]:
    """proto/radixserve.proto's `message SamplingParams`, parsed: field name -> Python type."""
    text = (REPO_ROOT / "proto" / "radixserve.proto").read_text()
    body = re.search(r"message SamplingParams \{(.*?)\n\}", text, re.S)
    assert body is not None, "proto/radixserve.proto has no message SamplingParams"
    fields: dict[str, object] = {}
    for line in body.group(1).splitlines():
        line = line.split("//", 1)[0].strip()
        if not line:
            continue
        found = re.fullmatch(r"(optional|repeated)?\s*(map<(\w+),\s*(\w+)>|\w+)\s+(\w+)\s*=\s*\d+;", line)
        assert found is not None, f"a SamplingParams line this test cannot read: {line!r}"
        label, kind, key, value, name = found.groups()
        if key is not None:
            fields[name] = dict[_PROTO_TYPES[key], _PROTO_TYPES[value]]  # type: ignore[misc]
        elif label == "repeated":
            fields[name] = list[_PROTO_TYPES[kind]]  # type: ignore[misc]
        else:
            assert label == "optional", f"{name}: a scalar must be optional (unset means the model's default)"
            fields[name] = _PROTO_TYPES[kind]
    return fields


def sampling_types() -> dict[str, object]:
    """Sampling's field types without their `| None` (every field is optional on the wire)."""
    hints = typing.get_type_hints(Sampling)
    out = {}
    for name in Sampling.__struct_fields__:
        args = [a for a in typing.get_args(hints[name]) if a is not type(None)]
        assert len(args) == 1, f"Sampling.{name} must be `<type> | None`"
        out[name] = args[0]
    return out


def test_the_proto_declares_samplings_fields_with_the_same_types() -> None:
    assert proto_sampling_fields() == sampling_types()


def test_grpc_reads_every_sampling_field_from_the_proto() -> None:
    every = radixserve_pb2.SamplingParams(
        max_new_tokens=9, min_new_tokens=1, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, frequency_penalty=0.2,
        presence_penalty=0.3, repetition_penalty=1.1, stop=["x"], stop_token_ids=[7], ignore_eos=False,
        skip_special_tokens=False, seed=3, logit_bias={4: -1.0}, json_schema="{}", regex="a", ebnf="root ::= \"a\"",
    )
    read = sampling_from_proto(every)
    assert [f for f in SAMPLING_FIELDS if getattr(read, f) is None] == []
    assert (read.ignore_eos, read.stop, read.logit_bias, read.seed) == (False, ["x"], {4: -1.0}, 3)
    assert sampling_from_proto(radixserve_pb2.SamplingParams()) == Sampling()


def test_the_workers_sampling_params_are_samplings_fields_plus_n() -> None:
    assert {f.name for f in dataclasses.fields(SamplingParams)} == SAMPLING_FIELDS | {"n"}


def test_the_native_http_body_takes_every_sampling_field() -> None:
    assert set(NativeSampling.model_fields) == SAMPLING_FIELDS | {"n"}
    values = {"max_new_tokens": 9, "min_new_tokens": 1, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
              "frequency_penalty": 0.2, "presence_penalty": 0.3, "repetition_penalty": 1.1, "stop": "x",
              "stop_token_ids": [7], "ignore_eos": False, "skip_special_tokens": False, "seed": 3,
              "logit_bias": {"4": -1.0}, "json_schema": "{}", "regex": "a", "ebnf": "root ::= \"a\""}
    assert set(values) == SAMPLING_FIELDS
    read = NativeSampling.model_validate(values).sampling(choice=1)
    assert [f for f in SAMPLING_FIELDS if getattr(read, f) is None] == []
    assert (read.stop, read.seed, read.logit_bias) == (["x"], 4, {4: -1.0})


def test_the_openai_bodies_take_every_sampling_field_under_its_openai_name() -> None:
    openai_names = {OPENAI_NAMES.get(f, f) for f in SAMPLING_FIELDS}
    assert openai_names - set(SamplingFields.model_fields) == {"max_tokens"}  # each endpoint declares its own
    assert "max_tokens" in ChatCompletionRequest.model_fields
    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "min_tokens": 1, "temperature": 0.5,
        "top_p": 0.9, "top_k": 5, "min_p": 0.1, "frequency_penalty": 0.2, "presence_penalty": 0.3,
        "repetition_penalty": 1.1, "stop": ["x"], "stop_token_ids": [7], "ignore_eos": False,
        "skip_special_tokens": False, "seed": 3, "logit_bias": {"4": -1.0}, "regex": "a"})
    (spec,) = body.specs(default_max_tokens=None)
    unset = [f for f in SAMPLING_FIELDS if getattr(spec.sampling, f) is None]
    assert sorted(unset) == ["ebnf", "json_schema"]  # one constraint per request: regex here


def test_sampling_validate_names_the_field_without_a_tokenizer() -> None:
    Sampling(temperature=0.0, stop=["\n"], stop_token_ids=[2**31 - 1]).validate()
    for sampling, message in [
        (Sampling(temperature=-1.0), "temperature must be >= 0"),
        (Sampling(max_new_tokens=2**31), "max_new_tokens must be <= 2147483647"),
        (Sampling(seed=2**63), "seed must be in"),
        (Sampling(stop_token_ids=[2**31]), "stop_token_ids entry 2147483648 is not a token id"),
        (Sampling(min_new_tokens=200), "min_new_tokens (200) must not exceed max_new_tokens (128)"),
        (Sampling(regex="("), "regex"),
    ]:
        with pytest.raises(ValueError) as caught:
            sampling.validate()
        assert str(caught.value).startswith(message.split(" ")[0]) and message in str(caught.value)


def test_exactly_one_prompt_form() -> None:
    assert prompt_field("a", None, None) == "text"
    assert prompt_field(None, [], None) == "messages"
    assert prompt_field(None, None, [1]) == "input_ids"
    for given in [(None, None, None), ("a", None, [1])]:
        with pytest.raises(ValueError, match="give exactly one of `text`, `messages` or `input_ids`"):
            prompt_field(*given)


def test_the_tokenizer_passes_sampling_on_unchecked(qwen3_path: Path) -> None:
    """The gateway checked it; the worker checks it against its vocabulary (tests/test_pipeline.py's
    test_a_bad_sampling_value_past_the_gateway_is_refused_by_the_worker)."""
    tok = AutoTokenizer.from_pretrained(qwen3_path)
    prompts = PromptTokenizer(tok, vocab_size=len(tok), context_len=256)
    bad = Sampling(temperature=-1.0, stop_token_ids=[10**6])
    req = TokenizeRequest(v=PROTOCOL_VERSION, rid="r", gateway_id="g", worker_id="w", sampling=bad, text="hi")
    sent = prompts.to_generate(req)
    assert sent.sampling == bad and sent.input_ids == tok.encode("hi")
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        bad.validate()
    with pytest.raises(ValueError, match="prompt has"):  # what needs the model's figures stays its check
        prompts.to_generate(msgspec.structs.replace(req, text="hi " * 300))


def test_a_generate_request_carries_every_field_of_its_tokenize_request() -> None:
    """Every GenerateRequest field but the prompt comes from the TokenizeRequest (none left at a default)."""
    assert set(GenerateRequest.__struct_fields__) - set(TokenizeRequest.__struct_fields__) == set()
    req = TokenizeRequest(v=PROTOCOL_VERSION, rid="r", gateway_id="g", worker_id="w", sampling=Sampling(seed=3), text="hi",
                          return_logprob=True, top_logprobs_num=2, priority=5, stream=False, resume_ids=[7], resume_chars=1)
    sent = generate_request(req, [1, 2])
    assert sent == GenerateRequest(v=PROTOCOL_VERSION, rid="r", gateway_id="g", input_ids=[1, 2], sampling=Sampling(seed=3),
                                   return_logprob=True, top_logprobs_num=2, priority=5, stream=False, resume_ids=[7],
                                   resume_chars=1)
