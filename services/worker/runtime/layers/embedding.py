"""Vocab-parallel token embedding and LM head.

The vocabulary is padded to a multiple of `padding_multiple * tp_size` and split into equal contiguous
ranges, one per rank. The embedding looks up the ids in its range, zeroes the rest and all-reduces;
the LM head computes logits for its range and the logits processor all-gathers them. Padding rows are
zero and trimmed away, so every rank sees exactly `num_embeddings` logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.runtime.distributed import get_tp_rank, get_tp_size, tp_all_reduce
from services.worker.runtime.layers.linear import (
    LoadedWeight,
    check_weight_shape,
    narrow_weight,
    new_parameter,
)

DEFAULT_VOCAB_PADDING = 64


def pad_vocab_size(vocab_size: int, multiple: int) -> int:
    return -(-vocab_size // multiple) * multiple


class VocabParallelEmbedding(nn.Module):
    """Embedding table whose rows (token ids) are split across TP ranks. As the LM head (its own or
    tied) its weight may be prepacked for CPU products (layers/linear.py)."""

    prepackable = True
    packed_weight: torch.Tensor | None = None
    cpu_rows = False  # as Projection's (layers/linear.py)
    gemv_tiles: object = None
    batch_invariant = False  # as the LM head: layers/linear.py's make_batch_invariant sets it

    def __init__(
        self, num_embeddings: int, embedding_dim: int, padding_multiple: int = DEFAULT_VOCAB_PADDING
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, padding_multiple * self.tp_size)
        self.num_embeddings_per_partition = self.num_embeddings_padded // self.tp_size
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end = self.vocab_start + self.num_embeddings_per_partition
        self.weight = new_parameter((self.num_embeddings_per_partition, embedding_dim), self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: LoadedWeight) -> None:
        check_weight_shape(loaded_weight, (self.num_embeddings, self.embedding_dim), type(self).__name__)
        valid = max(0, min(self.vocab_end, self.num_embeddings) - self.vocab_start)
        param.data.zero_()
        if valid:
            param.data[:valid].copy_(narrow_weight(loaded_weight, 0, self.vocab_start, valid))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection hidden -> vocab, split by vocab rows like the embedding (so tying them
    shares one sharded table). Applied by LogitsProcessor, never called directly."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is applied by LogitsProcessor, not called")
