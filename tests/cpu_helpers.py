"""Running a snippet in a fresh Python process for the CPU placement tests: thread pinning and OpenMP teams
are per process, so what a test reads back must come from a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def python_stdout(code: str) -> str:
    """stdout of `python -c code` run from the repository root without OMP_NUM_THREADS (which would fix
    torch's thread count before the code under test chooses it); raises if the process fails."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return out.stdout
