"""The `flashinfer` attention backend on the GPU: does FlashInfer run here, does the backend agree with
the triton backend, and how do their attention kernels compare.

    python bench/gpu_flashinfer.py [--skip-engine]     (repository root; flashinfer-python importable,
                                                        e.g. wheels carried in .whl-flashinfer/:
                                                        bench/gpu_session.sh flashinfer)

1. Import FlashInfer and note what its JIT needs (nvcc, ninja) and how long the first plan/run takes
   (FlashInfer compiles its kernels at first use).
2. Layer level, bf16, 0.6B- and 8B-shaped heads (16 or 32 query heads, 8 KV heads, head_dim 128): the same
   pool, page table and queries through FlashInferAttnBackend and TritonAttnBackend; decode at batch 1 /
   64 with 1-4k-token contexts, extend of 4 requests x 844-1955 new tokens after 2048-token prefixes.
   Relative error between the two and against a float32 reference (< 1e-2), and each one's time
   (CUDA events, median, each including its K/V store; nothing of FlashInfer's per-step plan).
3. Engine level (unless --skip-engine): a random Qwen3-0.6B-shaped bf16 checkpoint, greedy 32 tokens on 7
   prompts with attention_backend='flashinfer' vs 'triton' (both without CUDA graphs): tokens in common,
   and batch-1 decode tok/s of each.
A JSON copy goes to $OUT/gpu_flashinfer.json (default bench/out/).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from services.worker.mem.memory_pool import ReqToTokenPool, TokenToKVPool  # noqa: E402
from services.worker.runtime.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from services.worker.runtime.layers.attention import RadixAttention  # noqa: E402
from shared.progress import progress_bar, say  # noqa: E402

OUT = Path(os.environ.get("OUT", "bench/out"))
DEV = torch.device("cuda")
DT = torch.bfloat16
SHAPES = {"qwen3-0.6b": (16, 8, 128), "qwen3-8b": (32, 8, 128)}


def log(msg: str) -> None:
    say(f"[{time.strftime('%H:%M:%S')}] {msg}")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def time_ms(fn, reps: int = 30) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


class Case:
    """One pool with random K/V for a batch: requests' prefixes already stored, new tokens to come."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, prefix: list[int], new: list[int], seed: int) -> None:
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        seq = [p + n for p, n in zip(prefix, new)]
        total = sum(seq)
        slots = torch.randperm(total + 64, generator=g)[:total] + 1  # shuffled, slot 0 unused
        self.kv = TokenToKVPool(total + 80, 1, kv_heads, head_dim, DT, DEV)
        self.kv.k_buffer[0].copy_(torch.randn(self.kv.k_buffer[0].shape, generator=g).to(DT))
        self.kv.v_buffer[0].copy_(torch.randn(self.kv.v_buffer[0].shape, generator=g).to(DT))
        self.req = ReqToTokenPool(len(seq) + 2, max(seq) + 1, DEV)
        rows = list(range(1, len(seq) + 1))
        out_locs, at = [], 0
        for row, p, n in zip(rows, prefix, new):
            mine = slots[at : at + p + n]
            at += p + n
            self.req.req_to_token[row, : p + n] = mine.to(DEV, torch.int32)
            out_locs.append(mine[p:])
        ntok = sum(new)
        self.q = torch.randn((ntok, heads * head_dim), generator=g).to(DEV, DT)
        self.k = torch.randn((ntok, kv_heads * head_dim), generator=g).to(DEV, DT)
        self.v = torch.randn((ntok, kv_heads * head_dim), generator=g).to(DEV, DT)
        self.layer = RadixAttention(heads, head_dim, head_dim**-0.5, kv_heads, 0)
        decode = all(n == 1 for n in new) and len(new) > 0
        self.batch_args = dict(
            forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            batch_size=len(seq),
            input_ids=torch.zeros(ntok, dtype=torch.int64, device=DEV),
            positions=torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, new)]).to(DEV),
            req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=DEV),
            seq_lens=torch.tensor(seq, dtype=torch.int64, device=DEV),
            out_cache_loc=torch.cat(out_locs).to(DEV),
            seq_lens_cpu=seq,
            extend_prefix_lens_cpu=prefix,
            extend_seq_lens_cpu=new,
            req_to_token_pool=self.req,
            token_to_kv_pool=self.kv,
        )
        self.prefix, self.new, self.seq = prefix, new, seq

    def run(self, backend) -> tuple[torch.Tensor, float]:
        batch = ForwardBatch(attn_backend=backend, **self.batch_args)
        backend.init_forward_metadata(batch)
        out = backend.forward(self.q, self.k, self.v, self.layer, batch)
        ms = time_ms(lambda: backend.forward(self.q, self.k, self.v, self.layer, batch))
        return out, ms

    def reference(self) -> torch.Tensor:
        """Float32 attention of each new token over its request's keys (kernels/reference.py's math)."""
        outs, at = [], 0
        k_all, v_all = self.kv.k_buffer[0], self.kv.v_buffer[0]
        row_of = self.batch_args["req_pool_indices"].tolist()
        for row, p, n in zip(row_of, self.prefix, self.new):
            slots = self.req.req_to_token[row, : p + n].long()
            q = self.q[at : at + n].view(n, self.heads, self.head_dim).float()
            k = k_all[slots].float().repeat_interleave(self.heads // self.kv_heads, 1)
            v = v_all[slots].float().repeat_interleave(self.heads // self.kv_heads, 1)
            s = torch.einsum("qhd,khd->hqk", q, k) * self.head_dim**-0.5
            mask = torch.arange(p + n, device=DEV)[None, :] <= torch.arange(n, device=DEV)[:, None] + p
            s = s.masked_fill(~mask[None], float("-inf"))
            outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(n, -1))
            at += n
        return torch.cat(outs)


def layer_level(results: dict) -> bool:
    from services.worker.runtime.attention.flashinfer_backend import FlashInferAttnBackend
    from services.worker.runtime.attention.triton_backend import TritonAttnBackend

    g = torch.Generator().manual_seed(0)
    cases = [
        ("decode bs1 ctx4k", [4095], [1]),
        ("decode bs64 ctx1k-4k", torch.randint(1024, 4096, (64,), generator=g).tolist(), [1] * 64),
        ("extend 4x844-1955 new, prefix 2048", [2048] * 4, [844, 1955, 1203, 1500]),
        ("extend 1x128 new, prefix 30720", [30720], [128]),
    ]
    ok = True
    bar = progress_bar(desc="kernel cases", total=len(SHAPES) * len(cases), lines_when_piped=False)
    for model, (heads, kv_heads, head_dim) in SHAPES.items():
        for name, prefix, new in cases:
            case = Case(heads, kv_heads, head_dim, prefix, new, seed=len(name))
            t0 = time.perf_counter()
            fi_backend = FlashInferAttnBackend()
            fi_out, fi_ms = case.run(fi_backend)
            first_s = time.perf_counter() - t0
            tr_backend = TritonAttnBackend()
            tr_backend.reserve(max(64, len(new)), heads, kv_heads, head_dim, DEV)
            tr_out, tr_ms = case.run(tr_backend)
            want = case.reference()
            e_fi, e_tr, e_between = rel(fi_out, want), rel(tr_out, want), rel(fi_out, tr_out)
            good = e_fi < 1e-2 and e_tr < 1e-2
            ok &= good
            key = f"{model} {name}"
            results[key] = dict(flashinfer_ms=fi_ms, triton_ms=tr_ms, err_flashinfer=e_fi, err_triton=e_tr,
                                err_between=e_between, first_call_s=first_s)
            log(f"{key:48s} flashinfer {fi_ms * 1e3:8.1f} us  triton {tr_ms * 1e3:8.1f} us  "
                f"err fi {e_fi:.1e} tr {e_tr:.1e} fi-vs-tr {e_between:.1e}  first call {first_s:.1f} s  "
                f"{'ok' if good else 'FAIL'}")
            bar.update()
    bar.close()
    return ok


def engine_level(results: dict) -> bool:
    from bench.gpu_common import build_checkpoint
    from services.worker.frontend.engine import Engine

    path = build_checkpoint("0.6b", torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(10, 150000, (48,), generator=g).tolist()
    prompts = [torch.randint(10, 150000, (int(n),), generator=g).tolist() for n in (5, 40, 17, 90)]
    prompts += [shared + torch.randint(10, 150000, (int(n),), generator=g).tolist() for n in (3, 30, 11)]
    params = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
    outs, speed = {}, {}
    for backend in ("triton", "flashinfer"):
        t0 = time.perf_counter()
        with Engine(str(path), attention_backend=backend, cuda_graph_max_bs=0, max_total_tokens=65536) as e:
            outs[backend] = [r["output_ids"] for r in e.generate(input_ids=prompts, sampling_params=params)]
            prompt = list(range(1000, 1128))
            e.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 4, "ignore_eos": True})
            t1 = time.perf_counter()
            e.generate(input_ids=prompt[:-1] + [5], sampling_params={"temperature": 0, "max_new_tokens": 129,
                                                                    "ignore_eos": True})
            speed[backend] = 128 / (time.perf_counter() - t1)
        log(f"engine {backend}: {time.perf_counter() - t0:.1f} s including load; bs1 decode (no graphs) "
            f"{speed[backend]:.1f} tok/s")
    common = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
              for x, y in zip(outs["flashinfer"], outs["triton"])]
    same = sum(x == y for x, y in zip(outs["flashinfer"], outs["triton"]))
    results["engine"] = dict(identical_requests=same, of=len(prompts), tokens_in_common=common,
                             bs1_tok_s_no_graphs=speed)
    log(f"engine greedy bf16: {same}/{len(prompts)} requests identical over 32 tokens; leading tokens in "
        f"common {common}")
    # bf16 greedy on random weights parts at near-ties between any two kernels; the first tokens agree.
    return min(common) >= 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args()
    results: dict = {}
    log(f"nvcc: {shutil.which('nvcc') or os.environ.get('CUDA_HOME', '?')}; ninja module: "
        f"{importlib.util.find_spec('ninja') is not None}; torch {torch.__version__}; "
        f"{torch.cuda.get_device_name()}")
    t0 = time.perf_counter()
    try:
        import flashinfer
    except ImportError as e:
        log(f"flashinfer does not import: {e!r}")
        results["import_error"] = repr(e)
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "gpu_flashinfer.json").write_text(json.dumps(results, indent=2))
        return 1
    results["import_s"] = time.perf_counter() - t0
    results["version"] = flashinfer.__version__
    log(f"flashinfer {flashinfer.__version__} imported in {results['import_s']:.1f} s")
    ok = layer_level(results)
    if not args.skip_engine:
        ok &= engine_level(results)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_flashinfer.json").write_text(json.dumps(results, indent=2))
    print("\n== gpu_flashinfer ==")
    for key, r in results.items():
        if isinstance(r, dict) and "flashinfer_ms" in r:
            print(f"{key:48s} flashinfer {r['flashinfer_ms'] * 1e3:8.1f} us  triton {r['triton_ms'] * 1e3:8.1f} us  "
                  f"ratio {r['triton_ms'] / r['flashinfer_ms']:.2f}  err {r['err_flashinfer']:.1e}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
