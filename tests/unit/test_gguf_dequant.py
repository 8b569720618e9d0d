"""The native GGUF dequantizer (native/csrc/gguf_dequant.cpp) against the gguf package's numpy one: float32
bitwise for every block type it takes, bfloat16 bitwise torch's rounding of those values, and the reader
using it once the library is loaded."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from lmserve.model.checkpoints import gguf_reader

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
# byte offsets of each block's float16 scales (d, and dmin / m where the type has one)
HALFS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
         "Q6_K": (208,)}


@pytest.fixture(scope="module")
def dequantizer(quant_kernel):
    from lmserve.model.native import build as native

    return gguf_reader._NativeDequantizer(native.loaded())


def random_rows(qtype: GGMLQuantizationType, rows: int, k: int, seed: int) -> np.ndarray:
    """Random bytes in every field, with finite float16 scales (normal and subnormal, both signs)."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * (k // block), size), dtype=np.uint8)
    halfs = rng.standard_normal(raw.shape[0]).astype(np.float16) * np.float16(0.01)
    halfs[::7] = np.float16(3e-6)  # a subnormal
    for at in HALFS[qtype.name]:
        raw[:, at:at + 2] = np.roll(halfs, at).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def _info(qtype, rows, k):
    return gguf_reader.TensorInfo("t", (k, rows), int(qtype), 0)


@pytest.mark.parametrize("name", TYPES)
def test_native_values_are_the_gguf_packages_bitwise(dequantizer, name):
    qtype = GGMLQuantizationType[name]
    rows, k = 37, 512
    raw = random_rows(qtype, rows, k, seed=TYPES.index(name))
    expected = torch.from_numpy(np.ascontiguousarray(quants.dequantize(raw, qtype), dtype=np.float32))
    assert dequantizer.takes(int(qtype), torch.float32)
    out = torch.empty(rows, k)
    dequantizer(raw, _info(qtype, rows, k), out)
    assert torch.equal(out.view(torch.int32), expected.view(torch.int32))
    half = torch.empty(rows, k, dtype=torch.bfloat16)
    dequantizer(raw, _info(qtype, rows, k), half)
    assert torch.equal(half.view(torch.int16), expected.to(torch.bfloat16).view(torch.int16))


def test_types_it_does_not_take_stay_with_the_gguf_package(dequantizer):
    assert not dequantizer.takes(int(GGMLQuantizationType.Q2_K), torch.float32)
    assert not dequantizer.takes(int(GGMLQuantizationType.F16), torch.float32)
    assert not dequantizer.takes(int(GGMLQuantizationType.Q4_K), torch.float16)


def test_the_reader_reads_through_it_once_loaded(dequantizer):
    """gguf_reader._dequantize with the library loaded gives the gguf package's values for a whole tensor
    (the reader's own path, in both dtypes)."""
    qtype = GGMLQuantizationType.Q6_K
    raw = random_rows(qtype, 64, 768, seed=11)
    expected = torch.from_numpy(np.ascontiguousarray(quants.dequantize(raw, qtype), dtype=np.float32))
    buf = raw.tobytes()
    assert gguf_reader.bound(gguf_reader._NativeDequantizer) is not None
    for dtype in (torch.float32, torch.bfloat16):
        got = gguf_reader._dequantize(buf, _info(qtype, 64, 768), dtype)
        assert torch.equal(got, expected.to(dtype))
