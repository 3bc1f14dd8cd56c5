"""services/worker is built in floors that depend downward only (docs/ARCHITECTURE.md, "The worker's
floors"). Every import counts, including those inside functions and under `if TYPE_CHECKING:`: a
lazy import hides a circle from the interpreter, not from the reader.

Floors, top to bottom; a module imports only modules of its own floor or of a lower one:

    frontend   services/worker/frontend/   engine, scheduler client and loop, IPC, NATS service
    scheduler  services/worker/scheduler/  batches, policy, prefix-cache use, speculative decoding
    runtime    services/worker/runtime/    model runner, CUDA graphs, attention, layers, models, sampling
    mem        services/worker/mem/        KV pools and the radix tree over them
    base       services/worker/config.py   the engine configuration every floor reads
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.services_helpers import REPO_ROOT

PACKAGE = "services.worker"
FLOORS = ["base", "mem", "runtime", "scheduler", "frontend"]  # bottom to top
# Module name prefix -> floor (the package itself is on the base floor); the longest prefix decides.
FLOOR_OF_PREFIX = {
    "services.worker.config": "base",
    "services.worker.cpu_placement": "base",  # the config's CPU thread and core plan (stdlib only)
    "services.worker.cpu_threads": "base",  # the CPU thread count chosen at run time (stdlib, cpu_placement)
    "services.worker.mem": "mem",
    "services.worker.runtime": "runtime",
    "services.worker.scheduler": "scheduler",
    "services.worker.frontend": "frontend",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def worker_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((REPO_ROOT / "services" / "worker").rglob("*.py"))}


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """Worker modules `name` imports anywhere in its source (top level, functions, TYPE_CHECKING)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the submodule pkg.mod; `from mod import name` imports mod.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = worker_modules()
    known = set(modules)
    return {name: imported_modules(name, path, known) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def floor_of(module: str) -> str | None:
    if module == PACKAGE:
        return "base"
    matches = [p for p in FLOOR_OF_PREFIX if module == p or module.startswith(p + ".")]
    return FLOOR_OF_PREFIX[max(matches, key=len)] if matches else None


def test_the_import_graph_sees_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    # The graph must count what the interpreter does not run at import time, or circles hide.
    probe = tmp_path / "a.py"
    probe.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from services.worker.b import X\n"
        "def f():\n    from . import c\n"
    )
    known = {"services.worker.a", "services.worker.b", "services.worker.c", "services.worker.d"}
    assert imported_modules("services.worker.a", probe, known) == {"services.worker.b", "services.worker.c"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert floor_of("services.worker.runtime.layers.linear") == "runtime"
    assert floor_of("services.worker.config") == floor_of("services.worker") == "base"
    assert floor_of("services.worker.engine") is None  # a module at the package's top has no floor


def test_the_worker_has_no_import_circles() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_every_worker_module_has_a_floor() -> None:
    homeless = [m for m in import_graph() if floor_of(m) is None]
    assert homeless == [], f"modules outside every floor (move them into one): {homeless}"


def test_imports_run_only_down_the_floors() -> None:
    graph = import_graph()
    upward = [
        f"{m} ({floor_of(m)}) imports {t} ({floor_of(t)})"
        for m, targets in sorted(graph.items())
        for t in sorted(targets)
        if floor_of(m) and floor_of(t) and FLOORS.index(floor_of(t)) > FLOORS.index(floor_of(m))
    ]
    assert upward == [], "imports running back up:\n" + "\n".join(upward)


def test_no_worker_file_runs_over_400_lines_without_saying_why() -> None:
    # A file holds one idea (STYLE.md); one that grows past 400 lines says on its first line why it stays whole.
    long = [
        str(path.relative_to(REPO_ROOT))
        for path in worker_modules().values()
        if len(lines := path.read_text().splitlines()) > 400
        and not (lines[0].startswith("# Over 400 lines: ") and len(lines[0]) > len("# Over 400 lines: ") + 10)
    ]
    assert long == [], f"over 400 lines without '# Over 400 lines: <reason>' on line 1: {long}"
