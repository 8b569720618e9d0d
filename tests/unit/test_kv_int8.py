"""The int8 KV cache (model/kv_cache.py, native_common.h): its row format, the decode and prompt
kernels reading it (against the explicit attention over the values the codes stand for), the
native writes equal to torch's, batch and chunk invariance, the cache's memory (pages, release,
prefix copies), refusals where it cannot serve, and the engine's choice.

The oracle for the kernels is oracles.explicit_attention in float32 over codes x scales: the kernels
must compute attention over exactly those values (the codes widen exactly), so only the output's
rounding to bfloat16, the bfloat16 probabilities of the prompt path and the decode path's query in 16-bit
codes under its largest element separate them."""

from __future__ import annotations

import mmap
import random

import pytest
import torch

from oracles import explicit_attention
from lmserve.model.config import ModelConfig
from lmserve.model.attention.decode import DecodeAttention
from lmserve.model.kv_cache import KVCache, dequantize_rows, quantize_rows
from test_prompt_attention import kernel, lib  # noqa: F401 - fixtures: the native library, the prompt kernel on each path

H, HKV, D = 9, 3, 64  # SmolLM2-135M's attention shape
SMOL = ModelConfig(vocab_size=64, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                   intermediate_size=1536, max_position_embeddings=8192, bos_token_id=1, eos_token_ids=(2,),
                   name="smol-kv")


def shape(heads, layers=1):
    h, hkv, d = heads
    return ModelConfig(vocab_size=64, hidden_size=h * d, num_layers=layers, num_heads=h, num_kv_heads=hkv, head_dim=d,
                       intermediate_size=64, max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,),
                       name="kv-test")


@pytest.fixture(scope="module")
def decode(lib) -> DecodeAttention:
    return DecodeAttention(lib)


def filled(heads, slots, max_len, seed=0) -> KVCache:
    """A one-layer int8 cache with every position written (through KVCache.write) from random values."""
    h, hkv, d = heads
    c = KVCache(shape(heads), slots, max_len, torch.int8)
    g = torch.Generator().manual_seed(seed)
    for s in range(slots):
        kv = torch.randn(2, c.max_len, hkv, d, generator=g).bfloat16()
        c.write(0, torch.full((c.max_len,), s), torch.arange(c.max_len), kv[0], kv[1])
    return c


def values(c: KVCache, slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What slot `slot`'s first n positions stand for: [Hkv, n, d] float32 each."""
    ks, vs = c.scale_views(0)
    return (dequantize_rows(c.k[0, slot, :, :n], ks[slot, :n].T),
            dequantize_rows(c.v[0, slot, :, :n], vs[slot, :n].T))


def reference(q, c, slot, n):
    """q [H, d] of one token over keys 0..n-1 -> [H * d] float32."""
    K, V = values(c, slot, n)
    out, _ = explicit_attention(q[None, :, None].float(), K[None], V[None], torch.ones(1, 1, 1, n, dtype=torch.bool))
    return out[0, :, 0].reshape(-1)


# ---- the format ---------------------------------------------------------------------------------------
def test_codes_span_the_row_and_stand_for_it_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(200, 64, generator=g) * torch.rand(200, 1, generator=g) * 30).bfloat16()
    x[7] = 0  # an all-zero row
    codes, scale = quantize_rows(x)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float32
    nonzero = torch.arange(200) != 7
    assert (codes[nonzero].abs().amax(-1) == 127).all()  # the largest value of a row takes the top code
    assert (codes[7] == 0).all() and scale[7] == 0
    err = (dequantize_rows(codes, scale) - x.float()).abs()
    assert (err <= scale[:, None] * (0.5 + 1e-4)).all()  # (and x / scale rounds in float32)


@pytest.mark.parametrize("heads", [(H, HKV, D), (4, 4, 32), (8, 1, 128), (10, 2, 64), (12, 2, 80)])
def test_decode_writes_torchs_codes_and_attends_over_what_they_stand_for(decode, heads):
    h, hkv, d = heads
    c = filled(heads, 6, 1040)
    lengths = [1, 15, 16, 17, 200, 1024]
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(len(lengths), 1, h + 2 * hkv, d, generator=g).bfloat16()
    q, k, v = qkv[:, :, :h], qkv[:, :, h:h + hkv], qkv[:, :, h + hkv:]
    slots = torch.tensor(random.Random(2).sample(range(6), len(lengths)))
    pos = torch.tensor([n - 1 for n in lengths])
    out = decode(q, k, v, c.k[0], c.v[0], slots, pos, *c.scale_views(0))
    ks, vs = c.scale_views(0)
    for b, n in enumerate(lengths):
        s = int(slots[b])
        (kc, kscale), (vc, vscale) = quantize_rows(k[b, 0]), quantize_rows(v[b, 0])
        assert torch.equal(c.k[0, s, :, n - 1], kc) and torch.equal(ks[s, n - 1], kscale)
        assert torch.equal(c.v[0, s, :, n - 1], vc) and torch.equal(vs[s, n - 1], vscale)
        torch.testing.assert_close(out[b, 0].float(), reference(q[b, 0], c, s, n), atol=1e-2, rtol=1e-2)


def _decode_one(decode, c, q, slot, n):
    """Row q [1, 1, H, d] decoding at position n - 1 of `slot` (its own k/v written there)."""
    hkv = c.k.shape[2]
    kv = torch.randn(1, 1, 2 * hkv, q.shape[-1], generator=torch.Generator().manual_seed(n)).bfloat16()
    return decode(q, kv[:, :, :hkv], kv[:, :, hkv:], c.k[0], c.v[0], torch.tensor([slot]),
                  torch.tensor([n - 1]), *c.scale_views(0))


@pytest.mark.parametrize("spread", ["elements over 2^-40 .. 2^2", "large", "tiny", "zero"])
def test_decode_scores_hold_at_every_query_scale(decode, spread):
    """The decode kernel takes an int8 cache's scores as integer sums, the query as int16 codes under a
    power-of-two step set by its largest element: elements far below the largest round there (2^-16 of
    it), a large query must not overflow the codes, a tiny one (~1e-30) must not lose its step, and an
    all-zero one attends uniformly."""
    c = filled((H, HKV, D), 2, 300, seed=4)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 1, H, D, generator=g)
    if spread == "large":
        q = q * 3e4
    elif spread == "tiny":
        q = q * 1e-30
    elif spread == "zero":
        q = torch.zeros_like(q)
    else:
        q = q * torch.pow(2.0, -torch.randint(0, 43, q.shape, generator=g).float())
    q = q.bfloat16()
    out = _decode_one(decode, c, q, 1, 300)
    torch.testing.assert_close(out[0, 0].float(), reference(q[0, 0], c, 1, 300), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_query_over_codes_gives_nan_in_its_row_only(decode, bad):
    c = filled((H, HKV, D), 3, 200)
    qkv = torch.randn(3, 1, H + 2 * HKV, D).bfloat16()
    q = qkv[:, :, :H].clone()
    q[1, 0, 4, 7] = bad
    out = decode(q, qkv[:, :, H:H + HKV], qkv[:, :, H + HKV:], c.k[0], c.v[0], torch.tensor([0, 1, 2]),
                 torch.tensor([50, 120, 199]), *c.scale_views(0))
    assert torch.isnan(out[1]).any() and torch.isfinite(out[[0, 2]]).all()


@pytest.mark.parametrize("heads", [(H, HKV, D), (12, 2, 80), (8, 1, 128), (4, 1, 256)])
def test_decode_over_codes_gives_the_same_bits_on_every_instruction_set(decode, narrower_decode_attention, heads):
    """The integer scores are exact on every path (vpdpwssd, vpmaddwd, two AVX2 halves), and what follows
    them is the same float32 arithmetic, so the narrower builds give the served build's bits."""
    h, hkv, d = heads
    base = filled(heads, 4, 700, seed=6)
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(4, 1, h + 2 * hkv, d, generator=g).bfloat16()
    slots, pos = torch.tensor([3, 0, 2, 1]), torch.tensor([0, 15, 300, 699])

    def run(kernel):
        c = KVCache(shape(heads), 4, 700, torch.int8)
        c.k.copy_(base.k), c.v.copy_(base.v), c.scales.copy_(base.scales)
        return kernel(qkv[:, :, :h], qkv[:, :, h:h + hkv], qkv[:, :, h + hkv:], c.k[0], c.v[0], slots, pos,
                      *c.scale_views(0))

    served = run(decode)
    for name, kernel in narrower_decode_attention.items():
        assert torch.equal(run(kernel), served), name


def test_a_sliding_window_reads_its_own_keys_codes_and_scales(decode):
    """With a window the kernel starts at the window's first key in the codes and in the scales alike."""
    heads, window = (8, 2, 64), 24
    c = filled(heads, 4, 528, seed=4)
    lengths = [3, 24, 25, 300]
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(len(lengths), 1, 12, 64, generator=g).bfloat16()
    q, k, v = qkv[:, :, :8], qkv[:, :, 8:10], qkv[:, :, 10:]
    slots, pos = torch.arange(4), torch.tensor([n - 1 for n in lengths])
    out = decode(q, k, v, c.k[0], c.v[0], slots, pos, *c.scale_views(0), window=window)
    for b, n in enumerate(lengths):
        K, V = values(c, b, n)
        lo = max(0, n - window)
        ref, _ = explicit_attention(q[b, 0][None, :, None].float(), K[None, :, lo:], V[None, :, lo:],
                                    torch.ones(1, 1, 1, n - lo, dtype=torch.bool))
        torch.testing.assert_close(out[b, 0].float(), ref[0, :, 0].reshape(-1), atol=1e-2, rtol=1e-2)


def test_a_decode_row_is_bitwise_the_same_alone_and_in_any_batch(decode):
    rng = random.Random(1)
    base = filled((H, HKV, D), 8, 1040, seed=3)
    for trial in range(8):
        lengths = [rng.randint(1, 1000) for _ in range(rng.randint(2, 8))]
        g = torch.Generator().manual_seed(trial)
        qkv = torch.randn(len(lengths), 1, H + 2 * HKV, D, generator=g).bfloat16()
        q, k, v = qkv[:, :, :H], qkv[:, :, H:H + HKV], qkv[:, :, H + HKV:]
        slots, pos = torch.tensor(rng.sample(range(8), len(lengths))), torch.tensor([n - 1 for n in lengths])

        def run(rows):
            c = KVCache(shape((H, HKV, D)), 8, 1040, torch.int8)
            c.k.copy_(base.k), c.v.copy_(base.v), c.scales.copy_(base.scales)
            return decode(q[rows], k[rows], v[rows], c.k[0], c.v[0], slots[rows], pos[rows], *c.scale_views(0))

        together = run(slice(None))
        b = rng.randrange(len(lengths))
        assert torch.equal(run(slice(b, b + 1))[0], together[b]), (trial, lengths[b])


def test_decode_refuses_an_int8_cache_without_scales(decode):
    c = filled((H, HKV, D), 2, 64)
    qkv = torch.randn(1, 1, H + 2 * HKV, D).bfloat16()
    with pytest.raises(ValueError, match="needs its scales"):
        decode(qkv[:, :, :H], qkv[:, :, H:H + HKV], qkv[:, :, H + HKV:], c.k[0], c.v[0], torch.tensor([0]),
               torch.tensor([3]))


@pytest.mark.parametrize("heads", [(H, HKV, D), (4, 4, 32), (8, 1, 128)])
def test_prompt_tokens_attend_over_what_the_codes_stand_for(kernel, heads):
    h, hkv, d = heads
    c = filled(heads, 3, 1100)
    # a prompt from 0, a chunk continuing one at a block edge, a long tail
    slots = torch.tensor([0] * 40 + [1] * 20 + [2] * 5)
    pos = torch.cat([torch.arange(40), torch.arange(496, 516), torch.arange(1090, 1095)])
    g = torch.Generator().manual_seed(5)
    q = torch.randn(slots.shape[0], h, d, generator=g).bfloat16()
    out = kernel(q, c.k[0], c.v[0], slots, pos, *c.scale_views(0))
    for t in range(slots.shape[0]):
        torch.testing.assert_close(out[t].float(), reference(q[t], c, int(slots[t]), int(pos[t]) + 1),
                                   atol=2e-2, rtol=2e-2)


def test_a_prompt_token_is_bitwise_the_same_in_any_chunk(kernel):
    c = filled((H, HKV, D), 2, 700)
    slots, pos = torch.tensor([0] * 48 + [1] * 30), torch.cat([torch.arange(100, 148), torch.arange(600, 630)])
    q = torch.randn(78, H, D, generator=torch.Generator().manual_seed(6)).bfloat16()
    whole = kernel(q, c.k[0], c.v[0], slots, pos, *c.scale_views(0))
    for lo, hi in ((0, 1), (5, 21), (47, 49), (60, 78)):
        part = kernel(q[lo:hi], c.k[0], c.v[0], slots[lo:hi], pos[lo:hi], *c.scale_views(0))
        assert torch.equal(part, whole[lo:hi]), (lo, hi)


# ---- the cache's memory -------------------------------------------------------------------------------
def test_a_page_of_codes_and_of_scales_never_straddles_two_slots():
    c = KVCache(SMOL, 3, 100, torch.int8)
    assert c.virtual and c.max_len % c.page_tokens == 0
    assert (c.max_len * D) % mmap.PAGESIZE == 0 and (c.max_len * 2 * HKV * 4) % mmap.PAGESIZE == 0
    assert c.bytes_per_page == c.page_tokens * KVCache.bytes_per_token(SMOL, torch.int8) == c.page_tokens * c.token_bytes
    # 68 bytes a row (64 codes and a scale) against bfloat16's 128
    assert KVCache.bytes_per_token(SMOL, torch.int8) / KVCache.bytes_per_token(SMOL, torch.bfloat16) == 68 / 128


@pytest.mark.parametrize("virtual", [True, False])
def test_release_zeroes_only_that_slots_codes_and_scales(virtual):
    c = KVCache(SMOL, 3, 64, torch.int8, virtual=virtual)
    c.k.fill_(5), c.v.fill_(-5), c.scales.fill_(float("nan"))
    c.release(1, 20)
    ks, vs = c.scales[:, 1, :20, 0], c.scales[:, 1, :20, 1]
    assert (c.k[:, 1, :, :20] == 0).all() and (c.v[:, 1, :, :20] == 0).all()
    assert (ks == 0).all() and (vs == 0).all()
    for other in (0, 2):
        assert (c.k[:, other] == 5).all() and torch.isnan(c.scales[:, other]).all()


def test_a_prefix_copy_takes_the_scales_along():
    c = KVCache(SMOL, 3, 64, torch.int8)
    x = torch.randn(2, 50, HKV, D).bfloat16()
    for layer in range(SMOL.num_layers):
        c.write(layer, torch.zeros(50, dtype=torch.long), torch.arange(50), x[0], x[1])
    c.copy_prefix(0, 2, 30)
    assert torch.equal(c.k[:, 2, :, :30], c.k[:, 0, :, :30]) and torch.equal(c.scales[:, 2, :30], c.scales[:, 0, :30])
    assert (c.scales[:, 2, 30:] == 0).all() and (c.k[:, 2, :, 30:] == 0).all()


def test_sdpa_and_views_refuse_an_int8_cache():
    from lmserve.model.attention.sdpa import AttentionMetadata

    c = KVCache(shape((H, HKV, D)), 1, 64, torch.int8)
    meta = AttentionMetadata.for_decode([0], [3], "cpu")
    q, k = torch.randn(1, 1, H, D), torch.randn(1, 1, HKV, D)
    with pytest.raises(TypeError, match="native attention kernels"):
        meta.attend(q, k, k, c, 0)
    with pytest.raises(TypeError, match="native attention kernels"):
        c.view(0, 0, 1, 4)
    with pytest.raises(ValueError, match="CPU only"):
        KVCache(shape((H, HKV, D)), 1, 64, torch.int8, device="meta")


# ---- the engine's choice, and serving from an int8 cache ----------------------------------------------
@pytest.fixture(scope="module")
def smol_int4(smollm2_gguf_path, native_kernels_dir):
    from lmserve.model.loader import load_model
    from lmserve.server.engine.kv_choice import int8_unavailable

    loaded = load_model(smollm2_gguf_path, device="cpu", quantization="int4",
                        cache_dir=native_kernels_dir)
    why = int8_unavailable(loaded)
    if why:
        pytest.skip(f"an int8 KV cache cannot serve on this machine: {why}")
    return loaded


def test_auto_takes_int8_only_within_its_quality_bounds_and_says_why(smol_int4):
    from lmserve.server.engine import kv_choice as KC

    q, speedup = KC.measured(smol_int4)
    # both caches against float32: the int8 one computes differently (its codes reach the logits) and
    # keeps the mode within quality.py's bounds
    assert q.int8.tokens == q.model.tokens == KC.QUALITY_TOKENS - 1 and q.int8.mean_kl != q.model.mean_kl
    assert 0 < q.model.mean_kl and q.int8.within_bounds() and q.added_kl <= KC.MAX_MEAN_KL
    assert q.int8.top1_agreement >= 0.9
    # whether it also stays within a quarter of them depends on the kernels this machine chose for
    # the mode (one activation code on an AMX Xeon moved perplexity by +1.3% with the int8 cache); the
    # choice must follow the measurement and say which bound decided it
    choice = KC.choose_kv_dtype("auto", smol_int4)
    if not q.acceptable():
        assert choice.dtype == torch.bfloat16 and "move quality too far" in choice.reason
        assert f"{q.int8.ppl_ratio:.4f}" in choice.reason
    elif speedup >= KC.SPEED_FLOOR:  # the speed check is the machine's
        assert choice.dtype == torch.int8 and "mean KL" in choice.reason
    else:
        assert choice.dtype == torch.bfloat16 and "slower" in choice.reason
    # measured once: every engine on this loaded model holds the same cache, however timings move
    assert KC.measured(smol_int4) == (q, speedup) and KC.choose_kv_dtype("auto", smol_int4) == choice
    assert KC.choose_kv_dtype("model", smol_int4).dtype == torch.bfloat16


def test_the_check_takes_the_precision_probes_float32_reference_where_the_start_measured_one(smol_int4, monkeypatch):
    """At a start that measured the precision mode, the probe's reference logits (same text, same
    window) serve the check: the checkpoint is not read again and the numbers are the same."""
    from lmserve.model import loader
    from lmserve.model.tuning import quality as Q
    from lmserve.server.engine import kv_choice as KC

    ids = Q.text_ids(smol_int4.tokenizer, KC.QUALITY_TOKENS)
    window = min(512, smol_int4.config.max_position_embeddings)
    read_again = KC.measure_int8(smol_int4)
    smol_int4.plan.reference = (ids, window, loader.reference_logits(smol_int4.source, ids, window))

    def reference_read(*args, **kwargs):
        raise AssertionError("the float32 reference was read again")

    try:
        with monkeypatch.context() as m:
            m.setattr(loader, "reference_logits", reference_read)
            assert KC.measure_int8(smol_int4) == read_again
    finally:
        smol_int4.plan.reference = None


def test_a_restart_reads_the_check_from_the_disk_cache_without_the_float32_reference(smol_int4, monkeypatch):
    """The check is kept beside the precision plan: a model loaded again (a restart) makes the same choice
    from it without reading the checkpoint again, and an unreadable file is measured again and rewritten."""
    import json

    from lmserve.model import loader
    from lmserve.server.engine import kv_choice as KC

    from lmserve.server.engine import threads

    monkeypatch.setattr(threads, "BUSY_CORES", float("inf"))  # timed on a quiet machine, whatever runs beside
    smol_int4.measured.pop("kv", None)  # an earlier test's check, where a busy machine kept it in memory
    first = KC.measured(smol_int4)
    path = KC.cache_path(smol_int4)
    assert path is not None and path.is_file() and path.parent == smol_int4.cache_dir / "kernels"

    def reference_read(*args, **kwargs):
        raise AssertionError("the float32 reference was read again")

    with monkeypatch.context() as m:
        m.setattr(loader, "reference_logits", reference_read)
        assert KC.measured(smol_int4) == first
        assert first[0].describe() in KC.choose_kv_dtype("auto", smol_int4).reason  # chosen from the same numbers
    path.write_text("{not json")
    q, _ = KC.measured(smol_int4)  # measured again
    assert q.int8.mean_kl == pytest.approx(first[0].int8.mean_kl, rel=1e-6)
    assert json.loads(path.read_text())["int8"]["mean_kl"] == pytest.approx(q.int8.mean_kl)


def test_a_check_timed_beside_busy_processes_is_kept_in_memory_not_on_disk(smol_int4, monkeypatch):
    """Timed while other processes kept the cores busy, the check serves this loaded model (every engine on
    it makes the same choice) but is not written: the next start times it again, on a quieter machine."""
    from lmserve.server.engine import kv_choice as KC
    from lmserve.server.engine import threads

    path = KC.cache_path(smol_int4)
    path.unlink(missing_ok=True)
    monkeypatch.setattr(threads, "BUSY_CORES", -1.0)  # any use of the cores by others counts as busy
    try:
        first = KC.measured(smol_int4)
        assert not path.exists()
        monkeypatch.setattr(KC, "decode_speedup", lambda loaded: pytest.fail("timed again on the same loaded model"))
        assert KC.measured(smol_int4) == first
    finally:
        smol_int4.measured.pop("kv", None)


def test_a_checkpoint_gone_since_loading_keeps_the_models_dtype_and_says_why(smol_int4, tmp_path):
    """The int8 check reads the checkpoint again for its float32 reference: where it is gone, auto keeps
    the model's dtype (an unmeasured cache is not served by default) and an explicit int8 is served."""
    from dataclasses import replace

    from lmserve.server.engine import kv_choice as KC

    moved = replace(smol_int4, source=tmp_path / "moved.gguf")
    auto = KC.choose_kv_dtype("auto", moved)
    assert auto.dtype == torch.bfloat16 and "could not be measured" in auto.reason and "moved.gguf" in auto.reason
    asked = KC.choose_kv_dtype("int8", moved)
    assert asked.dtype == torch.int8 and "not measured" in asked.reason


async def test_greedy_tokens_from_an_int8_cache_are_the_same_alone_batched_and_after_a_prefix_hit(smol_int4):
    import asyncio

    from test_engine_helpers import collect, greedy, running
    from lmserve.server.engine import Request

    tok = smol_int4.tokenizer
    shared = tok.encode("You are a careful assistant. Answer in one short sentence. " * 4)
    prompts = [shared + tok.encode(t) for t in ("What is rain?", "Name a prime.", "Why is the sky blue?")]
    params = greedy(10, ignore_eos=True)
    with running(smol_int4, max_batch=1, prefix_cache=False, kv_cache_dtype="int8") as engine:
        assert engine.cache.quantized
        alone = [(await collect(engine, Request(p, params)))[0].token_ids for p in prompts]
    with running(smol_int4, max_batch=8, kv_cache_dtype="int8") as engine:
        batched = await asyncio.gather(*(collect(engine, Request(p, params)) for p in prompts))
        again = [(await collect(engine, Request(p, params)))[0].token_ids for p in prompts]  # prefix hits now
        assert engine.stats().prefix_hit_tokens_total >= len(shared)
    assert [r.token_ids for r, _ in batched] == alone == again


def test_int8_is_refused_where_it_cannot_serve_and_auto_keeps_the_models_dtype(trained_model_dir, native_kernels_dir):
    from lmserve.model.loader import load_model
    from lmserve.server.engine import Engine, EngineSettings
    from lmserve.server.engine.kv_choice import choose_kv_dtype

    f32 = load_model(trained_model_dir, dtype=torch.float32, device="cpu", cache_dir=native_kernels_dir)
    with pytest.raises(ValueError, match="float32 is the token-exact reference"):
        Engine(f32, EngineSettings(kv_cache_dtype="int8"))
    choice = choose_kv_dtype("auto", f32)
    assert choice.dtype == torch.float32 and choice.reason.startswith("float32")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineSettings(kv_cache_dtype="fp8")
