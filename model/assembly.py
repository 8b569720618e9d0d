"""A checkpoint's tensor sources turned into modules, one tensor (or one fused role) at a time.

`build_model` makes the serving model of a plan: the network is made on the meta device, the small
tensors (norms, biases) and the embedding are read into it, and each linear role (q|k|v, o, gate|up,
down, head) is built straight from its sources into its kernel's layout, the file's pages handed back
after each. No float32 copy of the model exists at any point; a role served from the file's own
blocks reads no floats at all.

`CheckpointModes` is what the precision probe (tuning/precision.py) measures a checkpoint through,
without ever holding a whole model in a candidate mode: the first layers' weights to time kernels on,
a plan's model with its first layers only (batch invariance is a property of each kernel at the
model's real shapes), and a plan's logits on the held-out text computed one decoder layer at a time.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import torch
from torch import Tensor, nn

from .attention.sdpa import AttentionMetadata
from .checkpoints.layout import expected_shapes, split_fused
from .checkpoints.sources import TensorSource
from .config import ModelConfig
from .errors import ModelLoadError, ShapeMismatchError
from .linear import embedding as quantized_embedding
from .linear import kernels as K
from .linear import quant_matmul as QM
from .linear.embedding import QuantizedEmbedding
from .linear.formats import KQUANT_TYPES, KQuantBlocks, Q80Blocks
from .linear.serving import fuse_linears, planned_linears
from .llama import DecoderLayer, LlamaForCausalLM

HEAD_ROWS = 8192  # vocabulary rows of the head built at a time when logits are streamed


def layer_shapes(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """expected_shapes of decoder layer i alone (every layer's tensors have the same shapes)."""
    return {n.replace("model.layers.0.", f"model.layers.{i}.", 1): s
            for n, s in expected_shapes(_first_layers(cfg, 1)).items() if n.startswith("model.layers.0.")}


def _first_layers(cfg: ModelConfig, n: int) -> ModelConfig:
    """The config of the model cut to its first n decoder layers."""
    n = min(n, cfg.num_layers)
    return dataclasses.replace(cfg, num_layers=n, layer_windows=cfg.layer_windows[:n])


def as_sources(cfg: ModelConfig, weights: Mapping[str, Tensor | TensorSource], q41: dict | None = None,
               q80: dict | None = None) -> dict[str, TensorSource]:
    """Tensors in memory (with their GGUF blocks by name, if any) or sources, all as sources."""
    blocks = {**(q41 or {}), **(q80 or {})}
    sources = {n: w if isinstance(w, TensorSource) else TensorSource.of(n, w, blocks.get(n)) for n, w in weights.items()}
    return split_fused(cfg, sources)  # Phi-3's q|k|v and gate|up: the decoder fuses its own again


def check_shapes(cfg: ModelConfig, sources: Mapping[str, TensorSource]) -> dict[str, tuple[int, ...]]:
    shapes = expected_shapes(cfg)
    missing = [n for n in shapes if n not in sources]
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensor(s), first: {missing[0]!r}")
    for name, shape in shapes.items():
        if tuple(sources[name].shape) != shape:
            raise ShapeMismatchError(name, shape, tuple(sources[name].shape))
    return shapes


PART_ELEMENTS = 1 << 23  # float32 elements a weight is read in at most (32 MB), row slice by row slice


def row_slices(src: TensorSource) -> tuple:
    """Readers of a 2-D source's rows in slices of about PART_ELEMENTS (one reader: the whole tensor), so
    that quantizing a large weight (a head) holds one slice's floats at a time: float32, or bfloat16 where
    the file stores bfloat16 (no float32 copy to quantize it: the same values)."""
    rows, cols = src.shape
    step = max(1, PART_ELEMENTS // cols)
    dtype = torch.bfloat16 if src.stored_as == "BF16" else torch.float32  # as stored: the quantizers take bfloat16
    if rows <= step:
        return (lambda: src.read(dtype),)
    return tuple((lambda r0=r0: src.rows(torch.arange(r0, min(rows, r0 + step)), dtype)) for r0 in range(0, rows, step))


class _Sourced:
    """source_of for serving.planned_linears: a linear's WeightSource from the checkpoint by the
    linear's name in the module tree (its floats read only when a kernel needs them), and a record
    of the sources read, handed back once the role is built."""

    def __init__(self, root: nn.Module, sources: Mapping[str, TensorSource], tied: bool, prefix: str = ""):
        self.names = {id(m): prefix + n for n, m in root.named_modules()}
        self.sources, self.tied = sources, tied
        self.used: list[TensorSource] = []

    def __call__(self, linear: nn.Linear) -> K.WeightSource:
        name = self.names[id(linear)]
        if name == "lm_head" and self.tied:
            name = "model.embed_tokens"
        src = self.sources[name + ".weight"]
        self.used.append(src)
        bias = linear.bias.detach() if linear.bias is not None and not linear.bias.is_meta else None
        return K.WeightSource.of(None, bias, src.blocks(), parts=row_slices(src), shape=tuple(src.shape))

    def releasing(self, make, device: torch.device | str = "cpu"):
        """`make` that puts each role's module on `device` (the file is read into host memory) and hands
        back the pages of the sources the role read."""
        def built(role: str, *layers: nn.Linear) -> nn.Module:
            module = make(role, *layers).to(device)
            for src in self.used:
                src.release()
            self.used.clear()
            return module
        return built


def _linear_weights(shapes: Mapping[str, tuple]) -> set[str]:
    return {n for n, s in shapes.items() if len(s) == 2 and n != "model.embed_tokens.weight"}


EMBEDDING = "model.embed_tokens.weight"


def _embedding_blocks(sources: Mapping[str, TensorSource], dtype: torch.dtype, device) -> KQuantBlocks | Q80Blocks | None:
    """The embedding's own blocks when the model serves it from them (K-quants, Q8_0 and Q5_0): bfloat16
    on CPU with the native library loaded (the rows it decodes are what a bfloat16 read of the file gives,
    bitwise)."""
    src = sources[EMBEDDING]
    if (dtype != torch.bfloat16 or torch.device(device).type != "cpu"
            or src.stored_as not in (*KQUANT_TYPES.values(), "Q8_0", "Q5_0") or not quantized_embedding.available()):
        return None  # (another type's blocks are not even read)
    blocks = src.blocks()
    return blocks if isinstance(blocks, (KQuantBlocks, Q80Blocks)) else None


def build_model(cfg: ModelConfig, weights: Mapping[str, Tensor | TensorSource], dtype: torch.dtype,
                device: torch.device | str, prepare: bool = True, plan=None, q41: dict | None = None,
                q80: dict | None = None, fused_ops=None, native_lib=None) -> LlamaForCausalLM:
    """Check names and shapes against the config, then build the model (no random init).

    weights: tensors or sources by Hugging Face name (q41 / q80: GGUF Q4_0-Q4_1 / Q8_0 blocks of
    in-memory tensors, by name). prepare: fuse the linear layers and build them for serving
    (LlamaForCausalLM.prepare_for_inference): with a plan (tuning.precision.Plan), each role on its
    planned kernel straight from its sources, one role at a time; without, the default kernel for
    dtype from the materialized weights. fused_ops, native_lib: the fused elementwise ops and the
    library for steps in one native call (loader.native_parts); None: the torch ops, eager layers.
    """
    sources = as_sources(cfg, weights, q41, q80)
    shapes = check_shapes(cfg, sources)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, fused_ops)
    streamed = prepare and plan is not None
    # a streamed build reads the linears role by role below; everything else is read now, in dtype
    eager = [n for n in shapes if not (streamed and n in _linear_weights(shapes))]
    table = _embedding_blocks(sources, dtype, device) if streamed else None
    if table is not None:  # rows decoded from the file's blocks when looked up (linear/embedding.py)
        eager.remove(EMBEDDING)
        model.model.embed_tokens = QuantizedEmbedding(table)
        sources[EMBEDDING].release()
    state = {n: sources[n].read(dtype).to(device) for n in eager}
    model.load_state_dict(state, strict=False, assign=True)
    for n in eager:
        sources[n].release()
    if cfg.tie_word_embeddings and not streamed:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.eval().requires_grad_(False)
    if streamed:
        sourced = _Sourced(model, sources, cfg.tie_word_embeddings)
        model.prepare_for_inference(sourced.releasing(planned_linears(plan.kernels, dtype, sourced), device), native_lib)
    elif prepare:
        model.prepare_for_inference(fuse_linears, native_lib)
    model.model.rotary.build(device, dtype)
    return model


def build_layer(cfg: ModelConfig, sources: Mapping[str, TensorSource], i: int, plan, dtype: torch.dtype) -> DecoderLayer:
    """Decoder layer i of a plan's model, alone (for a forward streamed one layer at a time)."""
    with torch.device("meta"):
        layer = DecoderLayer(cfg, i)
    prefix = f"model.layers.{i}."
    small = {n.removeprefix(prefix): sources[n].read(dtype) for n, s in layer_shapes(cfg, i).items() if len(s) == 1}
    layer.load_state_dict(small, strict=False, assign=True)
    layer.eval().requires_grad_(False)
    sourced = _Sourced(layer, sources, False, prefix)
    make = sourced.releasing(planned_linears(plan.kernels, dtype, sourced))
    with torch.no_grad():
        layer.self_attn.fuse_projections(make)
        layer.mlp.fuse_projections(make)
    return layer


def _released(src: TensorSource, index: Tensor | None):
    """A reader of the source's float32 weight (or of its rows in `index`) that hands the file's pages
    back after each read."""
    def read() -> Tensor:
        w = src.read() if index is None else src.rows(index)
        src.release()
        return w
    return read


class _RoleSamples(Mapping):
    """role -> its timed weights (the file's blocks, and readers of the float32 weights that a kernel
    reads when it needs floats: a mode served from the blocks reads none), made on first access;
    making a role drops the one made before."""

    ROLE_NAMES = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
                  "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}

    def __init__(self, sources: Mapping[str, TensorSource], cfg: ModelConfig, layers: int, head_rows: int):
        self.sources, self.cfg, self.layers, self.head_rows = sources, cfg, layers, head_rows
        self._last: tuple[str, list] | None = None

    def __iter__(self):
        return iter(K.ROLES)

    def __len__(self) -> int:
        return len(K.ROLES)

    def __getitem__(self, role: str) -> list[K.WeightSource]:
        if self._last is None or self._last[0] != role:
            self._last = None  # drop the previous role's floats before reading this one's
            self._last = (role, self._read(role))
        return self._last[1]

    def _held(self, names: list[str], rows: int | None = None) -> K.WeightSource:
        parts = []
        for name in names:
            s = self.sources[name]
            index = None if rows is None else torch.arange(rows)
            blocks = s.blocks()
            if blocks is not None and index is not None:
                blocks = blocks.rows(index)
            s.release()
            bias = self.sources.get(name.replace(".weight", ".bias"))
            shape = (s.shape[0] if rows is None else rows, s.shape[1])
            parts.append(K.WeightSource.of(None, None if bias is None else bias.read(), blocks,
                                           parts=(_released(s, index),), shape=shape))
        return K.WeightSource.cat(parts)

    def _read(self, role: str) -> list[K.WeightSource]:
        if role == "head":
            head = "model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"
            return [self._held([head], self.head_rows if self.head_rows < self.cfg.vocab_size else None)]
        return [self._held([f"model.layers.{i}.{m}.weight" for m in self.ROLE_NAMES[role]]) for i in range(self.layers)]


class CheckpointModes:
    """A checkpoint as the precision probe measures it (tuning.precision.ModeBuilder)."""

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, Tensor | TensorSource], q41: dict | None = None,
                 q80: dict | None = None):
        self.config = cfg
        self.sources = as_sources(cfg, weights, q41, q80)
        check_shapes(cfg, self.sources)

    def stored_types(self) -> dict[str, str]:
        """Each decoder layer's linear weight as the file names it, with the type it is stored in
        ("blk.1.ffn_up.weight": "F32"; a safetensors file's tensors by their Hugging Face names)."""
        linears = _linear_weights(expected_shapes(self.config)) - {"lm_head.weight"}
        return {self.sources[n].meta.get("gguf_name", n): self.sources[n].stored_as for n in sorted(linears)}

    def stored_size(self) -> tuple[int, int]:
        """(the checkpoint's tensor bytes as the file stores them, their weights): what a mode's size is
        weighed against (precision.memory_candidates)."""
        return (sum(s.nbytes for s in self.sources.values()),
                sum(math.prod(s.shape) for s in self.sources.values()))

    def timing_sources(self, max_bytes: int) -> tuple[Mapping[str, list[K.WeightSource]], dict[str, float]]:
        """Float32 weights (and the file's blocks) of each role for the first layers, about max_bytes of
        them (at least two layers), and of up to max_bytes of the head's rows, each role read when asked
        for and dropped when the next is (one role's floats held at a time); and for each role the factor
        from the timed weights to the whole model's (layers, or vocabulary rows for the head)."""
        cfg = self.config
        per_layer = sum(4 * s[0] * s[1] for n, s in layer_shapes(cfg, 0).items() if len(s) == 2)
        n = min(cfg.num_layers, max(2, -(-max_bytes // per_layer)))
        rows = min(cfg.vocab_size, max(1024, max_bytes // (4 * cfg.hidden_size)))
        if rows < cfg.vocab_size:  # a multiple of the native kernels' column group, or they cannot be timed
            rows -= rows % QM.GROUP_COLS
        scale = {r: cfg.num_layers / n for r in ("qkv", "o", "gate_up", "down")} | {"head": cfg.vocab_size / rows}
        return _RoleSamples(self.sources, cfg, n, rows), scale

    def model(self, plan, layers: int | None = None, device: torch.device | str = "cpu") -> LlamaForCausalLM:
        """The plan's model, with only its first `layers` decoder layers when given."""
        cfg = self.config if layers is None else _first_layers(self.config, layers)
        return build_model(cfg, self.sources, plan.mode.dtype, device, plan=plan)

    @torch.no_grad()
    def logits(self, plan, ids: list[int], window: int = 512) -> Tensor:
        """quality.logits_of of the plan's model, streamed: each window of the text is scored on its
        own, one decoder layer built at a time and the head a slice of rows at a time. [T, V] float32."""
        cfg, src, dtype = self.config, self.sources, plan.mode.dtype
        with torch.device("meta"):
            shell = LlamaForCausalLM(_first_layers(cfg, 1)).model  # its final norm, RoPE tables and embedding scale
        shell.norm.load_state_dict({"weight": src["model.norm.weight"].read(dtype)}, assign=True)
        shell.rotary.build("cpu", dtype)
        embed = src["model.embed_tokens.weight"]
        windows = [torch.tensor(ids[s:s + window]) for s in range(0, len(ids), window)]
        xs = [shell.scale_embeddings(embed.rows(w, dtype))[None] for w in windows]  # [1, L, D] each
        embed.release()
        ropes = [shell.rotary.all_tables(torch.arange(len(w))[None]) for w in windows]
        metas = [AttentionMetadata.fresh(torch.tensor([len(w)])) for w in windows]
        for i in range(cfg.num_layers):
            layer = build_layer(cfg, src, i, plan, dtype)
            xs = [layer(x, rope[layer.rope_kind], meta, None) for x, rope, meta in zip(xs, ropes, metas)]
            del layer
        h = torch.cat([shell.norm(x[0]) for x in xs])  # [T, D]
        head = src["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
        blocks = head.blocks()
        out = torch.empty(h.shape[0], cfg.vocab_size)
        for r0 in range(0, cfg.vocab_size, HEAD_ROWS):
            index = torch.arange(r0, min(cfg.vocab_size, r0 + HEAD_ROWS))
            part = blocks.rows(index) if blocks is not None else None
            ws = K.WeightSource.of(head.rows(index), None, part)
            out[:, r0:r0 + len(index)] = K.build(plan.kernels["head"], ws, dtype)(h).float()
        head.release()
        return out


__all__ = ["build_model", "build_layer", "expected_shapes", "layer_shapes", "as_sources", "CheckpointModes", "HEAD_ROWS"]
