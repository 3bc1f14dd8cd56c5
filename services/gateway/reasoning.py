"""Reasoning parsers: a thinking model's answer split into `reasoning_content` (what it wrote between
its think tags) and `content` (the rest), as SGLang's and vLLM's `--reasoning-parser` do.

    qwen3            Qwen3 (hybrid thinking): reasoning only when the answer opens with <think>; with
                     `chat_template_kwargs: {"enable_thinking": false}` it does not, and all is content.
    qwen3-thinking   Qwen3 thinking-only models and DeepSeek-R1, whose chat template opens <think> in the
    deepseek-r1      prompt: the answer starts in reasoning (a repeated <think> is dropped) until </think>.

ReasoningSplitter works on the text deltas as they stream: a delta that might be the start of a tag is
held until the next one decides it, so the streamed parts always add up to `split` of the whole text.
Whitespace around the reasoning and right after </think> is dropped; an answer without reasoning is
kept as written.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"
# parser name -> whether the answer starts inside the reasoning
PARSERS = {"qwen3": False, "qwen3-thinking": True, "deepseek-r1": True}

_UNDECIDED, _REASONING, _CONTENT = 0, 1, 2


def held_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (it may be a split tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ReasoningSplitter:
    """One choice's answer, fed delta by delta: feed() and finish() return (reasoning, content) deltas."""

    starts_in_reasoning: bool = False

    def __post_init__(self) -> None:
        self._state = _REASONING if self.starts_in_reasoning else _UNDECIDED
        self._held = ""
        self._fresh = True  # nothing of the current part emitted yet: its leading whitespace is dropped
        self._opened = not self.starts_in_reasoning  # a forced start may still repeat <think> once

    @classmethod
    def for_parser(cls, name: str) -> ReasoningSplitter:
        return cls(starts_in_reasoning=PARSERS[name])

    def feed(self, delta: str) -> tuple[str, str]:
        text = self._held + delta
        self._held = ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            if self._state == _UNDECIDED:
                stripped = text.lstrip()
                if stripped.startswith(START):
                    text, self._state, self._fresh = stripped[len(START):], _REASONING, True
                elif START.startswith(stripped):
                    self._held = text  # still possibly "<think>": wait for more
                    text = ""
                else:
                    self._state, self._fresh = _CONTENT, False  # no reasoning: the answer as written
            elif self._state == _REASONING:
                if not self._opened:
                    stripped = text.lstrip()
                    if START.startswith(stripped) and stripped != START:
                        self._held = text
                        break
                    self._opened = True
                    if stripped.startswith(START):
                        text = stripped[len(START):]
                        continue
                at = text.find(END)
                if at >= 0:
                    reasoning.append(self._part(text[:at].rstrip()))
                    text, self._state, self._fresh = text[at + len(END):], _CONTENT, True
                    continue
                # Held back: a split </think> at the end, and the whitespace before it, which is
                # dropped if </think> follows and sent with the next text otherwise.
                body = text[: len(text) - held_suffix(text, END)]
                core = body.rstrip()
                reasoning.append(self._part(core))
                self._held, text = text[len(core):], ""
            else:
                content.append(self._part(text))
                text = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is still held once the answer has ended: a would-be tag that never completed."""
        held, self._held = self._held, ""
        if self._state == _REASONING:
            return self._part(held.rstrip()), ""
        return "", held  # undecided to the end: no reasoning, so the answer as written

    def _part(self, text: str) -> str:
        if self._fresh:
            text = text.lstrip()
            self._fresh = not text
        return text


def split(text: str, parser: str) -> tuple[str, str]:
    """(reasoning, content) of a whole answer."""
    splitter = ReasoningSplitter.for_parser(parser)
    reasoning, content = splitter.feed(text)
    tail_reasoning, tail_content = splitter.finish()
    return reasoning + tail_reasoning, content + tail_content
