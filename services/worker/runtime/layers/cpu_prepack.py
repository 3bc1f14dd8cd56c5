"""The CPU's prepacked weights: every linear layer (and the LM head) gets a copy of its weight in
oneDNN's blocked layout, which layers/linear.py's `linear` multiplies batches of two rows or more with
(the plain F.linear repacks the weight on every call, which at batch 16 costs as much as the product
itself), and single rows where linear_calibration.py's `calibrate_single_row` found it the fastest.

Where the CPU products' best path is AVX2 (no AVX-512), float32 weights are packed instead into the
12-column panels of kernels/cpu/panels.cpp, whose products of 2 to 64 rows run ~1.3-1.8x oneDNN's there
(16 rows over a SmolLM2 step's weights 39.7 against 56.6 ms, about even at 256: bench/cpu_panels.py), and
so are bfloat16 weights, which oneDNN cannot pack on such a CPU (they went through F.linear, which repacks
the weight on every call); `linear` then multiplies every row count through them (panel_linear).
Where the best path is AVX-512, oneDNN's products are wider than the panels' AVX2 ones (on Intel; AMD's
Zen 4 runs AVX-512 at the AVX2 rate), so prepacking times 16-row products of the model's first four float32
weights through both layouts and takes the faster (`panels_against_onednn`). RS_CPU_PANELS=1 takes the
panels wherever their AVX2 path runs, 0 keeps oneDNN's layout everywhere.

Where the CPU has AVX512-BF16 (Zen 4, Intel from Cooper Lake) and the path is AVX-512, bfloat16 weights with
an even K may be packed as pair panels instead (pack_panels(w, pairs=True): vdpbf16ps, two multiply-adds
a lane an instruction), again where 16-row products of the first four such weights were faster than
oneDNN's (`use_pair_panels`; on a Zen 4 guest, SmolLM2's 16-row bfloat16 pass 21.4 against 24.5 ms). Their
sums are vdpbf16ps' own (odd k, then even, each a fused multiply-add, denormals flushed), so batch-invariant
as the panels are; RS_CPU_PANELS=0/1 decides for them as well."""

from __future__ import annotations

import logging
import os
import statistics
import time

import torch
from torch import nn

logger = logging.getLogger(__name__)

PANELS_ENV = "RS_CPU_PANELS"
# Rows of the products panels_against_onednn times (a decode batch's size), and its rounds.
PANELS_CALIBRATION_ROWS = 16
PANELS_CALIBRATION_ROUNDS = 11


def cpu_prepack_available() -> bool:
    """Whether this torch build has the oneDNN linear ops (x86 and aarch64 builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def cpu_prepack_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes oneDNN can prepack on this CPU: float32, and bfloat16 where the CPU has what
    oneDNN's bf16 products need (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only CPU refuses the
    reorder). Weights of another dtype keep F.linear."""
    return (
        (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)
    )


def prepack_weight(weight: torch.Tensor, rows_hint: int = 16) -> torch.Tensor:
    """`weight` [out, in] in oneDNN's blocked layout, for `linear(..., packed=...)`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)


def use_panels(model: nn.Module | None = None) -> bool:
    """Whether float32 weights (and bfloat16 ones oneDNN cannot pack) go into kernels/cpu/panels.cpp's
    panels rather than oneDNN's layout: where the C++ library builds and its best path here is AVX2, or
    it is AVX-512 and the panels' products of `model`'s first weights were the faster
    (panels_against_onednn; without a model, no). RS_CPU_PANELS=1: wherever AVX2 runs, 0: never."""
    choice = os.environ.get(PANELS_ENV, "")
    if choice == "0":
        return False
    from kernels import cpu_matvec  # imported where used: building it takes a compiler

    try:
        isa = cpu_matvec.matvec_isa()
    except cpu_matvec.MatvecUnavailable:
        return False
    if isa == "avx2" or (choice == "1" and isa == "avx512"):
        return True
    if isa != "avx512" or model is None:
        return False
    return _faster_than_onednn(model, torch.float32, "panels")


def _faster_than_onednn(model: nn.Module, dtype: torch.dtype, layout: str) -> bool:
    """Whether panels_against_onednn found the panels' products of `model`'s first `dtype` weights faster
    than oneDNN's (no when it could time none), logged with both times."""
    seconds = panels_against_onednn(model, dtype=dtype)
    if not seconds:
        return False
    faster = seconds["panels"] < seconds["onednn"]
    logger.info(
        "%s batches on %s: %d-row products of the first weights, %s %.3f ms, oneDNN %.3f ms",
        str(dtype).removeprefix("torch."), layout if faster else "oneDNN's layout", PANELS_CALIBRATION_ROWS,
        layout, seconds["panels"] * 1e3, seconds["onednn"] * 1e3,
    )  # fmt: skip
    return faster


def use_pair_panels(model: nn.Module | None = None) -> bool:
    """Whether bfloat16 weights of an even K go into pair panels (pack_panels(w, pairs=True)) rather than
    oneDNN's layout: where the library runs vdpbf16ps (AVX512-BF16 and the AVX-512 path) and the pair
    panels' products of `model`'s first bfloat16 weights were the faster (without a model, no).
    RS_CPU_PANELS=1: wherever vdpbf16ps runs, 0: never."""
    choice = os.environ.get(PANELS_ENV, "")
    if choice == "0":
        return False
    from kernels import cpu_matvec  # imported where used: building it takes a compiler

    try:
        cpu_matvec.load_matvec()
    except cpu_matvec.MatvecUnavailable:
        return False
    if not torch.ops.radixserve_cpu.pair_panels_native():
        return False
    if choice == "1":
        return True
    return model is not None and _faster_than_onednn(model, torch.bfloat16, "pair panels (vdpbf16ps)")


def panels_against_onednn(
    model: nn.Module, rounds: int = PANELS_CALIBRATION_ROUNDS, dtype: torch.dtype = torch.float32
) -> dict[str, float]:
    """The median seconds, over `rounds` alternating rounds, of PANELS_CALIBRATION_ROWS-row products with the
    first four CPU weights of `dtype` of `model` that opt in (for SmolLM2 its tied LM head, which streams from
    memory as every weight of a real step does, then the first layer's qkv, o and gate_up) through each layout, "panels" (for
    bfloat16 the pair panels, weights of an even K) and "onednn"; {} where it has none or oneDNN cannot pack
    them. (The median: the best of 5 rounds chose oneDNN once in five loads of SmolLM2 on a Zen 4 guest whose
    decode step was 28 % faster on the panels.)"""
    pairs = dtype == torch.bfloat16
    weights = [
        m.weight.detach()
        for m in model.modules()
        if getattr(m, "prepackable", False) and getattr(m, "weight", None) is not None and m.weight.dim() == 2
        and m.weight.dtype == dtype and m.weight.device.type == "cpu" and not (pairs and m.weight.shape[1] % 2)
    ][:4]  # fmt: skip
    if not weights or not cpu_prepack_available() or dtype not in cpu_prepack_dtypes():
        return {}
    xs = [torch.randn(PANELS_CALIBRATION_ROWS, w.shape[1]).to(dtype) for w in weights]
    panels = [torch.ops.radixserve_cpu.pack_panels(w, pairs) for w in weights]
    onednn = [prepack_weight(w) for w in weights]
    passes = {
        "panels": lambda: [torch.ops.radixserve_cpu.panel_linear(x, p) for x, p in zip(xs, panels)],
        "onednn": lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for x, p in zip(xs, onednn)],
    }
    times: dict[str, list[float]] = {name: [] for name in passes}
    with torch.inference_mode():
        for run in passes.values():
            run()
        for _ in range(rounds):
            for name, run in passes.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


# Weight dtypes whose single rows the C++ product takes (kernels/cpu_matvec.py), packed copy or not.
CPU_ROW_DTYPES = (torch.float32, torch.bfloat16)


def prepack_cpu_weights(model: nn.Module) -> int:
    """Give every module with a 2-D `weight` that opts in (`prepackable = True`) its packed copy; returns
    the bytes the copies take: oneDNN's layout for CPU tensors of the dtypes cpu_prepack_dtypes() names, or
    where use_panels() the panels for float32 ones and for bfloat16 ones oneDNN cannot pack. Each such module
    with a float32 or bfloat16 CPU weight is also marked `cpu_rows` (its single rows may take the C++
    product), packed or not: an AVX2-only CPU cannot pack bfloat16, and its single rows went through
    F.linear's bfloat16 product (a SmolLM2 batch-1 step 30 ms; the C++ product reads it in half)."""
    total = 0
    dtypes = cpu_prepack_dtypes()
    panels = use_panels(model)
    pairs = any(
        getattr(m, "prepackable", False) and getattr(m, "weight", None) is not None
        and m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu"
        for m in model.modules()
    ) and use_pair_panels(model)  # fmt: skip
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not getattr(module, "prepackable", False) or weight is None or weight.dim() != 2:
            continue
        if weight.device.type != "cpu":
            continue
        if weight.dtype in CPU_ROW_DTYPES:
            module.cpu_rows = True
        if pairs and weight.dtype == torch.bfloat16 and weight.shape[1] % 2 == 0:
            module.packed_weight = torch.ops.radixserve_cpu.pack_panels(weight.detach(), True)
        elif panels and (weight.dtype == torch.float32 or weight.dtype in CPU_ROW_DTYPES and weight.dtype not in dtypes):
            module.packed_weight = torch.ops.radixserve_cpu.pack_panels(weight.detach())
        elif weight.dtype in dtypes:
            module.packed_weight = prepack_weight(weight)
        else:
            continue
        total += weight.numel() * weight.element_size()
    if panels or pairs:
        logger.info("batched CPU %s products over kernels/cpu/panels.cpp's 12-column panels (%s=0: oneDNN's "
                    "layout)", "bfloat16 (pairs)" if pairs and not panels else "float32", PANELS_ENV)  # fmt: skip
    return total
