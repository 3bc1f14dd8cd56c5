"""A fix for running these kernels under Triton's CPU interpreter (TRITON_INTERPRET=1) with NumPy 2.4.

Triton 3.6's interpreter turns a loaded scalar (a 1-element array) into a loop bound with int(array),
which NumPy >= 2.4 rejects ("only 0-dimensional arrays can be converted to Python scalars";
triton-lang/triton#9171, fixed upstream by #9172 after 3.6.0). `install()` applies the same squeeze.
kernels/__init__.py calls it whenever the interpreter is on, so every process that runs a kernel
under it (test processes, and the Engine's TP rank processes they spawn) has it. Compiled GPU runs
never touch this.
"""

from __future__ import annotations

import os

_installed = False


def _index_of_scalar_handle(self: object) -> int:
    return int(self.handle.data.squeeze())  # type: ignore[attr-defined]


def install() -> None:
    """Patch the interpreter's tensor __index__ (idempotent; a no-op before NumPy 2.4)."""
    global _installed
    if _installed:
        return
    import numpy as np
    from triton.runtime import interpreter

    _installed = True
    if tuple(int(p) for p in np.__version__.split(".")[:2]) < (2, 4):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor: type, scope: interpreter._LangPatchScope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _index_of_scalar_handle)

    interpreter._patch_lang_tensor = patched


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
