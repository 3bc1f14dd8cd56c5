"""Check and time the Gated DeltaNet kernels (kernels/gated_delta_rule.py, kernels/causal_conv1d.py,
kernels/gated_rms_norm.py) at Qwen3.5's linear-attention sizes (16 q/k heads, 32 value heads, head dims 128, conv width 4) on one GPU.

    python bench/gpu_gdn.py            (from the repository root; needs torch + triton + transformers, a GPU)

Correctness, float32 and bf16 inputs: the chunked prefill (varlen, initial states, final states), the
token-by-token Triton prefill, the decode update with padded rows, and both conv kernels against
transformers' Qwen3.5 torch paths (per-token torch_recurrent_gated_delta_rule per sequence,
torch_chunk_gated_delta_rule, causal_conv1d_fn / causal_conv1d_update), plus decode replayed from a
CUDA graph; the decode update with the gating fused in and the gated RMSNorm against their torch forms
(layers/gdn_ops.py; in bf16 the norm should round as torch does: "differing" is the share of elements
that do not). Timing also compares the layer's decode tail (gating, update, gated norm) fused and not. Timing (bf16): prefill of 1x4096 and 8x512 tokens against transformers' per-token and
chunked torch paths; decode at batch 1 and 64 against the bytes of state it must read and write,
divided by the copy bandwidth measured in the same run (state rows rotate through a pool > 4x L2).
Prints one JSON line and a table; with $OUT set the JSON also goes to $OUT/gpu_gdn.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.testing

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformers.models.qwen3_5.modeling_qwen3_5 import (  # noqa: E402
    causal_conv1d_fn,
    causal_conv1d_update,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from bench.gpu_common import copy_bandwidth  # noqa: E402
from kernels.causal_conv1d import causal_conv1d_fwd  # noqa: E402
from kernels.causal_conv1d import causal_conv1d_update as conv_update  # noqa: E402
from kernels.gated_delta_rule import (  # noqa: E402
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule_update,
    fused_sigmoid_gating_delta_rule_update,
    recurrent_gated_delta_rule,
)
from kernels.gated_rms_norm import gated_rms_norm  # noqa: E402
from services.worker.runtime.layers import gdn_ops  # noqa: E402

DEV = torch.device("cuda")
HK, HV, DK, DV = 16, 32, 128, 128
CONV_CH, WIDTH = 2 * HK * DK + HV * DV, 4
SCALE = DK**-0.5
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
CHECK_LENS = [1, 5, 64, 130, 1000, 2100]
PREFILL_CASES = {"1x4096": [4096], "8x512": [512] * 8}
STATE_BYTES = HV * DK * DV * 4


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return float("inf")
    return float((out64 - ref64).norm() / ref64.norm())


def bench_us(fn: Callable[[], object]) -> float:
    return 1e3 * float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def wall_us(fn: Callable[[], object], runs: int = 3) -> float:
    """Median wall time of a slow torch reference (one warm-up), synchronised."""
    fn()
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e6 * sorted(times)[len(times) // 2]


def cu_of(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lens, device=DEV).cumsum(0).to(torch.int32)


def gdn_inputs(tokens: int, dtype: torch.dtype):
    q = torch.randn((tokens, HK, DK), device=DEV).to(dtype)
    k = torch.randn((tokens, HK, DK), device=DEV).to(dtype)
    v = torch.randn((tokens, HV, DV), device=DEV).to(dtype)
    # Qwen3.5's decay: -exp(A_log) * softplus(a + dt_bias), A in (0.01, 16)
    a_scale = torch.empty(HV, device=DEV).uniform_(0.01, 16)
    g = -a_scale * F.softplus(torch.randn((tokens, HV), device=DEV) - 4)
    beta = torch.sigmoid(torch.randn((tokens, HV), device=DEV))
    return q, k, v, g, beta


def raw_gates(bs: int, dtype: torch.dtype):
    """The layer's raw a and b (strided slices of one projection, as it splits in_proj), A_log, dt_bias;
    some a + dt_bias past softplus' threshold (20)."""
    proj = torch.randn((bs, 3 * HV), device=DEV).to(dtype)
    a, b = proj[:, :HV], proj[:, 2 * HV :]
    a[:, :2] += 25
    a_log = torch.empty(HV, device=DEV).uniform_(-4.6, 2.8)  # A in (0.01, 16)
    return a, b, a_log.to(dtype), torch.randn(HV, device=DEV).to(dtype)


def hf_heads(q, k, v, g, beta):
    """q and k repeated to the value heads: transformers releases before 5.x's GQA support need it."""
    return q.repeat_interleave(HV // HK, 1), k.repeat_interleave(HV // HK, 1), v, g, beta


def hf_recurrent(q, k, v, g, beta, initial: torch.Tensor, lens: list[int]):
    """transformers' per-token torch recurrence, one sequence at a time: (o, final states [B, ...])."""
    outs, finals, start = [], [], 0
    for i, n in enumerate(lens):
        s = slice(start, start + n)
        o, final = torch_recurrent_gated_delta_rule(
            *(x[s][None].float() for x in hf_heads(q, k, v, g, beta)), initial_state=initial[i : i + 1],
            output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        outs.append(o[0])
        finals.append(final[0])
        start += n
    return torch.cat(outs), torch.stack(finals)


def check_prefill(results: dict, dtype: torch.dtype) -> None:
    name = str(dtype).split(".")[-1]
    lens = CHECK_LENS
    q, k, v, g, beta = gdn_inputs(sum(lens), dtype)
    pool = torch.randn((2 * len(lens), HV, DK, DV), device=DEV) * 0.1
    idx = torch.randperm(2 * len(lens), device=DEV)[: len(lens)].to(torch.int32)
    pool[idx[::2].long()] = 0  # every other sequence starts from an empty state
    initial = pool[idx.long()].clone()
    ref_o, ref_state = hf_recurrent(q, k, v, g, beta, initial, lens)
    for kernel in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        work = pool.clone()
        o = kernel(q, k, v, g, beta, state=work, state_indices=idx, cu_seqlens=cu_of(lens), scale=SCALE)
        results[f"{kernel.__name__} {name} varlen"] = (rel_err(o, ref_o), rel_err(work[idx.long()], ref_state))
    # transformers' chunked path on equal-length sequences (its batch form).
    lens8 = [512] * 8
    q, k, v, g, beta = gdn_inputs(sum(lens8), dtype)
    work = torch.randn((8, HV, DK, DV), device=DEV) * 0.1
    initial = work.clone()
    o = chunk_gated_delta_rule(q, k, v, g, beta, state=work, state_indices=torch.arange(8, device=DEV),
                               cu_seqlens=cu_of(lens8), scale=SCALE)  # fmt: skip
    ref_o, ref_state = torch_chunk_gated_delta_rule(
        *(x.reshape(8, 512, *x.shape[1:]).float() for x in hf_heads(q, k, v, g, beta)), initial_state=initial,
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    results[f"chunk_gated_delta_rule {name} vs torch_chunk 8x512"] = (
        rel_err(o, ref_o.reshape(o.shape)), rel_err(work, ref_state))  # fmt: skip


def check_decode(results: dict, dtype: torch.dtype) -> None:
    name = str(dtype).split(".")[-1]
    bs, real = 64, 60  # the last four rows pad the batch: two at spare row 0, two at -1
    q, k, v, g, beta = gdn_inputs(bs, dtype)
    pool = torch.randn((bs + 1, HV, DK, DV), device=DEV) * 0.1
    idx = torch.cat((torch.randperm(bs, device=DEV)[:real] + 1, torch.tensor([0, 0, -1, -1], device=DEV)))
    idx = idx.to(torch.int32)
    initial = pool[idx[:real].long()].clone()
    o = fused_recurrent_gated_delta_rule_update(q, k, v, g, beta, state=pool, state_indices=idx, scale=SCALE)
    ref_o, ref_state = torch_recurrent_gated_delta_rule(
        *(x[:real, None].float() for x in hf_heads(q, k, v, g, beta)), initial_state=initial, output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    results[f"fused_recurrent_update {name} bs64 padded"] = (
        rel_err(o[:real], ref_o[:, 0]), rel_err(pool[idx[:real].long()], ref_state))  # fmt: skip
    # The same step replayed from a CUDA graph: identical to the eager call.
    start = torch.randn_like(pool)
    work = start.clone()
    eager = fused_recurrent_gated_delta_rule_update(q, k, v, g, beta, state=work, state_indices=idx, scale=SCALE)
    eager_pool = work.clone()
    work.copy_(start)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_recurrent_gated_delta_rule_update(q, k, v, g, beta, state=work, state_indices=idx, scale=SCALE)
    work.copy_(start)
    graph.replay()
    torch.cuda.synchronize()
    # Padded rows share row 0 (or none), so only the real rows are deterministic.
    rows = idx[:real].long()
    results[f"fused_recurrent_update {name} cuda graph == eager"] = (
        float(not torch.equal(out[:real], eager[:real])), float(not torch.equal(work[rows], eager_pool[rows])))  # fmt: skip


def check_fused(results: dict, dtype: torch.dtype) -> None:
    name = str(dtype).split(".")[-1]
    bs, real = 64, 60  # padded as in check_decode
    q, k, v, _, _ = gdn_inputs(bs, dtype)
    a, b, a_log, dt_bias = raw_gates(bs, dtype)
    pool = torch.randn((bs + 1, HV, DK, DV), device=DEV) * 0.1
    idx = torch.cat((torch.randperm(bs, device=DEV)[:real] + 1, torch.tensor([0, 0, -1, -1], device=DEV)))
    idx = idx.to(torch.int32)
    ref_pool = pool.clone()
    o = fused_sigmoid_gating_delta_rule_update(q, k, v, a, b, a_log, dt_bias, state=pool, state_indices=idx,
                                               scale=SCALE)  # fmt: skip
    ref_o = gdn_ops.fused_sigmoid_gating_delta_rule_update(
        q[:real], k[:real], v[:real], a[:real], b[:real], a_log, dt_bias, state=ref_pool,
        state_indices=idx[:real], scale=SCALE,
    )  # fmt: skip
    rows = idx[:real].long()
    results[f"fused_sigmoid_gating_update {name} bs64 padded"] = (
        rel_err(o[:real], ref_o), rel_err(pool[rows], ref_pool[rows]))  # fmt: skip
    x = torch.randn((bs, HV, DV), device=DEV).to(dtype)
    z = torch.randn((bs, HV * DV + 8), device=DEV).to(dtype)[:, : HV * DV].view(bs, HV, DV)
    w = (1 + 0.1 * torch.randn(DV, device=DEV)).to(dtype)
    out, ref = gated_rms_norm(x, z, w, 1e-6), gdn_ops.gated_rms_norm(x, z, w, 1e-6)
    differing = 0.0 if dtype == torch.float32 else (out != ref).float().mean().item()
    results[f"gated_rms_norm {name} (err, differing)"] = (rel_err(out, ref), differing)


def check_conv(results: dict, dtype: torch.dtype) -> None:
    name = str(dtype).split(".")[-1]
    lens = [1, 2, 7, 300]
    x = torch.randn((sum(lens), CONV_CH), device=DEV).to(dtype)
    weight = torch.randn((CONV_CH, WIDTH), device=DEV).to(dtype) * 0.5
    pool = torch.randn((8, CONV_CH, WIDTH - 1), device=DEV).to(dtype)
    idx = torch.tensor([5, 0, 3, 6], device=DEV, dtype=torch.int32)
    has_init = torch.tensor([True, False, True, False], device=DEV)
    states = [pool[int(i)].clone() if h else torch.zeros_like(pool[0]) for i, h in zip(idx, has_init)]
    y = causal_conv1d_fwd(x, weight, None, conv_state=pool, state_indices=idx, cu_seqlens=cu_of(lens),
                          has_initial_state=has_init)  # fmt: skip
    ref, start = [], 0
    for i, n in enumerate(lens):  # transformers' update path takes a whole sequence after its state
        st = states[i][None].clone()
        ref.append(causal_conv1d_update(x[start : start + n].T[None], st, weight, None, "silu")[0].T)
        states[i] = st[0]
        start += n
    results[f"causal_conv1d_fwd {name} varlen"] = (
        rel_err(y, torch.cat(ref)), rel_err(pool[idx.long()], torch.stack(states)))  # fmt: skip
    no_state = causal_conv1d_fn(x[-300:].T[None], weight, None, activation="silu")[0].T
    results[f"causal_conv1d_fwd {name} no state vs causal_conv1d_fn"] = (rel_err(y[-300:], no_state), 0.0)
    xb = torch.randn((64, CONV_CH), device=DEV).to(dtype)
    pool = torch.randn((64, CONV_CH, WIDTH - 1), device=DEV).to(dtype)
    hf_state = pool.clone()
    y = conv_update(xb, weight, None, conv_state=pool, state_indices=torch.arange(64, device=DEV))
    ref = causal_conv1d_update(xb[:, :, None], hf_state, weight, None, "silu")[:, :, 0]
    results[f"causal_conv1d_update {name} bs64"] = (rel_err(y, ref), rel_err(pool, hf_state))


def time_prefill(rows: list[dict], case: str, lens: list[int]) -> None:
    q, k, v, g, beta = gdn_inputs(sum(lens), torch.bfloat16)
    pool = torch.zeros((len(lens), HV, DK, DV), device=DEV)
    idx = torch.arange(len(lens), device=DEV, dtype=torch.int32)
    args = dict(state=pool, state_indices=idx, cu_seqlens=cu_of(lens), scale=SCALE)
    chunk = bench_us(lambda: chunk_gated_delta_rule(q, k, v, g, beta, **args))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        chunk_gated_delta_rule(q, k, v, g, beta, **args)
        torch.cuda.synchronize()
    split = {e.key[:40]: round(e.device_time_total, 1) for e in prof.key_averages() if e.device_time_total > 0}
    print(f"prefill {case}: GPU time by kernel (us) {split}", flush=True)
    recur = bench_us(lambda: recurrent_gated_delta_rule(q, k, v, g, beta, **args))
    batched = [x.reshape(len(lens), lens[0], *x.shape[1:]) for x in hf_heads(q, k, v, g, beta)]
    hf = dict(initial_state=pool.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True)
    hf_chunk = wall_us(lambda: torch_chunk_gated_delta_rule(*batched, **hf))
    hf_token = wall_us(lambda: torch_recurrent_gated_delta_rule(*batched, **hf), runs=1)
    rows.append(dict(kernel="chunk_gated_delta_rule", case=f"prefill {case} bf16", us=chunk,
                     tok_per_s=sum(lens) / chunk * 1e6, triton_recurrent_us=recur, torch_chunk_us=hf_chunk,
                     torch_per_token_us=hf_token))  # fmt: skip


def graph_us(calls: list[Callable[[], object]]) -> float:
    """GPU time per call: all calls captured in one CUDA graph (as the engine's decode runs them, without
    Python launch overhead), the replay timed and divided by their number."""
    for call in calls[:2]:
        call()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return bench_us(graph.replay) / len(calls)


def time_decode(rows: list[dict], bs: int, pool: torch.Tensor, copy_gbps: float) -> None:
    """The decode update with state rows drawn at random from `pool` (each call its own rows, together
    over 4x L2, so the state comes from DRAM)."""
    q, k, v, g, beta = gdn_inputs(bs, torch.bfloat16)
    sets = [torch.randperm(pool.shape[0], device=DEV)[:bs].to(torch.int32) for _ in range(max(8, 128 // bs))]
    calls = [
        lambda ix=ix: fused_recurrent_gated_delta_rule_update(q, k, v, g, beta, state=pool, state_indices=ix,
                                                              scale=SCALE)
        for ix in sets
    ]  # fmt: skip
    us = graph_us(calls)
    nbytes = 2 * bs * STATE_BYTES + bs * (2 * HK * DK + 2 * HV * DV) * 2
    gbps = nbytes / (us * 1e-6) / 1e9
    eager = bench_us(calls[0])
    rows.append(dict(kernel="fused_recurrent_update", case=f"decode bs{bs} bf16", us=us, gbps=gbps,
                     ratio_to_copy=gbps / copy_gbps, eager_call_us=eager))  # fmt: skip
    xb = torch.randn((bs, CONV_CH), device=DEV, dtype=torch.bfloat16)
    weight = torch.randn((CONV_CH, WIDTH), device=DEV, dtype=torch.bfloat16)
    cpool = torch.zeros((pool.shape[0], CONV_CH, WIDTH - 1), device=DEV, dtype=torch.bfloat16)
    conv_calls = [lambda ix=ix: conv_update(xb, weight, None, conv_state=cpool, state_indices=ix) for ix in sets]
    rows.append(dict(kernel="causal_conv1d_update", case=f"decode bs{bs} bf16", us=graph_us(conv_calls)))
    # The layer's decode tail after the conv: gating, update, gated norm; fused (the triton backend's
    # calls) against the torch gating and norm around the plain update (before the fusion).
    a, b, a_log, dt_bias = raw_gates(bs, torch.bfloat16)
    z = torch.randn((bs, HV, DV), device=DEV, dtype=torch.bfloat16)
    w = torch.ones(DV, device=DEV, dtype=torch.bfloat16)

    def unfused(ix: torch.Tensor) -> torch.Tensor:
        gg, bb = gdn_ops.sigmoid_gating(a, b, a_log, dt_bias)
        o = fused_recurrent_gated_delta_rule_update(q, k, v, gg, bb, state=pool, state_indices=ix, scale=SCALE)
        return gdn_ops.gated_rms_norm(o, z, w, 1e-6)

    def fused(ix: torch.Tensor) -> torch.Tensor:
        o = fused_sigmoid_gating_delta_rule_update(q, k, v, a, b, a_log, dt_bias, state=pool, state_indices=ix,
                                                   scale=SCALE)  # fmt: skip
        return gated_rms_norm(o, z, w, 1e-6)

    rows.append(dict(kernel="gating+update+norm", case=f"decode bs{bs} bf16",
                     us=graph_us([lambda ix=ix: fused(ix) for ix in sets]),
                     unfused_us=graph_us([lambda ix=ix: unfused(ix) for ix in sets])))  # fmt: skip


def main() -> int:
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(DEV)
    print(f"device: {props.name}; torch {torch.__version__}, triton {triton.__version__}", flush=True)
    copy_gbps = copy_bandwidth() / 1e9
    print(f"copy bandwidth {copy_gbps:.0f} GB/s (read + write)", flush=True)
    checks: dict[str, tuple[float, float]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        for check in (check_prefill, check_decode, check_fused, check_conv):
            try:
                check(checks, dtype)
            except Exception as exc:  # report it and go on to the other checks and the timings
                print(f"{check.__name__} {dtype} failed: {type(exc).__name__}: {exc}"[:400], flush=True)
                checks[f"{check.__name__} {dtype} raised"] = (float("inf"), float("inf"))
        print(f"checks {dtype} done", flush=True)
    rows: list[dict] = []
    for case, lens in PREFILL_CASES.items():
        time_prefill(rows, case, lens)
    print("prefill timed", flush=True)
    pool = torch.zeros((256, HV, DK, DV), device=DEV)  # 512 MiB of state rows, > 4x L2
    for bs in (1, 64):
        time_decode(rows, bs, pool, copy_gbps)
    ok = {name: all(e < TOL[torch.float32 if "float32" in name else torch.bfloat16] for e in errs)
          for name, errs in checks.items()}  # fmt: skip
    summary = {"copy_gbps": copy_gbps, "checks": {n: {"o_err": e[0], "state_err": e[1], "ok": ok[n]}
               for n, e in checks.items()}, "timings": rows}  # fmt: skip
    print(json.dumps(summary))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_gdn.json"), "w") as f:
            json.dump(summary, f, indent=1)
    print(f"\n{'check':<58} {'o rel err':>10} {'state err':>10}")
    for name, (eo, es) in checks.items():
        print(f"{name:<58} {eo:10.2e} {es:10.2e}{'' if ok[name] else '  FAIL'}")
    print(f"\n{'kernel':<24} {'case':<20} {'us':>9}  figures")
    for r in rows:
        rest = ", ".join(f"{k} {v:.3g}" for k, v in r.items() if k not in ("kernel", "case", "us"))
        print(f"{r['kernel']:<24} {r['case']:<20} {r['us']:9.1f}  {rest}")
    print(f"\n{sum(ok.values())}/{len(ok)} checks passed")
    return 0 if all(ok.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
