"""The committed stubs are what grpcio-tools makes from proto/ now."""

import importlib.util
import pathlib
import sys

from conftest import require

HERE = pathlib.Path(__file__).resolve().parent
SDK = HERE.parent


def test_committed_stubs_match_regeneration():
    require("grpcio-tools is not installed (pip install grpcio-tools)",
            importlib.util.find_spec("grpc_tools") is not None)
    sys.path.insert(0, str(SDK))
    try:
        import generate_stubs
    finally:
        sys.path.remove(str(SDK))
    fresh = generate_stubs.generate()
    assert sorted(fresh) == ["prefixrouter_pb2.py", "prefixrouter_pb2.pyi", "prefixrouter_pb2_grpc.py"]
    for name, text in fresh.items():
        committed = (generate_stubs.OUT / name).read_text()
        assert committed == text, (
            f"{name} differs from what grpcio-tools makes from proto/: "
            "run `python3 sdk/python/generate_stubs.py` and commit the result")
