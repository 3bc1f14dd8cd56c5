"""What constrained decoding costs: decode throughput with every request held to a JSON schema against
the same requests unconstrained, and llguidance's mask time per row.

    .venv/bin/python bench/grammar.py                      (CPU, the embedded default model)
    python bench/grammar.py --device cuda --batches 1,32,128   (the GPU host; default model from
                                                               --model-path or the embedded one)

Workload: the chat prompt "List fruits as JSON." for every row of a batch, greedy, NEW_TOKENS new
tokens each. Constrained rows carry a schema: an object whose array must hold at least 500 strings, so
no row can finish early and both sides generate exactly the same number of tokens (the free side runs
with ignore_eos). Two schemas: `plain` strings, and `bounded` ones (maxLength 40), whose bounded
repetition llguidance cannot answer from its precomputed token slices: each of their masks walks the
vocabulary (100x the time per mask on this CPU). Each batch size runs free, constrained, free, constrained (the first pair is a warm-up, the
prefix cache is flushed before each run); throughput = generated tokens / wall time of one generate
call, prefill included (the same on both sides). Mask time: the constrained outputs replayed through a
fresh matcher, timing each step's mask (llguidance, host side); median and p90 in microseconds.
A table closes the output; JSON goes to --out (default bench/out/grammar_<device>.json; recorded runs
live in bench/results/, named by benchmark and date).

--profile SCHEMA: instead, the scheduler of the largest batch stepped on this thread under cProfile,
free and then constrained (64 decode steps each after the prefill), printing where the host time goes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from services.worker.frontend.engine import Engine  # noqa: E402
from services.worker.runtime.sampling.grammar import GrammarBackend  # noqa: E402
from shared.progress import progress_bar, say  # noqa: E402
from shared.sampling_params import SamplingParams  # noqa: E402

NEW_TOKENS = 128
SCHEMAS = {
    name: {
        "type": "object",
        "properties": {"fruits": {"type": "array", "items": {"type": "string", **extra}, "minItems": 500}},
        "required": ["fruits"],
        "additionalProperties": False,
    }
    for name, extra in (("plain", {}), ("bounded", {"maxLength": 40}))
}
OUT_DIR = Path(__file__).resolve().parent / "out"


def run(engine: Engine, prompt: list[int], batch: int, schema: dict | None) -> tuple[float, list[list[int]]]:
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    if schema is not None:
        params["json_schema"] = json.dumps(schema)
    engine.flush_cache()
    start = time.perf_counter()
    results = engine.generate(input_ids=[prompt] * batch, sampling_params=params)
    wall = time.perf_counter() - start
    outs = [r["output_ids"] for r in results]
    assert all(len(o) == NEW_TOKENS for o in outs), [len(o) for o in outs]
    return batch * NEW_TOKENS / wall, outs


def mask_times(engine: Engine, outputs: list[list[int]], vocab_size: int, schema: dict) -> list[float]:
    """Microseconds per mask, replaying constrained outputs through fresh matchers."""
    backend = GrammarBackend(engine.tokenizer, vocab_size)
    params = SamplingParams(json_schema=json.dumps(schema))
    words = (vocab_size + 31) // 32
    bitmask = torch.empty(words, dtype=torch.int32)
    times = []
    for output in outputs:
        matcher = backend.matcher(params)
        for token in output:
            t0 = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), words * 4)
            times.append((time.perf_counter() - t0) * 1e6)
            assert matcher.consume_token(token)
    return times


def profile(args: argparse.Namespace, batch: int) -> None:
    """cProfile of scheduler steps on this thread (no scheduler process), free then constrained."""
    import cProfile
    import pstats

    from services.worker.config import EngineConfig
    from services.worker.frontend.scheduler_loop import SchedulerLoop
    from services.worker.scheduler.req import Req

    path = args.model_path
    kwargs = {"device": args.device, "max_total_tokens": 8192 * max(1, batch // 16)}
    if args.dtype:
        kwargs["dtype"] = args.dtype
    with Engine(path, **kwargs) as engine:  # for the tokenizer, template and resolved path only
        prompt = engine.tokenizer.encode(engine.apply_chat_template([{"role": "user", "content": "List fruits as JSON."}]))
        resolved = engine.config.model_path
        eos = frozenset(engine.model_config.eos_token_ids)
    loop = SchedulerLoop(EngineConfig.from_kwargs(resolved, **kwargs), 0, "")
    for name, schema in (("free", None), (args.profile, SCHEMAS[args.profile])):
        values = {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}
        if schema is not None:
            values["json_schema"] = json.dumps(schema)
        for i in range(batch):
            params = SamplingParams(**values)
            params.verify(engine.model_config.vocab_size)
            loop.scheduler.add_request(Req(f"{name}-{i}", prompt, params.normalize(), seed=i, eos_token_ids=eos))
        for _ in range(8):  # prefill and the first decodes
            loop.scheduler.step()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        prof = cProfile.Profile()
        start = time.perf_counter()
        prof.enable()
        for _ in range(64):
            loop.scheduler.step()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        prof.disable()
        print(f"== {name}, batch {batch}: {(time.perf_counter() - start) / 64 * 1e3:.3f} ms per step (profiled)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
        while loop.scheduler.has_work():
            loop.scheduler.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--schemas", default="plain,bounded", help=f"comma-separated, of {', '.join(SCHEMAS)}")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--profile", default=None, choices=sorted(SCHEMAS), help="profile the scheduler's steps instead")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.profile:
        profile(args, max(batches))
        return
    kwargs = {"device": args.device, "max_total_tokens": 8192 * max(1, max(batches) // 16)}
    if args.dtype:
        kwargs["dtype"] = args.dtype
    rows = []
    masks: dict[str, dict[str, float]] = {}
    samples: dict[str, str] = {}
    with Engine(args.model_path, **kwargs) as engine:
        prompt = engine.tokenizer.encode(engine.apply_chat_template([{"role": "user", "content": "List fruits as JSON."}]))
        vocab = engine.model_config.vocab_size
        schemas = args.schemas.split(",")
        bar = progress_bar(desc="schema x batch", total=len(schemas) * len(batches), lines_when_piped=False)
        for name in schemas:
            schema = SCHEMAS[name]
            sample_out: list[list[int]] = []
            for batch in batches:
                figures: dict[str, list[float]] = {"free": [], "constrained": []}
                for _ in range(2):  # the first pair warms up
                    for side in ("free", "constrained"):
                        tps, outs = run(engine, prompt, batch, schema if side == "constrained" else None)
                        figures[side].append(tps)
                        if side == "constrained":
                            sample_out = outs[:4]
                free, con = figures["free"][-1], figures["constrained"][-1]
                rows.append({"schema": name, "batch": batch, "free_tok_s": free, "constrained_tok_s": con,
                             "ratio": con / free, "warmup": {k: v[0] for k, v in figures.items()}})
                bar.update()
                say(f"{name} batch {batch}: free {free:.1f} tok/s, constrained {con:.1f} tok/s, ratio {con / free:.3f}")
            samples[name] = engine.tokenizer.decode(sample_out[0])
            times = mask_times(engine, sample_out, vocab, schema)
            masks[name] = {"median_us": statistics.median(times), "p90_us": statistics.quantiles(times, n=10)[-1],
                           "count": len(times)}
        bar.close()
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    result = {"device": device, "new_tokens": NEW_TOKENS, "rows": rows, "mask": masks, "sample_output": samples}
    out = Path(args.out) if args.out else OUT_DIR / f"grammar_{args.device.split(':')[0]}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    for name, text in samples.items():
        print(f"{name}: {text[:100]!r}...")
    print(f"{'schema':>8} {'batch':>6} {'free tok/s':>11} {'json tok/s':>11} {'ratio':>7}")
    for r in rows:
        print(f"{r['schema']:>8} {r['batch']:>6} {r['free_tok_s']:>11.1f} {r['constrained_tok_s']:>11.1f} {r['ratio']:>7.3f}")
    for name, m in masks.items():
        print(f"{name} mask per row per step: median {m['median_us']:.1f} us, p90 {m['p90_us']:.1f} us ({m['count']} masks)")
    print(f"JSON in {out}")


if __name__ == "__main__":
    main()
