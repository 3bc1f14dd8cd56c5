"""Programmatic dependent launch (kernels/pdl.py): when it is on, and the protocol every PDL kernel keeps.

The overlap itself runs only on an sm90 GPU (bench/gpu_pdl.py checks there that greedy tokens and log-probs
are identical with PDL on and off). What can be checked here is the part a future edit could break
silently: a kernel that takes the PDL flag must wait (pdl_enter) before it touches memory, except to
read a weight (constant during a step) through a weight loader, under `if PRELOAD:` / `if PRELOAD >= n:`.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re

import pytest
import torch

from kernels import pdl

PDL_MODULES = [
    "kernels.activation",
    "kernels.decode_attention",
    "kernels.fp8_gemv_mma",
    "kernels.fp8_quant",
    "kernels.gemv",
    "kernels.qk_norm_rope",
    "kernels.rmsnorm",
]
# Loaders a PDL kernel may call before its wait, on its weight operand only (the argument named here).
WEIGHT_LOADERS = {"_weight_tile": "W"}
MEMORY_OPS = {"load", "store", "atomic_add", "atomic_xchg", "atomic_cas", "atomic_max", "atomic_min"}


def test_off_on_cpu_and_under_the_interpreter(monkeypatch) -> None:
    assert pdl.launch_options(torch.device("cpu")) == {}
    # The interpreter rejects launch_pdl, whatever the device says.
    assert not pdl.pdl_enabled(torch.device("cuda", 0))
    monkeypatch.setattr(pdl, "interpreting", lambda: False)
    monkeypatch.setattr(pdl, "_device_supports", lambda index: True)
    assert pdl.launch_options(torch.device("cuda", 0)) == {"launch_pdl": True}
    monkeypatch.setenv(pdl.PDL_ENV, "0")
    assert pdl.launch_options(torch.device("cuda", 0)) == {}
    monkeypatch.setattr(pdl, "_device_supports", lambda index: False)  # before sm90
    monkeypatch.delenv(pdl.PDL_ENV)
    assert pdl.launch_options(torch.device("cuda", 0)) == {}


def test_pdl_mode_is_the_kernels_flag(monkeypatch) -> None:
    # Off: 0 whatever RS_PDL_EARLY_RELEASE says; on: release after the wait (1) unless asked before it (2).
    monkeypatch.setenv(pdl.EARLY_RELEASE_ENV, "1")
    assert pdl.pdl_mode({}) == 0
    assert pdl.pdl_mode({"launch_pdl": True}) == 2
    monkeypatch.setenv(pdl.EARLY_RELEASE_ENV, "0")
    assert pdl.pdl_mode({"launch_pdl": True}) == 1
    monkeypatch.delenv(pdl.EARLY_RELEASE_ENV)
    assert pdl.pdl_mode({"launch_pdl": True}) == 1


def _pdl_kernels() -> list[tuple[str, ast.FunctionDef]]:
    found = []
    for name in PDL_MODULES:
        tree = ast.parse(inspect.getsource(importlib.import_module(name)))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(a.arg == "PDL" for a in node.args.args):
                found.append((f"{name}.{node.name}", node))
    return found


def _calls(node: ast.AST) -> set[str]:
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            f = sub.func
            names.add(f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", ""))
    return names


def test_every_pdl_kernel_is_found() -> None:
    # One per module at least: a renamed flag would otherwise make the protocol test below vacuous.
    assert {name.rsplit(".", 1)[0] for name, _ in _pdl_kernels()} == set(PDL_MODULES)


@pytest.mark.parametrize(("name", "fn"), _pdl_kernels(), ids=lambda v: v if isinstance(v, str) else "")
def test_pdl_kernels_wait_before_touching_memory(name, fn) -> None:
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    early = [i for i, s in enumerate(body) if isinstance(s, ast.If) and ast.unparse(s.test) == "EARLY"]
    if early:
        # `if EARLY:` waits inside its loop (pdl_gate); its `else:` keeps the protocol below.
        _check_gated_loop(name, body[early[0]].body)
        _check_protocol(name, body[: early[0]] + body[early[0]].orelse)
    else:
        _check_protocol(name, body)


def _check_gated_loop(name: str, stmts: list[ast.stmt]) -> None:
    """An EARLY branch: one loop whose first statement is `gate = pdl_gate(PDL)`, whose memory is touched
    only through _group_product, with the rows' pointer offset by the gate (X + gate)."""
    assert len(stmts) == 1 and isinstance(stmts[0], ast.For), f"{name}: the EARLY branch is not one loop"
    loop = stmts[0].body
    assert ast.unparse(loop[0]) == "gate = pdl_gate(PDL)", (
        f"{name}: the EARLY loop does not open with its wait"
    )
    calls = [n for stmt in loop[1:] for n in ast.walk(stmt) if isinstance(n, ast.Call)]
    names = {c.func.attr if isinstance(c.func, ast.Attribute) else getattr(c.func, "id", "") for c in calls}
    assert not names & MEMORY_OPS and names <= {"pdl_release", "_group_product"}, (
        f"{name} calls {sorted(names)}"
    )
    products = [c for c in calls if getattr(c.func, "id", "") == "_group_product"]
    assert products and all(ast.unparse(c.args[0]) == "X + gate" for c in products), (
        f"{name}: a read of the rows in the EARLY loop is not tied to the wait"
    )


def _check_protocol(name: str, body: list[ast.stmt]) -> None:
    enter = [i for i, s in enumerate(body) if isinstance(s, ast.Expr) and "pdl_enter" in _calls(s)]
    assert enter, f"{name} takes PDL but never calls pdl_enter(PDL) at its top level"
    before = body[: enter[0]]
    for stmt in before:
        if isinstance(stmt, ast.If) and re.fullmatch(r"PRELOAD( >= \d+)?", ast.unparse(stmt.test)):
            _check_weight_preload(name, stmt)
            continue
        calls = _calls(stmt)
        assert not calls & MEMORY_OPS, f"{name} touches memory before pdl_enter: {ast.unparse(stmt)}"
        # Helpers could load; only Triton's own arithmetic may run before the wait.
        assert calls <= {"program_id", "arange", "where", "to", "num_programs", "minimum", "maximum", "zeros"}, (
            f"{name} calls {sorted(calls)} before pdl_enter: {ast.unparse(stmt)}"
        )


def _check_weight_preload(name: str, stmt: ast.If) -> None:
    assert not stmt.orelse, f"{name}: the PRELOAD block has an else branch"
    for call in (n for n in ast.walk(stmt) if isinstance(n, ast.Call)):
        f = call.func
        callee = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        if callee in WEIGHT_LOADERS:
            arg = call.args[0]
            assert isinstance(arg, ast.Name) and arg.id == WEIGHT_LOADERS[callee], (
                f"{name} preloads {ast.unparse(arg)}, not its weight, before pdl_enter"
            )
        else:
            assert callee in {"arange", "to"}, f"{name} calls {callee} before pdl_enter: {ast.unparse(call)}"


def test_weight_loaders_read_only_the_weight() -> None:
    from kernels import gemv

    tree = ast.parse(inspect.getsource(gemv._weight_tile.fn))
    loads = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _calls(n) & MEMORY_OPS]
    assert loads and all(ast.unparse(n.args[0]).startswith("W ") for n in loads)
    assert not {"store", "atomic_add"} & _calls(tree)



# Compiles kernels/gemv.py's one-row kernel for sm90 in a process without the interpreter (the tests run
# under it; Triton's NVIDIA backend compiles without a GPU), as the Engine launches it for a 0.6B
# product: 16 x 1,024 tiles over K = 2,048, 8 warps. Prints {"<PDL>,<PRELOAD>,<SPLIT>": ptx}.
_COMPILE_SM90 = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.gemv import _gemv_kernel
out = {}
for pdl_flag, preload, split in json.loads(sys.argv[1]):
    signature = {"X": "*bf16", "W": "*bf16", "Y": "*bf16", "N": "i32", "K": "i32", "stride_wn": "i32",
                 "Residual": "*bf16", "Norm_w": "*bf16", "Res_out": "*bf16", "eps": "fp32",
                 "Work": "*fp32", "Tickets": "*i32", "k_per_split": "i32"}
    constexprs = {"BLOCK_N": 16, "BLOCK_K": 1024, "EVEN_K": True, "PROLOGUE": 0, "HAS_RESIDUAL": False,
                  "BLOCK_FULL": 1, "PDL": pdl_flag, "PRELOAD": preload, "SPLIT": split}
    signature.update({name: "constexpr" for name in constexprs})
    src = ASTSource(fn=_gemv_kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 1})
    out[f"{pdl_flag},{preload},{split}"] = compiled.asm["ptx"]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def sm90_ptx() -> dict[str, str]:
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_SM90, json.dumps([[0, 0, 1], [1, 2, 1], [2, 2, 1], [2, 1, 2]])],
                          capture_output=True, text=True, env=env, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize(("flag", "release_first"), [(1, False), (2, True)])
def test_the_release_comes_after_the_wait_unless_asked_before_it(sm90_ptx, flag: int, release_first: bool) -> None:
    ptx = sm90_ptx[f"{flag},2,1"]
    release, wait = ptx.find("griddepcontrol.launch_dependents"), ptx.find("griddepcontrol.wait")
    assert release >= 0 and wait >= 0 and ptx.count("griddepcontrol.launch_dependents") == 1
    assert (release < wait) == release_first
    # Both weight tiles read ahead are loads issued before the wait; the row is read after it.
    assert ptx[:wait].count("ld.global") >= 2
    assert "griddepcontrol" not in sm90_ptx["0,0,1"]


def test_a_split_launch_takes_its_ticket_after_its_wait(sm90_ptx) -> None:
    # The split's parts meet through the ticket counters (kernels/split_reduce.py): an atomic, after the wait.
    ptx = sm90_ptx["2,1,2"]
    wait = ptx.find("griddepcontrol.wait")
    assert 0 <= wait < ptx.find("atom.") and "atom." not in sm90_ptx["2,2,1"]
