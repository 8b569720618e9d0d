"""The constrained-decoding mask on logits: the native one-pass kernel and the torch path, against an
explicit per-id rule (id t allowed iff t is inside the bitmask and its bit is set)."""

from __future__ import annotations

import pytest
import torch

from lmserve.model.native import build as native
from lmserve.server.engine.constraints import state as S


def _reference(logits: torch.Tensor, rows: list[int], bits: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    W = bits.shape[1]
    for r, word_row in zip(rows, bits.tolist()):
        for t in range(logits.shape[1]):
            if t >= 32 * W or not (word_row[t // 32] >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


def _case(V: int, W: int, seed: int, dtype):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(5, V, generator=g).to(dtype)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, W), generator=g, dtype=torch.int64).to(torch.int32)
    bits[0, 1] = -1  # a word of 32 allowed ids
    bits[1, 0] = 0  # a word of none
    bits[2] = 0
    bits[2, W - 1] = 1 << 3  # a single id allowed, in the last word
    return logits, [3, 0, 4], bits


@pytest.fixture(scope="module")
def kernel() -> S._NativeMask:
    lib, why = native.load()
    assert lib is not None, why  # g++ is part of the supported setup
    return S._NativeMask(lib)


# vocab inside the last word, exactly 32 W, and logits wider than the bitmask
@pytest.mark.parametrize("V,W", [(70, 3), (96, 3), (100, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_mask_sets_exactly_the_disallowed_ids(kernel, V, W, dtype):
    logits, rows, bits = _case(V, W, V + W, dtype)
    want = _reference(logits, rows, bits)
    assert kernel.applies(logits)
    kernel(logits, rows, bits)
    assert torch.equal(logits, want)


@pytest.mark.parametrize("V,W", [(70, 3), (100, 3)])
def test_torch_path_agrees(monkeypatch, V, W):
    monkeypatch.setattr(S, "_native_mask", lambda: None)  # as on a device without the native kernels
    logits, rows, bits = _case(V, W, 7 * V, torch.float32)
    want = _reference(logits, rows, bits)
    S.mask_logits(logits, rows, bits)
    assert torch.equal(logits, want)


def test_mask_logits_takes_the_native_kernel_on_cpu(kernel, monkeypatch):
    calls = []

    class Spy(S._NativeMask):
        def __call__(self, *args):
            calls.append(len(args[1]))
            return super().__call__(*args)

    spy = Spy(native.loaded())
    monkeypatch.setattr(S, "_native_mask", lambda: spy)
    logits, rows, bits = _case(4000, 125, 3, torch.float32)
    want = _reference(logits, rows, bits)
    S.mask_logits(logits, rows, bits)
    assert calls == [3] and torch.equal(logits, want)


def test_a_model_loaded_on_cpu_leaves_its_library_to_the_sampler(monkeypatch, native_kernels_dir):
    """The loader's native library is the one the sampler's mask and row max take (native.loaded()): a
    served CPU engine masks and takes its greedy maxima in one native pass, not through torch."""
    from lmserve.model.config import ModelConfig
    from lmserve.model.loader import native_parts
    from lmserve.server.engine import row_max as R

    monkeypatch.setattr(native, "_LOADED", {})  # as in a fresh server process, before its model loads
    monkeypatch.setattr(native, "_BOUND", {})
    assert S._native_mask() is None
    cfg = ModelConfig(vocab_size=97, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                      intermediate_size=128, max_position_embeddings=64)
    native_parts(torch.device("cpu"), native_kernels_dir, torch.bfloat16, cfg, True)
    assert native.loaded() is not None
    assert S._native_mask() is not None and native.bound(R._NativeRows) is not None
    logits, rows, bits = _case(100, 3, 11, torch.bfloat16)
    want = _reference(logits, rows, bits)
    S.mask_logits(logits, rows, bits)  # through the loader's library
    assert torch.equal(logits, want)


@pytest.mark.parametrize("V,W", [(70, 3), (96, 3), (1000, 32), (1000, 30)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_avx2_build_sets_exactly_the_disallowed_ids(tmp_path_factory, V, W, dtype):
    """The kernel built without AVX-512 (its word-by-word stores, where AVX-512 stores a word's 32 ids in
    two masked stores) against the same rule."""
    if "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("no AVX2 here")
    lib, why = native.build(tmp_path_factory.mktemp("mask-avx2"), march="x86-64-v3",
                            sources=[native.CSRC / "logit_mask.cpp"])
    assert lib is not None, why
    for kernel in (S._NativeMask(lib), S._NativeMask(native.load()[0])):
        logits, rows, bits = _case(V, W, 3 * V + W, dtype)
        want = _reference(logits, rows, bits)
        kernel(logits, rows, bits)
        assert torch.equal(logits, want)
