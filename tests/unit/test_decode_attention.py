"""The CPU decode-attention kernel: equal to the explicit attention, writes the cache, batch-invariant bit for bit."""

from __future__ import annotations

import random

import pytest
import torch

from oracles import explicit_attention
from lmserve.model.native import build as native
from lmserve.model.attention.decode import DecodeAttention

H, HKV, D = 9, 3, 64  # SmolLM2-135M's attention shape
SLOTS, MAX_LEN = 12, 1040


@pytest.fixture(scope="module")
def kernel(native_kernels_dir) -> DecodeAttention:
    lib, why = native.build(native_kernels_dir)
    assert lib is not None, why  # g++ is part of the supported setup (torch.compile needs it too)
    return DecodeAttention(lib)


def _case(dtype, lengths, seed=0, heads=(H, HKV, D)):
    h, hkv, d = heads
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(SLOTS, hkv, MAX_LEN, d, generator=g).to(dtype)
    vc = torch.randn(SLOTS, hkv, MAX_LEN, d, generator=g).to(dtype)
    qkv = torch.randn(len(lengths), 1, h + 2 * hkv, d, generator=g).to(dtype)
    q, k, v = qkv[:, :, :h], qkv[:, :, h:h + hkv], qkv[:, :, h + hkv:]  # strided views, as the model passes them
    slots = torch.tensor(random.Random(seed).sample(range(SLOTS), len(lengths)))
    pos = torch.tensor([n - 1 for n in lengths])
    return q, k, v, kc, vc, slots, pos


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
# query heads per kv head against the value pass's heads in registers (16 / (d / 16), at most 8): one pass
# of 3, 1 of 1, 4 of 2, passes of 4 then 1, 2 of 3, 7 of 1
@pytest.mark.parametrize("heads", [(H, HKV, D), (4, 4, 32), (8, 1, 128), (10, 2, 64), (12, 2, 80), (7, 1, 256)])
def test_matches_explicit_attention_and_writes_the_cache(kernel, dtype, tol, heads):
    lengths = [1, 15, 16, 17, 33, 200, 1024]
    q, k, v, kc, vc, slots, pos = _case(dtype, lengths, heads=heads)
    out = kernel(q, k, v, kc, vc, slots, pos)  # [B, 1, H*d]
    h, hkv, d = heads
    for b, n in enumerate(lengths):
        s = int(slots[b])
        assert torch.equal(kc[s, :, n - 1], k[b, 0]) and torch.equal(vc[s, :, n - 1], v[b, 0])
        ref, _ = explicit_attention(q[b].transpose(0, 1)[None].float(), kc[s, :, :n][None].float(),
                                    vc[s, :, :n][None].float(), torch.ones(1, 1, 1, n, dtype=torch.bool))
        torch.testing.assert_close(out[b, 0].float(), ref[0].transpose(0, 1).reshape(-1), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("window", [1, 16, 100])
def test_a_sliding_window_attends_to_its_last_keys_only(kernel, dtype, tol, window):
    """A sliding layer's row at position p sees keys p - window + 1 .. p, scaled as asked; what lies before
    its window changes nothing, not a bit."""
    lengths = [1, 15, 16, 17, 33, 200, 1024]
    q, k, v, kc, vc, slots, pos = _case(dtype, lengths, seed=3)
    before = kc.clone(), vc.clone()
    out = kernel(q, k, v, kc, vc, slots, pos, window=window, scale=0.3)
    for b, n in enumerate(lengths):
        s, lo = int(slots[b]), max(0, n - window)
        ref, _ = explicit_attention(q[b].transpose(0, 1)[None].float(), kc[s, :, lo:n][None].float(),
                                    vc[s, :, lo:n][None].float(), torch.ones(1, 1, 1, n - lo, dtype=torch.bool), 0.3)
        torch.testing.assert_close(out[b, 0].float(), ref[0].transpose(0, 1).reshape(-1), atol=tol, rtol=tol)
    kc2, vc2 = before
    for b, n in enumerate(lengths):  # other values before each row's window
        kc2[int(slots[b]), :, : max(0, n - window)] *= 3
        vc2[int(slots[b]), :, : max(0, n - window)] -= 1
    assert torch.equal(kernel(q, k, v, kc2, vc2, slots, pos, window=window, scale=0.3), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_bitwise_the_same_alone_and_in_any_batch(kernel, dtype):
    rng = random.Random(1)
    for trial in range(20):
        lengths = [rng.randint(1, 1000) for _ in range(rng.randint(2, SLOTS))]
        q, k, v, kc, vc, slots, pos = _case(dtype, lengths, seed=trial)
        together = kernel(q, k, v, kc.clone(), vc.clone(), slots, pos)
        b = rng.randrange(len(lengths))
        alone = kernel(q[b:b + 1], k[b:b + 1], v[b:b + 1], kc.clone(), vc.clone(), slots[b:b + 1], pos[b:b + 1])
        assert torch.equal(alone[0], together[b]), (trial, lengths[b])


def test_threads_do_not_change_a_bit(kernel):
    q, k, v, kc, vc, slots, pos = _case(torch.float32, [700, 3, 999, 64, 500])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(q, k, v, kc.clone(), vc.clone(), slots, pos)
        torch.set_num_threads(max(2, threads))
        many = kernel(q, k, v, kc.clone(), vc.clone(), slots, pos)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_a_non_finite_row_stays_alone(kernel):
    q, k, v, kc, vc, slots, pos = _case(torch.bfloat16, [40, 80, 120])
    q = q.clone()
    q[1, 0, 0, 0] = float("nan")
    out = kernel(q, k, v, kc, vc, slots, pos)
    assert torch.isnan(out[1]).any() and torch.isfinite(out[[0, 2]]).all()


@pytest.mark.parametrize("bad", ["slot", "pos", "negative"])
def test_a_row_outside_the_cache_raises_and_writes_nothing(kernel, bad):
    q, k, v, kc, vc, slots, pos = _case(torch.float32, [10, 20])
    if bad == "slot":
        slots = torch.tensor([0, SLOTS])
    elif bad == "pos":
        pos = torch.tensor([9, MAX_LEN])
    else:
        pos = torch.tensor([-1, 19])
    before_k, before_v = kc.clone(), vc.clone()
    with pytest.raises(IndexError, match="outside the cache"):
        kernel(q, k, v, kc, vc, slots, pos)
    assert torch.equal(kc, before_k) and torch.equal(vc, before_v)


def test_shapes_it_does_not_take_are_declared():
    assert DecodeAttention.supports(torch.bfloat16, 64, 9, 3)
    assert not DecodeAttention.supports(torch.float16, 64, 9, 3)
    assert not DecodeAttention.supports(torch.float32, 40, 8, 8)  # head_dim not a multiple of 16
    assert not DecodeAttention.supports(torch.float32, 48, 8, 8)  # nor one the kernel is compiled for
    assert not DecodeAttention.supports(torch.float32, 64, 9, 4)  # heads not a multiple of kv heads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(H, HKV, D), (12, 2, 80), (8, 1, 128), (4, 1, 256)])
def test_every_instruction_set_gives_the_served_builds_bits(kernel, narrower_decode_attention, dtype, heads):
    """Float caches: the AVX2 build's 8-lane paths (scores by the 16-lane lane tree, 8 keys a register; the
    value pass 8 lanes of the head at a time) give the bits of the 16-lane code the AVX-512 builds run,
    built here for AVX2 as well, and of the served build, at lengths inside, at and past a block of 16."""
    q, k, v, kc, vc, slots, pos = _case(dtype, [1, 15, 16, 17, 333, 1024], seed=11, heads=heads)

    def run(kern, window=0):
        kc2, vc2 = kc.clone(), vc.clone()
        return kern(q, k, v, kc2, vc2, slots, pos, window=window), kc2, vc2

    for window in (0, 40):
        served = run(kernel, window)
        for name, other in narrower_decode_attention.items():
            assert all(torch.equal(a, b) for a, b in zip(run(other, window), served)), (name, window)
