"""Constrained decoding: a request's output held to a JSON schema, a regular expression or an EBNF
grammar (SGLang's `json_schema`, `regex` and `ebnf` sampling parameters; OpenAI's `response_format`).

The grammar engine is llguidance (a Rust library that vLLM and SGLang also offer as a backend): from the
grammar and the tokenizer's vocabulary it computes, before each step, the set of tokens that keep the
output a prefix of some sentence of the grammar. Here:

  spec_of, check_grammar    shared/grammar_spec.py: the request's grammar, and the torch-free check that
                            it compiles (the gateway and the Engine refuse bad ones before they queue)
  GrammarBackend            per scheduler: the tokenizer as llguidance reads it (built on a thread when
                            the scheduler starts, ~0.4 s for a 49k vocabulary) and a matcher per request
  MaskBuffers               per runner: the constrained rows' next-token bitmasks, computed by
                            llguidance into reused (pinned) host memory and copied to the device
                            (ModelRunner.sample_async)
  apply_bitmask(...)        the sampler's step after the penalties and logit_bias: disallowed tokens
                            to -inf (kernels/token_bitmask.py on CUDA, torch ops on the CPU)

A matcher advances with each token the request gains (Scheduler._add_tokens). When the grammar can go
no further the request finishes with reason 'stop' (no EOS step is spent); a token the grammar refuses,
which the mask makes impossible unless min_new_tokens bans the grammar's only way out, ends the request
as 'abort' with the matcher's reason.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any

import torch

from shared.grammar_spec import llguidance, short_error, spec_of

if TYPE_CHECKING:
    from shared.sampling_params import SamplingParams

# From this many constrained rows a CUDA step computes their masks on llguidance's thread pool. Fewer
# rows, or a CPU step (whose compute threads hold the cores), compute them one after another: a mask
# takes 1-10 us for typical grammars, less than handing work to the pool.
PARALLEL_MIN_ROWS = 16


class GrammarBackend:
    """llguidance's view of one model's vocabulary, and the matchers of its constrained requests.

    `tokenizer` is the checkpoint's transformers tokenizer (a fast one); `vocab_size` the model's
    logits width (it may exceed the tokenizer's: padding rows are never allowed). Building the
    vocabulary index takes ~0.4 s for 49k tokens (~1 s for Qwen3's 151k); `prebuild()` starts it on a
    thread so that the first constrained request does not hold the scheduler that long."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        self._prebuild: threading.Thread | None = None

    def prebuild(self) -> None:
        """Build the vocabulary index on a daemon thread now (errors surface at the first use)."""
        self._prebuild = threading.Thread(target=self._try_build, name="grammar-vocab", daemon=True)
        self._prebuild.start()

    def close(self, timeout: float = 30.0) -> None:
        """Wait for prebuild()'s thread: a process that exits while llguidance builds the index aborts
        ("terminate called without an active exception", exit code -6), as a rank of a group that ended
        less than a second after it started did."""
        if self._prebuild is not None:
            self._prebuild.join(timeout)

    def _try_build(self) -> None:
        with contextlib.suppress(Exception):
            self._lltokenizer()

    def _lltokenizer(self) -> Any:
        with self._lock:  # a request that comes during prebuild() waits for it
            if self._tokenizer is None:
                if self._hf_tokenizer is None:
                    raise ValueError("constrained decoding needs a tokenizer; this checkpoint has none")
                # Imported here: llguidance's HF bridge loads transformers, needed only once a grammar is.
                from llguidance.hf import from_tokenizer

                self._tokenizer = from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size)
            return self._tokenizer

    def matcher(self, params: SamplingParams) -> Any | None:
        """A fresh matcher for the request's grammar (None without one); ValueError if it cannot be
        compiled against this vocabulary."""
        spec = spec_of(params)
        if spec is None:
            return None
        field, grammar = spec
        matcher = llguidance().LLMatcher(self._lltokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{field} cannot be compiled: {short_error(matcher.get_error())}")
        return matcher


class MaskBuffers:
    """Host bitmasks for a runner's constrained rows, and their copy to the device. On CUDA the host
    side is pinned memory allocated once (two buffers, alternating, grown when more rows come) so
    the copy neither allocates nor waits; the step before has been read back by the time a buffer
    is written again (a constrained step needs the last one's tokens), so the second buffer is a
    margin, not a requirement. Several rows' masks are computed in parallel on llguidance's thread
    pool from PARALLEL_MIN_ROWS rows on."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.device = device
        self._host: list[torch.Tensor] = []
        self._turn = 0
        self._executor: Any = None

    def _buffer(self, rows: int) -> torch.Tensor:
        if not self._host or self._host[0].shape[0] < rows:
            size = max(rows, 2 * self._host[0].shape[0] if self._host else 8)
            pin = self.device.type == "cuda"
            self._host = [torch.empty((size, self.words), dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._turn ^= 1
        return self._host[self._turn][:rows]

    def bitmask(self, matchers: list[Any]) -> torch.Tensor:
        """int32 [len(matchers), ceil(V / 32)] on the device: each row's next-token bitmask. Computed on
        the host (llguidance) while the device runs the forward; several rows in parallel on
        llguidance's thread pool."""
        host = self._buffer(len(matchers))
        if len(matchers) < PARALLEL_MIN_ROWS or self.device.type != "cuda":
            for i, matcher in enumerate(matchers):
                matcher.unsafe_compute_mask_ptr(host[i].data_ptr(), self.words * 4)
        else:
            if self._executor is None:
                self._executor = llguidance().LLExecutor()
            self._executor.unsafe_compute_mask_ptr(
                [(m, i) for i, m in enumerate(matchers)], host.data_ptr(), self.words * 4, len(matchers)
            )
        # On the CPU the sampler reads the buffer before this step returns, so it is used as it is.
        return host.to(self.device, non_blocking=True) if self.device.type == "cuda" else host.to(self.device)


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` with every token the rows' bitmasks clear at -inf (the rows of `rows`); a new tensor
    on the CPU, in place on CUDA (one Triton launch)."""
    if logits.is_cuda:
        # Imported here: triton is needed (and installed) only where CUDA runs.
        from kernels.token_bitmask import apply_token_bitmask_

        apply_token_bitmask_(logits, rows, bitmask)
        return logits
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    return logits.index_put((rows,), logits[rows].masked_fill(~allowed, float("-inf")))


_BITS: dict[torch.device, torch.Tensor] = {}


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [rows, words] (bit j of word w is token 32*w + j) -> bool [rows, vocab_size]."""
    shifts = _BITS.get(bitmask.device)
    if shifts is None:
        shifts = _BITS[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
