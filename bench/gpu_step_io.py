"""The work of a decode step outside its CUDA graph, torch's launches against the step kernels, on one GPU.

    python bench/gpu_step_io.py            (repository root; a CUDA GPU)

- greedy sampling: kernels/sampling.py's greedy_argmax against torch.argmax on float32 logits [bs, 151,936]
  (Qwen3's vocabulary), hot in the L2 as a step's logits are: checked equal over 200 calls each of random
  rows, rows with ties and NaNs (the in-kernel merge's ordering runs on real concurrency here), then timed;
- the input fixups: kernels/step_inputs.py's apply_step_inputs against the torch form it replaces
  (ScheduleBatch._forward_batch: the in-flight tokens' gather and where, the request table's index_put).
Times are GPU time a call: 50 calls captured in a CUDA graph, the replays' CUDA-event median (what the
GPU spends when the host runs ahead, as it does in a decode step). `gpu_step_io_2026-12-07_a.json` timed the
calls from Python instead, which measured their launch cost; its checks stand. Prints a table last; JSON to $OUT/gpu_step_io.json.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_common import OUT  # noqa: E402
from kernels.sampling import greedy_argmax  # noqa: E402
from kernels.step_inputs import apply_step_inputs  # noqa: E402
from services.worker.runtime.layers.linear_calibration import cuda_graph_seconds  # noqa: E402

VOCAB = 151_936


def per_call_us(fn: Callable[[], object], calls: int = 50) -> float:
    """GPU µs a call: `calls` calls captured in one CUDA graph (layers/linear_calibration.py's
    cuda_graph_seconds, median of its replays), so the figure is the kernels' own time back to back, not
    Python's launch cost (timing the calls from Python measured that: ~18 µs a torch argmax, ~57 a
    greedy_argmax, whatever the GPU did)."""

    def batch() -> None:
        for _ in range(calls):
            fn()

    return cuda_graph_seconds(batch) * 1e6 / calls


def greedy_rows(bs: int, gen: torch.Generator) -> list[torch.Tensor]:
    random_rows = torch.randn((bs, VOCAB), generator=gen, device="cuda")
    tied = torch.randn((bs, VOCAB), generator=gen, device="cuda").round()  # many ties at the maximum
    nans = torch.randn((bs, VOCAB), generator=gen, device="cuda")
    nans[:, ::9973] = float("nan")
    return [random_rows, tied, nans]


def main() -> int:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows: list[dict] = []
    failed = False
    for bs in (1, 8, 64, 256):
        cases = greedy_rows(bs, gen)
        mismatches = 0
        for logits in cases:
            want = logits.argmax(dim=-1)
            mismatches += sum(not torch.equal(greedy_argmax(logits), want) for _ in range(200))
        logits = cases[0]
        torch_us = per_call_us(lambda logits=logits: logits.argmax(dim=-1))
        kernel_us = per_call_us(lambda logits=logits: greedy_argmax(logits))
        failed |= mismatches > 0
        rows.append({"what": f"greedy argmax [{bs}, {VOCAB}] fp32", "torch_us": torch_us, "kernel_us": kernel_us,
                     "check": f"{mismatches} of {600} calls differ"})
        print(rows[-1], flush=True)

    table = torch.zeros((512, 4096), dtype=torch.int32, device="cuda")
    for bs in (1, 64, 256):
        tokens = torch.randint(0, VOCAB, (bs,), generator=gen, device="cuda")
        index = torch.randperm(bs, device="cuda")
        index[1::3] = -1
        r = torch.randperm(512, device="cuda")[:bs]
        c = torch.randint(0, 4096, (bs,), generator=gen, device="cuda")
        packed = torch.cat([torch.randint(0, VOCAB, (5 * bs,), generator=gen, device="cuda"), index, r, c,
                            torch.randint(0, 2**30, (bs,), generator=gen, device="cuda")])

        def torch_form(packed=packed, bs=bs, tokens=tokens) -> None:
            ids, idx = packed[:bs], packed[5 * bs : 6 * bs]
            torch.where(idx >= 0, tokens[idx.clamp(min=0)], ids, out=ids)
            rows_, cols, values = packed[6 * bs :].split(bs)
            table[rows_, cols] = values.to(torch.int32)

        def kernel_form(packed=packed, bs=bs, tokens=tokens) -> None:
            apply_step_inputs(packed, tokens, 5 * bs, bs, table, 6 * bs, bs)

        want_packed, want_table = packed.clone(), table.clone()
        saved_table = table.clone()
        torch_form(want_packed)
        want_table.copy_(table)
        table.copy_(saved_table)
        got = packed.clone()
        kernel_form(got)
        same = torch.equal(got, want_packed) and torch.equal(table, want_table)
        failed |= not same
        torch_us = per_call_us(lambda packed=packed, form=torch_form: form(packed.clone()))
        kernel_us = per_call_us(lambda packed=packed, form=kernel_form: form(packed.clone()))
        clone_us = per_call_us(lambda packed=packed: packed.clone())
        rows.append({"what": f"step input fixups, {bs} rows (clone of the buffer subtracted)",
                     "torch_us": torch_us - clone_us, "kernel_us": kernel_us - clone_us,
                     "check": "identical" if same else "DIFFERENT"})
        print(rows[-1], flush=True)

    OUT.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(), "timing": "cuda graph of 50 calls", "rows": rows}
    (OUT / "gpu_step_io.json").write_text(json.dumps(result, indent=2))
    print(f"\n{torch.cuda.get_device_name()}")
    print(f"| {'what':<58} | torch µs | kernel µs | check |")
    for row in rows:
        print(f"| {row['what']:<58} | {row['torch_us']:8.2f} | {row['kernel_us']:9.2f} | {row['check']} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
