"""The committed Python stubs are exactly what grpc_tools generates from lmserve.proto."""

import shutil
import subprocess
import sys
from pathlib import Path

import grpc_tools  # noqa: F401  (dev extra; the test needs the compiler)


PROTO_ROOT = Path(__file__).resolve().parents[2] / "proto"
GENERATED = ("lmserve_pb2.py", "lmserve_pb2_grpc.py", "lmserve_pb2.pyi")


def test_committed_stubs_match_regeneration(tmp_path):
    (tmp_path / "lmserve" / "v1").mkdir(parents=True)
    shutil.copy(PROTO_ROOT / "lmserve" / "v1" / "lmserve.proto", tmp_path / "lmserve" / "v1")
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", str(tmp_path),
         f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}",
         str(tmp_path / "lmserve" / "v1" / "lmserve.proto")],
        check=True, cwd=tmp_path,
    )
    for name in GENERATED:
        fresh = (tmp_path / "lmserve" / "v1" / name).read_bytes()
        committed = (PROTO_ROOT / "lmserve" / "v1" / name).read_bytes()
        assert fresh == committed, f"{name} is stale: run proto/generate.sh"


def test_stubs_import_as_package_modules():
    from lmserve.v1 import lmserve_pb2, lmserve_pb2_grpc

    assert lmserve_pb2.DESCRIPTOR.package == "lmserve.v1"
    service = lmserve_pb2.DESCRIPTOR.services_by_name["TextGeneration"]
    assert {m.name for m in service.methods} == {"Generate", "GenerateStream", "Tokenize", "GetModelInfo",
                                                "LoadLoraAdapter", "UnloadLoraAdapter"}
    assert service.methods_by_name["GenerateStream"].server_streaming
    assert hasattr(lmserve_pb2_grpc, "TextGenerationServicer")


def test_enums_have_unspecified_zero():
    from lmserve.v1 import lmserve_pb2

    for enum in lmserve_pb2.DESCRIPTOR.enum_types_by_name.values():
        zero = enum.values_by_number[0].name
        assert zero.endswith("_UNSPECIFIED"), zero


def test_presence_fields_track_presence():
    from lmserve.v1 import lmserve_pb2

    params = lmserve_pb2.SamplingParams()
    assert not params.HasField("seed") and not params.HasField("logprobs")
    params.seed = 0
    params.logprobs = 0
    assert params.HasField("seed") and params.HasField("logprobs")
