"""ForwardBatch: the device-side view of one scheduler step, the only thing a model sees.

The scheduler's CPU view (ScheduleBatch) is turned into this once per step. Models and layers read
positions and token ids from it; attention backends read the KV-slot mapping from it.

The batch carries the step's attention backend, and a backend reads the batch: so the batch names the
backend by what the model's attention layers call on it (`StepAttention`, implemented by
attention/base.py's AttentionBackend), and a backend sees a layer only as its geometry
(`AttentionLayer`, which layers/attention.py's RadixAttention has).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

import torch

from services.worker.mem.memory_pool import ReqToTokenPool, TokenToKVPool
from services.worker.mem.state_pool import HybridReqToTokenPool, StateMetadata
from services.worker.mem.state_snapshots import StateSnapshots
from services.worker.runtime.layers.layernorm import RMSNorm
from services.worker.runtime.layers.rotary import RotaryEmbedding


class AttentionLayer(Protocol):
    """One attention layer as a backend sees it: which KV buffer, and this rank's head geometry."""

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float


class StepAttention(Protocol):
    """What the model's attention layers call on the step's backend (see attention/base.py)."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor: ...

    def forward_with_rope(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary_emb: RotaryEmbedding,
        q_norm: RMSNorm | None,
        k_norm: RMSNorm | None,
        layer: AttentionLayer,
        batch: ForwardBatch,
    ) -> torch.Tensor: ...


class ForwardMode(enum.Enum):
    """EXTEND: each request appends one or more new tokens after a (possibly empty) cached prefix
    (prefill, chunked prefill, speculative verification). DECODE: exactly one new token each."""

    EXTEND = "extend"
    DECODE = "decode"

    def is_extend(self) -> bool:
        return self is ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


@dataclass
class ForwardBatch:
    """One step's inputs. All tensors live on the model's device unless the name ends in `_cpu`.

    For request i: its new tokens occupy positions extend_prefix_lens[i] .. seq_lens[i]-1; their KV is
    written to out_cache_loc (in the same order as input_ids) before attention reads the pool through
    req_to_token_pool.req_to_token[req_pool_indices[i], :seq_lens[i]].
    """

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    req_pool_indices: torch.Tensor  # [bs] int64, rows of req_to_token
    seq_lens: torch.Tensor  # [bs] int64, total length after this step (prefix + new)
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV slots of the new tokens
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]  # tokens already in the KV pool; all seq_len-1 for decode
    extend_seq_lens_cpu: list[int]  # new tokens per request; all 1 for decode
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: TokenToKVPool
    attn_backend: StepAttention
    # Logits for every token rather than the last one of each request (prefill parity tests,
    # speculative verification).
    return_all_logits: bool = False
    # Extend steps of requests asking for prompt log-probs: rows of input_ids whose logits those need,
    # returned after the bs last-token rows (logits [bs + len(prompt_logit_rows), vocab]); None: none.
    prompt_logit_rows: torch.Tensor | None = field(default=None, repr=False)
    # Per-backend metadata, set by attn_backend.init_forward_metadata().
    attn_metadata: object | None = field(default=None, repr=False)
    # [bs] int64 device rows of each request's last new token, when computed on the device (a CUDA
    # graph's extend step derives them from its static offsets); None: built from extend_seq_lens_cpu.
    last_token_rows: torch.Tensor | None = field(default=None, repr=False)
    # Decode steps: input_ids, positions, req_pool_indices, seq_lens and out_cache_loc as the rows of one
    # [5, bs] block (the step's packed host-to-device copy lays them out so), which a CUDA graph replay
    # copies into its static inputs in one launch instead of five; None: copy them one by one.
    packed_rows: torch.Tensor | None = field(default=None, repr=False)
    # A float32 [rows, vocab] buffer the logits processor writes the logits into, cast and copied in one
    # launch (a CUDA graph's static logits); None: the forward returns a new tensor.
    logits_out: torch.Tensor | None = field(default=None, repr=False)
    # Hybrid models (linear-attention layers): each request's state row, whether it continues a
    # state, and its token bounds; set by init_state_metadata.
    state_metadata: StateMetadata | None = field(default=None, repr=False)
    # Hybrid extend steps: (request index, snapshot slot) of the requests whose state one token short of
    # their end this step saves (HybridRadixCache.track_state; mem/state_pool.py's StateTrack, made by mem/state_snapshots.py).
    state_track: list[tuple[int, int]] = field(default_factory=list, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def init_state_metadata(self, snapshots: StateSnapshots | None = None) -> None:
        """Set state_metadata when the request rows own state rows (a hybrid model's
        HybridReqToTokenPool, mem/state_pool.py), with the step's tracking into `snapshots`' slots;
        nothing otherwise."""
        pool = self.req_to_token_pool
        if isinstance(pool, HybridReqToTokenPool):
            self.state_metadata = pool.state_metadata(
                self.req_pool_indices, self.extend_seq_lens_cpu, self.extend_prefix_lens_cpu
            )
            if self.state_track:
                if snapshots is None:
                    raise ValueError("the step tracks states but the model runner has no snapshot slots")
                self.state_metadata.track = snapshots.track(
                    self.state_track,
                    self.extend_seq_lens_cpu,
                    self.extend_prefix_lens_cpu,
                    self.input_ids.device,
                )

    def last_token_indices(self) -> torch.Tensor:
        """Row of each request's last new token in input_ids (where its next-token logits come from):
        last_token_rows when set, else built from the host lengths."""
        if self.last_token_rows is not None:
            return self.last_token_rows
        ends = torch.tensor(self.extend_seq_lens_cpu, dtype=torch.int64).cumsum(0) - 1
        return ends.to(self.input_ids.device, non_blocking=True)
