"""Fixes for running these kernels under Triton's CPU interpreter (TRITON_INTERPRET=1).

- NumPy 2.4: Triton 3.6's interpreter turns a loaded scalar (a 1-element array) into a loop bound with
  int(array), which NumPy >= 2.4 rejects ("only 0-dimensional arrays can be converted to Python scalars";
  triton-lang/triton#9171, fixed upstream by #9172 after 3.6.0). `install()` applies the same squeeze.
- float8: the interpreter converts to float8 with its own bit arithmetic, which rounds ties away from
  zero and flushes some subnormals to zero (17.0 -> 18.0 and 0.001 -> 0.0 in e4m3), where the GPU
  (cvt.rn.satfinite) and torch round to nearest even. `install()` makes conversions from and to
  float8e4nv / float8e5 go through torch, so the interpreter stores the bits a GPU stores and tests can
  compare a float8 KV pool bit for bit (kernels/kv_store.py clips to the finite range first, so the
  GPU's saturation never differs from torch's).

kernels/__init__.py calls `install()` whenever the interpreter is on, so every process that runs a
kernel under it (test processes, and the Engine's TP rank processes they spawn) has both. Compiled GPU
runs never touch this.
"""

from __future__ import annotations

import os
from typing import Any

_installed = False


def _index_of_scalar_handle(self: object) -> int:
    return int(self.handle.data.squeeze())  # type: ignore[attr-defined]


def _install_scalar_index() -> None:
    import numpy as np
    from triton.runtime import interpreter

    if tuple(int(p) for p in np.__version__.split(".")[:2]) < (2, 4):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor: type, scope: interpreter._LangPatchScope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _index_of_scalar_handle)

    interpreter._patch_lang_tensor = patched


def _install_fp8_conversions() -> None:
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    # The interpreter keeps bfloat16 as uint16 and float8 as uint8 arrays: torch views of the same bits.
    as_torch = {
        tl.float8e4nv: (np.uint8, torch.float8_e4m3fn),
        tl.float8e5: (np.uint8, torch.float8_e5m2),
        tl.bfloat16: (np.uint16, torch.bfloat16),
        tl.float16: (np.float16, torch.float16),
        tl.float32: (np.float32, torch.float32),
        tl.float64: (np.float64, torch.float64),
    }
    fp8 = (tl.float8e4nv, tl.float8e5)
    original = interpreter.InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self: Any, src: Any, dst_type: Any, rounding_mode: Any) -> Any:
        src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
        downcast_rtz = rounding_mode is not None and rounding_mode != interpreter._ir.ROUNDING_MODE.RTNE
        if (src_ty not in fp8 and dst_ty not in fp8) or src_ty not in as_torch or dst_ty not in as_torch:
            return original(self, src, dst_type, rounding_mode)
        if downcast_rtz:
            return original(self, src, dst_type, rounding_mode)
        src_np, src_torch = as_torch[src_ty]
        dst_np, dst_torch = as_torch[dst_ty]
        values = torch.from_numpy(np.ascontiguousarray(src.data).view(src_np)).view(src_torch)
        converted = values.to(dst_torch)
        if converted.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            data = converted.view(torch.uint8).numpy()
        elif converted.dtype == torch.bfloat16:
            data = converted.view(torch.uint16).numpy()
        else:
            data = converted.numpy()
        return interpreter.TensorHandle(data.view(dst_np).reshape(src.data.shape), dst_ty)

    interpreter.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp


def install() -> None:
    """Patch the interpreter (idempotent): the scalar __index__ (a no-op before NumPy 2.4) and float8
    conversions."""
    global _installed
    if _installed:
        return
    _installed = True
    _install_scalar_index()
    _install_fp8_conversions()


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
