"""The edge services stand alone (DESIGN.md §7): importing the gateway's, the tokenizer's or the
detokenizer's entry module in a fresh interpreter loads neither torch nor anything of services.worker,
so their containers need neither."""

from __future__ import annotations

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
