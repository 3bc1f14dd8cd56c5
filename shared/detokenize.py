"""Incremental detokenization: token ids in, text deltas out, never a broken UTF-8 character and
never a partial stop string.

Decoding a growing id list token by token is wrong for byte-level BPE (a character can span tokens)
and for tokenizers that merge spaces with neighbours; decoding the whole list each step is quadratic.
Like vLLM/SGLang we re-decode only a short window: text = decode(ids[prefix:]) minus decode(ids[prefix:read]),
where `prefix` trails `read` by one step, and hold the delta back while it ends in U+FFFD (an
incomplete character). Stop strings are matched against that finished text only (here and in the
worker's scheduler, see `finished_text`): a U+FFFD that stands for the first bytes of a character still
being generated, or for the last bytes of one cut off by a decode window, is never taken for a stop
string's own U+FFFD; a real U+FFFD in the text is, once the token after it shows it complete.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

REPLACEMENT = "\ufffd"


class Tokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def finished_text(decode: Callable[[list[int]], str], ids: list[int], prefix: int, read: int) -> tuple[str, int, int]:
    """The text that ids[read:] add after ids[:read], if it ends in a whole character, with the next
    (prefix, read); ("", prefix, read) while it ends in U+FFFD (an incomplete character, or a real
    U+FFFD that the next token shows complete). `prefix` <= `read` are the window indices of the
    previous call (0, 0 at first); the window starts on a character boundary, so no U+FFFD of a
    character cut in two ever shows at its start."""
    prefix_text = decode(ids[prefix:read])
    full = decode(ids[prefix:])
    if full.endswith(REPLACEMENT) or len(full) <= len(prefix_text):
        return "", prefix, read
    return full[len(prefix_text) :], read, len(ids)


class IncrementalDetokenizer:
    """One request's output text, built a step at a time."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.text = ""  # all text decoded so far (complete characters only)
        self.sent = 0  # characters of self.text already returned
        self._prefix = 0
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> None:
        self.ids.extend(token_ids)
        new, self._prefix, self._read = finished_text(self._decode, self.ids, self._prefix, self._read)
        self.text += new

    def resume(self, token_ids: list[int], sent_chars: int) -> None:
        """Continue a request whose first `token_ids` were detokenized elsewhere (it moved from a lost
        worker) and whose client has seen `sent_chars` characters of their text: the next delta
        starts after those."""
        self.add(token_ids)
        self.sent = max(0, min(sent_chars, len(self.text)))

    def _stop_cut(self) -> int | None:
        """Index in self.text where the first stop string begins, if one has appeared."""
        hits = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def delta(self, final: bool = False) -> str:
        """Text not yet returned. Mid-stream it stops short of anything that could be the start of a
        stop string; at the end it is cut where a stop string begins, also one in the last text."""
        if final and self._read < len(self.ids) and self._stop_cut() is None:
            # The text still held back at the very end (a trailing U+FFFD, real or of undecodable
            # bytes) is final now: it is emitted as the tokenizer decodes it, and cut like the rest.
            self.text += self._decode(self.ids[self._prefix :])[len(self._decode(self.ids[self._prefix : self._read])) :]
            self._read = len(self.ids)
        cut = self._stop_cut()
        end = len(self.text) if cut is None else cut
        if not final and cut is None:
            end -= self._partial_stop_len()
        end = max(end, self.sent)
        out = self.text[self.sent : end]
        self.sent = end
        return out

    def _partial_stop_len(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(self.text)), 0, -1):
                if self.text.endswith(stop[:k]):
                    best = max(best, k)
                    break
        return best

    def output_text(self) -> str:
        """The whole text, cut at the first stop string."""
        cut = self._stop_cut()
        return self.text if cut is None else self.text[:cut]
