"""The CPU prompt-attention kernel (bfloat16 or int8 cache; AVX-512 BF16 dot products, the same sums on AVX2
multiply-adds, or AMX tiles where granted), each path: equal to the explicit attention within
bfloat16 rounding, each token bitwise the same whatever chunk or batch it comes in, bounds-checked;
and through the model, a bfloat16 prefill on the kernel gives SDPA's logits within rounding and a
prompt prefilled in chunks equals the same prompt prefilled whole, bit for bit."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from lmserve.model.native import build as native
from lmserve.model.attention.backend import NativeCpuBackend, SdpaBackend
from oracles import explicit_attention
from lmserve.model.attention.prompt import PromptAttention

H, HKV, D = 9, 3, 64  # SmolLM2-135M's attention shape
SLOTS, MAX_LEN = 6, 1100


@pytest.fixture(scope="module")
def lib(native_kernels_dir):
    lib, why = native.build(native_kernels_dir)
    assert lib is not None, why  # g++ is part of the supported setup (torch.compile needs it too)
    return lib


@pytest.fixture(scope="module", params=["vector", "amx"])
def kernel(lib, request) -> PromptAttention:
    """Each path the kernel has: vector dot products (AVX-512 BF16, or AVX2 multiply-adds), and AMX tiles
    where the OS grants them (a process serves one path for every prompt token; both must hold every
    property here)."""
    assert PromptAttention.built(lib), "the prompt kernel is built on every CPU with AVX2"
    k = PromptAttention(lib)
    was = k.allow_amx(request.param == "amx")
    if request.param == "amx" and not k.uses_amx(D):
        k.allow_amx(was)
        pytest.skip("no AMX tile state granted on this CPU or OS: the AVX-512 path serves")
    yield k
    k.allow_amx(was)


@pytest.fixture(params=[torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def dtype(request, kernel):
    """The cache's dtype (queries and outputs take it too): bfloat16, and float32 (the token-exact
    reference's cache, on the vector path alone: the tiles take bfloat16 products)."""
    if request.param == torch.float32 and kernel.uses_amx(D):
        pytest.skip("a float32 cache takes the vector path, tested under [vector]")
    return request.param


def _cache(heads=(H, HKV, D), seed=0, dtype=torch.bfloat16):
    h, hkv, d = heads
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(SLOTS, hkv, MAX_LEN, d, generator=g).to(dtype)
    vc = torch.randn(SLOTS, hkv, MAX_LEN, d, generator=g).to(dtype)
    return kc, vc


def _queries(n, heads=(H, HKV, D), seed=1, dtype=torch.bfloat16):
    h, hkv, d = heads
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, h + 2 * hkv, d, generator=g).to(dtype)
    return qkv[:, :h]  # strided rows, as the model passes them


def _reference(q, kc, vc, slots, pos):
    """The explicit attention in float32 on the same bfloat16 values, token by token."""
    out = []
    for t in range(q.shape[0]):
        s, n = int(slots[t]), int(pos[t]) + 1
        ref, _ = explicit_attention(q[t][None, :, None].float(), kc[s, :, :n][None].float(),
                                    vc[s, :, :n][None].float(), torch.ones(1, 1, 1, n, dtype=torch.bool))
        out.append(ref[0, :, 0].reshape(-1))
    return torch.stack(out)


def _tokens(spans):
    """[(slot, first position, count)] -> per-token slots and positions."""
    slots = torch.tensor([s for s, p0, n in spans for _ in range(n)])
    pos = torch.cat([torch.arange(p0, p0 + n) for s, p0, n in spans])
    return slots, pos


@pytest.mark.parametrize("heads", [(H, HKV, D), (4, 4, 32), (8, 1, 128), (6, 2, 32)])
def test_matches_explicit_attention(kernel, heads, dtype):
    kc, vc = _cache(heads, dtype=dtype)
    # a new prompt from 0, a chunk continuing one, single tokens at block edges, a long tail
    slots, pos = _tokens([(0, 0, 37), (3, 500, 40), (1, 15, 1), (1, 16, 1), (2, 1, 2), (4, 1050, 30)])
    q = _queries(len(slots), heads, dtype=dtype)
    out = kernel(q, kc, vc, slots, pos)  # [T, H*d]
    assert out.dtype == dtype
    ref = _reference(q, kc, vc, slots, pos)
    if dtype == torch.float32:  # float32 sums in another order: a few units in the last place
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        return
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    err = (out.float() - ref).abs().mean()
    assert err < 2e-3  # bfloat16 rounding of the output and of the probabilities, on average well below


def test_a_token_is_bitwise_the_same_in_any_chunk_or_batch(kernel, dtype):
    kc, vc = _cache(dtype=dtype)
    rng = random.Random(0)
    for trial in range(12):
        spans, used = [], rng.sample(range(SLOTS), rng.randint(1, 4))
        for s in used:
            n = rng.randint(1, 60)
            spans.append((s, rng.randint(0, MAX_LEN - n), n))
        slots, pos = _tokens(spans)
        q = _queries(len(slots), seed=trial, dtype=dtype)
        together = kernel(q, kc, vc, slots, pos)
        t = rng.randrange(len(slots))
        alone = kernel(q[t:t + 1], kc, vc, slots[t:t + 1], pos[t:t + 1])
        assert torch.equal(alone[0], together[t]), (trial, spans, t)
        cut = rng.randint(1, len(slots))  # the same tokens split into two calls anywhere
        split = torch.cat([kernel(q[:cut], kc, vc, slots[:cut], pos[:cut]),
                           kernel(q[cut:], kc, vc, slots[cut:], pos[cut:])]) if cut < len(slots) else together
        assert torch.equal(split, together)


def test_the_avx2_build_agrees_with_this_machines(kernel, dtype, narrower_prompt_attention):
    """The AVX2 build (pair products on float multiply-adds) against the one this CPU serves: a float32
    cache bitwise (the same float steps lane by lane); a bfloat16 cache within a bfloat16 rounding of the
    output (AVX-512 BF16's dot product flushes denormals and may round its pair sums otherwise; AMX tiles
    sum in another order), and bitwise where this CPU has neither."""
    kc, vc = _cache(dtype=dtype)
    slots, pos = _tokens([(0, 0, 37), (3, 500, 40), (1, 15, 1), (4, 1050, 30)])
    q = _queries(len(slots), dtype=dtype)
    served, avx2 = kernel(q, kc, vc, slots, pos), narrower_prompt_attention["avx2"](q, kc, vc, slots, pos)
    flags = Path("/proc/cpuinfo").read_text()
    if dtype == torch.float32 or (" avx512_bf16 " not in flags and not kernel.uses_amx(D)):
        assert torch.equal(served, avx2)
    else:
        torch.testing.assert_close(served.float(), avx2.float(), atol=1e-2, rtol=1e-2)


def test_threads_do_not_change_a_bit(kernel, dtype):
    kc, vc = _cache(dtype=dtype)
    slots, pos = _tokens([(0, 0, 100), (2, 700, 64)])
    q = _queries(len(slots), dtype=dtype)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(q, kc, vc, slots, pos)
        torch.set_num_threads(2)
        two = kernel(q, kc, vc, slots, pos)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two)


def test_non_finite_keys_stay_in_their_slot_and_past_a_tokens_position(kernel, dtype):
    kc, vc = _cache(dtype=dtype)
    kc[1, :, 40] = float("nan")  # slot 1 at position 40
    vc[1, :, 41:] = float("inf")  # and everything past it in the values
    slots, pos = _tokens([(1, 0, 40), (0, 30, 20)])  # slot 1's tokens see keys 0..39 only
    out = kernel(_queries(len(slots), dtype=dtype), kc, vc, slots, pos)
    assert torch.isfinite(out).all()
    bad = kernel(_queries(1, dtype=dtype), kc, vc, torch.tensor([1]), torch.tensor([40]))
    assert torch.isnan(bad).all()


@pytest.mark.parametrize("bad", ["slot", "negative slot", "position"])
def test_a_token_outside_the_cache_raises(kernel, bad):
    kc, vc = _cache()
    slots, pos = _tokens([(0, 0, 3)])
    if bad == "slot":
        slots[1] = SLOTS
    elif bad == "negative slot":
        slots[1] = -1
    else:
        pos[2] = MAX_LEN
    with pytest.raises(IndexError):
        kernel(_queries(3), kc, vc, slots, pos)


def test_shapes_it_does_not_take_are_declared(kernel):
    assert PromptAttention.supports(torch.bfloat16, 64, 9, 3)
    assert PromptAttention.supports(torch.float32, 64, 9, 3)
    assert not PromptAttention.supports(torch.float16, 64, 9, 3)
    assert not PromptAttention.supports(torch.bfloat16, 48, 9, 3)  # head_dim must be whole pairs of 16
    assert not PromptAttention.supports(torch.bfloat16, 64, 9, 2)
    kc = torch.zeros(2, 3, 8, 48, dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        kernel(torch.zeros(1, 9, 48, dtype=torch.bfloat16), kc, kc, torch.tensor([0]), torch.tensor([0]))
    kc = torch.zeros(2, 3, 8, 64)
    with pytest.raises(TypeError):  # a float32 cache with bfloat16 queries
        kernel(torch.zeros(1, 9, 64, dtype=torch.bfloat16), kc, kc, torch.tensor([0]), torch.tensor([0]))


# ---- through the model ------------------------------------------------------------------------------

def _model(dtype):
    from lmserve.model.config import ModelConfig
    from lmserve.model.llama import LlamaForCausalLM

    cfg = ModelConfig(vocab_size=300, hidden_size=H * D, intermediate_size=256, num_layers=2, num_heads=H,
                      num_kv_heads=HKV, head_dim=D, max_position_embeddings=512)
    m = LlamaForCausalLM(cfg).init_weights(std=0.05, generator=torch.Generator().manual_seed(3)).to(dtype).eval()
    for linear in [mod for mod in m.modules() if isinstance(mod, torch.nn.Linear)]:
        _one_row_at_a_time(linear)
    return m


@pytest.fixture(scope="module")
def model(kernel):
    return _model(torch.bfloat16)


def _one_row_at_a_time(linear: torch.nn.Linear) -> None:
    """Make a linear compute each row alone. torch's own bfloat16 GEMM may round a row differently with the
    number of rows computed beside it (on a Xeon with AMX, 16 or 37 rows differ from 300), which would
    make a chunked prefill differ from a whole one before attention is reached. That is the serving
    linears' concern (model/tuning/precision.py serves only kernels whose rows do not depend on the batch); here
    the attention kernel is under test, so the linears are kept out of it."""
    def forward(x):
        rows = x.reshape(-1, x.shape[-1])  # [N, in]
        out = torch.cat([torch.nn.functional.linear(r, linear.weight, linear.bias) for r in rows.split(1)])  # [N, out]
        return out.reshape(*x.shape[:-1], out.shape[-1])
    linear.forward = forward


def _prefill(model, cache, ids, chunks, kernel):
    """Prefill `ids` into slot 0 chunk by chunk; logits of the last token of each chunk."""
    from lmserve.model.llama import Segment

    backend = NativeCpuBackend(None, kernel) if kernel is not None else SdpaBackend("cpu")
    out, start = [], 0
    for n in chunks:
        slot = torch.tensor([0])
        if start == 0:
            meta, positions = backend.packed(slot, torch.tensor([n]))
        else:
            meta, positions = backend.chunk(slot, torch.tensor([start]), n)
        assert torch.equal(positions, torch.arange(start, start + n)[None])
        seg = Segment(torch.tensor(ids[start:start + n])[None], positions, meta)
        out.append(model.forward_segments([seg], cache, torch.tensor([n - 1]))[0])
        start += n
    return torch.stack(out)


def test_model_prefill_on_the_kernel_matches_sdpa_and_chunks_change_nothing(model, kernel):
    from lmserve.model.kv_cache import KVCache

    cfg = model.config
    ids = random.Random(5).choices(range(cfg.vocab_size), k=300)
    caches = [KVCache(cfg, 1, 512, torch.bfloat16) for _ in range(3)]
    with torch.inference_mode():
        whole = _prefill(model, caches[0], ids, [300], kernel)[-1]
        chunked = _prefill(model, caches[1], ids, [100, 37, 16, 147], kernel)[-1]
        sdpa = _prefill(model, caches[2], ids, [300], None)[-1]
    assert torch.equal(whole, chunked)
    assert torch.equal(caches[0].k[1][0, :, :300], caches[1].k[1][0, :, :300])
    torch.testing.assert_close(whole.float(), sdpa.float(), atol=0.1, rtol=0.05)
    p, r = torch.log_softmax(whole.float(), -1), torch.log_softmax(sdpa.float(), -1)
    assert (p.exp() * (p - r)).sum() < 1e-3  # KL(kernel || SDPA) of the next-token distribution


def test_float32_model_prefill_on_the_kernel_matches_sdpa_and_chunks_change_nothing(kernel):
    """float32, the token-exact reference, takes the kernel too: a prompt cut into chunks (as after a
    prefix hit) gives the whole prompt's logits bit for bit, and SDPA's to float32 rounding."""
    from lmserve.model.kv_cache import KVCache

    if kernel.uses_amx(D):
        pytest.skip("a float32 cache takes the vector path, tested under [vector]")
    model = _model(torch.float32)
    ids = random.Random(6).choices(range(model.config.vocab_size), k=300)
    caches = [KVCache(model.config, 1, 512, torch.float32) for _ in range(3)]
    with torch.inference_mode():
        whole = _prefill(model, caches[0], ids, [300], kernel)[-1]
        chunked = _prefill(model, caches[1], ids, [100, 37, 16, 147], kernel)[-1]
        sdpa = _prefill(model, caches[2], ids, [300], None)[-1]
    assert torch.equal(whole, chunked)
    torch.testing.assert_close(whole, sdpa, atol=1e-4, rtol=1e-4)


def test_the_benchmarks_sdpa_baseline_computes_the_same_attention(kernel):
    """`lmserve bench attention-kernels` times the kernel beside SDPA's call over the cache: that call
    must do the same work (a chunk of one slot after cached keys), or the ratio means nothing."""
    from lmserve.server.bench.attention_kernels import SdpaPrompt

    kc, vc = _cache()
    slots, pos = _tokens([(2, 300, 24)])
    q = _queries(len(slots)).contiguous()
    torch.testing.assert_close(SdpaPrompt()(q, kc, vc, slots, pos).float(), kernel(q, kc, vc, slots, pos).float(),
                               atol=2e-2, rtol=2e-2)
