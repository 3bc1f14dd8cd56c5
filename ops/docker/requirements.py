"""The project's runtime dependencies (pyproject.toml's [project] dependencies), one per line, for the
image builds: `--edge` leaves out what only the worker needs (torch, triton), so the gateway, tokenizer
and detokenizer image has no torch; `--extra NAME` adds an optional extra (flashinfer)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import tomllib

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
# Imported by the worker alone (tests/test_service_independence.py keeps the edges free of them).
WORKER_ONLY = frozenset({"torch", "triton"})


def requirement_name(requirement: str) -> str:
    """The distribution name a requirement line starts with ('torch>=2.6' -> 'torch')."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return match.group(1).lower().replace("_", "-")


def requirements(edge: bool = False, extras: tuple[str, ...] = (), pyproject: Path = PYPROJECT) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in extras:
        if extra not in project.get("optional-dependencies", {}):
            raise ValueError(f"pyproject.toml has no extra {extra!r}")
        wanted += project["optional-dependencies"][extra]
    return [r for r in wanted if not (edge and requirement_name(r) in WORKER_ONLY)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--edge", action="store_true", help="leave out the worker-only packages (torch, triton)")
    parser.add_argument("--extra", action="append", default=[], help="add an optional extra of pyproject.toml")
    args = parser.parse_args(argv)
    try:
        lines = requirements(args.edge, tuple(e for e in args.extra if e))
    except ValueError as exc:
        print(f"requirements: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
