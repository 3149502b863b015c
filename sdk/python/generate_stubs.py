"""Regenerates the gRPC stubs in src/prefix_router/_proto/ from the repository's proto/ with
grpcio-tools (`python3 sdk/python/generate_stubs.py`). The stubs are committed; the test
tests/test_stubs.py fails when they differ from what this script makes now.
"""

import pathlib
import sys
import tempfile

PROTO_ROOT = pathlib.Path(__file__).resolve().parents[2] / "proto" / "proto"
PROTO_FILE = "prefixrouter/v1/prefixrouter.proto"
OUT = pathlib.Path(__file__).resolve().parent / "src" / "prefix_router" / "_proto"
# The generated service module imports the messages by their proto path; inside the package
# they sit beside it.
ABSOLUTE_IMPORT = "from prefixrouter.v1 import prefixrouter_pb2 as"
RELATIVE_IMPORT = "from . import prefixrouter_pb2 as"


def generate() -> dict:
    """The stub files as grpcio-tools makes them now: {file name: text}."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(PROTO_ROOT / PROTO_FILE),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTO_ROOT / PROTO_FILE}")
        generated = pathlib.Path(tmp) / "prefixrouter" / "v1"
        files = {}
        for path in sorted(generated.iterdir()):
            text = path.read_text()
            if path.name.endswith("_pb2_grpc.py"):
                text = text.replace(ABSOLUTE_IMPORT, RELATIVE_IMPORT)
            files[path.name] = text
        return files


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in generate().items():
        (OUT / name).write_text(text)
        print(f"wrote {OUT / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
