"""MoE routing on one GPU: torch's softmax + topk + renormalize against kernels/moe_routing.py (issue 24),
and the sorted layout's torch ops against its one-launch kernel (kernels/moe_blocks.py, issues 24/26).

    python bench/gpu_moe_routing.py            (from the repository root; needs torch + triton, a CUDA GPU)

For Qwen3-30B-A3B's router (128 experts, top-8) and Qwen3.5-35B-A3B's (256, top-8), renormalized:
- check, on 4096 rows of float32 and of bfloat16 logits (bfloat16 ties often): the kernel's ids equal
  a stable descending sort of the logits (its stated order), its weights equal torch's to 2e-6, and
  every id where it differs from torch.topk is a tie in torch's probabilities (the same weight);
- time both at T = 1 and 64 on bfloat16 logits (what the router linear gives), each inside a CUDA graph
  that calls it CALLS times back to back, so launch gaps count as they do in a captured decode step;
- count the CUDA kernels of one eager call (torch.profiler).
The sorted layout (align_tokens_by_expert_torch vs align_tokens_by_expert_kernel), same routers:
- check all three outputs equal (values, dtypes, shapes) for the kernel's routing at T = 64, 300 and
  4096 (the last has several tiles per program), int32 ids, and skewed ids (3 experts, all in one);
- time both at T = 64 and 300 with the block_m moe_tiles_for picks, in CUDA graphs as above.
Prints tables; with $OUT set, the rows go to $OUT/gpu_moe_routing.json.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from functools import partial

import torch

if __package__ in (None, ""):
    # Run as a script: make the repository's packages importable without an install.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels.moe_blocks import (  # noqa: E402
    align_tokens_by_expert_kernel,
    align_tokens_by_expert_torch,
    moe_tiles_for,
)
from kernels.moe_routing import moe_topk_softmax  # noqa: E402

ROUTERS = {"qwen3-30b-a3b": (128, 8), "qwen3.5-35b-a3b": (256, 8)}  # experts, top-k
TOKENS = (1, 64)
ALIGN_TOKENS = (64, 300)
ALIGN_CHECK_TOKENS = (64, 300, 4096)
CHECK_ROWS = 4096
CALLS = 50  # routing calls per captured graph
REPLAYS = 200


def torch_routing(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """layers/moe.py's select_experts as it runs off CUDA (on CUDA it now calls the kernel)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def check(logits: torch.Tensor, top_k: int) -> dict:
    weights, ids = moe_topk_softmax(logits, top_k, renormalize=True)
    ref_weights, ref_ids = torch_routing(logits, top_k, renormalize=True)
    stable = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices[:, :top_k]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    # Where the ids differ from torch.topk's, torch's probabilities of both must be equal (a tie).
    same_prob = torch.isclose(probs.gather(1, ids), probs.gather(1, ref_ids), rtol=1e-6, atol=0)
    row = {
        "ids_equal_stable_sort": bool(torch.equal(ids, stable)),
        "ids_equal_topk_rows": float((ids == ref_ids).all(dim=-1).float().mean()),
        "differing_ids_are_ties": bool(same_prob[ids != ref_ids].all()),
        "weights_max_abs_diff": float((weights - ref_weights).abs().max()),
    }
    row["ok"] = (
        row["ids_equal_stable_sort"] and row["differing_ids_are_ties"] and row["weights_max_abs_diff"] <= 2e-6
    )
    return row


def check_align(ids: torch.Tensor, num_experts: int) -> bool:
    """The kernel's (sorted_ids, expert_ids, num_padded) equal the torch form's, for every block_m
    moe_tiles_for picks (16, 32, 64)."""
    for block_m in (16, 32, 64):
        out = align_tokens_by_expert_kernel(ids, num_experts, block_m)
        ref = align_tokens_by_expert_torch(ids, num_experts, block_m)
        if not all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in zip(out, ref)):
            return False
    return True


def align_rows(dev: torch.device, gen: torch.Generator, name: str, experts: int, top_k: int) -> list[dict]:
    rows = []
    for tokens in ALIGN_CHECK_TOKENS:
        logits = torch.randn((tokens, experts), device=dev, generator=gen)
        _, ids = moe_topk_softmax(logits, top_k, True)
        skewed = torch.randint(0, 3, (tokens, top_k), device=dev, generator=gen)
        ok = {
            "routed": check_align(ids, experts),
            "int32": check_align(ids.to(torch.int32), experts),
            "skewed": check_align(skewed, experts),
            "one_expert": check_align(torch.full_like(ids, experts - 1), experts),
        }
        rows.append({"kind": "align_check", "router": name, "tokens": tokens} | ok | {"ok": all(ok.values())})
    for tokens in ALIGN_TOKENS:
        _, ids = moe_topk_softmax(torch.randn((tokens, experts), device=dev, generator=gen), top_k, True)
        block_m = moe_tiles_for(tokens * top_k, experts).block_m
        paths = {
            "torch": partial(align_tokens_by_expert_torch, ids, experts, block_m),
            "kernel": partial(align_tokens_by_expert_kernel, ids, experts, block_m),
        }
        row = {"kind": "align_time", "router": name, "tokens": tokens, "block_m": block_m}
        for path, fn in paths.items():
            row[f"{path}_us"] = time_in_graph(fn)
            row[f"{path}_kernels"] = kernels_per_call(fn)
        row["speedup"] = row["torch_us"] / row["kernel_us"]
        rows.append(row)
    return rows


def time_in_graph(fn: Callable[[], object]) -> float:
    """Microseconds per call of fn, CALLS calls per CUDA graph replay (median of 5 timings)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compiles the Triton kernel and warms torch's caches outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    for _ in range(10):
        graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPLAYS):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (REPLAYS * CALLS))
    return sorted(times)[len(times) // 2]


def kernels_per_call(fn: Callable[[], object]) -> int:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)


def main() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for name, (experts, top_k) in ROUTERS.items():
        for dtype in (torch.float32, torch.bfloat16):
            logits = (torch.randn((CHECK_ROWS, experts), device=dev, generator=gen) * 2).to(dtype)
            rows.append({"kind": "check", "router": name, "dtype": str(dtype)[6:]} | check(logits, top_k))
        for tokens in TOKENS:
            logits = torch.randn((tokens, experts), device=dev, generator=gen).bfloat16()
            paths = {
                "torch": partial(torch_routing, logits, top_k, True),
                "kernel": partial(moe_topk_softmax, logits, top_k, True),
            }
            row = {"kind": "time", "router": name, "tokens": tokens}
            for path, fn in paths.items():
                row[f"{path}_us"] = time_in_graph(fn)
                row[f"{path}_kernels"] = kernels_per_call(fn)
            row["speedup"] = row["torch_us"] / row["kernel_us"]
            rows.append(row)
        rows += align_rows(dev, gen, name, experts, top_k)

    print("\n== gpu_moe_routing: torch softmax+topk+renormalize vs one Triton launch, in CUDA graphs ==")
    print(f"{'router':18s}{'T':>4s}{'torch us':>10s}{'kernel us':>11s}{'speedup':>9s}{'launches':>10s}")
    for r in (r for r in rows if r["kind"] == "time"):
        launches = f"{r['torch_kernels']}->{r['kernel_kernels']}"
        print(f"{r['router']:18s}{r['tokens']:>4d}{r['torch_us']:>10.2f}{r['kernel_us']:>11.2f}"
              f"{r['speedup']:>8.2f}x{launches:>10s}")  # fmt: skip
    print(f"{'router':18s}{'logits':>9s}  ids==stable  rows ids==topk  diffs are ties  max |dw|   ok")
    for r in (r for r in rows if r["kind"] == "check"):
        print(f"{r['router']:18s}{r['dtype']:>9s}  {r['ids_equal_stable_sort']!s:11s}  "
              f"{r['ids_equal_topk_rows']:13.4f}  {r['differing_ids_are_ties']!s:14s}  "
              f"{r['weights_max_abs_diff']:.1e}  {r['ok']}")  # fmt: skip
    print("\n== sorted layout: align_tokens_by_expert torch ops vs one Triton launch, in CUDA graphs ==")
    print(
        f"{'router':18s}{'T':>4s}{'block_m':>8s}{'torch us':>10s}{'kernel us':>11s}{'speedup':>9s}{'launches':>10s}"
    )
    for r in (r for r in rows if r["kind"] == "align_time"):
        launches = f"{r['torch_kernels']}->{r['kernel_kernels']}"
        print(f"{r['router']:18s}{r['tokens']:>4d}{r['block_m']:>8d}{r['torch_us']:>10.2f}{r['kernel_us']:>11.2f}"
              f"{r['speedup']:>8.2f}x{launches:>10s}")  # fmt: skip
    print(f"{'router':18s}{'T':>5s}  routed  int32  skewed  one expert  ok")
    for r in (r for r in rows if r["kind"] == "align_check"):
        print(f"{r['router']:18s}{r['tokens']:>5d}  {r['routed']!s:6s}  {r['int32']!s:5s}  {r['skewed']!s:6s}  "
              f"{r['one_expert']!s:10s}  {r['ok']}")  # fmt: skip
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_moe_routing.json"), "w") as f:
            json.dump(rows, f, indent=1)
    if not all(r["ok"] for r in rows if r["kind"] == "check"):
        sys.exit("gpu_moe_routing: the kernel's routing differs from torch's (see the check rows)")
    if not all(r["ok"] for r in rows if r["kind"] == "align_check"):
        sys.exit(
            "gpu_moe_routing: the sorted layout's kernel differs from its torch form (see the check rows)"
        )


if __name__ == "__main__":
    main()
