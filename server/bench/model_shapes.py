"""Random-weight checkpoints of the model shapes people serve, for speed and memory benchmarks.

A shape is a public model's architecture (Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B) with random
weights and SmolLM2's tokenizer (its 49,152-entry vocabulary instead of Llama 3's 128,256, so the
head is smaller than the real model's and the tokenizer is one the tests already trust). Random
weights say nothing about quality; they load, decode and read memory exactly as trained ones do.

Formats:
- GGUF in llama.cpp's own block types, written as blocks (random codes and scales), not quantized
  from float weights: `q4_k_m` follows llama.cpp's Q4_K_M recipe (Q6_K for the head and for attn_v
  and ffn_down of a subset of layers, Q4_K elsewhere), `q4_0` and `q8_0` are one type throughout.
  Seconds even for 8B.
- `bf16` / `f16`: a Hugging Face directory (config.json, safetensors shards, tokenizer.json).

    python -m lmserve.server.bench.model_shapes llama-3.2-1b q4_k_m --out /tmp/models
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SIGMA = 0.02  # standard deviation of the random weights (what trained Llama linears show, roughly)


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    tied: bool
    rope_theta: float = 500000.0
    context: int = 8192

    def linears(self) -> dict[str, tuple[int, int]]:
        """GGUF name within a block -> (rows, cols) of the weight (torch order: [out, in])."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"attn_q": (q, self.hidden), "attn_k": (kv, self.hidden), "attn_v": (kv, self.hidden),
                "attn_output": (self.hidden, q), "ffn_gate": (self.ffn, self.hidden),
                "ffn_up": (self.ffn, self.hidden), "ffn_down": (self.hidden, self.ffn)}

    def parameters(self, vocab: int) -> int:
        per_layer = sum(r * c for r, c in self.linears().values()) + 2 * self.hidden
        return self.layers * per_layer + vocab * self.hidden * (1 if self.tied else 2) + self.hidden


SHAPES = {s.name: s for s in (
    Shape("llama-3.2-1b", hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, ffn=8192, tied=True),
    Shape("llama-3.2-3b", hidden=3072, layers=28, heads=24, kv_heads=8, head_dim=128, ffn=8192, tied=True),
    Shape("llama-3.1-8b", hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, ffn=14336, tied=False),
)}
GGUF_FORMATS = ("q4_k_m", "q4_0", "q8_0")
HF_FORMATS = ("bf16", "f16")


# ---------------------------------------------------------------- random blocks, type by type

def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def random_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, row_bytes] uint8 of random blocks of `qtype` whose weights have mean ~0 and std ~SIGMA."""
    if qtype == "Q4_0":  # per 32: f16 d, 16 bytes of nibbles; w = d (q - 8), q uniform: std 4.6 d
        n = rows * cols // 32
        d = np.full((n, 1), SIGMA / 4.6)
        out = np.concatenate([_f16_bytes(d).reshape(n, 2), rng.integers(0, 256, (n, 16), np.uint8)], axis=1)
    elif qtype == "Q8_0":  # per 32: f16 d, 32 int8; w = d q, q uniform in -127..127: std 73 d
        n = rows * cols // 32
        d = np.full((n, 1), SIGMA / 73)
        out = np.concatenate([_f16_bytes(d).reshape(n, 2), rng.integers(-127, 128, (n, 32), np.int8).view(np.uint8)],
                             axis=1)
    elif qtype == "Q4_K":  # per 256: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
        n = rows * cols // 256
        # scales and mins 32..47 (both 6-bit fields), w = d sc q - dmin m: dmin = 7.5 d centres it, std ~ 40 * 4.6 d
        sc = rng.integers(32, 48, (n, 8), np.uint8)
        mn = rng.integers(32, 48, (n, 8), np.uint8)
        packed = np.zeros((n, 12), np.uint8)
        packed[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
        packed[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
        packed[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
        d = np.full((n, 1), SIGMA / (40 * 4.6))
        out = np.concatenate([_f16_bytes(d).reshape(n, 2), _f16_bytes(7.5 * d).reshape(n, 2), packed,
                              rng.integers(0, 256, (n, 128), np.uint8)], axis=1)
    elif qtype == "Q6_K":  # per 256: 128 bytes low nibbles, 64 bytes high bits, 16 int8 scales, f16 d
        n = rows * cols // 256
        scales = rng.integers(16, 32, (n, 16), np.int8).view(np.uint8)
        d = np.full((n, 1), SIGMA / (24 * 18.5))  # w = d sc (q - 32), q uniform 0..63: std 18.5
        out = np.concatenate([rng.integers(0, 256, (n, 192), np.uint8), scales, _f16_bytes(d).reshape(n, 2)], axis=1)
    else:
        raise ValueError(f"no random blocks for {qtype}")
    return np.ascontiguousarray(out).reshape(rows, -1)


def _use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's Q4_K_M rule for which layers' attn_v and ffn_down get Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_types(shape: Shape, fmt: str) -> dict[str, str]:
    """GGUF tensor name -> block type of a `fmt` file (norms are F32 and not listed)."""
    base = {"q4_k_m": "Q4_K", "q4_0": "Q4_0", "q8_0": "Q8_0"}[fmt]
    types = {"token_embd.weight": base}
    if not shape.tied:
        types["output.weight"] = "Q6_K" if fmt == "q4_k_m" else base
    for i in range(shape.layers):
        for name in shape.linears():
            more = fmt == "q4_k_m" and name in ("attn_v", "ffn_down") and _use_more_bits(i, shape.layers)
            types[f"blk.{i}.{name}.weight"] = "Q6_K" if more else base
    return types


# ---------------------------------------------------------------- writers

def _tokenizer_fields(tokenizer_gguf: Path) -> tuple[dict, int]:
    """The tokenizer.* key/values of a GGUF file (SmolLM2's), and its vocabulary size."""
    from lmserve.model.checkpoints.gguf_reader import read_directory
    import mmap

    with open(tokenizer_gguf, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        meta, _ = read_directory(buf)
    fields = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    return fields, len(fields["tokenizer.ggml.tokens"])


def _add_fields(writer, fields: dict) -> None:
    for key, value in fields.items():
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_float32(key, float(value))


def write_tokenizer_gguf(tokenizer_gguf: Path, path: Path) -> Path:
    """A GGUF holding only the tokenizer.* fields of `tokenizer_gguf` (no tensors): ~2 MB for SmolLM2's,
    where the model file is ~100 MB. Every writer here takes it as `tokenizer_gguf`, so a machine that cannot
    pull SmolLM2 (an offline GPU host) writes the shapes from this file alone."""
    import gguf

    fields, _ = _tokenizer_fields(tokenizer_gguf)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tokenizer only")
    _add_fields(writer, fields)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path


def write_gguf(shape: Shape, fmt: str, path: Path, tokenizer_gguf: Path, seed: int = 0) -> Path:
    """A `fmt` GGUF of `shape` with random blocks, written one tensor at a time."""
    import gguf

    fields, vocab = _tokenizer_fields(tokenizer_gguf)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"{shape.name} (random weights)")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type({"q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
                          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[fmt])
    _add_fields(writer, fields)
    types = tensor_types(shape, fmt)
    dims = {"token_embd.weight": (vocab, shape.hidden), "output.weight": (vocab, shape.hidden)}
    dims |= {f"blk.{i}.{n}.weight": rc for i in range(shape.layers) for n, rc in shape.linears().items()}
    norms = ["output_norm.weight"] + [f"blk.{i}.{n}.weight" for i in range(shape.layers) for n in ("attn_norm", "ffn_norm")]
    plan = [(name, types[name]) for name in types] + [(name, "F32") for name in norms]
    for name, qtype in plan:  # the directory first; the data follows in the same order
        rows, cols = dims.get(name, (1, shape.hidden))
        raw_type = gguf.GGMLQuantizationType[qtype]
        block, size = gguf.GGML_QUANT_SIZES[raw_type]
        nbytes = rows * cols // block * size
        if qtype == "F32":
            writer.add_tensor_info(name, (cols,), np.dtype(np.float32), nbytes)
        else:  # the shape in bytes per row, as the writer takes raw blocks
            writer.add_tensor_info(name, (rows, cols // block * size), np.dtype(np.uint8), nbytes, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, qtype in plan:
        rows, cols = dims.get(name, (1, shape.hidden))
        data = (np.ones(cols, np.float32) if qtype == "F32" else random_blocks(qtype, rows, cols, rng))
        writer.write_tensor_data(data)
    writer.close()
    return path


def write_hf_dir(shape: Shape, fmt: str, out: Path, tokenizer_gguf: Path, seed: int = 0,
                 shard_bytes: int = 2 << 30) -> Path:
    """A Hugging Face directory of `shape` with random `fmt` (bf16/f16) weights, one shard at a time."""
    import torch
    from safetensors.torch import save_file

    from lmserve.model.text.tokenizer import Tokenizer

    fields, vocab = _tokenizer_fields(tokenizer_gguf)
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[fmt]
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    names: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, shape.hidden), "model.norm.weight": (shape.hidden,)}
    hf = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for i in range(shape.layers):
        for n, rc in shape.linears().items():
            names[f"model.layers.{i}.{hf[n]}.weight"] = rc
        names[f"model.layers.{i}.input_layernorm.weight"] = (shape.hidden,)
        names[f"model.layers.{i}.post_attention_layernorm.weight"] = (shape.hidden,)
    if not shape.tied:
        names["lm_head.weight"] = (vocab, shape.hidden)
    shards, current, size = [], {}, 0
    for name, dims in names.items():
        t = torch.ones(dims, dtype=dtype) if len(dims) == 1 else (torch.randn(dims, generator=g) * SIGMA).to(dtype)
        current[name] = t
        size += t.numel() * t.element_size()
        if size >= shard_bytes:
            shards.append(current)
            current, size = {}, 0
    if current:
        shards.append(current)
    weight_map = {}
    for k, shard in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map |= {name: file for name in shard}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    tok = Tokenizer.from_gguf_fields(fields)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
              "hidden_size": shape.hidden, "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
              "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim, "intermediate_size": shape.ffn,
              "rope_theta": shape.rope_theta, "rms_norm_eps": 1e-5, "tie_word_embeddings": shape.tied,
              "max_position_embeddings": shape.context, "bos_token_id": tok.bos_id, "eos_token_id": list(tok.eos_ids),
              "hidden_act": "silu", "torch_dtype": {"bf16": "bfloat16", "f16": "float16"}[fmt]}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tok.save_pretrained(out)
    return out


def write(shape_name: str, fmt: str, out_dir: Path, tokenizer_gguf: Path, seed: int = 0) -> Path:
    """The checkpoint `shape_name` in `fmt` under `out_dir` (reused when it exists)."""
    shape = SHAPES[shape_name]
    out_dir.mkdir(parents=True, exist_ok=True)
    if fmt in GGUF_FORMATS:
        path = out_dir / f"{shape.name}-random.{fmt}.gguf"
        if not path.is_file():
            tmp = path.with_suffix(".part")
            write_gguf(shape, fmt, tmp, tokenizer_gguf, seed)
            tmp.replace(path)
        return path
    if fmt in HF_FORMATS:
        path = out_dir / f"{shape.name}-random-{fmt}"
        if not (path / "config.json").is_file():
            write_hf_dir(shape, fmt, path, tokenizer_gguf, seed)
        return path
    raise ValueError(f"unknown format {fmt!r}: expected one of {GGUF_FORMATS + HF_FORMATS}")


def main(argv: list[str] | None = None) -> int:
    from lmserve.model.checkpoints.catalog import default_models_dir, pull

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("format", choices=GGUF_FORMATS + HF_FORMATS)
    p.add_argument("--out", type=Path, default=Path(".cache/shapes"), help="directory to write into (default .cache/shapes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--models-dir", type=Path, default=None, help="where SmolLM2 (the tokenizer's source) is pulled")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="a GGUF whose tokenizer the checkpoint takes (write_tokenizer_gguf's; default: SmolLM2, pulled)")
    args = p.parse_args(argv)
    tokenizer_gguf = args.tokenizer or pull("smollm2", args.models_dir or default_models_dir(), progress=False)
    print(write(args.shape, args.format, args.out, tokenizer_gguf, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
