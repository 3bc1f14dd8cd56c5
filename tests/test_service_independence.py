"""The services stand alone: importing the gateway's, the tokenizer's or the detokenizer's entry
module in a fresh interpreter loads neither torch nor anything of services.worker, so their containers
need neither; and no service's package imports another's."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from tests.services_helpers import REPO_ROOT


@pytest.mark.parametrize("module", ["services.gateway.service", "services.tokenizer.service", "services.detokenizer.service"])
def test_an_edge_service_imports_without_torch_or_the_worker(module: str) -> None:
    probe = f"import sys, {module}; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('services.worker')))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("package", ["gateway", "tokenizer", "detokenizer", "worker"])
def test_a_service_imports_only_shared_and_its_own_package(package: str) -> None:
    """Every import written in services/<package>/ (at the top, in a function or for type checking)
    names the standard library, a third-party package, `shared` or services.<package> itself: the
    services share only the message schema and shared/, and one is composed with another only in
    services/cli.py (a worker with --with-detokenizer)."""
    own = f"services.{package}"
    crossing = []
    for path in sorted((REPO_ROOT / "services" / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            crossing += [f"{path.relative_to(REPO_ROOT)}: {name}" for name in names
                         if name.split(".")[0] == "services" and name != own and not name.startswith(own + ".")]
    assert crossing == []
