"""Triton kernels with torch references (reference.py). Under TRITON_INTERPRET=1 they run on the CPU
through Triton's interpreter, patched for NumPy 2.4 (interpreter_compat.py)."""

from kernels.interpreter_compat import install, interpreting

if interpreting():
    install()
