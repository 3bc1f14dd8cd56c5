"""Time the scheduler's own work per decode step, and the radix cache's match/insert rate, on the CPU.

    .venv/bin/python bench/cpu_scheduler.py        (from the repository root)

1. Decode step at batch 256 with a trivial model: the real Scheduler drives 256 running requests
   over a ModelRunner whose forward returns fixed random logits [bs, 512] at once; everything else
   is the real code (admission checks, ScheduleBatch.prepare_decode, the ForwardBatch, the batched
   sampler on the 512-token vocabulary, finish checks, outputs). `scheduler.step()` is timed whole;
   the breakdown times its parts, plus the torch attention backend's per-step metadata build (which
   a real forward adds). Target: step <= 1 ms.
2. Radix cache: 1000 sequences of 1-4k tokens that share 40 "system prompts" (and, for some, a
   conversation history) are matched then inserted, as the scheduler does for each request; the rate
   is tokens of key walked per second, for matches and inserts separately.

Each figure is the median of several repeats. A short table closes the output; a JSON copy goes to
bench/out/cpu_scheduler.json.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

if __package__ in (None, ""):
    # Run as a script: make the repository's packages importable without an install.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from services.worker.config import EngineConfig  # noqa: E402
from services.worker.mem.memory_pool import ReqToTokenPool, TokenToKVPool, TokenToKVPoolAllocator  # noqa: E402
from services.worker.mem.radix_cache import RadixCache  # noqa: E402
from services.worker.runtime.attention.torch_backend import TorchAttnBackend  # noqa: E402
from services.worker.runtime.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from services.worker.runtime.model_runner import ModelRunner  # noqa: E402
from services.worker.runtime.sampling.sampler import Sampler  # noqa: E402
from services.worker.scheduler.req import Req  # noqa: E402
from services.worker.scheduler.schedule_batch import ScheduleBatch  # noqa: E402
from services.worker.scheduler.scheduler import Scheduler  # noqa: E402
from shared.progress import progress_bar  # noqa: E402
from shared.sampling_params import SamplingParams  # noqa: E402

BATCH = 256
VOCAB = 512
PROMPT_LEN = 256
WARMUP_STEPS = 20
TIMED_STEPS = 200
STEP_TARGET_MS = 1.0
OUT_DIR = Path(__file__).resolve().parent / "out"


class TrivialRunner(ModelRunner):
    """The real ModelRunner's pools and sampler around a model that costs nothing: forward returns
    a fixed random [bs, VOCAB] logits tensor."""

    def __init__(self, max_total_tokens: int, max_running: int, context_len: int) -> None:
        self.device = torch.device("cpu")
        self.tp_size = 1
        self.model_config = SimpleNamespace(vocab_size=VOCAB, eos_token_ids=(0,))
        self.max_total_tokens = max_total_tokens
        self.token_to_kv_pool = TokenToKVPool(max_total_tokens, 1, 1, 8, torch.float32, self.device)
        self.allocator = TokenToKVPoolAllocator(max_total_tokens, self.device)
        self.req_to_token_pool = ReqToTokenPool(max_running, context_len + 1, self.device)
        self.state_snapshots = None  # not a hybrid model: a plain radix cache
        self.attn_backend = TorchAttnBackend()
        self.sampler = Sampler()
        self.logits = torch.randn((max_running, VOCAB), generator=torch.Generator().manual_seed(0))

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.logits[: batch.batch_size]


class Timed:
    """Wraps a callable and records the wall time (seconds) of each call."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.times: list[float] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.times.append(time.perf_counter() - start)


def build_scheduler(decode_steps: int) -> Scheduler:
    context = PROMPT_LEN + decode_steps + 8
    runner = TrivialRunner(BATCH * context, BATCH, context)
    config = EngineConfig(model_path="trivial", max_running_requests=BATCH, chunked_prefill_size=None)
    scheduler = Scheduler(config, runner, decode_tail=lambda ids: "")
    rng = random.Random(0)
    for i in range(BATCH):
        params = SamplingParams.from_dict({"temperature": 0.0, "ignore_eos": True, "max_new_tokens": decode_steps})
        params.normalize()
        prompt = [rng.randrange(1, VOCAB) for _ in range(PROMPT_LEN)]
        scheduler.add_request(Req(f"r{i}", prompt, params, seed=i))
    while scheduler.waiting:
        scheduler.step()
    assert len(scheduler.running) == BATCH, "every request must be decoding"
    return scheduler


def bench_decode_step() -> dict[str, float]:
    """One scheduler, 256 decoding requests: TIMED_STEPS plain steps, then TIMED_STEPS more with the
    parts wrapped in timers (so the wrappers never slow the whole-step figure)."""
    scheduler = build_scheduler(WARMUP_STEPS + 2 * TIMED_STEPS + 10)
    runner = scheduler.runner
    for _ in range(WARMUP_STEPS):
        scheduler.step()
    steps, cpu = [], []
    for _ in range(TIMED_STEPS):
        start, start_cpu = time.perf_counter(), time.thread_time()
        outputs = scheduler.step()
        steps.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - start_cpu)
        assert len(outputs) == BATCH
    prepare = Timed(ScheduleBatch.prepare_decode)
    sample = Timed(runner.sample_async)
    ScheduleBatch.prepare_decode = lambda self, *a, **k: prepare(self, *a, **k)  # type: ignore[method-assign]
    runner.sample_async = sample  # type: ignore[method-assign]
    try:
        for _ in range(TIMED_STEPS):
            scheduler.step()
    finally:
        ScheduleBatch.prepare_decode = prepare.fn  # type: ignore[method-assign]
    # The attention metadata a real forward builds first (torch backend), on one more decode batch.
    forward_batch = ScheduleBatch(list(scheduler.running), ForwardMode.DECODE, scheduler.mem).prepare_decode()
    meta_times = []
    for _ in range(50):
        start = time.perf_counter()
        runner.attn_backend.init_forward_metadata(forward_batch)
        meta_times.append(time.perf_counter() - start)
    ms = 1e3
    step = statistics.median(steps) * ms
    prep = statistics.median(prepare.times) * ms
    samp = statistics.median(sample.times) * ms
    return {
        "step_ms": step,
        "step_p90_ms": sorted(steps)[int(0.9 * len(steps))] * ms,
        "step_thread_cpu_ms": statistics.median(cpu) * ms,
        "prepare_decode_ms": prep,
        "sample_async_ms": samp,
        "rest_of_step_ms": step - prep - samp,
        "attn_metadata_ms": statistics.median(meta_times) * ms,
    }


def radix_workload(seed: int = 0) -> list[list[int]]:
    """1000 sequences of 1-4k tokens: 40 system prompts (200-1000 tokens) shared by many; half the
    sequences continue an earlier one (a later turn of the same conversation)."""
    rng = random.Random(seed)
    vocab = 32000
    systems = [[rng.randrange(vocab) for _ in range(rng.randint(200, 1000))] for _ in range(40)]
    seqs: list[list[int]] = []
    for _ in range(1000):
        target = rng.randint(1024, 4096)
        base = rng.choice(seqs) if seqs and rng.random() < 0.5 else rng.choice(systems)
        seq = base[: min(len(base), target - 64)]
        seq = seq + [rng.randrange(vocab) for _ in range(target - len(seq))]
        seqs.append(seq)
    return seqs


def bench_radix(repeats: int = 3) -> dict[str, float]:
    seqs = radix_workload()
    tokens = sum(len(s) for s in seqs)
    match_s, insert_s, hit_tokens = [], [], 0
    for _ in progress_bar(range(repeats), desc="radix repeats", lines_when_piped=False):
        allocator = TokenToKVPoolAllocator(tokens, "cpu")
        cache = RadixCache(ReqToTokenPool(1, 8, "cpu"), allocator)
        t_match = t_insert = 0.0
        hit_tokens = 0
        for seq in seqs:
            start = time.perf_counter()
            matched = cache.match_prefix(seq).indices
            t_match += time.perf_counter() - start
            hit_tokens += matched.numel()
            fresh = allocator.alloc(len(seq) - matched.numel())
            assert fresh is not None
            value = torch.cat((matched, fresh))
            start = time.perf_counter()
            cache.insert(seq, value)
            t_insert += time.perf_counter() - start
        match_s.append(t_match)
        insert_s.append(t_insert)
    return {
        "sequences": len(seqs),
        "tokens": tokens,
        "hit_ratio": hit_tokens / tokens,
        "match_tokens_per_s": tokens / statistics.median(match_s),
        "insert_tokens_per_s": tokens / statistics.median(insert_s),
        "match_us_per_seq": statistics.median(match_s) / len(seqs) * 1e6,
        "insert_us_per_seq": statistics.median(insert_s) / len(seqs) * 1e6,
    }


def main() -> None:
    load = os.getloadavg()[0]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
          f"load average {load:.2f}")
    steps = [bench_decode_step() for _ in progress_bar(range(3), desc="decode-step runs", lines_when_piped=False)]
    decode = {key: statistics.median(s[key] for s in steps) for key in steps[0]}
    print(f"decode step at batch {BATCH} (trivial model, vocab {VOCAB}), median of 3 runs x {TIMED_STEPS} steps:")
    for key, value in decode.items():
        print(f"  {key:20s} {value:8.3f}")
    radix = bench_radix()
    print(f"radix cache: {radix['sequences']} sequences, {radix['tokens']} tokens, hit ratio {radix['hit_ratio']:.2f}")
    print(f"  match  {radix['match_tokens_per_s'] / 1e6:8.1f} M tokens/s ({radix['match_us_per_seq']:.1f} us/seq)")
    print(f"  insert {radix['insert_tokens_per_s'] / 1e6:8.1f} M tokens/s ({radix['insert_us_per_seq']:.1f} us/seq)")
    step = decode["step_ms"]
    status = f"met ({1 - step / STEP_TARGET_MS:.0%} under)" if step <= STEP_TARGET_MS else (
        f"missed (by {step / STEP_TARGET_MS - 1:.0%})"
    )
    end_load = os.getloadavg()[0]
    print(f"load average at the end {end_load:.2f}\n")
    print(f"{'figure':36s} {'value':>9s} {'target':>8s}  status")
    print(f"{'scheduler.step() @ bs 256 (ms)':36s} {step:9.3f} {'<= 1.0':>8s}  {status}")
    print(f"{'  its thread CPU time (ms)':36s} {decode['step_thread_cpu_ms']:9.3f}")
    print(f"{'  prepare_decode (ms)':36s} {decode['prepare_decode_ms']:9.3f}")
    print(f"{'  sample_async (ms)':36s} {decode['sample_async_ms']:9.3f}")
    print(f"{'  the rest (ms)':36s} {decode['rest_of_step_ms']:9.3f}")
    print(f"{'torch attn metadata @ bs 256 (ms)':36s} {decode['attn_metadata_ms']:9.3f}")
    print(f"{'radix match (M tokens/s)':36s} {radix['match_tokens_per_s'] / 1e6:9.1f}")
    print(f"{'radix insert (M tokens/s)':36s} {radix['insert_tokens_per_s'] / 1e6:9.1f}")
    OUT_DIR.mkdir(exist_ok=True)
    result = {"load_average": load, "load_average_end": end_load, "torch": torch.__version__, "decode_step": decode, "radix": radix}
    (OUT_DIR / "cpu_scheduler.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
