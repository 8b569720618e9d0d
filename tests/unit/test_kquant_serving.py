"""A GGUF file of K-quants served as it is: a tiny Llama (random weights, every matrix's inner size a
multiple of 256) written with gguf's writer in the mixes llama.cpp calls Q4_K_M and Q5_K_M, loaded in
bfloat16+kquant (every linear on the native K-quant kernel, each tensor in its own type: a fused q|k|v
of Q4_K and Q6_K rows is one weight of two segments), decoded, and measured against a float32 model
of the same dequantized weights (the quality probe's mean KL bound, and each position's logits). Also: the
auto choice measures kquant as a candidate, rows are batch-invariant end to end, and a file the mode
cannot serve fails naming the tensor and its type.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from lmserve.model.assembly import CheckpointModes
from lmserve.model.linear import quant_matmul as QM
from lmserve.model.linear.formats import KQuantBlocks
from lmserve.model.linear.kernels import NativeQuantLinear
from lmserve.model.loader import load_model, read_checkpoint
from lmserve.model.tuning import quality as Qm
from lmserve.model.tuning.precision import PrecisionError, model_batch_invariant

from _gguf_files import hf_tensors, q4k_encode, q5k_encode, q6k_encode, write_gguf

VOCAB = 272  # the byte-level tokenizer's 256 bytes, <|endoftext|> and 15 more (a multiple of 16)
CODECS = {Q.Q4_K: q4k_encode, Q.Q5_K: q5k_encode, Q.Q6_K: q6k_encode}


def mix(base: Q):
    """llama.cpp's *_K_M choice, shortened to two layers: Q6_K for the embedding (the tied head) and for
    layer 0's attn_v and ffn_down, `base` for every other matrix."""
    def encode(name: str, arr: np.ndarray):
        more_bits = name == "model.embed_tokens.weight" or (name.startswith("model.layers.0.")
                                                             and (".v_proj." in name or ".down_proj." in name))
        qtype = Q.Q6_K if more_bits else base
        return CODECS[qtype](arr), qtype
    return encode


def tiny_llama(seed: int) -> dict[str, np.ndarray]:
    """Random weights whose next-token distributions are far from uniform (a quality probe on a
    near-uniform model would pass anything): unit norms, an embedding (the tied head) of std 0.5."""
    tensors = hf_tensors(np.random.default_rng(seed), vocab=VOCAB, scale=0.08)
    for name in tensors:
        if name.endswith("norm.weight"):
            tensors[name] = np.ones_like(tensors[name])
    tensors["model.embed_tokens.weight"] *= 3
    return tensors


pytestmark = pytest.mark.usefixtures("quant_kernel")


@pytest.fixture(scope="module", params=[Q.Q4_K, Q.Q5_K], ids=["Q4_K_M", "Q5_K_M"])
def kquant_file(request, tmp_path_factory):
    tensors = tiny_llama(7)
    path = tmp_path_factory.mktemp("gguf") / f"tiny-{request.param.name}.gguf"
    return write_gguf(path, tensors, encode=mix(request.param), byte_tokenizer=True), request.param


@pytest.fixture(scope="module")
def cache(native_kernels_dir):
    return native_kernels_dir  # the kernels built once, and this module's measured choices beside them


def test_the_loader_keeps_each_k_quant_tensor_in_its_blocks_and_type(kquant_file):
    path, base = kquant_file
    with read_checkpoint(path) as ckpt:
        src = ckpt.sources
        layer_weights = [n for n in src if n.startswith("model.layers.") and n.endswith("proj.weight")]
        assert all(type(src[n].blocks()) is KQuantBlocks for n in layer_weights)
        assert src["model.layers.0.self_attn.v_proj.weight"].blocks().type_name == "Q6_K"
        assert src["model.layers.1.self_attn.v_proj.weight"].blocks().type_name == base.name
        stored = CheckpointModes(ckpt.config, src).stored_types()
        assert stored["blk.0.ffn_down.weight"] == "Q6_K" and stored["blk.1.ffn_up.weight"] == base.name
        assert len(stored) == len(layer_weights)
        for name in layer_weights:  # the blocks (q/k rows unpermuted) hold the very weights the floats are read from
            assert torch.equal(src[name].blocks().dequantize(), src[name].read()), name


def assert_close_to_float32(path, kq, cache) -> list[int]:
    """kq's logits on held-out text against a float32 model of the file's own (dequantized) weights, and
    kq's rows batch-invariant; returns the text's ids."""
    reference = load_model(path, dtype="float32", quantization="none", device="cpu", cache_dir=cache)
    ids = Qm.text_ids(kq.tokenizer, 200)
    want = Qm.logits_of(reference.model, ids, 128)
    got = Qm.logits_of(kq.model, ids, 128)
    q = Qm.compare(want, got, ids, 128)
    # the quality bound on mean KL (a random model's perplexity, ~1e5 here, swings by percents with the
    # bfloat16 model's rounding alone: its 3% bound says nothing here); every layer on one activation
    # code, the worst kernel choice, gave 0.004-0.0045 and bfloat16 weights 0.0012
    assert q.mean_kl <= Qm.MAX_MEAN_KL, q.as_dict()
    # close position by position: the largest logit error against the logits' spread (all one code
    # 0.15-0.17, two codes 0.07-0.08, bfloat16 weights 0.07-0.08; int4 requantized from these weights 0.65-1.4)
    assert ((got.float() - want).abs().amax(-1) <= 0.25 * want.std(-1)).all()
    assert model_batch_invariant(kq.model, ids)
    return ids


def test_a_k_quant_mix_serves_in_its_own_types_within_the_quality_bounds_of_float32(kquant_file, cache):
    path, base = kquant_file
    kq = load_model(path, dtype="bfloat16", quantization="kquant", device="cpu", cache_dir=cache)
    assert kq.mode == "bfloat16+kquant"
    layers = kq.model.model.layers
    for layer in layers:
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(m, NativeQuantLinear) and m.kernel.startswith("native-kquant"), m
    qkv = [QM.kquant_segments(layer.self_attn.qkv_proj.packed) for layer in layers]
    assert qkv[0] == [(base.name, 256 + 128), ("Q6_K", 128)]  # q|k in the base type, v in Q6_K: one weight
    assert qkv[1] == [(base.name, 512)] and QM.kquant_segments(layers[0].mlp.down_proj.packed) == [("Q6_K", 256)]
    ids = assert_close_to_float32(path, kq, cache)
    if kq.model.native_step is not None:  # the layers in one native call (lm_qmm hands K-quants on): bitwise eager
        native = Qm.logits_of(kq.model, ids, 128, kq.attention, torch.bfloat16)
        step, kq.model.native_step = kq.model.native_step, None
        try:
            eager = Qm.logits_of(kq.model, ids, 128, kq.attention, torch.bfloat16)
        finally:
            kq.model.native_step = step
        assert torch.equal(native, eager)


def test_auto_measures_the_files_own_k_quants_as_a_candidate_mode(kquant_file, cache):
    path, _ = kquant_file
    loaded = load_model(path, device="cpu", cache_dir=cache)
    measured = loaded.plan.measurements["modes"]
    assert "bfloat16+kquant" in measured, list(measured)
    kernels = measured["bfloat16+kquant"]["kernels"]
    assert all(kernels[r].startswith("native-kquant") for r in ("qkv", "o", "gate_up", "down")), kernels


def test_auto_leaves_out_the_modes_that_would_outgrow_the_file(kquant_file, cache, monkeypatch):
    """Without the slack (sized for real models), this tiny file's float32, bfloat16 and int8 would
    each take more than 1.3x its bytes: auto measures only int4 and its own K-quants, and says so."""
    from lmserve.model.tuning import precision as P

    path, _ = kquant_file
    monkeypatch.setattr(P, "MEMORY_SLACK", 0)
    QM.use_cache_dir(cache)
    try:
        with read_checkpoint(path) as ckpt:
            plan = P.resolve_plan(CheckpointModes(ckpt.config, ckpt.sources), ckpt.tokenizer, path,
                                  torch.device("cpu"), None, None, True, cache_dir=None)
    finally:
        QM.use_cache_dir(None)
    assert set(plan.measurements["modes"]) <= {"bfloat16+int4", "bfloat16+kquant"}, list(plan.measurements["modes"])
    assert plan.mode.name in ("bfloat16+int4", "bfloat16+kquant")
    assert "not candidates at this size" in plan.reason
    assert all(f"{m} (" in plan.reason for m in ("float32", "bfloat16", "bfloat16+int8"))


def test_kquant_refuses_a_file_whose_layers_are_not_all_k_quants_naming_the_tensor(tmp_path):
    def encode(name, arr):
        if name == "model.layers.1.mlp.up_proj.weight":
            return arr, None  # F32
        return q4k_encode(arr), Q.Q4_K
    path = write_gguf(tmp_path / "mixed.gguf", tiny_llama(8),
                      encode=encode, byte_tokenizer=True)
    with pytest.raises(PrecisionError, match=r"blk\.1\.ffn_up\.weight \(F32\)"):
        load_model(path, dtype="bfloat16", quantization="kquant", device="cpu", cache_dir=tmp_path)


def test_the_embedding_is_served_from_the_files_blocks_bitwise_as_its_bfloat16_read(kquant_file, cache):
    """A K-quant embedding stays in its blocks (the file's bytes: 4.3x smaller than bfloat16 for Q6_K)
    and each looked-up row is what a bfloat16 read of the file holds, through the module and through the
    native step's own lookup: logits bitwise those of the model with the bfloat16 table."""
    from lmserve.model.linear.embedding import QuantizedEmbedding
    from lmserve.model.native import build as native
    from lmserve.model.native.step import NativeStep

    path, _ = kquant_file
    kq = load_model(path, dtype="bfloat16", quantization="kquant", device="cpu", cache_dir=cache)
    embed = kq.model.model.embed_tokens
    assert isinstance(embed, QuantizedEmbedding) and embed.ggml_type == int(Q.Q6_K)
    with read_checkpoint(path) as ckpt:
        table = ckpt.sources["model.embed_tokens.weight"].read(torch.bfloat16)
        assert embed.raw.numel() == ckpt.sources["model.embed_tokens.weight"].nbytes
    ids = torch.tensor([[0, 5, VOCAB - 1], [17, 17, 200]])
    assert torch.equal(embed(ids), table[ids])
    with pytest.raises(IndexError):
        embed(torch.tensor([VOCAB]))
    text = Qm.text_ids(kq.tokenizer, 120)
    served = Qm.logits_of(kq.model, text, 64, kq.attention, torch.bfloat16)  # the native step where it runs
    kq.model.model.embed_tokens = torch.nn.Embedding(*table.shape, _weight=table)
    if kq.model.native_step is not None:  # a step whose tables point at the bfloat16 embedding
        kq.model.native_step = NativeStep(native.loaded(), kq.model)
    assert torch.equal(Qm.logits_of(kq.model, text, 64, kq.attention, torch.bfloat16), served)


# ---- a mix whose rows are not all a multiple of 256 -------------------------------------------------
# llama.cpp stores a K-quant mix's tensors whose rows cannot hold 256-weight super-blocks (Gemma 3 270M's
# 640, SmolLM2's 576) in Q5_0 / Q8_0 instead of Q4_K / Q6_K; Gemma 3 270M's own Q4_K_M file holds q, k,
# gate and up in Q5_0, v in Q8_0 or Q5_0, o and down in Q4_K / Q6_K and the embedding in Q8_0. This tiny
# file holds the same pattern (its rows are 256 wide, the types chosen per tensor as in that file).

def encoded(arr: np.ndarray, qtype: Q):
    """(arr in qtype's blocks, qtype): this file's K-quant codecs, gguf's quantizer for the 32-blocks."""
    from gguf import quants

    return (CODECS[qtype](arr) if qtype in CODECS else quants.quantize(arr, qtype)), qtype


def mix_file(factory, name: str, seed: int, encode):
    return write_gguf(factory.mktemp("gguf") / name, tiny_llama(seed), encode=encode, byte_tokenizer=True)


def fallback_mix(name: str, arr: np.ndarray):
    layer0 = name.startswith("model.layers.0.")
    if name == "model.embed_tokens.weight" or (layer0 and ".v_proj." in name):
        return encoded(arr, Q.Q8_0)
    if ".o_proj." in name or ".down_proj." in name:
        return encoded(arr, Q.Q6_K if layer0 and ".down_proj." in name else Q.Q4_K)
    return encoded(arr, Q.Q5_0)


@pytest.fixture(scope="module")
def fallback_file(tmp_path_factory):
    return mix_file(tmp_path_factory, "tiny-fallback-mix.gguf", 9, fallback_mix)


def test_q5_0_and_q8_0_tensors_of_a_k_quant_mix_keep_their_own_weights_as_8_bit_codes(fallback_file):
    from lmserve.model.linear.formats import Q80Blocks

    with read_checkpoint(fallback_file) as ckpt:
        src = ckpt.sources
        stored = CheckpointModes(ckpt.config, src).stored_types()
        assert stored["blk.1.attn_v.weight"] == "Q5_0" and stored["blk.0.attn_v.weight"] == "Q8_0"
        for name in [n for n in src if n.startswith("model.layers.") and n.endswith("proj.weight")]:
            blocks = src[name].blocks()
            assert type(blocks) is (KQuantBlocks if (".o_proj." in name or ".down_proj." in name) else Q80Blocks)
            # the weights a float read of the file gives (gguf's own dequantization, bitwise: test_gguf_dequant)
            assert torch.equal(blocks.dequantize(), src[name].read()), name


def test_kquant_serves_a_mix_with_q5_0_and_q8_0_tensors_within_the_quality_bounds(fallback_file, cache):
    from lmserve.model.linear.formats import Q80Blocks

    kq = load_model(fallback_file, dtype="bfloat16", quantization="kquant", device="cpu", cache_dir=cache)
    assert kq.mode == "bfloat16+kquant"
    for layer in kq.model.model.layers:
        assert layer.self_attn.qkv_proj.bits == 8 and layer.mlp.gate_up_proj.bits == 8  # Q5_0 | Q8_0 codes
        assert layer.self_attn.o_proj.bits == QM.KQUANT_BITS and layer.mlp.down_proj.bits == QM.KQUANT_BITS
    with read_checkpoint(fallback_file) as ckpt:  # the packed 8-bit codes are the file's, not re-quantized
        src = ckpt.sources
        names = [f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"]
        packed = QM.pack_q8(Q80Blocks.cat([src[n].blocks() for n in names]))
        table = src["model.embed_tokens.weight"].read(torch.bfloat16)
    assert torch.equal(kq.model.model.layers[1].self_attn.qkv_proj.packed, packed)
    embed = kq.model.model.embed_tokens  # the Q8_0 table stays in its bytes; rows as a bfloat16 read gives them
    assert embed.ggml_type == int(Q.Q8_0) and embed.raw.numel() == table.numel() // 32 * 34
    every = torch.arange(VOCAB)[None]
    assert torch.equal(embed(every), table[every])
    assert_close_to_float32(fallback_file, kq, cache)
    loaded = load_model(fallback_file, device="cpu", cache_dir=cache)  # auto: the mix is a candidate mode
    assert "bfloat16+kquant" in loaded.plan.measurements["modes"], list(loaded.plan.measurements["modes"])


# A Q5_K_M file of such a model stores Q5_K's fallback rows in Q5_1 (w = d * q + m, a minimum per block).
def q51_mix(name: str, arr: np.ndarray):
    if name == "model.embed_tokens.weight" or ".v_proj." in name:
        return encoded(arr, Q.Q8_0)
    return encoded(arr, Q.Q5_K if ".o_proj." in name or ".down_proj." in name else Q.Q5_1)


@pytest.fixture(scope="module")
def q51_file(tmp_path_factory):
    return mix_file(tmp_path_factory, "tiny-q5_1-mix.gguf", 10, q51_mix)


def test_q5_1_tensors_are_rounded_to_q8_0_codes_of_their_own_weights(q51_file):
    """Q5_1 blocks decode to the weights gguf's own reader gives, then Q8_0's recipe rounds them: the codes
    are quantize_q80's of the file's float read, bitwise, each weight within half a step of the file's."""
    from lmserve.model.linear.formats import Q80Blocks, quantize_q80_torch

    with read_checkpoint(q51_file) as ckpt:
        src = ckpt.sources
        assert CheckpointModes(ckpt.config, src).stored_types()["blk.1.ffn_gate.weight"] == "Q5_1"
        for name in [n for n in src if n.startswith("model.layers.") and n.endswith("proj.weight")
                     and (".q_proj." in n or ".k_proj." in n or ".gate_proj." in n or ".up_proj." in n)]:
            blocks, w = src[name].blocks(), src[name].read()
            assert type(blocks) is Q80Blocks and not blocks.exact, name
            want = quantize_q80_torch(w)
            assert torch.equal(blocks.q, want.q) and torch.equal(blocks.d, want.d), name
            step = blocks.d.repeat_interleave(32, 1)
            assert ((blocks.dequantize() - w).abs() <= step / 2 + 1e-7).all(), name
        assert src["model.layers.0.self_attn.v_proj.weight"].blocks().exact  # Q8_0: the file's own codes


def test_kquant_serves_a_q5_k_m_mix_with_q5_1_tensors_within_the_quality_bounds(q51_file, cache):
    from lmserve.model.tuning.precision import Mode, file_exact_modes

    kq = load_model(q51_file, dtype="bfloat16", quantization="kquant", device="cpu", cache_dir=cache)
    assert kq.mode == "bfloat16+kquant"
    for layer in kq.model.model.layers:
        assert layer.self_attn.qkv_proj.bits == 8 and layer.mlp.gate_up_proj.bits == 8  # Q5_1 | Q8_0 as codes
        assert layer.self_attn.o_proj.bits == QM.KQUANT_BITS and layer.mlp.down_proj.bits == QM.KQUANT_BITS
    assert_close_to_float32(q51_file, kq, cache)
    with read_checkpoint(q51_file) as ckpt:  # rounded codes are not the file's own: no tie goes to kquant for them
        timed, _ = CheckpointModes(ckpt.config, ckpt.sources).timing_sources(1 << 30)
        kquant = Mode(torch.bfloat16, "kquant")
        assert kquant not in file_exact_modes(timed, [kquant, Mode(torch.bfloat16, "int8")])


def test_kquant_refuses_a_fused_weight_whose_parts_need_different_kernel_paths_naming_both(tmp_path):
    def encode(name, arr):
        from gguf import quants
        if name == "model.layers.1.self_attn.v_proj.weight":
            return quants.quantize(arr, Q.Q8_0), Q.Q8_0
        return q4k_encode(arr), Q.Q4_K
    path = write_gguf(tmp_path / "fused-mix.gguf", tiny_llama(8), encode=encode, byte_tokenizer=True)
    with pytest.raises(PrecisionError, match=r"blk\.1\.attn_k\.weight \(Q4_K\) and blk\.1\.attn_v\.weight \(Q8_0\)"):
        load_model(path, dtype="bfloat16", quantization="kquant", device="cpu", cache_dir=tmp_path)
