"""Fused bfloat16 elementwise ops on CPU: against the torch ops they replace, row by row, and inside the model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmserve.model.native import build as native
from lmserve.model.config import ModelConfig
from lmserve.model.linear.fused_ops import FusedOps
from lmserve.model.llama import LlamaForCausalLM, RMSNorm, Rotary

BF16 = torch.bfloat16
ULP = 2 ** -7  # one bfloat16 step at 1.0


@pytest.fixture(scope="module")
def ops(native_kernels_dir) -> FusedOps:
    lib, why = native.build(native_kernels_dir)
    assert lib is not None, why  # g++ is part of the supported setup
    return FusedOps(lib)


def _close(got, want, steps=1):
    """Within `steps` bfloat16 rounding steps of the torch result, and equal for most elements."""
    diff = (got.float() - want.float()).abs()
    assert bool((diff <= steps * ULP * want.float().abs().clamp_min(1.0)).all()), diff.max()
    assert (got == want).float().mean() > 0.95


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("gemma", [False, True], ids=["w", "1+w"])
def test_add_rmsnorm_matches_the_residual_add_and_norm(ops, rows, gemma):
    g = torch.Generator().manual_seed(rows)
    norm = RMSNorm(576, 1e-5, gemma)
    norm.weight.data = torch.randn(576, generator=g) * 0.3 + (0 if gemma else 1)  # a Gemma norm scales by 1 + w
    norm.to(BF16)
    x, res = (torch.randn(1, rows, 576, generator=g) * 4).to(BF16), torch.randn(1, rows, 576, generator=g).to(BF16)
    s, y = ops.add_rmsnorm(x, res, norm.weight, norm.eps, norm.style)
    assert torch.equal(s, x + res)  # the add is one rounding: exact
    _close(y, norm(x + res))
    alone, y_alone = ops.add_rmsnorm(x, None, norm.weight, norm.eps, norm.style)
    assert alone is x or torch.equal(alone, x)
    _close(y_alone, norm(x))


@pytest.mark.parametrize("rows", [1, 5, 257])
def test_rope_matches_rotate_half(ops, rows):
    cfg = ModelConfig(vocab_size=32, hidden_size=576, num_layers=1, num_heads=9, num_kv_heads=3, head_dim=64,
                      intermediate_size=64, max_position_embeddings=4096)
    rot = Rotary(cfg)
    rot.build("cpu", BF16)
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(1, rows, 15, 64, generator=g).to(BF16)  # q (9) | k (3) | v (3) heads
    cos, sin = rot.tables(torch.randint(0, 4000, (1, rows), generator=g))
    got = ops.rope(qkv, cos, sin, 12)
    _close(got, Rotary.apply(qkv[:, :, :12], cos, sin), steps=2)


@pytest.mark.parametrize("gemma", [False, True], ids=["w", "1+w"])
def test_rope_with_qk_norms_matches_the_norms_then_rotate_half(ops, gemma):
    """Qwen3's and Gemma 3's q/k norms (each head RMS-normed by its own weights) fused before the rotation,
    at Gemma 3 270M's heads (4 q, 1 k, d = 256)."""
    cfg = ModelConfig(vocab_size=32, hidden_size=640, num_layers=1, num_heads=4, num_kv_heads=1, head_dim=256,
                      intermediate_size=64, max_position_embeddings=4096)
    rot = Rotary(cfg)
    rot.build("cpu", BF16)
    g = torch.Generator().manual_seed(4)
    norms = [RMSNorm(256, 1e-6, gemma) for _ in range(2)]
    for n in norms:
        n.weight.data = torch.randn(256, generator=g) * 0.3 + (0 if gemma else 1)
        n.to(BF16)
    qkv = (torch.randn(1, 9, 6, 256, generator=g) * 3).to(BF16)  # q (4) | k (1) | v (1) heads
    cos, sin = rot.tables(torch.randint(0, 4000, (1, 9), generator=g))
    got = ops.rope(qkv, cos, sin, 5, 4, tuple(norms))
    q, k = norms[0](qkv[:, :, :4]), norms[1](qkv[:, :, 4:5])
    _close(got, torch.cat([Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin)], 2), steps=3)


@pytest.mark.parametrize("rows", [1, 33])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_act_mul_matches_the_gated_activation(ops, rows, act):
    g = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(1, rows, 2 * 1536, generator=g) * 6).to(BF16)  # reaches both tails of the activation
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")
    _close(ops.act_mul(gate_up, act), want * up, steps=2)


def test_rows_do_not_depend_on_the_batch(ops):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(576, generator=g).to(BF16)
    x, res = torch.randn(1, 40, 576, generator=g).to(BF16), torch.randn(1, 40, 576, generator=g).to(BF16)
    gate_up = torch.randn(1, 40, 3072, generator=g).to(BF16)
    threads = torch.get_num_threads()
    try:
        together = [ops.add_rmsnorm(x, res, w, 1e-5)[1], ops.act_mul(gate_up), ops.act_mul(gate_up, "gelu_tanh")]
        torch.set_num_threads(1)
        alone = [torch.cat([ops.add_rmsnorm(x[:, i:i + 1], res[:, i:i + 1], w, 1e-5)[1] for i in range(40)], 1),
                 torch.cat([ops.act_mul(gate_up[:, i:i + 1]) for i in range(40)], 1),
                 torch.cat([ops.act_mul(gate_up[:, i:i + 1], "gelu_tanh") for i in range(40)], 1)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(alone, together))


FAMILY_OPTIONS = {  # ModelConfig fields of each family's layer (config.py)
    "llama": {},
    "qwen3": dict(qk_norm=True),
    "gemma3": dict(norm_style="gemma", sandwich_norms=True, hidden_act="gelu_tanh", qk_norm=True,
                   embed_scale=128 ** 0.5, query_scale=24 ** -0.5, layer_windows=(8, 0, 8), rope_local_theta=10000.0),
}


@pytest.mark.parametrize("family", list(FAMILY_OPTIONS))
def test_a_bfloat16_model_with_fused_ops_keeps_its_logits(ops, family):
    """Whole decoder on CPU in bfloat16: the fused path against the torch ops, same weights and inputs."""
    from lmserve.model.attention.sdpa import AttentionMetadata

    cfg = ModelConfig(vocab_size=256, hidden_size=128, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32,
                      intermediate_size=256, max_position_embeddings=128, **FAMILY_OPTIONS[family])
    model = LlamaForCausalLM(cfg).init_weights(generator=torch.Generator().manual_seed(0)).to(BF16)
    with_ops = LlamaForCausalLM(cfg, fused_ops=ops).to(BF16)
    with_ops.load_state_dict(model.state_dict())
    model.prepare_for_inference()
    with_ops.prepare_for_inference()
    assert with_ops.uses_fused_ops and not model.uses_fused_ops
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(12).expand(2, 12)
    meta = AttentionMetadata.fresh(torch.tensor([12, 9]), 12)
    with torch.inference_mode():
        plain = model(ids, pos, meta).float()
        fused = with_ops(ids, pos, meta).float()
    assert torch.equal(plain.argmax(-1)[0], fused.argmax(-1)[0])
    assert (plain - fused).abs().max() < 0.05 * plain.abs().max()


def test_the_avx2_paths_give_the_16_lane_codes_bits(ops, tmp_path_factory):
    """On AVX2 (no AVX-512) the bfloat16 roundings, stores and e^x take 8-lane registers of their own
    (native_common.h); the 16-lane code the other builds run, built for AVX2 with LMSERVE_GENERIC_VECTORS,
    gives the same bits for every op and style, NaN and infinities included."""
    from pathlib import Path

    if " avx2 " not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU has no AVX2")
    lib, why = native.build(tmp_path_factory.mktemp("fused-16-lane"), march="x86-64-v3 -DLMSERVE_GENERIC_VECTORS",
                            sources=[s for s in native.SOURCES if s.name == "fused_ops.cpp"])
    assert lib is not None, why
    generic = FusedOps(lib)
    g = torch.Generator().manual_seed(8)
    x, res = (torch.randn(1, 9, 576, generator=g) * 4).to(BF16), (torch.randn(1, 9, 576, generator=g) * 4).to(BF16)
    x[0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    w = torch.randn(576, generator=g).to(BF16)
    gate_up = (torch.randn(1, 9, 2 * 1536, generator=g) * 30).to(BF16)  # past both clamps of e^x
    gate_up[0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    qkv = (torch.randn(1, 9, 6, 256, generator=g) * 3).to(BF16)  # Gemma 3 270M's heads: q (4) | k (1) | v (1)
    cfg = ModelConfig(vocab_size=32, hidden_size=640, num_layers=1, num_heads=4, num_kv_heads=1, head_dim=256,
                      intermediate_size=64, max_position_embeddings=4096)
    rot = Rotary(cfg)
    rot.build("cpu", BF16)
    cos, sin = rot.tables(torch.randint(0, 4000, (1, 9), generator=g))
    norms = {style: tuple(RMSNorm(256, 1e-6, style == "gemma") for _ in range(2)) for style in ("llama", "gemma")}
    for n in norms["llama"] + norms["gemma"]:
        n.weight.data = torch.randn(256, generator=g) * 0.3
        n.to(BF16)

    def run(o):
        outs = [o.act_mul(gate_up), o.act_mul(gate_up, "gelu_tanh"), o.rope(qkv, cos, sin, 5)]
        for style in ("llama", "gemma"):
            outs += list(o.add_rmsnorm(x, res, w, 1e-6, style))
            outs.append(o.rope(qkv, cos, sin, 5, 4, norms[style]))
        return outs

    for got, want in zip(run(ops), run(generic)):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
