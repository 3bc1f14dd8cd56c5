"""Tool-call parsing: a model's answer in the Hermes format that Qwen2.5 and Qwen3 chat templates teach,

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

becomes OpenAI's `tool_calls` (`{"id", "type": "function", "function": {"name", "arguments": "<JSON>"}}`)
and the text outside the blocks, as vLLM's `hermes` and SGLang's `qwen25` parsers return it. A block
whose body is not a JSON object with a string `name` (and `arguments`, or Hermes' `parameters`, an
object or a string) stays in the content as written, as does a block the answer never closed (cut by
max_tokens).

ToolCallStreamer does the same on streamed text deltas: content flows until a `<tool_call>` starts (a
delta that may be half a tag waits for the next), then the block is held and comes out as one whole
call once `</tool_call>` arrives. Concatenated, the streamed content and calls equal `parse` of the
whole answer.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from services.gateway.reasoning import held_suffix
from shared.grammar_spec import JSON_DEFAULTS

START, END = "<tool_call>", "</tool_call>"
PARSERS = ("hermes", "qwen3")  # one format: Qwen's templates use Hermes' tags


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_from(body: str) -> dict[str, Any] | None:
    """The OpenAI tool call a block's body spells, or None when it spells none."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser goes
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        text = arguments
    elif isinstance(arguments, dict):
        text = json.dumps(arguments, ensure_ascii=False)
    else:
        return None
    return {"id": new_call_id(), "type": "function", "function": {"name": value["name"], "arguments": text}}


@dataclass
class ToolCallStreamer:
    """One choice's answer, fed delta by delta: (content delta, tool calls completed by this delta)."""

    _held: str = ""
    _in_block: bool = False
    calls: int = field(default=0)  # tool calls emitted so far (their `index` in streamed deltas)

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        text = self._held + delta
        self._held = ""
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while text:
            if not self._in_block:
                at = text.find(START)
                if at < 0:
                    keep = held_suffix(text, START)
                    content.append(text[: len(text) - keep])
                    self._held, text = text[len(text) - keep:], ""
                    break
                content.append(text[:at])
                text, self._in_block = text[at + len(START):], True
                continue
            at = text.find(END)
            if at < 0:
                self._held, text = text, ""
                break
            body, text, self._in_block = text[:at], text[at + len(END):], False
            call = call_from(body)
            if call is None:
                content.append(START + body + END)
            else:
                calls.append(call)
        self.calls += len(calls)
        return "".join(content), calls

    def finish(self) -> str:
        """Content still held once the answer ended: a half tag, or a block never closed."""
        held, self._held = self._held, ""
        if self._in_block:
            self._in_block = False
            return START + held
        return held


def parse(text: str) -> tuple[str, list[dict[str, Any]]]:
    """(content, tool calls) of a whole answer."""
    streamer = ToolCallStreamer()
    content, calls = streamer.feed(text)
    return content + streamer.finish(), calls


def forced_call_grammar(tools: list[dict[str, Any]], name: str | None, parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect, sent as the request's `ebnf`) whose sentences are Hermes
    tool-call blocks and nothing else: OpenAI's tool_choice "required" (a call to any of `tools`, more
    than one unless `parallel` is False) or a named function (`name`: exactly one call to it). Each
    block's body is {"name": <the tool>, "arguments": <an object its parameters schema allows>}."""
    bodies = []
    for tool in tools:
        function = tool["function"]
        if name is not None and function["name"] != name:
            continue
        parameters = function.get("parameters") or {"type": "object"}
        bodies.append({
            "type": "object",
            "properties": {"name": {"const": function["name"]}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    schema = {"anyOf": bodies, "x-guidance": JSON_DEFAULTS}  # the JSON form response_format gets
    call = f'call: "{START}\\n" %json {json.dumps(schema)} "\\n{END}"'
    start = 'start: call ("\\n" call)*' if parallel and name is None else "start: call"
    return f"{start}\n{call}\n"
