"""GGUF reading: dequantization, HF naming, q/k unpermutation, and the named errors.

Oracles: transformers' own GGUF loader on the real SmolLM2 file; original float tensors for round trips
through gguf's quantizers; a from-the-spec numpy codec for the K-quants (gguf has no Python quantizer
for them); the llama.cpp converter's permutation formula and RoPE itself for the unpermute.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from lmserve.model.errors import (
    CheckpointNotFoundError,
    ModelLoadError,
    ShapeMismatchError,
    UnsupportedArchitectureError,
    UnsupportedQuantizationError,
)
from lmserve.model.checkpoints.gguf_reader import llama_cpp_permute, llama_cpp_unpermute, read_gguf

from _gguf_files import (FFN, HEADS, HIDDEN, KV_HEADS, VOCAB, _f16, converter_permute, hf_tensors, q4k_decode,
                         q4k_encode, q6k_decode, q6k_encode, write_gguf)


# Worst-case error per block of each quantizer, from its definition: (block length, bound(blocks [n, block])).
# Every scale is stored as fp16, which moves a dequantized value by at most ~2^-11 of the block's largest value.
def _amax(b):
    return np.abs(b).max(-1, keepdims=True)


def _range(b):
    return b.max(-1, keepdims=True) - b.min(-1, keepdims=True)


def _q4k_bound(b):  # super-blocks [n, 256]
    sub = b.reshape(len(b), 8, 32)
    lo, hi = np.minimum(sub.min(-1), 0), np.maximum(sub.max(-1), 0)
    d, dmin = (hi - lo).max(-1, keepdims=True) / 15 / 63, (-lo).max(-1, keepdims=True) / 63
    # half a (6-bit-rounded) step, half a min step, and clipping at the top when the step rounded down
    return (hi - lo).max(-1, keepdims=True) / 30 + d / 2 + dmin / 2 + 7.5 * d + _amax(b) * 2.0**-9


def _q6k_bound(b):  # super-blocks [n, 256]
    d = _amax(b) / 31 / 127
    return _amax(b) / 62 + d / 2 + 15.5 * d + _amax(b) * 2.0**-9


ERROR_BOUNDS = {
    Q.F32: (1, lambda b: np.zeros_like(b)),
    Q.F16: (1, lambda b: np.abs(b) * 2.0**-11),
    Q.BF16: (1, lambda b: np.abs(b) * 2.0**-8),
    Q.Q8_0: (32, lambda b: _amax(b) / 127 / 2 + _amax(b) * 2.0**-10),
    Q.Q4_0: (32, lambda b: _amax(b) / 8 + _amax(b) * 2.0**-10),  # the far side of zero clips by one step
    Q.Q4_1: (32, lambda b: _range(b) / 15 / 2 + _amax(b) * 2.0**-9),
    Q.Q5_0: (32, lambda b: _amax(b) / 16 + _amax(b) * 2.0**-10),
    Q.Q5_1: (32, lambda b: _range(b) / 31 / 2 + _amax(b) * 2.0**-9),
    Q.Q4_K: (256, _q4k_bound),
    Q.Q6_K: (256, _q6k_bound),
}
K_CODECS = {Q.Q4_K: q4k_encode, Q.Q6_K: q6k_encode}


def encoder_for(qtype):
    def encode(name, arr):
        if qtype in K_CODECS:
            return K_CODECS[qtype](arr), qtype
        return gguf.quants.quantize(arr, qtype), qtype
    return encode


# ---- (a) the real checkpoint against transformers' loader -------------------------------------

@pytest.mark.slow
def test_smollm2_matches_transformers_gguf_loader(smollm2_gguf_path):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    ours = read_gguf(smollm2_gguf_path)
    # The skeleton only supplies HF parameter names; transformers parses the file's config itself.
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**ours.config.to_hf()))
    parsed = load_gguf_checkpoint(str(smollm2_gguf_path), return_tensors=True, model_to_load=skeleton)
    ref = parsed["tensors"]

    assert set(ours.tensors) == set(ref)
    for name, expected in ref.items():
        got = ours.tensors[name]
        assert got.dtype == torch.float32 and got.shape == expected.shape, name
        assert torch.equal(got, expected), name

    c, hf = ours.config, parsed["config"]
    assert (c.vocab_size, c.hidden_size, c.num_layers) == (hf["vocab_size"], hf["hidden_size"], hf["num_hidden_layers"])
    assert (c.num_heads, c.num_kv_heads, c.intermediate_size) == (
        hf["num_attention_heads"], hf["num_key_value_heads"], hf["intermediate_size"])
    assert c.tie_word_embeddings is hf["tie_word_embeddings"] is True and "lm_head.weight" not in ours.tensors
    assert c.rope_theta == pytest.approx(hf["rope_theta"]) and c.rms_norm_eps == pytest.approx(hf["rms_norm_eps"])
    assert ours.metadata["tokenizer.ggml.tokens"] == parsed["tokenizer"]["tokens"]
    assert ours.metadata["tokenizer.ggml.merges"] == parsed["tokenizer"]["merges"]


# ---- (b) round trips through each storage type -------------------------------------------------

@pytest.mark.parametrize("qtype", list(ERROR_BOUNDS), ids=lambda q: q.name)
def test_round_trip_within_type_error_bound(tmp_path, qtype):
    rng = np.random.default_rng(int(qtype))
    original = hf_tensors(rng, tied=False)
    ck = read_gguf(write_gguf(tmp_path / "m.gguf", original, encode=encoder_for(qtype)))

    assert set(ck.tensors) == set(original)
    assert ck.config.tie_word_embeddings is False
    block, bound = ERROR_BOUNDS[qtype]
    for name, want in original.items():
        got = ck.tensors[name].numpy()
        assert got.shape == want.shape, name
        if want.ndim == 1:  # norms stay F32
            np.testing.assert_array_equal(got, want, err_msg=name)
            continue
        err = np.abs(got - want).reshape(-1, block)
        limit = bound(want.reshape(-1, block).astype(np.float64)) + 1e-7
        assert (err <= limit).all(), f"{name}: worst excess {np.max(err - limit):.3g}"
        if qtype is not Q.F32:
            assert err.max() > 0, f"{name}: {qtype.name} stored losslessly? the quantizer was not applied"


@pytest.mark.parametrize("qtype, decode", [(Q.Q4_K, q4k_decode), (Q.Q6_K, q6k_decode)], ids=["Q4_K", "Q6_K"])
def test_k_quant_bytes_decode_like_the_spec(tmp_path, qtype, decode):
    """Arbitrary block bytes (finite fp16 scales) decode to what the format spec says."""
    rng = np.random.default_rng(7)
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    scale_offsets = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}[qtype]

    def encode(name, arr):
        raw = rng.integers(0, 256, size=(arr.shape[0], arr.shape[1] // 256, block_bytes), dtype=np.uint8)
        for off in scale_offsets:
            raw[..., off:off + 2] = _f16(rng.uniform(-0.05, 0.05, raw.shape[:2])).view(np.uint8).reshape(*raw.shape[:2], 2)
        return raw.reshape(arr.shape[0], -1), qtype

    written: dict[str, np.ndarray] = {}

    def recording(name, arr):
        raw, q = encode(name, arr)
        written[name] = raw
        return raw, q

    ck = read_gguf(write_gguf(tmp_path / "k.gguf", hf_tensors(rng), encode=recording))
    for name, raw in written.items():
        want = torch.from_numpy(decode(raw))  # rows in file order
        got = ck.tensors[name]
        if ".q_proj." in name or ".k_proj." in name:  # the reader unpermuted these rows; put them back
            got = llama_cpp_permute(got, HEADS if ".q_proj." in name else KV_HEADS)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_bf16_target_dtype_and_qwen2_layout(tmp_path):
    """qwen2 keeps q/k rows as stored (no llama.cpp permutation), carries biases; dtype is honoured."""
    original = hf_tensors(np.random.default_rng(3), arch="qwen2")
    ck = read_gguf(write_gguf(tmp_path / "q.gguf", original, arch="qwen2"), dtype=torch.bfloat16)
    assert ck.config.model_type == "qwen2" and ck.config.attention_bias and ck.config.tie_word_embeddings
    assert set(ck.tensors) == set(original)
    for name, want in original.items():
        assert ck.tensors[name].dtype == torch.bfloat16
        assert torch.equal(ck.tensors[name], torch.from_numpy(want).to(torch.bfloat16)), name


def test_metadata_is_plain_python(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", hf_tensors(np.random.default_rng(4)), extra_kv={"general.name": "tiny"})
    ck = read_gguf(path)
    md = ck.metadata
    assert md["general.architecture"] == "llama" and md["general.name"] == "tiny" == ck.config.name
    assert md["tokenizer.ggml.tokens"] == [f"tok{i}" for i in range(VOCAB)]
    assert md["llama.attention.head_count"] == HEADS and isinstance(md["llama.attention.head_count"], int)
    assert isinstance(md["llama.rope.freq_base"], float) and md["tokenizer.ggml.eos_token_id"] == 1
    assert ck.config.eos_token_ids == (1,) and ck.config.num_kv_heads == KV_HEADS


def test_metadata_matches_gguf_readers_parse(tmp_path):
    """Our header parser agrees with gguf.GGUFReader on every key, across value types."""
    path = tmp_path / "kv.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200); w.add_int8("t.i8", -5); w.add_uint16("t.u16", 60000); w.add_int16("t.i16", -300)
    w.add_uint64("t.u64", 2**40 + 3); w.add_int64("t.i64", -(2**40)); w.add_float64("t.f64", 1 / 3)
    w.add_bool("t.bool", True); w.add_string("t.str", "héllo ✓")
    w.add_array("t.ints", [1, -2, 3]); w.add_array("t.floats", [0.5, 1.25]); w.add_array("t.strs", ["a", "", "ß"])
    w.add_array("t.bools", [True, False])
    w.add_tensor("x", np.arange(8, dtype=np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()

    from lmserve.model.checkpoints.gguf_reader import read_directory

    with open(path, "rb") as f:
        meta, infos = read_directory(f.read())
    reference = {k: field.contents() for k, field in gguf.GGUFReader(path).fields.items()}
    assert meta == reference
    assert [(t.name, t.torch_shape) for t in infos] == [("x", (8,))]


def test_truncated_or_foreign_file_is_a_load_error(tmp_path):
    path = write_gguf(tmp_path / "t.gguf", hf_tensors(np.random.default_rng(9)))
    data = path.read_bytes()
    path.write_bytes(data[:-1000])
    with pytest.raises(ModelLoadError, match="end of the file"):
        read_gguf(path)
    path.write_bytes(b"PK\x03\x04 not a gguf at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        read_gguf(path)


# ---- (c) bad checkpoints raise their named errors ---------------------------------------------

def test_missing_file(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="nope.gguf"):
        read_gguf(tmp_path / "nope.gguf")


def test_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "g.gguf", hf_tensors(np.random.default_rng(5)), arch="gpt2")
    with pytest.raises(UnsupportedArchitectureError, match="gpt2"):
        read_gguf(path)


@pytest.mark.parametrize("qtype", [Q.I32, Q.Q8_K], ids=lambda q: q.name)
def test_unsupported_quantization_names_tensor_and_type(tmp_path, qtype):
    def encode(name, arr):
        if name != "model.layers.1.mlp.up_proj.weight":
            return arr, None
        if qtype is Q.I32:
            return arr.astype(np.int32), None
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        return np.zeros((arr.shape[0], arr.shape[1] // block * size), np.uint8), qtype

    path = write_gguf(tmp_path / "u.gguf", hf_tensors(np.random.default_rng(6)), encode=encode)
    with pytest.raises(UnsupportedQuantizationError, match=rf"blk\.1\.ffn_up\.weight.*{qtype.name}"):
        read_gguf(path)


def test_shape_mismatch_names_tensor(tmp_path):
    tensors = hf_tensors(np.random.default_rng(8))
    tensors["model.layers.0.mlp.down_proj.weight"] = tensors["model.layers.0.mlp.down_proj.weight"][:, :256]
    with pytest.raises(ShapeMismatchError, match=r"blk\.0\.ffn_down\.weight") as info:
        read_gguf(write_gguf(tmp_path / "s.gguf", tensors))
    assert info.value.expected == (HIDDEN, FFN) and info.value.got == (HIDDEN, 256)


# ---- (d) the q/k unpermutation -----------------------------------------------------------------

def test_unpermute_is_exact_inverse_of_converter_permutation():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n_heads, half, cols = int(rng.integers(1, 9)), int(rng.integers(1, 33)), int(rng.integers(0, 5))
        shape = (n_heads * 2 * half,) + ((cols,) if cols else ())  # weights [rows, in] and biases [rows]
        w = rng.standard_normal(shape).astype(np.float32)
        permuted = converter_permute(w, n_heads)
        np.testing.assert_array_equal(llama_cpp_permute(torch.from_numpy(w), n_heads).numpy(), permuted)
        np.testing.assert_array_equal(llama_cpp_unpermute(torch.from_numpy(permuted), n_heads).numpy(), w)
        np.testing.assert_array_equal(
            llama_cpp_permute(llama_cpp_unpermute(torch.from_numpy(w), n_heads), n_heads).numpy(), w)


def test_unpermuted_rows_give_rotate_half_rope():
    """Why the permutation exists: interleaved-pair RoPE on the permuted projection equals, after
    unpermuting, HF rotate-half RoPE on the unpermuted one."""
    rng = np.random.default_rng(1)
    n_heads, d, hidden, pos = 3, 16, 8, 5
    w_hf = torch.from_numpy(rng.standard_normal((n_heads * d, hidden)).astype(np.float64))
    x = torch.from_numpy(rng.standard_normal(hidden))
    theta = pos / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)  # [d/2]
    cos, sin = theta.cos(), theta.sin()

    def rope_rotate_half(q):  # HF: pairs (j, j + d/2)
        q = q.view(n_heads, d)
        a, b = q[:, : d // 2], q[:, d // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).reshape(-1)

    def rope_interleaved(q):  # llama.cpp: pairs (2j, 2j + 1)
        q = q.view(n_heads, d // 2, 2)
        a, b = q[..., 0], q[..., 1]
        return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).reshape(-1)

    w_file = torch.from_numpy(converter_permute(w_hf.numpy(), n_heads))
    in_file_convention = rope_interleaved(w_file @ x)
    w_ours = llama_cpp_unpermute(w_file, n_heads)
    torch.testing.assert_close(llama_cpp_unpermute(in_file_convention.view(-1, 1), n_heads).view(-1),
                               rope_rotate_half(w_ours @ x))
    torch.testing.assert_close(w_ours, w_hf, rtol=0, atol=0)
