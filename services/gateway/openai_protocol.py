"""OpenAI-compatible request bodies (`/v1/chat/completions`, `/v1/completions`) and their translation
into the gateway's GenerateSpec.

Bodies are validated strictly: a wrong type is a 400 naming the field, never a silent coercion.
Ranges shared with SGLang's sampling parameters (temperature, top_p, top_k, min_p, penalties, seed,
stop) are checked by Sampling.validate with the same field names; only the fields whose names
differ from it (max_tokens, n, logprobs) carry their own bounds here. Unknown fields are ignored, as
OpenAI's SDKs send fields a server may not know.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, WithJsonSchema

from services.gateway.errors import bad_request
from services.gateway.generate_spec import MAX_N, MAX_TOP_LOGPROBS, GenerateSpec, check_token_ids
from services.gateway.request_body import (
    ID_PROMPTS,
    REQUEST_TIMEOUT,
    TEXT_PROMPTS,
    Count,
    RequestBody,
    SamplingValues,
    StrictModel,
    TemplateKwargs,
    logit_bias_ids,
)
from services.gateway.tool_calls import forced_call_grammar
from shared.grammar_spec import check_grammar
from shared.protocol import ChatMessage, Sampling
from shared.sampling_params import SamplingParams

# Sampling fields OpenAI names otherwise (the rest keep Sampling's names).
OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "json_schema": "response_format"}
# Sampling fields `SamplingFields.sampling` sets from something other than the same-named body field:
# max_tokens (two names, and a per-endpoint default), the constraint (constraint()), and the values
# that change form on the way (stop as a list, seed + choice, logit_bias keyed by id).
_SET_APART = ("max_new_tokens", "stop", "seed", "logit_bias", "json_schema", "regex", "ebnf")
# What OpenAI's completions endpoint generates when max_tokens is not given.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# OpenAI's three forms (a json_schema's schema must also compile, which JSON Schema cannot say).
RESPONSE_FORMAT: dict[str, Any] = {
    "description": "{\"type\": \"text\" | \"json_object\" | \"json_schema\", \"json_schema\": {\"name\", \"schema\"}}",
    "properties": {"type": {"enum": ["text", "json_object", "json_schema", None]}},
    "if": {"properties": {"type": {"const": "json_schema"}}, "required": ["type"]},
    "then": {"properties": {"json_schema": {"type": "object", "properties": {"schema": {"type": "object"}},
                                            "required": ["schema"]}}, "required": ["json_schema"]},
}


NAMED: dict[str, Any] = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1}}, "required": ["name"]}
TOOL: dict[str, Any] = {"type": "object", "properties": {"type": {"const": "function"}, "function": NAMED},
                        "required": ["type", "function"]}


def _is_name(value: object) -> bool:
    return isinstance(value, str) and bool(value)


class StreamOptions(StrictModel):
    include_usage: bool = False


class SamplingFields(RequestBody, SamplingValues):
    """The sampling knobs both endpoints take (OpenAI's, plus SGLang's top_k/min_p/... extensions)."""

    model: str | None = Field(None, description="a model a live worker serves (GET /v1/models); None: any")
    n: int = Field(1, ge=1, le=MAX_N, description="choices to generate (each its own request, seeds seed+i)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    min_tokens: Count | None = Field(None, description="at most max_tokens (or max_completion_tokens)")
    rid: str | None = Field(None, description="request id (choice i of n > 1 gets `<rid>-<i>`)")
    user: str | None = None
    response_format: dict[str, object] | None = Field(None, json_schema_extra=RESPONSE_FORMAT)
    timeout: float | None = Field(None, gt=0, le=86_400, description=REQUEST_TIMEOUT)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def constraint(self) -> dict[str, str]:
        """The Sampling fields of the output's constraint (constrained decoding), from response_format
        or SGLang's regex/ebnf; 400 naming the field for a form no worker can run."""
        given: dict[str, str] = {}
        fmt = self.response_format
        if fmt is not None:
            kind = fmt.get("type")
            if kind == "json_object":
                given["json_schema"] = '{"type": "object"}'
            elif kind == "json_schema":
                spec = fmt.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise bad_request("response_format json_schema needs {\"json_schema\": {\"name\": ..., "
                                      "\"schema\": {...}}}", "response_format")
                given["json_schema"] = json.dumps(schema)
            elif kind not in (None, "text"):
                raise bad_request(f"response_format type must be text, json_object or json_schema, got {kind!r}",
                                  "response_format")
        for name in ("regex", "ebnf"):
            value = getattr(self, name)
            if value is not None:
                given[name] = value
        names = ["response_format" if k == "json_schema" else k for k in given]
        if len(given) > 1:
            raise bad_request(f"{names[0]} and {names[1]} cannot be combined: one constraint per request", names[1])
        if given:
            try:
                check_grammar(SamplingParams(**given))  # type: ignore[arg-type]
            except ValueError as exc:
                raise bad_request(str(exc), names[0]) from None
        return given

    def sampling(self, max_new_tokens: int | None, choice: int, constraint: dict[str, str] | None = None) -> Sampling:
        """Choice `choice`'s Sampling: every field read from this body under its OpenAI name (a Sampling
        field this body lacks fails here, and in tests/test_request_contract.py)."""
        values = {name: getattr(self, OPENAI_NAMES.get(name, name))
                  for name in Sampling.__struct_fields__ if name not in _SET_APART}
        return Sampling(
            **values,
            max_new_tokens=max_new_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else self.stop,
            seed=None if self.seed is None else self.seed + choice,
            logit_bias=logit_bias_ids(self.logit_bias),
            **(constraint or {}),
        )

    def check_min_tokens(self, max_new: int | None, max_name: str) -> None:
        """400 naming min_tokens when it exceeds the answer's length limit, in the names this body used
        (the doors' shared check would name SGLang's min_new_tokens and max_new_tokens)."""
        if self.min_tokens is not None and max_new is not None and self.min_tokens > max_new:
            raise bad_request(f"min_tokens ({self.min_tokens}) must not exceed {max_name} ({max_new})", "min_tokens")

    def choice_rid(self, prompt_index: int, choice: int, prompts: int) -> str | None:
        if self.rid is None:
            return None
        if prompts == 1 and self.n == 1:
            return self.rid
        return f"{self.rid}-{prompt_index * self.n + choice}"


class ContentPart(StrictModel):
    """Text only (the check, with its message, is ChatMessageIn.text's)."""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra={"required": ["type", "text"]})

    type: str = Field(json_schema_extra={"const": "text"})
    text: Annotated[str | None, WithJsonSchema({"type": "string"})] = None


class ChatMessageIn(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, object]] | None = None  # an assistant turn's calls, as a reply gave them
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def message(self, index: int) -> ChatMessage:
        return ChatMessage(role=self.role, content=self.text(index), tool_calls=self.tool_calls or None,
                           tool_call_id=self.tool_call_id, name=self.name)

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise bad_request(
                    f"only text content parts are supported, got type {part.type!r}",
                    f"messages.{index}.content.{j}.type",
                )
            texts.append(part.text)
        return "".join(texts)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    # Conditions between fields, as JSON Schema states them (the checks are in specs()).
    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra={"allOf": [
        {"if": {"properties": {"top_logprobs": {"type": "integer", "minimum": 1}}, "required": ["top_logprobs"]},
         "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}},
        {"if": {"properties": {"tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]}},
                "required": ["tool_choice"]},
         "then": {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]}},
    ]})

    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: Count | None = Field(None, description="deprecated by OpenAI for max_completion_tokens")
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="needs logprobs: true")
    tools: list[dict[str, object]] | None = Field(None, json_schema_extra={"items": TOOL}, description=(
        "function tools, for a gateway started with --tool-call-parser (else a 400 unless tool_choice is none)"))
    tool_choice: str | dict[str, object] | None = Field(None, json_schema_extra={"anyOf": [
        {"enum": ["auto", "none", "required"]},
        {"type": "object", "properties": {"type": {"const": "function"}, "function": NAMED}, "required": ["type", "function"]},
        {"type": "null"}]}, description="a named function must be among the tools")
    parallel_tool_calls: bool | None = None
    # Not supported: only their empty forms are accepted.
    functions: list[dict[str, object]] | None = Field(None, json_schema_extra={"maxItems": 0})
    function_call: str | dict[str, object] | None = Field(None, json_schema_extra={"anyOf": [{"const": "none"},
                                                                                              {"type": "null"}]})
    modalities: list[str] | None = Field(None, json_schema_extra={"items": {"const": "text"}, "maxItems": 1})
    audio: Annotated[dict[str, object] | None, WithJsonSchema({"type": "null"})] = None
    add_generation_prompt: bool = True
    separate_reasoning: bool = Field(
        True, description="with the gateway's --reasoning-parser: reasoning in reasoning_content (false: all in content)")
    chat_template_kwargs: TemplateKwargs | None = None

    def uses_tools(self) -> bool:
        """Whether the model gets the tools (and its answer is parsed for calls)."""
        return bool(self.tools) and self.tool_choice != "none"

    def forced_tool_call(self) -> str | None:
        """The grammar that makes the answer tool calls only, for tool_choice "required" or a named
        function (forced_call_grammar); None for "auto", "none" or unset. 400 naming tool_choice for
        any other value, a name no tool has, or tools whose parameters cannot be compiled."""
        choice = self.tool_choice
        if choice in (None, "auto", "none"):
            return None
        if choice == "required":
            name = None
        elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
            name = choice["function"].get("name")  # type: ignore[union-attr]
            if not isinstance(name, str) or not name:
                raise bad_request("a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                                  "tool_choice")
        else:
            raise bad_request("tool_choice must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                              "\"function\": {\"name\": ...}}", "tool_choice")
        if not self.tools:
            raise bad_request(f"tool_choice {choice!r} needs tools", "tool_choice")
        if name is not None and not any(t.get("function", {}).get("name") == name for t in self.tools  # type: ignore[union-attr]
                                        if isinstance(t.get("function"), dict)):
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        grammar = forced_call_grammar(self.tools, name, self.parallel_tool_calls is not False)  # type: ignore[arg-type]
        try:
            check_grammar(SamplingParams(ebnf=grammar))
        except ValueError as exc:
            raise bad_request(f"the tools' parameters cannot be enforced: {exc}", "tools") from None
        return grammar

    def specs(self, default_max_tokens: int | None, tool_parser: str | None = None) -> list[GenerateSpec]:
        """One GenerateSpec per choice. Without max_tokens the answer may fill the context
        (`default_max_tokens`, which the worker clips to what the prompt leaves). Tools need the
        gateway's tool_parser to read the calls back."""
        if self.uses_tools() and tool_parser is None:
            raise bad_request("tools need a gateway started with --tool-call-parser", "tools")
        for i, tool in enumerate(self.tools or []):
            function = tool.get("function")
            if tool.get("type") != "function" or not isinstance(function, dict) or not _is_name(function.get("name")):
                raise bad_request("a tool is {\"type\": \"function\", \"function\": {\"name\": ...}}", f"tools.{i}")
        if self.functions:
            raise bad_request("functions are not supported", "functions")
        if self.function_call not in (None, "none"):
            raise bad_request("function_call is not supported (no functions)", "function_call")
        if self.audio is not None or (self.modalities and self.modalities != ["text"]):
            raise bad_request("only text output is supported (modalities ['text'], no audio)",
                              "audio" if self.audio is not None else "modalities")
        constraint = self.constraint()
        forced = self.forced_tool_call()
        if forced is not None:
            if constraint:
                field = "response_format" if "json_schema" in constraint else next(iter(constraint))
                raise bad_request(f"tool_choice {self.tool_choice!r} and {field} cannot be combined", field)
            constraint = {"ebnf": forced}
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        messages = [m.message(i) for i, m in enumerate(self.messages)]
        limits = ((self.max_completion_tokens, "max_completion_tokens"), (self.max_tokens, "max_tokens"),
                  (default_max_tokens, "the context's length"))
        max_new, limit_name = next(((v, name) for v, name in limits if v is not None), (None, ""))
        self.check_min_tokens(max_new, limit_name)
        return [
            GenerateSpec(
                sampling=self.sampling(max_new, i, constraint),
                messages=messages,
                model=self.model,
                rid=self.choice_rid(0, i, 1),
                return_logprob=self.logprobs,
                top_logprobs_num=self.top_logprobs or 0,
                add_generation_prompt=self.add_generation_prompt,
                chat_template_kwargs=self.chat_template_kwargs,
                tools=self.tools if self.uses_tools() else None,
                timeout=self.timeout,
            )
            for i in range(self.n)
        ]


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `prompt` is a string, a list of strings, token ids or lists of them; a
    list is a batch: choice `p * n + i` is the i-th of prompt p."""

    model_config = ConfigDict(strict=True, extra="ignore")

    prompt: Annotated[str | list[str] | list[int] | list[list[int]], WithJsonSchema({"anyOf": [
        *TEXT_PROMPTS, *ID_PROMPTS], "description": "a prompt, or a batch of them (at most the gateway's --max-batch-size): text or token ids"})]
    max_tokens: Count | None = COMPLETIONS_DEFAULT_MAX_TOKENS
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="top logprobs per token")
    echo: bool = Field(False, description="the prompt before the completion (a token-id prompt decoded), and with "
                       "logprobs its tokens' log-probs first")
    suffix: str | None = Field(None, json_schema_extra={"maxLength": 0}, description="not supported")
    best_of: int | None = Field(None, ge=1, description="1 or n only: each choice is its own generation")

    def prompts(self, max_batch: int | None = None) -> list[str | list[int]]:
        p = self.prompt
        prompts: list[str | list[int]]
        if isinstance(p, str):
            prompts = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]  # type: ignore[arg-type]
        else:
            prompts = list(p)  # type: ignore[arg-type]
        if not prompts or not all(prompts):
            raise bad_request("prompt must not be empty", "prompt")
        if max_batch is not None and len(prompts) > max_batch:
            raise bad_request(f"prompt: a batch of {len(prompts)} prompts; the limit is {max_batch}", "prompt")
        for prompt in prompts:
            if isinstance(prompt, list):
                check_token_ids(prompt, "prompt")
        return prompts

    def specs(self, max_batch: int | None = None) -> list[GenerateSpec]:
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of not in (1, self.n):
            raise bad_request(f"best_of is not supported (ask for n choices instead), got best_of {self.best_of} "
                              f"with n {self.n}", "best_of")
        prompts = self.prompts(max_batch)
        self.check_min_tokens(self.max_tokens, "max_tokens")
        constraint = self.constraint()
        specs = []
        for p_index, prompt in enumerate(prompts):
            for i in range(self.n):
                specs.append(
                    GenerateSpec(
                        sampling=self.sampling(self.max_tokens, i, constraint),
                        text=prompt if isinstance(prompt, str) else None,
                        input_ids=prompt if isinstance(prompt, list) else None,
                        model=self.model,
                        rid=self.choice_rid(p_index, i, len(prompts)),
                        top_logprobs_num=self.logprobs or 0,
                        # echo with logprobs lists the prompt's tokens first, with their log-probs; a
                        # token-id prompt's echo is their text, which comes with them.
                        return_logprob=self.logprobs is not None or (self.echo and isinstance(prompt, list)),
                        logprob_start_len=0 if self.echo and (self.logprobs is not None or isinstance(prompt, list)) else None,
                        timeout=self.timeout,
                        prompt_param="prompt",
                    )
                )
        return specs
