"""Read a GGUF checkpoint into torch tensors named the way Hugging Face Llama/Qwen2 models name them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import ModelConfig
from .errors import CheckpointNotFoundError, ModelLoadError, ShapeMismatchError, UnsupportedArchitectureError, UnsupportedQuantizationError

# GGUF tensor name -> HF parameter name. `{i}` is the block index.
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
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")


@dataclass
class GGUFCheckpoint:
    """A dequantized GGUF checkpoint: config, HF-named tensors, and every GGUF key/value."""

    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, Any]


def hf_name(gguf_name: str) -> str | None:
    """The HF parameter name for a GGUF tensor name, or None for tensors the model does not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"
    return None


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor the config implies, with its torch shape."""
    h, q_out, kv_out = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q_out, h),
            p + "self_attn.k_proj.weight": (kv_out, h),
            p + "self_attn.v_proj.weight": (kv_out, h),
            p + "self_attn.o_proj.weight": (h, q_out),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, cfg.intermediate_size),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        if cfg.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q_out,),
                p + "self_attn.k_proj.bias": (kv_out,),
                p + "self_attn.v_proj.bias": (kv_out,),
            }
    return shapes


def llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to q/k rows: per head, rotate-half order -> interleaved pairs.

    Row r = half*(d/2) + j of a head moves to row 2*j + half. Works on weights [n_heads*d, in] and biases [n_heads*d].
    """
    rest = w.shape[1:]
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, d // 2, *rest).transpose(1, 2).reshape(w.shape)  # [nh, d/2, 2, ...] -> [nh*d, ...]


def llama_cpp_unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of `llama_cpp_permute`: interleaved-pair rows back to HF rotate-half order."""
    rest = w.shape[1:]
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *rest).transpose(1, 2).reshape(w.shape)  # [nh, 2, d/2, ...] -> [nh*d, ...]


def read_metadata(reader) -> dict[str, Any]:
    """All key/values of an open `gguf.GGUFReader` as plain Python values."""
    return {key: field.contents() for key, field in reader.fields.items()}


def _dequantize(tensor, dtype: torch.dtype) -> torch.Tensor:
    """One GGUF tensor -> a torch tensor in torch (reversed-ne) shape, built without keeping extra copies."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType(tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(tensor.shape))
    try:
        arr = quants.dequantize(tensor.data, qtype)
    except NotImplementedError:
        raise UnsupportedQuantizationError(
            f"tensor {tensor.name!r} is stored as {qtype.name}, which cannot be dequantized"
        ) from None
    if not arr.flags.writeable:  # a view into the read-only memory-mapped file
        arr = np.array(arr, dtype=np.float32)
    out = torch.from_numpy(arr.reshape(shape))
    return out if out.dtype == dtype else out.to(dtype)


def read_gguf(path: str | Path, dtype: torch.dtype = torch.float32) -> GGUFCheckpoint:
    """Read and dequantize a llama/qwen2 GGUF file.

    Raises CheckpointNotFoundError (no file), UnsupportedArchitectureError (not llama/qwen2),
    UnsupportedQuantizationError (a tensor type gguf cannot dequantize), ShapeMismatchError
    (a tensor disagrees with the metadata), ModelLoadError (a required tensor is absent).
    """
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise CheckpointNotFoundError(f"GGUF file not found: {path}")
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {e}") from e

    metadata = read_metadata(reader)
    by_name = {t.name: t for t in reader.tensors}
    config = ModelConfig.from_gguf({**metadata, "_tied": "output.weight" not in by_name}, name=metadata.get("general.name") or path.stem)
    arch = config.model_type
    rope_dims = metadata.get(f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != config.head_dim:
        raise UnsupportedArchitectureError(f"partial rotary embeddings ({rope_dims} of {config.head_dim} dims) are not supported")

    shapes = expected_shapes(config)
    wanted = {hf_name(n): n for n in by_name if hf_name(n) in shapes}
    missing = sorted(set(shapes) - set(wanted))
    if missing:
        raise ModelLoadError(f"{path.name} lacks {len(missing)} tensor(s), e.g. {missing[:3]}")

    tensors: dict[str, torch.Tensor] = {}
    for name, expected in shapes.items():  # one tensor at a time: peak memory is one float32 copy
        t = by_name[wanted[name]]
        got = tuple(int(n) for n in reversed(t.shape))
        if got != expected:
            raise ShapeMismatchError(wanted[name], expected, got)
        w = _dequantize(t, dtype)
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = config.num_heads if ".q_proj." in name else config.num_kv_heads
            w = llama_cpp_unpermute(w, heads).contiguous()
        tensors[name] = w
    return GGUFCheckpoint(config=config, tensors=tensors, metadata=metadata)
