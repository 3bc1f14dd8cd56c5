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
- bfloat16: the interpreter casts float32 -> bfloat16 by dropping the low 16 bits (toward zero), where the
  GPU (cvt.rn.bf16.f32) and torch round to nearest even; float16 <-> bfloat16 it casts the raw integers.
  `install()` makes every cast between bfloat16 and another float type go through torch. Truncation is
  a bias of half an ulp on every stored bfloat16: where a kernel quantizes a value it stored in bfloat16
  (the FP8 MoE's w8a8 intermediate), e4m3's rounding turned that into a 1-2 % error against a reference
  that rounds to nearest, which the GPU does not have.
- bfloat16 dots: the interpreter multiplies the uint16 bit patterns of bfloat16 operands as integers
  (np.matmul on the raw arrays; 3.6.0 widens only 8-bit floats first). `install()` widens bfloat16
  operands to float32 (exact) before the product, as the tensor cores' float32 accumulation does.

kernels/__init__.py calls `install()` whenever the interpreter is on, so every process that runs a
kernel under it (test processes, and the Engine's TP rank processes they spawn) has them all. Compiled GPU
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


def _torch_conversion() -> tuple[dict, Any]:
    """(the float types torch can stand in for, convert(src handle, dst scalar type) -> handle)."""
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
    as_bits = {torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8, torch.bfloat16: torch.uint16}

    def convert(src: Any, dst_ty: Any) -> Any:
        src_np, src_torch = as_torch[src.dtype.scalar]
        dst_np, dst_torch = as_torch[dst_ty]
        values = torch.from_numpy(np.ascontiguousarray(src.data).view(src_np)).view(src_torch)
        converted = values.to(dst_torch)
        data = converted.view(as_bits.get(dst_torch, dst_torch)).numpy()
        return interpreter.TensorHandle(data.view(dst_np).reshape(src.data.shape), dst_ty)

    return as_torch, convert


def _install_fp8_conversions() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    as_torch, convert = _torch_conversion()
    fp8 = (tl.float8e4nv, tl.float8e5)
    original = interpreter.InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self: Any, src: Any, dst_type: Any, rounding_mode: Any) -> Any:
        src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
        downcast_rtz = rounding_mode is not None and rounding_mode != interpreter._ir.ROUNDING_MODE.RTNE
        if (src_ty not in fp8 and dst_ty not in fp8) or src_ty not in as_torch or dst_ty not in as_torch:
            return original(self, src, dst_type, rounding_mode)
        if downcast_rtz:
            return original(self, src, dst_type, rounding_mode)
        return convert(src, dst_ty)

    interpreter.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp


def _install_bf16_conversions() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    as_torch, convert = _torch_conversion()
    original = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        src_ty, dst_ty = src.dtype.scalar, dst_type.scalar
        if tl.bfloat16 in (src_ty, dst_ty) and src_ty != dst_ty and src_ty in as_torch and dst_ty in as_torch:
            return convert(src, dst_ty)
        return original(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = cast_impl


def _install_bf16_dots() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def widened(handle: Any) -> Any:
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = np.ascontiguousarray(handle.data).view(np.uint16).astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(
        self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any
    ) -> Any:
        return original(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot


def install() -> None:
    """Patch the interpreter (idempotent): the scalar __index__ (a no-op before NumPy 2.4), float8 and
    bfloat16 conversions, bfloat16 dots."""
    global _installed
    if _installed:
        return
    _installed = True
    _install_scalar_index()
    _install_fp8_conversions()
    _install_bf16_conversions()
    _install_bf16_dots()


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
