"""Launches of one MoE block forward as CUDA runs it, counted on the CPU (no GPU needed).

Qwen3.5-MoE's block (models/qwen3_5_moe.py) at a 35B-A3B-like shape, scaled down in H and I (the
number of launches does not depend on them): router linear, select_experts (its CUDA path,
kernels/moe_routing.py, and the torch ops it replaced), FusedMoE's CUDA branch (kernels/fused_moe.fused_moe,
its sorted layout laid out as on CUDA by kernels/moe_blocks.py's kernel; the torch ops that kernel replaced
are listed apart), and the gated shared expert. Each torch op outside another op is counted through torch.profiler and sorted
into kernels and free ops (allocations and views, which launch nothing on CUDA); Triton launches are
counted by stand-ins for the kernels (their outputs are left unwritten, which does not change the count).

CPU ops are a proxy for CUDA launches, with known differences: on CUDA softmax(dtype=float32) of a
bfloat16 input is one kernel (two ops here: a cast and the softmax), topk may add a sort kernel, and at
batch 1 the shared expert's SiLU runs inside its down product (here chunk, silu and mul).

    python bench/cpu_moe_launches.py [--tokens 1 64] [--experts 256] [--top-k 8] [--layout auto|sorted]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import kernels.fused_moe as fm  # noqa: E402
import kernels.moe_blocks as mb  # noqa: E402
import kernels.moe_routing as mr  # noqa: E402
from services.worker.runtime.layers.linear import ReplicatedLinear  # noqa: E402
from services.worker.runtime.layers.moe import select_experts  # noqa: E402
from services.worker.runtime.models.llama import LlamaMLP  # noqa: E402

# Ops that allocate or view: no kernel on CUDA.
FREE = {
    "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::view", "aten::reshape",
    "aten::_reshape_alias", "aten::flatten", "aten::select", "aten::slice", "aten::t",
    "aten::transpose", "aten::unsqueeze", "aten::expand", "aten::as_strided", "aten::alias",
    "aten::detach", "aten::chunk", "aten::split", "aten::narrow", "aten::contiguous", "aten::lift_fresh",
    "aten::resolve_conj", "aten::resolve_neg", "aten::numpy_T", "aten::permute",
}  # fmt: skip
# Ops that launch only when they copy (a cast to the tensor's own dtype, a reshape of a contiguous tensor).
COPIES = {"aten::_to_copy", "aten::clone", "aten::copy_"}


class _KernelCounter:
    """Stands in for a Triton kernel (fm._moe_gemm_kernel...): kernel[grid](...) counts one launch."""

    def __init__(self) -> None:
        self.launches = 0

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(*args: object, **kwargs: object) -> None:
            self.launches += 1

        return launch


def _no_check(ids: torch.Tensor, experts: int) -> None:
    """Stands in for the ids' range check, which runs only off CUDA."""


def _copies(event: object) -> bool:
    return any(child.name in COPIES or _copies(child) for child in event.cpu_children)


def count(fn: Callable[[], object]) -> tuple[Counter[str], Counter[str], int]:
    """(top-level torch ops of one call of fn that launch a kernel on CUDA, those that do not, Triton
    launches). fused_moe's range check of the ids is left out: it runs only off CUDA. fused_moe's sorted
    layout takes its CUDA path, the Triton kernel (in a tree that has it)."""
    counter = _KernelCounter()
    kernel, fm._moe_gemm_kernel = fm._moe_gemm_kernel, counter
    routing, mr._moe_routing_kernel = mr._moe_routing_kernel, counter
    check, fm.check_expert_ids = getattr(fm, "check_expert_ids", None), _no_check
    mb_check, align = getattr(mb, "check_expert_ids", None), fm.align_tokens_by_expert
    align_kernel = getattr(mb, "_moe_align_kernel", None)
    if align_kernel is not None:
        fm.align_tokens_by_expert = mb.align_tokens_by_expert_kernel
        mb._moe_align_kernel, mb.check_expert_ids = counter, _no_check
    try:
        fn()  # warm up: first-call work (imports, caches) is not the step's
        counter.launches = 0
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn()
    finally:
        fm._moe_gemm_kernel, fm.check_expert_ids = kernel, check
        mr._moe_routing_kernel = routing
        fm.align_tokens_by_expert = align
        if align_kernel is not None:
            mb._moe_align_kernel, mb.check_expert_ids = align_kernel, mb_check
    kernels: Counter[str] = Counter()
    free: Counter[str] = Counter()
    for event in prof.events():
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if not event.name.startswith("aten::") or parent is not None:
            continue
        launches = event.name not in FREE and (
            event.name not in {"aten::to", "aten::reshape"} or _copies(event)
        )
        (kernels if launches else free)[event.name] += 1
    return kernels, free, counter.launches


class Block:
    """The block's modules and expert weights at a small H and I."""

    def __init__(self, experts: int, top_k: int, dtype: torch.dtype = torch.bfloat16) -> None:
        hidden_size, inter, shared_inter = 64, 32, 64
        self.top_k, self.dtype = top_k, dtype
        self.gate = ReplicatedLinear(hidden_size, experts, bias=False).to(dtype)
        self.shared_gate = ReplicatedLinear(hidden_size, 1, bias=False).to(dtype)
        self.shared = LlamaMLP(hidden_size, shared_inter, "silu").to(dtype)
        for p in (*self.gate.parameters(), *self.shared_gate.parameters(), *self.shared.parameters()):
            p.data.normal_(0, 0.05)
        self.w13 = torch.randn(experts, 2 * inter, hidden_size, dtype=dtype)
        self.w2 = torch.randn(experts, hidden_size, inter, dtype=dtype)

    def stages(self, tokens: int, layout: dict[str, bool]) -> dict[str, Callable[[], object]]:
        x = torch.randn(tokens, self.w13.shape[2], dtype=self.dtype)
        logits = self.gate(x)
        weights, ids = select_experts(logits, self.top_k, True)
        routed = torch.randn_like(x)
        w13, w2 = self.w13, self.w2
        block_m = fm.moe_tiles_for(ids.numel(), w13.shape[0]).block_m
        sort = getattr(mb, "align_tokens_by_expert_torch", fm.align_tokens_by_expert)
        return {
            "router linear": lambda: self.gate(x),
            "select_experts (moe_routing kernel)": lambda: mr.moe_topk_softmax(logits, self.top_k, True),
            "select_experts (torch ops, before)": lambda: select_experts(logits, self.top_k, True),
            "fused_moe": lambda: fm.fused_moe(x, w13, w2, weights, ids, **layout),
            "sorted layout (torch ops, before)": lambda: sort(ids, w13.shape[0], block_m),
            "fused_moe (deterministic)": lambda: fm.fused_moe(
                x, w13, w2, weights, ids, fm.DETERMINISTIC_MOE_TILES, sum_in_order=True, **layout
            ),
            "shared expert (gate, MLP, mul, add)": lambda: (
                torch.sigmoid(self.shared_gate(x)) * self.shared(x) + routed
            ),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--layout", choices=["auto", "sorted"], default="auto")
    args = parser.parse_args()
    torch.manual_seed(0)
    block = Block(args.experts, args.top_k)
    layout = {} if args.layout == "auto" else {"pair_per_block": False}
    if args.layout == "sorted" and "pair_per_block" not in fm.fused_moe.__code__.co_varnames:
        layout = {}  # a tree from before the one-pair-per-block layout: sorted is all it has
    for tokens in args.tokens:
        print(f"T={tokens}, E={args.experts}, top-{args.top_k}, layout {args.layout}")
        total = 0
        for name, fn in block.stages(tokens, layout).items():
            kernels, free, gemms = count(fn)
            if not name.endswith(("(deterministic)", "before)")):
                total += kernels.total() + gemms
            listed = ", ".join(f"{op[6:]}x{n}" if n > 1 else op[6:] for op, n in sorted(kernels.items()))
            print(f"  {name:36s} {kernels.total():2d} torch + {gemms} triton [{listed}] free {free.total()}")
        print(f"  block total (default mode): {total} launches")


if __name__ == "__main__":
    main()
