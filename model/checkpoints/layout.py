"""Which tensors a checkpoint of a given ModelConfig holds: their Hugging Face names and shapes, the GGUF
names llama.cpp's converter gives them, and what is undone at load (Phi-3's fused projections split,
the +1 the converter adds to Gemma's norm weights taken off). loader.py and gguf_reader.py read
checkpoints through it."""

from __future__ import annotations

import re

import torch

from ..config import ModelConfig
from .sources import TensorSource

# GGUF tensor name -> HF parameter name; per-block names sit under `blk.{i}.` and `model.layers.{i}.`
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
# where an architecture's converter names a tensor otherwise
_ARCH_BLOCK_NAMES = {
    "gemma3": {
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
    "phi3": {
        "attn_qkv.weight": "self_attn.qkv_proj.weight",
        "ffn_up.weight": "mlp.gate_up_proj.weight",  # gate rows, then up rows
    },
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")
FUSED = ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight")  # Phi-3's, split at load


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF parameter name for a GGUF tensor name of `arch`, or None for tensors the model does not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None:
        return None
    name = _ARCH_BLOCK_NAMES.get(arch, {}).get(m.group(2)) or _BLOCK_NAMES.get(m.group(2))
    return f"model.layers.{m.group(1)}.{name}" if name else None


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model is built from, with its torch shape (Phi-3's fused projections already split)."""
    D, d, V, I = cfg.hidden_size, cfg.head_dim, cfg.vocab_size, cfg.intermediate_size
    q_out, kv_out = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, D)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q_out, D),
            p + "self_attn.k_proj.weight": (kv_out, D),
            p + "self_attn.v_proj.weight": (kv_out, D),
            p + "self_attn.o_proj.weight": (D, q_out),
            p + "mlp.gate_proj.weight": (I, D),
            p + "mlp.up_proj.weight": (I, D),
            p + "mlp.down_proj.weight": (D, I),
            p + "input_layernorm.weight": (D,),
            p + "post_attention_layernorm.weight": (D,),
        }
        if cfg.sandwich_norms:
            shapes |= {p + "pre_feedforward_layernorm.weight": (D,), p + "post_feedforward_layernorm.weight": (D,)}
        if cfg.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
        if cfg.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q_out,), p + "self_attn.k_proj.bias": (kv_out,),
                       p + "self_attn.v_proj.bias": (kv_out,)}
        if cfg.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (D,)
    return shapes


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """expected_shapes as the family's checkpoints store them: Phi-3's q|k|v and gate|up as one tensor each."""
    shapes = expected_shapes(cfg)
    if cfg.model_type == "phi3":
        for i in range(cfg.num_layers):
            for fused in FUSED:
                parts = fused_parts(cfg, f"model.layers.{i}.{fused}")
                shapes[f"model.layers.{i}.{fused}"] = (sum(rows for _, rows in parts), shapes[parts[0][0]][1])
                for part, _ in parts:
                    del shapes[part]
    return shapes


def fused_parts(cfg: ModelConfig, name: str) -> list[tuple[str, int]] | None:
    """A fused tensor's parts, in row order: (HF name, rows); None for any other name."""
    if name.endswith(FUSED[0]):
        p, d = name.removesuffix(FUSED[0]), cfg.head_dim
        return [(p + "self_attn.q_proj.weight", cfg.num_heads * d), (p + "self_attn.k_proj.weight", cfg.num_kv_heads * d),
                (p + "self_attn.v_proj.weight", cfg.num_kv_heads * d)]
    if name.endswith(FUSED[1]):
        p = name.removesuffix(FUSED[1])
        return [(p + "mlp.gate_proj.weight", cfg.intermediate_size), (p + "mlp.up_proj.weight", cfg.intermediate_size)]
    return None


def split_rows(x, sizes: list[int]) -> list:
    """A tensor, or a block format whose every field is [rows, ...] (quant.Q41Blocks, Q80Blocks), cut by rows."""
    if isinstance(x, torch.Tensor):
        return [t.contiguous() for t in x.split(sizes)]
    import dataclasses

    fields = [f.name for f in dataclasses.fields(x)]
    parts = [getattr(x, f).split(sizes) for f in fields]
    return [type(x)(*(p[i].contiguous() for p in parts)) for i in range(len(sizes))]


def split_fused(cfg: ModelConfig, tensors: dict) -> dict:
    """Phi-3's fused q|k|v and gate|up tensors (or blocks, or sources) replaced by their parts, in place;
    returns tensors."""
    for name in [n for n in tensors if n.endswith(FUSED)]:
        parts = fused_parts(cfg, name)
        value = tensors.pop(name)
        if isinstance(value, TensorSource):
            start = 0
            for part, rows in parts:
                tensors[part] = value.row_block(part, start, start + rows)
                start += rows
            continue
        for (part, _), piece in zip(parts, split_rows(value, [rows for _, rows in parts])):
            tensors[part] = piece
    return tensors


def unshift_gemma_norms(cfg: ModelConfig, tensors: dict) -> dict:
    """llama.cpp's converter stores a Gemma norm's (1 + w); the decoder reads w (transformers' form)."""
    if cfg.norm_style == "gemma":
        for name in tensors:
            if name.endswith("norm.weight"):
                value = tensors[name]
                tensors[name] = value.mapped(lambda t: t - 1.0) if isinstance(value, TensorSource) else value - 1.0
    return tensors
