"""Decode throughput of the offline Engine vs transformers' `generate`, same weights, on the CPU.

    .venv/bin/python bench/cpu_decode.py        (from the repository root; needs the default model:
                                                 `radixserve model fetch`)

Both run the embedded default model (SmolLM2-135M-Instruct) in float32 (or both in bfloat16 with
`--dtype bfloat16`: on CPUs with AMX that is where oneDNN's bf16 kernels pay), greedy, with EOS banned
until the last token (min_new_tokens = max_new_tokens on both sides, so every call generates exactly
its tokens and both sample from the same distribution), on the same prompts of 64 token ids:
  - batch 1: one prompt, 128 new tokens;
  - batch 16: 16 distinct prompts in one call, 128 new tokens each.
Throughput = generated tokens / wall time of one generate call. That time includes the prefill of
the prompts, every decode step and sampling; for the Engine also its request bookkeeping, the hand-off
to its scheduler thread and detokenisation of the output, which HF's generate does not do (HF returns
ids). Prompts are passed as ids, so neither side tokenises. The Engine's prefix cache is flushed
before each of its runs, so it never reuses an earlier run's prompt. A steady-state decode rate is
derived per side from the same calls with 1 new token: (tokens(128) - tokens(1)) / (time(128) - time(1)).

Each side lives in its own process (each with the machine's threads, one running at a time), so
neither inherits the other's thread pools or allocator state; the parent sends the calls and times
nothing itself. Each figure is the median of REPEATS runs, ours and HF's alternating, so both see the
same load. The ceiling (DESIGN §6) is the batch-1 bound (float32 weight bytes read per step) / (copy
bandwidth measured here, read + write bytes). In float32 the greedy tokens of the batch-1 run must
equal HF's; in bfloat16 the two sides round differently, so the first mismatch is only reported.
A short table closes the output; a JSON copy goes to bench/out/cpu_decode[_bfloat16].json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    # Run as a script: make the repository's packages importable without an install.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shared.model_path import resolve_model_path  # noqa: E402
from shared.progress import progress_bar, say  # noqa: E402

PROMPT_LEN = 64
NEW_TOKENS = 128
REPEATS = 3
# (batch size, target ratio ours / HF) from the issue.
CASES = ((1, 1.2), (16, 3.0))
OUT_DIR = Path(__file__).resolve().parent / "out"
LOADED = 1.5


def copy_bandwidth_gbs(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Host memory copy bandwidth, counting the bytes read and written (GB/s, median)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times) / 1e9


def make_prompts(count: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Distinct random prompts (ids above the special tokens), so no two share a cached prefix."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size) for _ in range(PROMPT_LEN)] for _ in range(count)]


class HFSide:
    """transformers' model and generate, in the run's dtype, in this process's main thread."""

    def __init__(self, path: str, dtype: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        embedding = self.model.get_input_embeddings().weight
        tied = self.model.get_output_embeddings().weight is embedding
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        # A step reads every weight once, except the input embedding (one row per token); a tied
        # embedding is read in full as the LM head.
        self.info = {
            "vocab_size": self.model.config.vocab_size,
            "weight_bytes_per_step": weights - (0 if tied else embedding.numel() * embedding.element_size()),
        }

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
            )
        return out[:, PROMPT_LEN:].tolist()

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class OursSide:
    """Our offline Engine, float32 (its scheduler runs in its own thread, as in any Engine)."""

    def __init__(self, path: str, dtype: str) -> None:
        from services.worker.frontend.engine import Engine

        # A KV pool for the largest case (16 x 192 tokens) plus room; the default would size it from
        # RAM (and zero gigabytes at start-up) for nothing.
        self.engine = Engine(path, dtype=dtype, max_total_tokens=8192)
        self.info = {"max_total_tokens": 8192}

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        # As HF's min_new_tokens: EOS may not be sampled before the last token (ignore_eos alone
        # would let it be sampled and carry on, a different sequence from HF's).
        params = {"temperature": 0.0, "max_new_tokens": new_tokens, "min_new_tokens": new_tokens}
        results = self.engine.generate(input_ids=prompts, sampling_params=params)
        return [r["output_ids"] for r in results]  # type: ignore[index]

    def flush(self) -> None:
        if not self.engine.flush_cache():
            raise RuntimeError("the engine refused to flush its prefix cache")

    def close(self) -> None:
        self.engine.shutdown()


def serve(side: str, path: str, dtype: str, conn: Connection) -> None:
    """A side's process: load, report info, then answer ('generate', prompts, n) with (seconds,
    tokens) until ('close',)."""
    impl: Any = HFSide(path, dtype) if side == "hf" else OursSide(path, dtype)
    conn.send(impl.info)
    while True:
        cmd = conn.recv()
        if cmd[0] == "close":
            impl.close()
            conn.send(None)
            return
        _, prompts, new_tokens = cmd
        impl.flush()
        start = time.perf_counter()
        tokens = impl.generate(prompts, new_tokens)
        conn.send((time.perf_counter() - start, tokens))


class Side:
    """The parent's handle on one side's process."""

    def __init__(self, name: str, path: str, dtype: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(name, path, dtype, child), daemon=True)
        self.proc.start()
        self.info: dict[str, Any] = self.conn.recv()

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
        self.conn.send(("generate", prompts, new_tokens))
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(("close",))
        self.conn.recv()
        self.proc.join(timeout=60)


def run_case(sides: dict[str, Side], bs: int, vocab_size: int) -> dict[str, Any]:
    prompts = make_prompts(bs, vocab_size, seed=bs)
    runs: dict[str, dict[int, list[float]]] = {name: {1: [], NEW_TOKENS: []} for name in sides}
    tokens: dict[str, list[list[int]]] = {}
    loads = []
    for _ in progress_bar(range(REPEATS), desc=f"batch {bs} repeats", lines_when_piped=False, leave=False):
        # Ends on the full-length runs, whose tokens the greedy check compares.
        for new in (1, NEW_TOKENS):
            for name, side in sides.items():
                seconds, tokens[name] = side.generate(prompts, new)
                runs[name][new].append(seconds)
        loads.append(os.getloadavg()[0])
    result: dict[str, Any] = {"batch_size": bs, "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS,
                              "load_averages": loads}
    for name in sides:
        t_full = statistics.median(runs[name][NEW_TOKENS])
        t_one = statistics.median(runs[name][1])
        result[name] = {
            "seconds": t_full,
            "seconds_all": runs[name][NEW_TOKENS],
            "tok_per_s": bs * NEW_TOKENS / t_full,
            "prefill_plus_1_seconds": t_one,
            "decode_only_tok_per_s": bs * (NEW_TOKENS - 1) / max(t_full - t_one, 1e-9),
        }
    result["ratio"] = result["ours"]["tok_per_s"] / result["hf"]["tok_per_s"]
    result["decode_only_ratio"] = result["ours"]["decode_only_tok_per_s"] / result["hf"]["decode_only_tok_per_s"]
    result["greedy_rows_equal_hf"] = sum(a == b for a, b in zip(tokens["ours"], tokens["hf"]))
    result["first_mismatch"] = [
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(tokens["ours"], tokens["hf"])
    ]
    return result


def print_table(results: list[dict[str, Any]], ceiling_bs1: float) -> None:
    print(f"{'batch':>5}  {'ours tok/s':>10}  {'HF tok/s':>9}  {'ratio':>6}  {'target':>6}  {'status':<14}"
          f"  {'decode-only ours/HF tok/s':>26}  {'ratio':>6}")
    for r in results:
        ratio, target = r["ratio"], r["target_ratio"]
        status = ("met" if ratio >= target else "missed") + f" ({ratio / target - 1:+.0%})"
        decode = f"{r['ours']['decode_only_tok_per_s']:.1f} / {r['hf']['decode_only_tok_per_s']:.1f}"
        print(f"{r['batch_size']:>5}  {r['ours']['tok_per_s']:>10.1f}  {r['hf']['tok_per_s']:>9.1f}  "
              f"{ratio:>6.2f}  {target:>6.1f}  {status:<14}  {decode:>26}  {r['decode_only_ratio']:>6.2f}")
    steady = results[0]["ours"]["decode_only_tok_per_s"]
    print(f"batch-1 ceiling (weights / copy bandwidth): {ceiling_bs1:.1f} tok/s; "
          f"ours reaches {steady / ceiling_bs1:.0%} of it in steady decode")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", default=None, help="HF checkpoint directory (default: the embedded model)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="both sides' dtype")
    args = parser.parse_args()
    path = str(resolve_model_path(args.model_path))
    load = os.getloadavg()[0]
    print(f"model {path} ({args.dtype})\ntorch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
          f"load average {load:.2f}")
    if load >= LOADED:
        print(f"warning: the machine is loaded (load average >= {LOADED}); figures will be noisy")
    bandwidth = copy_bandwidth_gbs()

    sides = {"ours": Side("ours", path, args.dtype), "hf": Side("hf", path, args.dtype)}
    step_bytes = sides["hf"].info["weight_bytes_per_step"]
    vocab_size = sides["hf"].info["vocab_size"]
    ceiling_bs1 = bandwidth * 1e9 / step_bytes
    print(f"weights read per decode step {step_bytes / 2**20:.0f} MiB; copy bandwidth {bandwidth:.1f} GB/s "
          f"-> batch-1 ceiling {ceiling_bs1:.1f} tok/s")
    # Warm both (thread pools, allocators, first-call paths) before any timing.
    for side in sides.values():
        side.generate(make_prompts(2, vocab_size, seed=99), 4)

    results = []
    for bs, target in progress_bar(CASES, desc="batch sizes", lines_when_piped=False):
        r = run_case(sides, bs, vocab_size)
        r["target_ratio"] = target
        results.append(r)
        say(f"batch {bs}: ours {r['ours']['tok_per_s']:.1f} tok/s, HF {r['hf']['tok_per_s']:.1f} tok/s "
            f"(x{r['ratio']:.2f}); decode only: ours {r['ours']['decode_only_tok_per_s']:.1f}, "
            f"HF {r['hf']['decode_only_tok_per_s']:.1f} (x{r['decode_only_ratio']:.2f}); "
            f"greedy rows equal to HF: {r['greedy_rows_equal_hf']}/{bs}; load {max(r['load_averages']):.2f}")
    for side in sides.values():
        side.close()

    check = results[0]["greedy_rows_equal_hf"] == 1 or args.dtype != "float32"
    end_load = os.getloadavg()[0]
    equal = results[0]["greedy_rows_equal_hf"] == 1
    print(f"\ngreedy check (batch 1, {NEW_TOKENS} tokens): ours == HF: {'PASS' if equal else 'FAIL'}"
          + ("" if equal else f" (first mismatch at token {results[0]['first_mismatch'][0]})"))
    print(f"load average at the end {end_load:.2f}\n")
    print_table(results, ceiling_bs1)
    OUT_DIR.mkdir(exist_ok=True)
    summary = {
        "torch": torch.__version__,
        "dtype": args.dtype,
        "load_average_start": load,
        "load_average_end": end_load,
        "copy_bandwidth_gbs": bandwidth,
        "weight_bytes_per_step": step_bytes,
        "ceiling_bs1_tok_per_s": ceiling_bs1,
        "greedy_check_bs1": check,
        "cases": results,
    }
    name = "cpu_decode.json" if args.dtype == "float32" else f"cpu_decode_{args.dtype}.json"
    (OUT_DIR / name).write_text(json.dumps(summary, indent=2))
    if not check:
        sys.exit(1)


if __name__ == "__main__":
    main()
