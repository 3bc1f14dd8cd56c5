"""Constrained decoding (services/worker/runtime/sampling/grammar.py): `json_schema`, `regex` and `ebnf`.

References:
- transformers' own greedy `generate` on the same checkpoint with a logits processor that masks each
  step by an llguidance matcher of its own: our engine must give the same tokens (it stops once the
  grammar can go no further, where transformers spends one more step on the EOS the mask forces).
- Python's `re` and `json` on what comes out of sampled requests (temperature 1, many seeds): every
  output is a whole sentence of its grammar.
A constrained request in a batch leaves its neighbours' tokens as they are alone, with and without the
overlap schedule and with speculative decoding on; retraction (its matcher kept), chunked prefill and
mixed steps under overlap give the tokens of a plain run. Bad grammars are ValueErrors naming the field.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import llguidance
import llguidance.hf
import llguidance.torch
import pytest
import torch
from transformers import AutoTokenizer, LogitsProcessor, LogitsProcessorList

from services.worker.frontend.engine import Engine
from services.worker.runtime.sampling.grammar import unpack_bitmask
from shared.grammar_spec import spec_of
from shared.sampling_params import SamplingParams
from tests.engine_helpers import hf_model, output_ids, random_prompts

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
    },
    "required": ["city", "n", "ok"],
    "additionalProperties": False,
}
REGEX = r"(yes|no), [0-9]{1,3}!"
EBNF = 'root ::= "The " animal " says " ("hi" | "bye") "."\nanimal ::= "cat" | "dog" | "owl"'
CONSTRAINTS = [{"json_schema": json.dumps(SCHEMA)}, {"regex": REGEX}, {"ebnf": EBNF}]


def fits(constraint: dict[str, str], text: str) -> bool:
    """Whether `text` is a sentence of the constraint's grammar, judged without llguidance."""
    if "regex" in constraint:
        return re.fullmatch(REGEX, text) is not None
    if "ebnf" in constraint:
        return re.fullmatch(r"The (cat|dog|owl) says (hi|bye)\.", text) is not None
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (
        isinstance(value, dict) and set(value) == {"city", "n", "ok"}
        and isinstance(value["city"], str) and len(value["city"]) <= 6
        and type(value["n"]) is int and 0 <= value["n"] <= 999 and isinstance(value["ok"], bool)
        # The separators the backend fixes (grammar.JSON_DEFAULTS): json.dumps' own.
        and text == json.dumps(value, ensure_ascii=False)
    )


class MatcherMask(LogitsProcessor):
    """transformers-side reference: one llguidance matcher per row, fed the row's last token."""

    def __init__(self, path: Path, constraint: dict[str, str], prompt_len: int) -> None:
        tok = AutoTokenizer.from_pretrained(path)
        self.lltok = llguidance.hf.from_tokenizer(tok, n_vocab=hf_model(str(path)).config.vocab_size)
        _, grammar = spec_of(SamplingParams(**constraint))
        self.matcher = llguidance.LLMatcher(self.lltok, grammar, log_level=0)
        self.prompt_len = prompt_len
        self.eos = tok.eos_token_id

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.prompt_len:
            assert self.matcher.consume_token(int(input_ids[0, -1]))
        bitmask = llguidance.torch.allocate_token_bitmask(1, scores.shape[1])
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, 0)
        return scores.masked_fill(~unpack_bitmask(bitmask, scores.shape[1]), float("-inf"))


def hf_constrained(path: Path, prompt: list[int], constraint: dict[str, str], n: int) -> list[int]:
    mask = MatcherMask(path, constraint, len(prompt))
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model(str(path)).generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0,
            eos_token_id=mask.eos, logits_processor=LogitsProcessorList([mask]),
        )[0, len(prompt):].tolist()
    return out[:-1] if out and out[-1] == mask.eos else out


def without_eos(ids: list[int], eos: int) -> list[int]:
    return ids[:-1] if ids and ids[-1] == eos else ids


def check_constrained_batch(engine: Engine, path: Path) -> list[list[int]]:
    """Three constrained requests (CONSTRAINTS) and an unconstrained one in one batch on `engine`
    (serving the checkpoint at `path`): each constrained request's tokens are transformers' under the
    same masks, and they fit their grammar; the unconstrained request's tokens are its tokens alone.
    Returns the four prompts."""
    prompts = random_prompts(4, 5, 12, seed=31)
    eos = AutoTokenizer.from_pretrained(path).eos_token_id
    refs = [hf_constrained(path, p, c, 60) for p, c in zip(prompts, CONSTRAINTS)]
    free = engine.generate(input_ids=prompts[3], sampling_params={"temperature": 0, "max_new_tokens": 16})
    params = [{"temperature": 0, "max_new_tokens": 60, **c} for c in CONSTRAINTS]
    params.append({"temperature": 0, "max_new_tokens": 16})
    results = engine.generate(input_ids=prompts, sampling_params=params)
    got = output_ids(results)
    assert [without_eos(g, eos) for g in got[:3]] == refs
    assert got[3] == free["output_ids"]
    for constraint, result in zip(CONSTRAINTS, results):
        assert result["meta_info"]["finish_reason"]["type"] == "stop", result
        assert fits(constraint, result["text"]), result["text"]
    return prompts


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_constrained_tokens_match_transformers_with_a_masking_processor(qwen3_path: Path, overlap: bool) -> None:
    """check_constrained_batch on Qwen3, with and without the overlap schedule."""
    with Engine(str(qwen3_path), disable_overlap_schedule=not overlap) as engine:
        prompts = check_constrained_batch(engine, qwen3_path)
    # Without the constraint the same model writes something else: the masks did the work.
    assert not any(fits(c, r["text"]) for c, r in zip(CONSTRAINTS, engine_free_texts(qwen3_path, prompts[:3])))


def engine_free_texts(path: Path, prompts: list[list[int]]) -> list[dict]:
    with Engine(str(path)) as engine:
        return engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 40})


@pytest.mark.parametrize(
    "options",
    [{"max_total_tokens": 120}, {"chunked_prefill_size": 5}, {"enable_mixed_chunk": True, "chunked_prefill_size": 8}],
    ids=["retracting", "chunked", "mixed"],
)
def test_constrained_tokens_survive_retraction_chunking_and_mixed_steps_with_overlap(
    qwen3_path: Path, options: dict
) -> None:
    """Sixteen requests, three in four constrained: a small pool (retracted requests keep their matchers
    and resume), chunked prefill and mixed steps, with the overlap schedule, give the tokens of an
    ample pool without overlap."""
    prompts = random_prompts(16, 10, 20, seed=41)
    params = [
        {"temperature": 0, "max_new_tokens": 60, **CONSTRAINTS[i % 4]} if i % 4 < 3
        else {"temperature": 0, "max_new_tokens": 60, "ignore_eos": True}
        for i in range(len(prompts))
    ]
    runs = []
    for overlap, extra in ((False, {}), (True, options)):
        with Engine(str(qwen3_path), disable_overlap_schedule=not overlap, **extra) as engine:
            runs.append(engine.generate(input_ids=prompts, sampling_params=params))
            stats = engine.get_server_info()["stats"]
    assert output_ids(runs[1]) == output_ids(runs[0])
    if "max_total_tokens" in options:
        assert stats["num_retractions"] > 0
    for i, result in enumerate(runs[1]):
        if i % 4 < 3:
            assert fits(CONSTRAINTS[i % 4], result["text"]), result["text"]


def test_sampled_outputs_are_sentences_of_their_grammar(qwen3_path: Path) -> None:
    """Temperature 1, eight seeds a constraint: each output fits, judged by `re` and `json`."""
    prompt = random_prompts(1, 6, 6, seed=5)[0]
    with Engine(str(qwen3_path)) as engine:
        for constraint in CONSTRAINTS:
            results = engine.generate(
                input_ids=prompt,
                sampling_params={"temperature": 1.0, "max_new_tokens": 60, "n": 8, "seed": 7, **constraint},
            )
            texts = [r["text"] for r in results]
            assert all(r["meta_info"]["finish_reason"]["type"] == "stop" for r in results)
            assert all(fits(constraint, t) for t in texts), texts
            assert len(set(texts)) > 1  # sampled, not forced: the grammar leaves choices


def test_constrained_requests_do_not_speculate_and_keep_their_tokens(qwen3_path: Path) -> None:
    """With n-gram speculation on, a constrained request decodes one token a step (its mask follows
    each token): the same tokens as without speculation."""
    prompts = random_prompts(2, 6, 10, seed=8)
    params = [{"temperature": 0, "max_new_tokens": 40, **CONSTRAINTS[0]}, {"temperature": 0, "max_new_tokens": 24}]
    with Engine(str(qwen3_path)) as engine:
        plain = output_ids(engine.generate(input_ids=prompts, sampling_params=params))
    with Engine(str(qwen3_path), speculative_algorithm="ngram", speculative_num_draft_tokens=3) as engine:
        spec = output_ids(engine.generate(input_ids=prompts, sampling_params=params))
    assert spec == plain


def test_the_default_model_answers_in_the_schema(default_model_path: Path) -> None:
    """The embedded chat model, asked for JSON: free, it writes prose around it; constrained, the
    answer is the schema's object, and it knows the city."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    with Engine(str(default_model_path), max_total_tokens=2048) as engine:
        prompt = engine.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France? Answer in JSON with city and country."}])
        free = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 40})
        out = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 40, "json_schema": json.dumps(schema)})
    with pytest.raises(ValueError):
        json.loads(free["text"])
    value = json.loads(out["text"])
    assert set(value) == {"city", "country"} and value["city"] == "Paris"
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"regex": "[a-"}, "regex cannot be compiled: at 1(8): invalid regex"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
        ({"json_schema": "[1, 2]"}, "json_schema must be a JSON schema (an object), got list"),
        ({"json_schema": {"type": "nonsense"}}, "json_schema cannot be compiled: Invalid type: nonsense"),
        ({"json_schema": {"type": "array", "minContains": 1}}, 'json_schema cannot be compiled: Unimplemented keys: ["minContains"]'),
        ({"ebnf": "root ::= missing"}, "ebnf is not a grammar llguidance can read"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "regex and ebnf cannot be combined"),
    ],
)
def test_bad_grammars_are_value_errors_naming_the_field(qwen3_path: Path, params: dict, message: str, engine_cache: dict) -> None:
    if "qwen3" not in engine_cache:
        engine_cache["qwen3"] = Engine(str(qwen3_path))
    engine = engine_cache["qwen3"]
    with pytest.raises(ValueError) as caught:
        engine.generate(input_ids=[5, 6, 7], sampling_params=params)
    assert message in str(caught.value)


@pytest.fixture(scope="module")
def engine_cache() -> dict:
    cache: dict = {}
    yield cache
    for engine in cache.values():
        engine.shutdown()
