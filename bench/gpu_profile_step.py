"""Profile decode steps of the real scheduler on the GPU: where the host time of a step goes
(cProfile) and which kernels the device runs (torch.profiler), to find what bounds a step.

    python bench/gpu_profile_step.py [--model DIR] [--batch 1] [--prompt 128]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from services.worker.config import EngineConfig  # noqa: E402
from services.worker.sampling.sampling_params import SamplingParams  # noqa: E402
from services.worker.scheduler.req import Req  # noqa: E402
from services.worker.scheduler_loop import SchedulerLoop  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/rs-qwen3-0.6b-bfloat16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--host-profile", action="store_true")
    args = ap.parse_args()
    pool = max(65536, args.batch * (args.prompt + 600))
    loop = SchedulerLoop(EngineConfig(model_path=args.model, max_total_tokens=pool), 0, "tcp://127.0.0.1:0")
    s = loop.scheduler
    params = SamplingParams(max_new_tokens=500, temperature=0.0, ignore_eos=True)
    params.normalize()
    for i in range(args.batch):
        s.add_request(Req(f"r{i}", [1000 + (i * 7 + j) % 50000 for j in range(args.prompt)], params, seed=i))
    while s.waiting or s.chunked_req:
        s.step()
    for _ in range(20):
        s.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        s.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) / 50 * 1e3
    print(f"batch {args.batch}, prompt {args.prompt}: step {step_ms:.2f} ms, {args.batch / step_ms * 1e3:.0f} tok/s")
    if args.host_profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(20):
            s.step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            s.step()
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))


if __name__ == "__main__":
    main()
