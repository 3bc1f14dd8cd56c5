"""The CPU single-row product (kernels/cpu/matvec.cpp), built once with torch's C++ extension
tools and cached under ~/.cache/torch_extensions (TORCH_EXTENSIONS_DIR): `make setup` builds it
(`python -m kernels.cpu_matvec`), a process that finds it missing builds it on first use (~10 s).

    y = matvec(x, weight, bias)   # x: one row [1, K] (or [K]); weight: [N, K]; float32 CPU tensors, or
                                  # all bfloat16 (summed in float32 over the widened values, rounded once)
    y, x_plus_r = torch.ops.radixserve_cpu.rmsnorm_matvec(x, residual, norm_weight, eps, weight)
    y = torch.ops.radixserve_cpu.silu_mul_matvec(gate_up, weight)   # gate_up: [1, 2K]
    out = torch.ops.radixserve_cpu.decode_attention_row(q, k, v, scale)  # batch-1 decode attention
        # (this and the next: q and pool float32, or both bfloat16, widened as read)
    out = torch.ops.radixserve_cpu.decode_attention_rows(q, k_pool, v_pool, slots, seq_lens, scale)  # a batch's
    out = torch.ops.radixserve_cpu.extend_attention_rows(q, k_pool, v_pool, slots, seq_lens, q_lens, scale)
        # a prefill batch's causal attention (kernels/cpu/extend_attention.cpp)

(the last two once load_matvec has loaded the library: layers/linear.py's Projection uses them), and
kernels/cpu/rows.cpp's row-wise steps for batches of rows, through `row_ops()`:

    normed, x_plus_r = ops.add_rmsnorm_rows(x, residual, norm_weight, eps)   # x: [M, K]
    normed = ops.rmsnorm_rows(x, norm_weight, eps)
    ops.qk_norm_rope_rows_(q, k, positions, cos, sin, q_norm, k_norm, eps, head_dim)   # in place
    ops.store_kv_rows_(k, v, k_dst, v_dst, rows)   # k_dst[rows[i]] = k[i], the same for v

It streams the weight in its own [N, K] layout, rows split across torch's compute threads, and
accumulates in float32. Where it cannot be built (no C++ compiler, no ninja, an unsupported torch) or
loaded, `load_matvec` raises MatvecUnavailable with the reason and callers keep torch's products
(layers/linear_calibration.py logs it once).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SOURCE = Path(__file__).resolve().parent / "cpu" / "matvec.cpp"
# The decoder layer's row-wise steps for batches (norms, RoPE, KV stores), built into the same library.
ROWS_SOURCE = SOURCE.with_name("rows.cpp")
# A prefill batch's causal attention over the pool (extend_attention_rows), built into the same library.
EXTEND_SOURCE = SOURCE.with_name("extend_attention.cpp")
# A Llama-shaped decoder layer's batch-1 decode step as one op (decoder_layer_row), the same library.
LAYER_SOURCE = SOURCE.with_name("layer_row.cpp")
# Products of a few float32 or bfloat16 rows over 12-column weight panels (pack_panels, panel_linear), the same library.
PANELS_SOURCE = SOURCE.with_name("panels.cpp")
# The extension's name and cache folder. torch rebuilds it when the source or flags change; the torch
# version is in the name so that an upgrade (another C++ ABI) builds anew instead of loading a stale one.
EXTENSION = "radixserve_cpu_matvec_" + re.sub(r"\W", "_", torch.__version__)


class MatvecUnavailable(RuntimeError):
    """The C++ matrix-vector product could not be built or loaded here; the message says why."""


_loaded: Callable[..., torch.Tensor] | None = None
# RS_CPU_ROW_OPS=0 keeps torch's ops for the row-wise steps (rows.cpp) for A/B runs.
ROW_OPS_ENV = "RS_CPU_ROW_OPS"
_row_ops: Any = None
_failure: str | None = None


def _ensure_ninja() -> None:
    """torch's extension builder runs `ninja` from PATH; the PyPI wheel's binary (a project dependency)
    sits in the venv's bin folder, which PATH lacks when the venv's python runs unactivated."""
    if shutil.which("ninja"):
        return
    candidates = [Path(sys.executable).parent]
    try:
        import ninja

        candidates.insert(0, Path(ninja.BIN_DIR))
    except ImportError:
        pass
    for folder in candidates:
        if (folder / "ninja").exists():
            os.environ["PATH"] = f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"
            return
    raise MatvecUnavailable("ninja is not installed (pip install ninja, or the system's ninja-build)")


def _headers_digest() -> str:
    """A digest of the library's headers (kernels/cpu/*.h): torch rebuilds an extension when its sources or
    flags change, not its headers, so their digest goes into the flags."""
    digest = hashlib.sha1()
    for header in sorted(SOURCE.parent.glob("*.h")):
        digest.update(header.read_bytes())
    return digest.hexdigest()[:12]


def load_matvec(verbose: bool = False) -> Callable[..., torch.Tensor]:
    """torch.ops.radixserve_cpu.matvec, building the extension if this machine has no cached build.
    Raises MatvecUnavailable (once built or failed, the outcome is kept for the process)."""
    global _loaded, _failure
    if _loaded is not None:
        return _loaded
    if _failure is not None:
        raise MatvecUnavailable(_failure)
    try:
        if not torch.backends.openmp.is_available():
            raise MatvecUnavailable("this torch build has no OpenMP, which the product's threads use")
        _ensure_ninja()
        from torch.utils.cpp_extension import load

        # -fopenmp: at::parallel_for's OpenMP region is compiled into this library; at run time it binds
        # to the libgomp that torch already loaded (same soname), so both share one thread pool.
        load(
            name=EXTENSION,
            sources=[str(SOURCE), str(ROWS_SOURCE), str(EXTEND_SOURCE), str(LAYER_SOURCE), str(PANELS_SOURCE)],
            # -ffp-contract=off: no multiply-add is fused unless written so, which keeps rows.cpp's
            # products and sums rounded one by one, as torch's ops round them.
            extra_cflags=["-O3", "-fopenmp", "-ffp-contract=off", f"-DRS_CPU_HEADERS={_headers_digest()}"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=verbose,
        )
        _loaded = torch.ops.radixserve_cpu.matvec
        global _row_ops
        _row_ops = torch.ops.radixserve_cpu if os.environ.get(ROW_OPS_ENV, "1") != "0" else None
    except MatvecUnavailable as exc:
        _failure = str(exc)
        raise
    except Exception as exc:  # a compiler error, a missing header, a failed load: all mean "not here"
        _failure = (
            f"building or loading {SOURCE.name} failed: {type(exc).__name__}: {str(exc).strip()[-600:]}"
        )
        raise MatvecUnavailable(_failure) from exc
    return _loaded


def row_attention() -> Callable[..., torch.Tensor] | None:
    """torch.ops.radixserve_cpu.decode_attention_row (one decode query row's attention over a span of the
    pool) where the library is already loaded in this process, else None: never builds."""
    return torch.ops.radixserve_cpu.decode_attention_row if _loaded is not None else None


def rows_attention() -> Callable[..., torch.Tensor] | None:
    """torch.ops.radixserve_cpu.decode_attention_rows (a decode batch's attention, each request's keys read
    from the pool through its slots) where the library is already loaded in this process, else None."""
    return torch.ops.radixserve_cpu.decode_attention_rows if _loaded is not None else None


# RS_CPU_EXTEND_ATTENTION=0 keeps torch's SDPA for CPU prefill attention (for A/B runs).
EXTEND_ATTENTION_ENV = "RS_CPU_EXTEND_ATTENTION"


def extend_attention() -> Callable[..., torch.Tensor] | None:
    """torch.ops.radixserve_cpu.extend_attention_rows (a prefill batch's causal attention, keys and values
    read from the pool through slots) where the library is already loaded in this process, its path is
    AVX-512 or AVX2 (the portable path is a reference, slower than SDPA) and RS_CPU_EXTEND_ATTENTION is not
    0, else None: never builds."""
    if _loaded is None or os.environ.get(EXTEND_ATTENTION_ENV, "1") == "0":
        return None
    if torch.ops.radixserve_cpu.matvec_isa() not in ("avx512", "avx2"):
        return None
    return torch.ops.radixserve_cpu.extend_attention_rows


# The dtypes rows.cpp's ops take (every tensor of a call in one of them; the rotary tables stay float32).
ROW_DTYPES = (torch.float32, torch.bfloat16)


def row_ops() -> Any:
    """torch.ops.radixserve_cpu for rows.cpp's row-wise steps (add_rmsnorm_rows, rmsnorm_rows,
    qk_norm_rope_rows_, store_kv_rows_) where the library is already loaded in this process and
    RS_CPU_ROW_OPS is not 0, else None: never builds. Float32 or bfloat16 CPU rows (ROW_DTYPES); callers check."""
    return _row_ops


def matvec_isa() -> str:
    """The instruction set the product uses: on this CPU the best of 'avx512', 'avx2' and 'portable'."""
    load_matvec()
    return torch.ops.radixserve_cpu.matvec_isa()


def use_matvec_isa(isa: str) -> str:
    """Make later products use `isa` (tests and benchmarks run each path this CPU has), the single-row
    products' own choice (use_product_isa) dropped; returns the one before. Raises RuntimeError where this
    CPU lacks it."""
    load_matvec()
    return torch.ops.radixserve_cpu.use_matvec_isa(isa)


def use_product_isa(isa: str) -> str:
    """Make the single-row products only (the C++ product, alone or in a layer op, and its row helpers'
    chunks) use `isa`, "" for the path every other step uses; returns the one they used before. Raises
    RuntimeError where this CPU lacks it. Load-time calibration (layers/linear_calibration.py) sets it."""
    load_matvec()
    return torch.ops.radixserve_cpu.use_product_isa(isa)


def product_isa() -> str:
    """The path the single-row products use (use_product_isa's choice, else matvec_isa())."""
    load_matvec()
    return torch.ops.radixserve_cpu.product_isa()


def use_alone_prefetch(nbytes: int) -> int:
    """Set how far ahead (bytes of a float32 weight; -1: the base distance, RS_CPU_PREFETCH_BYTES or this
    CPU's default) a single-row product streamed by no other compute thread beside it (a team of one, or
    the row helpers' chunks) asks for its weight's lines; returns the setting before. The same bits either
    way. Load-time calibration (layers/linear_calibration.calibrate_alone_prefetch) sets it."""
    load_matvec()
    return int(torch.ops.radixserve_cpu.use_alone_prefetch(nbytes))


def prefetch_setting() -> tuple[int, int]:
    """(the base prefetch distance, the lone stream's or -1 for the base), in bytes of a float32 weight."""
    load_matvec()
    base, alone = torch.ops.radixserve_cpu.prefetch_setting()
    return int(base), int(alone)


def matvec_isas() -> list[str]:
    """The paths this CPU runs, best first (avx512, avx2, portable)."""
    load_matvec()
    return list(torch.ops.radixserve_cpu.matvec_isas())


# RS_CPU_ROW_HELPERS=0: no row helpers (A/B runs); a rank whose OpenMP team gave cores back then computes
# its products on the one thread left. 1 (default): helpers where a probe finds they add CPU time;
# always: helpers whenever cores are given back (services/worker/cpu_threads.py).
ROW_HELPERS_ENV = "RS_CPU_ROW_HELPERS"


def set_row_helpers(count: int, delay_us: int = 0) -> list[int]:
    """Start `count` helper threads for the single-row products (kernels/cpu/row_helpers.h), ending those
    before (0: none), and return their kernel thread ids. They never make a product wait: the rows are cut
    into chunks, and any chunk a helper claimed and has not finished when the rest are done is computed
    again by the caller, the same bits either way. Where the library is not loaded, or RS_CPU_ROW_HELPERS is
    0, starts none and returns []. `delay_us` (tests) makes each helper sleep that long after every claim."""
    if _loaded is None or (count > 0 and os.environ.get(ROW_HELPERS_ENV, "1") == "0"):
        return []
    return list(torch.ops.radixserve_cpu.set_row_helpers(count, delay_us))


def row_helper_stats() -> tuple[int, int]:
    """(chunks the helpers computed, chunks taken over from a thread that had claimed them), this process."""
    load_matvec()
    helped, taken, _ = torch.ops.radixserve_cpu.row_helper_stats()
    return helped, taken


def row_helper_busy_ns() -> int:
    """CPU nanoseconds the row helpers have spent inside products (claiming, computing and committing
    chunks), this process (0 where the library is not loaded): their work, without the spinning between
    products that their CPU time also holds."""
    if _loaded is None:
        return 0
    return int(torch.ops.radixserve_cpu.row_helper_stats()[2])


if __name__ == "__main__":
    # `make setup`: build now so no Engine pays for it; never fail setup (the engines fall back).
    try:
        load_matvec(verbose="-v" in sys.argv)
        print(f"setup: built the CPU matrix-vector product ({matvec_isa()})")
    except MatvecUnavailable as exc:
        print(f"setup: the CPU matrix-vector product is not available, torch's products will be used: {exc}")
