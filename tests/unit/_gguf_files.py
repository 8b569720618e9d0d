"""Tiny GGUF files for tests, written the way llama.cpp writes them (GGUF names, q/k rows permuted),
and from-the-spec numpy codecs for the K-quants (gguf has no Python quantizer for them)."""

from __future__ import annotations

import gguf
import numpy as np

# A tiny llama: every matrix's inner dimension is a multiple of 256 so K-quant blocks fit.
HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, LAYERS = 256, 512, 4, 2, 64, 32, 2


# ---- independent references -----------------------------------------------------------------

def converter_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, restated in numpy."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(rng: np.random.Generator, arch: str = "llama", tied: bool = True, vocab: int = VOCAB,
               scale: float = 0.5) -> dict[str, np.ndarray]:
    """Random float32 weights in HF naming and torch shapes (normal, standard deviation `scale`)."""
    def r(*shape):
        return rng.standard_normal(shape).astype(np.float32) * scale

    q_out, kv_out = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    t = {"model.embed_tokens.weight": r(vocab, HIDDEN), "model.norm.weight": r(HIDDEN)}
    if not tied:
        t["lm_head.weight"] = r(vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t |= {
            p + "self_attn.q_proj.weight": r(q_out, HIDDEN), p + "self_attn.k_proj.weight": r(kv_out, HIDDEN),
            p + "self_attn.v_proj.weight": r(kv_out, HIDDEN), p + "self_attn.o_proj.weight": r(HIDDEN, q_out),
            p + "mlp.gate_proj.weight": r(FFN, HIDDEN), p + "mlp.up_proj.weight": r(FFN, HIDDEN),
            p + "mlp.down_proj.weight": r(HIDDEN, FFN),
            p + "input_layernorm.weight": r(HIDDEN), p + "post_attention_layernorm.weight": r(HIDDEN),
        }
        if arch == "qwen2":
            t |= {p + "self_attn.q_proj.bias": r(q_out), p + "self_attn.k_proj.bias": r(kv_out),
                  p + "self_attn.v_proj.bias": r(kv_out)}
    return t


GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, i, rest = hf.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{i}.{GGUF_NAMES[module]}.{suffix}"


def byte_level_vocab(size: int) -> list[str]:
    """A GPT-2 byte-level BPE vocabulary without merges: the 256 bytes as GPT-2 spells them, then
    <|endoftext|> (256) and <|extraN|> tokens up to `size`: any text tokenizes, a byte a token."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    spelled = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    return [spelled[b] for b in range(256)] + ["<|endoftext|>"] + [f"<|extra{i}|>" for i in range(size - 257)]


def write_gguf(path, tensors: dict[str, np.ndarray], arch: str = "llama", encode=None, extra_kv=None, heads=HEADS,
               byte_tokenizer: bool = False):
    """Write `tensors` (HF names, torch shapes) the way llama.cpp would: GGUF names, q/k permuted for llama.

    encode(name, array) -> (array to store, raw GGML type or None); 1-D tensors always stay F32.
    byte_tokenizer: a byte-level GPT-2 tokenizer (byte_level_vocab) sized to the embedding, so that
    text can be tokenized (the loader's quality probe); else tokens tok0, tok1, ... of VOCAB.
    """
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(heads)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if byte_tokenizer:
        tokens = byte_level_vocab(tensors["model.embed_tokens.weight"].shape[0])
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokens)
        w.add_token_types([1] * 256 + [3] * (len(tokens) - 256))
        w.add_token_merges([])
        w.add_eos_token_id(256)
    else:
        w.add_token_list([f"tok{i}" for i in range(VOCAB)])
        w.add_eos_token_id(1)
    for key, value in (extra_kv or {}).items():
        w.add_string(key, value)
    for name, arr in tensors.items():
        if arch == "llama" and ".q_proj." in name:
            arr = converter_permute(arr, heads)
        elif arch == "llama" and ".k_proj." in name:
            arr = converter_permute(arr, KV_HEADS)
        raw = None
        if encode is not None and arr.ndim == 2:
            arr, raw = encode(name, arr)
        w.add_tensor(gguf_name(name), arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# Q4_K and Q6_K per the ggml format spec (block_q4_K / block_q6_K, QK_K = 256).
def _f16(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(np.float16)


def _k_scales(x: np.ndarray, top: int):
    """Q4_K's and Q5_K's plain (non-searching) scales: per super-block of 256, 8 sub-blocks of 32 with a
    6-bit scale and minimum under float16 d and dmin, y = d sc q - dmin m with q in 0..top. Returns
    (the 4 header bytes d | dmin and the 12 scale bytes [nb, 16], the codes [nb, 8, 32])."""
    sub = x.reshape(-1, 8, 32).astype(np.float64)  # [nb, 8, 32]
    lo, hi = np.minimum(sub.min(-1), 0.0), np.maximum(sub.max(-1), 0.0)
    scale, mins = (hi - lo) / top, -lo
    d, dmin = _f16(scale.max(-1) / 63), _f16(mins.max(-1) / 63)  # [nb]
    d32, dmin32 = d.astype(np.float64)[:, None], dmin.astype(np.float64)[:, None]
    sc = np.clip(np.round(np.divide(scale, d32, out=np.zeros_like(scale), where=d32 > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(np.divide(mins, dmin32, out=np.zeros_like(mins), where=dmin32 > 0)), 0, 63).astype(np.uint8)
    step, off = (d32 * sc)[..., None], (dmin32 * mn)[..., None]
    q = np.clip(np.round(np.divide(sub + off, step, out=np.zeros_like(sub), where=step > 0)), 0, top).astype(np.uint8)
    scales = np.zeros((x.size // 256, 12), np.uint8)
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales], axis=1), q


def q4k_encode(x: np.ndarray) -> np.ndarray:
    """Plain (non-searching) Q4_K quantizer: 8 sub-blocks of 32 with 6-bit scale and min per super-block."""
    header, q = _k_scales(x, 15)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # sub-block 2c -> low nibbles, 2c+1 -> high
    return np.concatenate([header, qs], axis=1).reshape(x.shape[0], -1)


def q4k_decode(raw: np.ndarray) -> np.ndarray:
    b = raw.reshape(-1, 144)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)  # [nb, 1]
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    s = b[:, 4:16].astype(np.int32)
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], axis=1)  # [nb, 8]
    mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    qs = b[:, 16:144].reshape(-1, 4, 32)
    q = np.stack([qs & 0xF, qs >> 4], axis=2).reshape(-1, 8, 32).astype(np.float32)  # [nb, 8, 32]
    y = d[..., None] * sc[..., None].astype(np.float32) * q - dmin[..., None] * mn[..., None].astype(np.float32)
    return y.reshape(raw.shape[0], -1)


def q5k_encode(x: np.ndarray) -> np.ndarray:
    """Plain Q5_K quantizer: Q4_K's sub-blocks, scales and minimums with 5-bit codes (0..31), the fifth
    bit of sub-block j's element l in bit j of qh[l]."""
    header, q = _k_scales(x, 31)
    qs = ((q[:, 0::2] & 0xF) | ((q[:, 1::2] & 0xF) << 4)).reshape(-1, 128)
    qh = sum(((q[:, j] >> 4) & 1) << j for j in range(8)).astype(np.uint8)  # [nb, 32]
    return np.concatenate([header, qh, qs], axis=1).reshape(x.shape[0], -1)


def q6k_encode(x: np.ndarray) -> np.ndarray:
    """Plain Q6_K quantizer: 16 sub-blocks of 16 with int8 scales, 6-bit signed quants."""
    sub = x.reshape(-1, 16, 16).astype(np.float64)  # [nb, 16, 16]
    scale = np.abs(sub).max(-1) / 31
    d = _f16(scale.max(-1) / 127)
    d64 = d.astype(np.float64)[:, None]
    sc = np.clip(np.round(np.divide(scale, d64, out=np.zeros_like(scale), where=d64 > 0)), -128, 127).astype(np.int8)
    step = (d64 * sc)[..., None]
    q = np.clip(np.round(np.divide(sub, step, out=np.zeros_like(sub), where=step != 0)), -32, 31)
    q6 = (q + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [nb, half, quarter, l]
    ql = np.concatenate([(q6[:, :, 0] & 0xF) | ((q6[:, :, 2] & 0xF) << 4),
                         (q6[:, :, 1] & 0xF) | ((q6[:, :, 3] & 0xF) << 4)], axis=2).reshape(-1, 128)
    qh = ((q6[:, :, 0] >> 4) | ((q6[:, :, 1] >> 4) << 2) | ((q6[:, :, 2] >> 4) << 4) | ((q6[:, :, 3] >> 4) << 6))
    blocks = np.concatenate([ql, qh.reshape(-1, 64), sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=1)
    return blocks.reshape(x.shape[0], -1)


def q6k_decode(raw: np.ndarray) -> np.ndarray:
    b = raw.reshape(-1, 210)
    ql = b[:, 0:128].reshape(-1, 2, 64).astype(np.int32)
    qh = b[:, 128:192].reshape(-1, 2, 32).astype(np.int32)
    sc = b[:, 192:208].copy().view(np.int8).astype(np.float32)  # [nb, 16]
    d = b[:, 208:210].copy().view(np.float16).astype(np.float32)  # [nb, 1]
    q = np.stack([
        (ql[:, :, :32] & 0xF) | (((qh >> 0) & 3) << 4),
        (ql[:, :, 32:] & 0xF) | (((qh >> 2) & 3) << 4),
        (ql[:, :, :32] >> 4) | (((qh >> 4) & 3) << 4),
        (ql[:, :, 32:] >> 4) | (((qh >> 6) & 3) << 4),
    ], axis=2) - 32  # [nb, half, quarter, 32]
    y = d[:, :, None] * sc.reshape(-1, 16, 1) * q.reshape(-1, 16, 16).astype(np.float32)
    return y.reshape(raw.shape[0], -1)
