"""Which matrix product each linear layer uses, chosen by timing at load (ModelRunner does it once).

On CUDA in bfloat16/float16, a single row (batch-1 decode) can go through the Triton matrix-vector
product in kernels/gemv.py instead of cuBLAS: on the H200 it read an 8B model's weights at 0.99 of the
copy bandwidth where cuBLAS reached 0.88 (bench/gpu_gemv.py). `select_gemv_tiles` times both on each
weight shape of the model (`gemv_backend='auto'`) and gives a module `gemv_tiles` where the Triton
product won; linear.py's layers then take single rows through it.

On the CPU, single rows are fastest through the prepacked oneDNN weight, MKL's plain matrix-vector
product or (float32) the C++ product of kernels/cpu_matvec.py depending on the CPU; `calibrate_single_row`
times one pass over the model's weights each way and keeps the fastest, counting only passes during
which no other process held one of the cores. Where that is the C++ product, `calibrate_product_isa` then
times its vector loops (AVX-512 and AVX2 where the CPU has both) the same way and keeps the faster.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import services.worker.runtime.layers.linear as linear_module
from services.worker.runtime.layers.linear import (
    MATVEC_DTYPES,
    linear,
    load_gemv_kernels,
    set_single_row_product,
)

logger = logging.getLogger(__name__)

# Tiles select_gemv_tiles tries on each weight shape: the best "rows" tiles of bench/gpu_gemv.py's sweep
# on the H200 at the shapes of an 8B decode step (qkv, o and down, gate_up, LM head), and "dot" tiles,
# which also take up to 16 rows (speculative verification) with the same bits per row as one.
GEMV_CANDIDATES = (
    (8, 512, 4, 3, "rows"), (16, 1024, 8, 1, "rows"), (32, 256, 8, 1, "rows"), (16, 256, 4, 3, "rows"),
    (16, 512, 4, 3, "dot"), (32, 256, 4, 3, "dot"), (64, 128, 4, 4, "dot"),
)
# With RS_GEMV_SPLIT=1 (A/B runs, bench/gpu_pdl.py --env RS_GEMV_SPLIT): "rows" tiles that split K across
# 2 or 3 programs a row block, for narrow products (N = 1,024 at Qwen3-0.6B: 64 row blocks of 16 for 132 SMs),
# timed beside the others where K divides (GemvTiles.fits).
GEMV_SPLIT_CANDIDATES = ((16, 1024, 8, 1, "rows", 2), (16, 1024, 8, 1, "rows", 3), (8, 1024, 4, 1, "rows", 2))
GEMV_SPLIT_ENV = "RS_GEMV_SPLIT"
# Thin row blocks, for the same narrow products: 128 or 256 programs over N = 1,024 with no reduction across
# programs. In the 0.6B's chain of products (bench/gpu_gemv_chain.py, H100, 2026-12-07) o_proj took 1.65 us
# less a layer at 8 x 2,048 than at 16 x 1,024, down_proj 1.35 (the splits above: 0.41 and none). Timed by
# default; RS_GEMV_THIN=0 leaves them out (A/B runs, bench/gpu_pdl.py --env RS_GEMV_THIN).
GEMV_THIN_CANDIDATES = ((8, 2048, 8, 1, "rows"), (4, 1024, 4, 1, "rows"), (4, 2048, 4, 1, "rows"))
GEMV_THIN_ENV = "RS_GEMV_THIN"
# The Triton product must beat cuBLAS by this much to be kept under 'auto'.
GEMV_MIN_GAIN = 0.02
# A "dot" tile is preferred over a "rows" tile that is faster by less than this: it serves up to 16 rows.
GEMV_DOT_PREFERENCE = 0.03


def gemv_candidates() -> tuple[tuple[Any, ...], ...]:
    """The GEMV tiles calibration times: GEMV_CANDIDATES, GEMV_THIN_CANDIDATES unless RS_GEMV_THIN=0, and
    GEMV_SPLIT_CANDIDATES with RS_GEMV_SPLIT=1."""
    split = os.environ.get(GEMV_SPLIT_ENV, "0") == "1"
    thin = os.environ.get(GEMV_THIN_ENV, "1") != "0"
    return GEMV_CANDIDATES + (GEMV_THIN_CANDIDATES if thin else ()) + (GEMV_SPLIT_CANDIDATES if split else ())


def gemv_modules(model: nn.Module) -> list[nn.Module]:
    """Modules whose single-row products may go through the GEMV: opted-in layers (the linear layers
    and the LM head) with a 2-D half-precision CUDA weight."""
    return [
        m for m in model.modules()
        if getattr(m, "prepackable", False) and getattr(m, "weight", None) is not None and m.weight.dim() == 2
        and m.weight.is_cuda and m.weight.dtype in (torch.bfloat16, torch.float16) and m.weight.stride(1) == 1
    ]


def choose_gemv_tiles(
    shapes: dict[tuple[int, int], list[torch.Tensor]],
    time_pass: Callable[[list[torch.Tensor], Any], float],
    candidates: list[Any],
    mode: str,
    absorbed: dict[tuple[int, int], float] | None = None,
) -> dict[tuple[int, int], Any]:
    """For each weight shape (N, K), the candidate tile with the cheapest pass over its weights ("dot" tiles
    win when within GEMV_DOT_PREFERENCE of the cheapest). It is kept when mode is 'triton', or under 'auto'
    when it beats cuBLAS (`time_pass(weights, None)`) by GEMV_MIN_GAIN; else the shape gets None (cuBLAS).
    `absorbed` gives, per shape, the seconds of the elementwise launch before it (a norm, SiLU-and-mul)
    that a "rows" tile folds into its product (kernels.gemv's prologues) and cuBLAS or a "dot" tile pay."""
    chosen: dict[tuple[int, int], Any] = {}
    for shape, weights in shapes.items():
        extra = (absorbed or {}).get(shape, 0.0)
        timed = [(time_pass(weights, t) + (0.0 if getattr(t, "kind", "rows") == "rows" else extra), t)
                 for t in candidates if getattr(t, "fits", lambda k: True)(shape[1])]
        best_t, best_tiles = min(timed, key=lambda item: item[0] * (
            1.0 - GEMV_DOT_PREFERENCE if getattr(item[1], "kind", "rows") == "dot" else 1.0))
        if mode == "triton" or best_t < (1.0 - GEMV_MIN_GAIN) * (time_pass(weights, None) + extra):
            chosen[shape] = best_tiles
        else:
            chosen[shape] = None
    return chosen


def cuda_graph_seconds(fn: Callable[[], None], reps: int = 5) -> float:
    """Seconds of one replay of `fn` captured as a CUDA graph (median of reps, after a warm-up on a side
    stream as capture requires): what a step's graph pays for fn, without host launch cost."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _graph_pass_time(weights: list[torch.Tensor], tiles: Any) -> float:
    """Seconds of one single-row product per weight in `weights` (cuBLAS when tiles is None)."""
    # Imported here: triton is needed (and installed) only where CUDA runs.
    from kernels.gemv import gemv

    x = torch.randn(1, weights[0].shape[1], dtype=weights[0].dtype, device=weights[0].device)
    outs = [torch.empty(1, w.shape[0], dtype=w.dtype, device=w.device) for w in weights]

    def one_pass() -> None:
        for w, o in zip(weights, outs):
            if tiles is None:
                torch.mm(x, w.t(), out=o)
            else:
                gemv(x, w, out=o, tiles=tiles)

    with torch.cuda.device(x.device):
        return cuda_graph_seconds(one_pass) / len(weights)


def _prologue_seconds(prologue: str, k: int, dtype: torch.dtype, device: torch.device) -> float:
    """Seconds of the separate launch a module's `prologue` costs when its product cannot absorb it
    (one CUDA-graph replay of the kernel on a single row of K inputs)."""
    # Imported here: triton is needed (and installed) only where CUDA runs.
    from kernels.activation import silu_and_mul
    from kernels.rmsnorm import fused_add_rmsnorm

    if prologue == "rmsnorm":
        x, r = (torch.randn(1, k, dtype=dtype, device=device) for _ in range(2))
        w = torch.ones(k, dtype=dtype, device=device)
        return cuda_graph_seconds(lambda: fused_add_rmsnorm(x, r, w, 1e-6))
    if prologue == "silu_and_mul":
        x = torch.randn(1, 2 * k, dtype=dtype, device=device)
        return cuda_graph_seconds(lambda: silu_and_mul(x))
    raise ValueError(f"unknown prologue {prologue!r}")


def select_gemv_tiles(model: nn.Module, mode: str, max_weights_per_shape: int = 16) -> dict[tuple[int, int], Any]:
    """Give each GEMV-capable module of `model` its `gemv_tiles` (None: cuBLAS) per `mode` ('auto',
    'triton', 'cublas'); returns the choice per weight shape. Timing uses up to max_weights_per_shape
    distinct weights of a shape, so most reads come from memory rather than L2, as in a real step. A shape
    whose modules take a prologue (`prologue`: "rmsnorm" or "silu_and_mul", set by the model) credits
    "rows" tiles with the launch they absorb."""
    modules = gemv_modules(model)
    for m in modules:
        m.gemv_tiles = None
    if mode == "cublas" or not modules:
        return {}
    # Imported here: triton is needed (and installed) only where CUDA runs.
    from kernels.gemv import GemvTiles

    load_gemv_kernels()
    shapes: dict[tuple[int, int], list[torch.Tensor]] = {}
    for m in modules:
        weights = shapes.setdefault(tuple(m.weight.shape), [])
        if len(weights) < max_weights_per_shape and all(w.data_ptr() != m.weight.data_ptr() for w in weights):
            weights.append(m.weight)
    with torch.inference_mode():
        absorbed: dict[tuple[int, int], float] = {}
        launch: dict[tuple[str, int], float] = {}
        for m in modules:
            if getattr(m, "prologue", None) is not None:
                shape = tuple(m.weight.shape)
                key = (m.prologue, shape[1])
                if key not in launch:
                    launch[key] = _prologue_seconds(m.prologue, shape[1], m.weight.dtype, m.weight.device)
                absorbed[shape] = max(absorbed.get(shape, 0.0), launch[key])
        chosen = choose_gemv_tiles(
            shapes, _graph_pass_time, [GemvTiles(*c) for c in gemv_candidates()], mode, absorbed
        )
    for m in modules:
        m.gemv_tiles = chosen[tuple(m.weight.shape)]
    return chosen


# A pass of a product that spreads over the compute threads (the packed one, the C++ one) counts only if
# the process got at least this share of its compute threads' time: with a core taken by another process
# (a second model loading beside this one), their threads wait for each other and the pass takes ~2x,
# while MKL's one-core product for a single row (on some CPUs) does not slow down, so a disturbed timing
# would keep the slower product for the process's life.
CALIBRATION_MIN_CPU_SHARE = 0.85
CALIBRATION_MAX_SECONDS = 3.0
THREADED_PRODUCTS = ("packed", "matvec")
# The C++ product is kept unless another is faster than this by more: only it shares its rows with the row
# helpers of a rank that gave cores back under contention (kernels/cpu/row_helpers.h; SmolLM2 batch 1 beside
# two busy loops, Zen 4: 19.3 tok/s without helpers, 21.9-22.3 with, bench/HISTORY.md thirty-ninth session),
# and calibration times the products at full threads on a quiet host.
MATVEC_PREFERENCE = 0.06


def _timed(fn: Callable[[], None]) -> tuple[float, float]:
    """Wall seconds of fn() and the process's CPU seconds per wall second meanwhile (all threads)."""
    cpu, start = time.process_time(), time.perf_counter()
    fn()
    wall = time.perf_counter() - start
    return wall, (time.process_time() - cpu) / max(wall, 1e-9)


def _best_passes(
    passes: dict[str, Callable[[], None]], threaded: tuple[str, ...], repeats: int, max_seconds: float,
    alternate: bool,
) -> tuple[dict[str, float], int]:
    """One warm pass each, then rounds of one pass each in turn (in reverse every other round where
    `alternate`) until `repeats` rounds are clean (every `threaded` pass kept its threads busy,
    CALIBRATION_MIN_CPU_SHARE) or `max_seconds` have passed: the best seconds per pass over the clean rounds
    (over all rounds if none was), and the clean rounds' count."""
    busy_floor = CALIBRATION_MIN_CPU_SHARE * torch.get_num_threads()
    clean = dict.fromkeys(passes, float("inf"))
    anyhow = dict(clean)
    clean_rounds = rounds = 0
    with torch.inference_mode():
        for run in passes.values():
            run()
        deadline = time.perf_counter() + max_seconds
        while clean_rounds < repeats and (rounds == 0 or time.perf_counter() < deadline):
            order = list(passes.items())
            timed = {name: _timed(run) for name, run in (order[::-1] if alternate and rounds % 2 else order)}
            rounds += 1
            anyhow = {name: min(anyhow[name], timed[name][0]) for name in passes}
            if all(busy >= busy_floor for name, (_, busy) in timed.items() if name in threaded):
                clean = {name: min(clean[name], timed[name][0]) for name in passes}
                clean_rounds += 1
    return (clean if clean_rounds else anyhow), clean_rounds


def single_row_product() -> str:
    """The product set_single_row_product chose: "plain", "packed" or "matvec"."""
    if linear_module._matvec is not None:
        return "matvec"
    return "packed" if linear_module.PREPACKED_MIN_ROWS == 1 else "plain"


def single_row_matvec(modules: list[nn.Module]) -> Callable[..., torch.Tensor] | None:
    """The C++ product (kernels/cpu_matvec.py) where every weight of `modules` is float32, or every one
    bfloat16, and it builds here; else None, with a log line saying why it could not be built or loaded."""
    if len({m.weight.dtype for m in modules}) != 1 or modules[0].weight.dtype not in MATVEC_DTYPES:
        return None
    from kernels import cpu_matvec  # imported where used, as kernels.gemv's products

    try:
        return cpu_matvec.load_matvec()
    except cpu_matvec.MatvecUnavailable as exc:
        logger.warning("single rows cannot use the C++ matrix-vector product, only torch's: %s", exc)
        return None


def calibrate_single_row(
    model: nn.Module, repeats: int = 3, max_seconds: float = CALIBRATION_MAX_SECONDS
) -> dict[str, float]:
    """Time one single-row pass over every prepacked weight of `model` (where none could be packed, as
    bfloat16 on an AVX2-only CPU, every weight prepack_cpu_weights marked `cpu_rows`) through each product
    this CPU has: F.linear ("plain"), the packed weight ("packed", where there is one) and, for a float32
    or bfloat16 model, the C++ product ("matvec", where it builds). One warm pass each, then rounds of one pass each in turn, until
    `repeats` rounds are clean or `max_seconds` have passed; single rows then use the product with the
    fastest pass (set_single_row_product), the C++ one where it is within MATVEC_PREFERENCE of it. A round is clean when the threaded products kept their
    compute threads busy (CALIBRATION_MIN_CPU_SHARE); if none was, the best of all rounds decides.
    Returns the best seconds per product and `clean_rounds`."""
    modules = [m for m in model.modules() if getattr(m, "packed_weight", None) is not None]
    packed = bool(modules)
    if not packed:  # a dtype this CPU cannot pack (bfloat16 on AVX2): F.linear against the C++ product
        modules = [m for m in model.modules() if getattr(m, "cpu_rows", False)]
    if not modules:
        return {}
    inputs = [torch.randn(1, m.weight.shape[1], dtype=m.weight.dtype) for m in modules]
    matvec = single_row_matvec(modules)

    def through_linear(rows_from: int) -> Callable[[], None]:
        def run() -> None:
            for module, x in zip(modules, inputs):
                linear(x, module.weight, None, module.packed_weight, min_rows=rows_from)

        return run

    def through_matvec() -> None:
        for module, x in zip(modules, inputs):
            matvec(x, module.weight)

    passes = {"plain": through_linear(2), "packed": through_linear(1)} if packed else {"plain": through_linear(2)}
    if matvec is not None:
        passes["matvec"] = through_matvec
    best, clean_rounds = _best_passes(passes, THREADED_PRODUCTS, repeats, max_seconds, alternate=False)
    choice = min(best, key=best.__getitem__)
    if "matvec" in best and best["matvec"] <= best[choice] * (1 + MATVEC_PREFERENCE):
        choice = "matvec"
    set_single_row_product(choice)
    return {**best, "clean_rounds": float(clean_rounds)}


# The AVX2 loop must beat the CPU's first one by this much to be kept for the single-row products.
PRODUCT_ISA_MIN_GAIN = 0.03


def _matvec_passes(
    model: nn.Module, product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
    switch: Callable[[Any], Any], settings: dict[str, Any],
) -> dict[str, Callable[[], None]] | None:
    """For each of `settings` (name: value), one single-row pass over the weights of the model's modules whose
    single rows can take the C++ product (prepacked, else marked cpu_rows) through `product` (x, weight; None:
    that C++ product), run under switch(value) and switched back after; None where there are no such modules
    or the C++ product cannot take them."""
    modules = [m for m in model.modules() if getattr(m, "packed_weight", None) is not None]
    if not modules:
        modules = [m for m in model.modules() if getattr(m, "cpu_rows", False)]
    matvec = single_row_matvec(modules) if modules else None
    if matvec is None:
        return None
    run_product = product or matvec
    inputs = [torch.randn(1, m.weight.shape[1], dtype=m.weight.dtype) for m in modules]

    def through(value: Any) -> Callable[[], None]:
        def run() -> None:
            before = switch(value)
            try:
                for module, x in zip(modules, inputs):
                    run_product(x, module.weight)
            finally:
                switch(before)

        return run

    return {name: through(value) for name, value in settings.items()}


def calibrate_product_isa(
    model: nn.Module, repeats: int = 3, max_seconds: float = CALIBRATION_MAX_SECONDS
) -> dict[str, float]:
    """Where single rows go through the C++ product and this CPU runs both its AVX-512 and its AVX2 loop, time
    one single-row pass over the model's weights with each (a warm pass each, then rounds of one each in
    turn, clean rounds as calibrate_single_row counts them, until `repeats` are clean or `max_seconds` have
    passed) and keep the AVX2 loop for the products where its best pass was PRODUCT_ISA_MIN_GAIN faster
    (kernels/cpu_matvec.use_product_isa; every other step keeps the AVX-512 path). On one Zen 4 guest the
    AVX2 loop streamed 6-8 % faster at one and two threads; on another the AVX-512 one 4 % (bench/HISTORY.md,
    thirty-ninth session). Returns the best seconds per loop and `clean_rounds`; {} where there was no choice."""
    from kernels import cpu_matvec

    passes = _matvec_passes(model, None, cpu_matvec.use_product_isa, {"avx512": "avx512", "avx2": "avx2"})
    if passes is None or cpu_matvec.matvec_isas()[:2] != ["avx512", "avx2"]:
        return {}
    best, clean_rounds = _best_passes(passes, tuple(passes), repeats, max_seconds, alternate=True)
    faster = best["avx2"] < best["avx512"] * (1 - PRODUCT_ISA_MIN_GAIN)
    cpu_matvec.use_product_isa("avx2" if faster else "")
    return {**best, "clean_rounds": float(clean_rounds)}


# A lone stream drops its prefetch requests only where a pass over the weights is this much faster without.
ALONE_PREFETCH_MIN_GAIN = 0.03


def calibrate_alone_prefetch(
    model: nn.Module, repeats: int = 3, max_seconds: float = CALIBRATION_MAX_SECONDS
) -> dict[str, float]:
    """Where single rows take the C++ product (calibrate_single_row chose it) and this CPU's products ask for
    their weight's lines ahead (kernels/cpu/matvec.cpp's prefetch_bytes: not on Zen 3), time one single-row
    pass over the model's weights on the calling thread alone (as a team of one streams it, the rank cut to
    one thread beside busy neighbours) with the requests and without (rounds as calibrate_product_isa's), and
    drop them for lone streams where the pass was ALONE_PREFETCH_MIN_GAIN faster without
    (kernels/cpu_matvec.use_alone_prefetch; the same bits either way). On a Zen 5 guest one thread streamed
    8-11 % faster without them while two threads were 4 % faster with them (bench/HISTORY.md, fortieth
    session). Returns the best seconds ("prefetch", "none") and `clean_rounds`; {} where there was no choice."""
    if single_row_product() != "matvec":
        return {}
    from kernels import cpu_matvec

    passes = _matvec_passes(model, lambda x, w: torch.ops.radixserve_cpu.matvec_alone(x, w),
                            cpu_matvec.use_alone_prefetch, {"prefetch": -1, "none": 0})  # fmt: skip
    if passes is None or cpu_matvec.prefetch_setting()[0] == 0:
        return {}
    # No CPU-share check (a lone pass keeps one of the rank's cores busy, not its threads): every round counts.
    best, clean_rounds = _best_passes(passes, (), repeats, max_seconds, alternate=True)
    faster = best["none"] < best["prefetch"] * (1 - ALONE_PREFETCH_MIN_GAIN)
    cpu_matvec.use_alone_prefetch(0 if faster else -1)
    return {**best, "clean_rounds": float(clean_rounds)}
