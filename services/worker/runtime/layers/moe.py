"""Mixture of experts: top-k routing and the expert computation, tensor-parallel by intermediate dim.

Every rank holds every expert, but only its slice of each expert's intermediate dimension: the
fused gate_up (w13) is split column-wise, down (w2) row-wise, so the layer needs one all-reduce, like a
dense MLP. `moe_forward` is the torch reference; on CUDA kernels/fused_moe.py replaces it (same
contract, no host sync, so a decode step with MoE layers can be captured in a CUDA graph). With FP8
experts (layers/fp8_weights.py: w13/w2 in float8_e4m3fn with block scales `w13_weight_scale_inv`
[E, ceil(2I / bn), ceil(H / bk)] and `w2_weight_scale_inv` [E, ceil(H / bn), ceil(I / bk)]) the
kernel reads the scales; the reference dequantizes the experts a step hits (float32 math).

Deterministic inference (`batch_invariant`, set by layers/batch_invariant.py's make_batch_invariant): on
the CPU each expert's rows go through invariant_linear; on CUDA the fused kernel runs one fixed launch
shape (DETERMINISTIC_MOE_TILES: moe_tiles_for picks tiles by the number of token-expert pairs) and sums
each token's k expert outputs in order.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.runtime.distributed import divide, get_tp_rank, get_tp_size, tp_all_reduce
from services.worker.runtime.layers import batch_invariant
from services.worker.runtime.layers.activation import silu_and_mul
from services.worker.runtime.layers.fp8 import dequantize_blocks
from services.worker.runtime.layers.linear import (
    LoadedWeight,
    check_weight_shape,
    narrow_weight,
    new_parameter,
)

# HF names one expert's matrices `...mlp.experts.{e}.{gate,up,down}_proj.weight`.
_EXPERT_WEIGHT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_SHARDS = {
    "gate_proj": ("w13_weight", "w1"),
    "up_proj": ("w13_weight", "w3"),
    "down_proj": ("w2_weight", "w2"),
}


def expert_weight_target(name: str) -> tuple[str, int, str] | None:
    """For an HF per-expert checkpoint name: (FusedMoE parameter name, expert id, shard id); else None.
    `model.layers.3.mlp.experts.5.up_proj.weight` -> (`model.layers.3.mlp.experts.w13_weight`, 5, 'w3')."""
    match = _EXPERT_WEIGHT.search(name)
    if match is None:
        return None
    param_name, shard_id = _EXPERT_SHARDS[match.group(2)]
    return f"{name[: match.start()]}.experts.{param_name}", int(match.group(1)), shard_id


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts (float32), keep the top k; renormalize makes the kept weights sum to 1.
    Returns (weights [tokens, k] float32, expert ids [tokens, k] int64), largest weight first.

    On CUDA one Triton launch (kernels/moe_routing.py) instead of the four or five torch ops below, which
    at batch-1 decode cost more in launches than in work; it breaks ties toward the lower expert id."""
    if router_logits.is_cuda:
        # Imported here: triton is needed (and installed) only where CUDA runs.
        from kernels.moe_routing import moe_topk_softmax

        return moe_topk_softmax(router_logits, top_k, renormalize)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_forward(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale_inv: torch.Tensor | None = None,
    w2_scale_inv: torch.Tensor | None = None,
    block_size: tuple[int, int] | None = None,
    product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear,
    act: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
) -> torch.Tensor:
    """sum_k weight_k * down_e(silu(gate_e(x)) * up_e(x)) over each token's chosen experts e.

    hidden [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_* [T, k]. With scales,
    w13 and w2 are FP8 and each expert hit is dequantized with its block scales and run in float32.
    Token-expert pairs are sorted by expert so each expert hit runs one matmul over all its tokens
    (`product(x, w)`, x w^T; `act` the gated activation). A token's expert outputs are added in expert order.
    """
    num_experts = w13.shape[0]
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.flatten()
    order = torch.argsort(flat_ids, stable=True)
    token_of = order // top_k
    weight_of = topk_weights.flatten()[order].to(hidden.dtype)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    out = torch.zeros_like(hidden)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tokens = token_of[start : start + count]
        if w13_scale_inv is None or w2_scale_inv is None or block_size is None:
            expert_out = product(act(product(hidden[tokens], w13[expert])), w2[expert])
        else:
            gate_up = dequantize_blocks(w13[expert], w13_scale_inv[expert], block_size)
            down = dequantize_blocks(w2[expert], w2_scale_inv[expert], block_size)
            expert_out = product(act(product(hidden[tokens].float(), gate_up)), down).to(hidden.dtype)
        expert_out = expert_out * weight_of[start : start + count, None]
        out.index_add_(0, tokens, expert_out)
        start += count
    return out


class FusedMoE(nn.Module):
    """All experts of one layer, stacked: w13_weight [E, 2 * I_rank, H], w2_weight [E, H, I_rank].

    Checkpoint tensors are per expert (HF `experts.{e}.gate_proj/up_proj/down_proj`); the loader takes
    (expert_id, shard_id) with shard ids 'w1' (gate), 'w3' (up), 'w2' (down).
    """

    # Set by layers/fp8_weights.py when the experts are FP8, beside the w13_weight_scale_inv and
    # w2_weight_scale_inv parameters it adds (None: the experts are in the model's dtype).
    fp8_block_size: tuple[int, int] | None = None
    batch_invariant = False

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        self.intermediate_per_rank = divide(intermediate_size, self.tp_size)
        i_rank = self.intermediate_per_rank
        self.w13_weight = new_parameter((num_experts, 2 * i_rank, hidden_size), self.weight_loader)
        self.w2_weight = new_parameter((num_experts, hidden_size, i_rank), self.weight_loader)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: LoadedWeight, expert_id: int, shard_id: str
    ) -> None:
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert id {expert_id} is outside num_experts={self.num_experts}")
        rows = self.intermediate_per_rank
        start = self.tp_rank * rows
        if shard_id == "w2":
            check_weight_shape(loaded_weight, (self.hidden_size, self.intermediate_size), "expert down_proj")
            param.data[expert_id].copy_(narrow_weight(loaded_weight, 1, start, rows))
            return
        check_weight_shape(loaded_weight, (self.intermediate_size, self.hidden_size), f"expert {shard_id}")
        offset = 0 if shard_id == "w1" else rows
        param.data[expert_id, offset : offset + rows].copy_(narrow_weight(loaded_weight, 0, start, rows))

    def forward(
        self,
        hidden: torch.Tensor,
        router_logits: torch.Tensor,
        shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The routed experts' weighted sum, plus sigmoid(gate) * shared_out where shared = (shared_out,
        gate) is given (a gated shared expert's output, added before the all-reduce: one rank only)."""
        if shared is not None and self.tp_size != 1:
            raise ValueError("FusedMoE: a shared expert's output is added here only without tensor parallelism")
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        if hidden.is_cuda:
            # Imported here: triton is needed (and installed) only where CUDA runs.
            from kernels.fused_moe import fused_moe

            fp8 = {}
            if self.fp8_block_size is not None:
                fp8 = dict(
                    w13_scale_inv=self.w13_weight_scale_inv,
                    w2_scale_inv=self.w2_weight_scale_inv,
                    block_size=self.fp8_block_size,
                )
            if self.batch_invariant:
                from kernels.fused_moe import DETERMINISTIC_MOE_TILES

                if fp8:  # one form for every batch size (the default picks by size)
                    fp8["fp8_activations"] = False
                out = fused_moe(
                    hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                    tiles=DETERMINISTIC_MOE_TILES, sum_in_order=True, shared=shared, **fp8,
                )  # fmt: skip
            else:
                out = fused_moe(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids, shared=shared, **fp8)
        else:
            invariant = self.batch_invariant
            scales = (None, None, None)
            if self.fp8_block_size is not None:
                scales = (self.w13_weight_scale_inv, self.w2_weight_scale_inv, self.fp8_block_size)
            out = moe_forward(
                hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids, *scales,
                product=batch_invariant.invariant_linear if invariant else F.linear,
                act=batch_invariant.silu_and_mul if invariant else silu_and_mul,
            )  # fmt: skip
            if shared is not None:
                out = out + torch.sigmoid(shared[1]) * shared[0]
        return tp_all_reduce(out)
