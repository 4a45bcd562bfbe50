"""Generates the Python stubs of proto/ into worker/gen (run by the build; never edit the output)."""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_FILES = ["cyllm/inference/v1/inference.proto"]
# Mapping the proto root to the virtual path worker/gen makes protoc emit imports that resolve
# inside the worker package (`from worker.gen.cyllm...`) without rewriting its output.
PACKAGE_PREFIX = "worker/gen"


def generate(out_root: Path) -> list[Path]:
    """Writes *_pb2.py, *_pb2.pyi and *_pb2_grpc.py under out_root/worker/gen; returns them."""
    from grpc_tools import protoc
    import grpc_tools

    include = Path(grpc_tools.__file__).resolve().parent / "_proto"
    out_root.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"--proto_path={PACKAGE_PREFIX}={PROTO_ROOT}",
        f"--proto_path={include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(f"{PACKAGE_PREFIX}/{name}" for name in PROTO_FILES),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    gen_root = out_root / PACKAGE_PREFIX
    written = []
    for directory in {(gen_root / name).parent for name in PROTO_FILES}:
        # Plain packages from worker/gen down, so the stubs import the same from a wheel.
        package = directory
        while package != gen_root.parent:
            (package / "__init__.py").touch()
            package = package.parent
        written.extend(sorted(directory.glob("*_pb2*.py*")))
    return written


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT.parent
    for path in generate(out):
        print(path)
