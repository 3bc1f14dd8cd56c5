"""Profile decode steps of the real scheduler on the GPU (Qwen3-0.6B-shaped, bf16, batch 1): where the
host time of a step goes (cProfile) and what the device runs (torch.profiler), to find per-step overhead.

    python bench/gpu_profile_step.py [checkpoint dir]
"""

from __future__ import annotations

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
    path = sys.argv[1] if len(sys.argv) > 1 else "/tmp/rs-qwen3-0.6b-bfloat16"
    loop = SchedulerLoop(EngineConfig(model_path=path, max_total_tokens=65536), 0, "tcp://127.0.0.1:0")
    s = loop.scheduler
    params = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
    params.normalize()
    s.add_request(Req("a", list(range(1000, 1128)), params, seed=0))
    for _ in range(20):
        s.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        s.step()
    torch.cuda.synchronize()
    print(f"step: {(time.perf_counter() - t0) / 50 * 1e3:.2f} ms")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        s.step()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            s.step()
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    print(p.key_averages().table(sort_by="cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
