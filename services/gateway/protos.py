"""The gRPC stubs, generated from proto/*.proto by grpcio-tools and imported from
services/gateway/proto_gen/.

The stubs are never committed (proto_gen/ holds only a .gitignore): `make proto` writes them, and
importing this module writes them too when any is missing or older than its .proto, so a fresh
checkout, an edited .proto and a new grpcio all just work. Generation goes through a temporary
directory and an atomic rename, so processes starting together never import a half-written file.
The protos are compiled under the import path `services/gateway/proto_gen/`, which makes protoc emit
package-qualified imports between the generated modules.
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = REPO_ROOT / "proto"
OUT_DIR = Path(__file__).resolve().parent / "proto_gen"
PACKAGE_PATH = "services/gateway/proto_gen"
PROTOS = ("radixserve",)


def _outputs(name: str) -> list[Path]:
    return [OUT_DIR / f"{name}_pb2.py", OUT_DIR / f"{name}_pb2_grpc.py"]


def stale() -> bool:
    """Whether any stub is missing or older than its .proto (stubs without their .proto, as in an
    install that did not ship proto/, are used as they are)."""
    for name in PROTOS:
        source = PROTO_DIR / f"{name}.proto"
        for out in _outputs(name):
            if not out.is_file():
                return True
            if source.is_file() and out.stat().st_mtime < source.stat().st_mtime:
                return True
    return False


def generate() -> None:
    """Compile every proto into OUT_DIR (what `make proto` runs). RuntimeError with protoc's exit code."""
    from grpc_tools import protoc

    include = str(Path(protoc.__file__).parent / "_proto")
    with tempfile.TemporaryDirectory(prefix="radixserve-proto-") as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PACKAGE_PATH}={PROTO_DIR}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(str(PROTO_DIR / f"{name}.proto") for name in PROTOS),
        ]
        code = protoc.main(args)
        if code != 0:
            raise RuntimeError(f"protoc failed with exit code {code} on {PROTO_DIR}")
        OUT_DIR.mkdir(exist_ok=True)
        for produced in sorted((Path(tmp) / PACKAGE_PATH).glob("*.py")):
            staged = OUT_DIR / f".{produced.name}.{os.getpid()}"
            shutil.copyfile(produced, staged)
            os.replace(staged, OUT_DIR / produced.name)


def _load(module: str) -> ModuleType:
    return importlib.import_module(f"services.gateway.proto_gen.{module}")


# `python -m services.gateway.protos` (what `make proto` runs) always regenerates; an import only
# when a stub is missing or stale.
if __name__ == "__main__" or stale():
    generate()

radixserve_pb2 = _load("radixserve_pb2")
radixserve_pb2_grpc = _load("radixserve_pb2_grpc")
