"""Run every Triton kernel in this folder on the CPU through Triton's interpreter.

TRITON_INTERPRET is read when `@triton.jit` decorates a function, so it must be set before the kernels
in kernels/ are imported; pytest imports this file before the test modules beside it.
"""

from __future__ import annotations

import importlib
import os
import sys

import numpy as np

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from kernels.interpreter_compat import install as install_interpreter_fix  # noqa: E402


def _interpret_language_helpers() -> None:
    """triton.language's own jit helpers (tl.zeros, tl.max, tl.cdiv...) are decorated when triton is
    first imported. torch._dynamo imports triton whenever it is installed, so a test module loaded
    earlier in the session (anything importing transformers' models) can freeze them as compiled-only
    functions, which the interpreter refuses to call. Swap each for its interpreted twin."""
    twins: dict[int, interpreter.InterpretedFunction] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("triton.language") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if type(value) is JITFunction:
                twin = twins.setdefault(id(value), interpreter.InterpretedFunction(value.fn))
                setattr(module, attr, twin)


def _reload_compiled_kernels() -> None:
    """Kernel modules some other test imported before this file ran hold compiled-only kernels;
    re-decorate them (the modules are stateless)."""
    for name in sorted(n for n in sys.modules if n == "kernels" or n.startswith("kernels.")):
        importlib.reload(sys.modules[name])


_interpret_language_helpers()
_reload_compiled_kernels()


# Every process that imports kernels/ under the interpreter gets kernels.interpreter_compat's NumPy 2.4
# fix; installing it here too covers kernel modules this file re-decorated above.
install_interpreter_fix()


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded generator per test: fresh, non-zero random inputs that are still reproducible."""
    return torch.Generator().manual_seed(20240611)


@pytest.fixture
def row_dot(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interpreter's tl.dot is NumPy's matmul, and OpenBLAS gives a row other bits when it sits at
    another position of the tile (its edge kernels sum differently), which no GPU MMA does: there each
    output element is its own float32 sum of products, whatever the other rows hold. Model that: each
    element summed over K in order (bfloat16 widened first, which the interpreter cannot multiply, and
    float8 to float16 as the interpreter's own dot does; both exact)."""

    def widen(x: interpreter.TensorHandle) -> np.ndarray:
        if x.dtype.scalar == tl.bfloat16:
            return interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32)
        if x.dtype.scalar.is_floating() and x.dtype.scalar.primitive_bitwidth == 8:
            return interpreter._convert_float(x.data, x.dtype.scalar, tl.float16, None).view(np.float16)
        return x.data

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # noqa: ANN001, ANN202
        a32, b32 = widen(a), widen(b)
        products = a32[:, :, None].astype(d.data.dtype) * b32[None, :, :].astype(d.data.dtype)
        return interpreter.TensorHandle(products.sum(axis=1) + d.data, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


class PagedKV:
    """One layer's KV pool filled with random values, and a req_to_token table whose rows map each
    request's positions to distinct, shuffled slots (so reading the wrong slot or position shows)."""

    def __init__(
        self,
        gen: torch.Generator,
        seq_lens: list[int],
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        total = sum(seq_lens)
        num_slots = total + 37  # spare slots that no request owns
        self.k_buffer = torch.randn((num_slots + 1, num_kv_heads, head_dim), generator=gen).to(dtype)
        self.v_buffer = torch.randn((num_slots + 1, num_kv_heads, head_dim), generator=gen).to(dtype)
        num_rows = len(seq_lens) + 3
        self.req_to_token = torch.zeros((num_rows, max(seq_lens) + 5), dtype=torch.int32)
        # Requests use scattered rows of the table, not 0..bs-1.
        self.req_pool_indices = torch.randperm(num_rows, generator=gen)[: len(seq_lens)]
        slots = torch.randperm(num_slots, generator=gen)[:total] + 1
        start = 0
        for row, n in zip(self.req_pool_indices.tolist(), seq_lens):
            self.req_to_token[row, :n] = slots[start : start + n].to(torch.int32)
            start += n
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int64)


@pytest.fixture
def paged_kv() -> type[PagedKV]:
    return PagedKV


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere (an unwritten poisoned element) gives inf."""
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return float("inf")
    return float((out64 - ref64).norm() / ref64.norm())


def poisoned(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An output buffer full of NaN, so any element a kernel fails to write fails the comparison."""
    return torch.full(shape, float("nan"), dtype=dtype)


def rotary_caches(rotary_dim: int, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary cos/sin tables [max_position, rotary_dim / 2] (base 10000), float32."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.outer(torch.arange(max_position).float(), inv_freq)
    return freqs.cos(), freqs.sin()
