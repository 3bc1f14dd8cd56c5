"""Final hidden states -> float32 next-token logits, full vocabulary on every rank."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from services.worker.runtime.distributed import tp_all_gather
from services.worker.runtime.layers import linear as linear_mod
from services.worker.runtime.layers.embedding import VocabParallelEmbedding
from services.worker.runtime.layers.linear import linear

if TYPE_CHECKING:
    from services.worker.runtime.forward_batch import ForwardBatch


def gemv_into(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, gemv_tiles: Any) -> bool:
    """x W^T written into `out` (float32, or x's dtype; [rows, N], contiguous) by the Triton GEMV, where
    linear() would take it (tiles set, 1 to max_rows rows, and no split here): the values linear() returns,
    widened. False, with nothing written, elsewhere."""
    if gemv_tiles is None or x.dim() != 2 or not 1 <= x.shape[0] <= gemv_tiles.max_rows or gemv_tiles.split != 1:
        return False
    gemv = linear_mod._gemv
    assert gemv is not None, "gemv_tiles are set only after load_gemv_kernels()"
    gemv(x, weight, out=out, tiles=gemv_tiles)
    return True


class LogitsProcessor(nn.Module):
    """Picks the rows that need logits (each request's last new token, or all tokens when the batch
    asks), applies the vocab-parallel LM head, gathers the vocab shards and trims the padding.

    A decode batch has one token per request, each its request's last, so its rows are used as they
    are. An extend batch's rows come from ForwardBatch.last_token_indices(): built from the host
    lengths in an eager step, or, inside a CUDA graph, the batch's device-side last_token_rows (computed
    from the graph's static offsets), so a replay gathers the rows of the batch it replays. Requests
    asking for prompt log-probs add their prompt rows (ForwardBatch.prompt_logit_rows) after those.
    """

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def forward(
        self, hidden: torch.Tensor, lm_head: VocabParallelEmbedding, batch: ForwardBatch
    ) -> torch.Tensor:
        if not batch.return_all_logits and not batch.forward_mode.is_decode():
            rows = batch.last_token_indices()
            if batch.prompt_logit_rows is not None:
                rows = torch.cat([rows, batch.prompt_logit_rows])
            hidden = hidden[rows]
        out = batch.logits_out
        if (
            out is not None and lm_head.tp_size == 1 and lm_head.weight.shape[0] == self.vocab_size
            and not lm_head.batch_invariant
            and gemv_into(hidden, lm_head.weight, out[: hidden.shape[0]], lm_head.gemv_tiles)
        ):  # fmt: skip
            # The GEMV wrote the float32 buffer itself (rounded to the activation dtype first, so the values
            # of the copy below): a CUDA-graph decode step without the cast's launch.
            return out[: hidden.shape[0]]
        logits = linear(
            hidden, lm_head.weight, None, lm_head.packed_weight, gemv_tiles=lm_head.gemv_tiles,
            batch_invariant=lm_head.batch_invariant, cpu_rows=lm_head.cpu_rows,
        )  # fmt: skip
        logits = tp_all_gather(logits, dim=-1)[:, : self.vocab_size]
        if out is not None:
            return out[: logits.shape[0]].copy_(logits)
        return logits.float()
