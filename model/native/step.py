"""A serving step's decoder layers in one native call (native_step.cpp, built by native/build.py).

At batch 1 on a 2-core CPU the eager layers spent ~9 ms of a ~25 ms decode step outside their
kernels: ~1,700 torch ops and ~270 ctypes calls dispatched from Python (the per-op profile of
server/bench/step_profile.py), and every prefill chunk paid the same. When every linear runs on the
native quantized kernel, attention on the native decode and prompt kernels and the elementwise work
on the fused ops, `NativeStep` calls those same kernels from one C++ loop instead, with the same
arguments in the same order: its rows are bitwise the eager step's (tests/unit/test_native_step.py),
batch-invariant for the same reasons.

It computes each layer from a description (`_describe`): its norms by role (Gemma 3's sandwich norms
around attention and the MLP too), q/k norms (Qwen3, Gemma 3), window and RoPE table (Gemma 3's
sliding layers have their own base), with the model's norm style (w or 1 + w), activation (SiLU or
GELU-tanh) and embedding scale, so every family ModelConfig describes runs in it (a linear with a
bias aside: Qwen2).

It takes the steps the native attention backend lays out: decode rows (`KernelDecode`, a verified
draft's rows included), prompt chunks and packed new prompts (`KernelPrompt`), and steps mixing them.
Steps on SDPA (no prompt kernel below AVX2, another device) keep the eager layers.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from ..attention.backend import KernelDecode, KernelPrompt
from ..attention.decode import scale_pointers
from ..linear import fused_ops
from ..linear.kernels import NativeQuantLinear
from ..kv_cache import KVCache


class _Linear(ctypes.Structure):
    _fields_ = [("packed", ctypes.c_void_p), ("bits", ctypes.c_int32), ("precise", ctypes.c_int32)]


class _Lora(ctypes.Structure):  # native_step.cpp's StepLora: one fused linear's adapters (LoraSlots)
    _fields_ = [("A", ctypes.c_void_p), ("B", ctypes.c_void_p * 3), ("scaling", ctypes.c_void_p * 3),
                ("lo", ctypes.c_int32 * 3), ("out", ctypes.c_int32 * 3), ("M", ctypes.c_int32), ("R", ctypes.c_int32)]


class _Layer(ctypes.Structure):  # native_step.cpp's StepLayer: one layer's description
    _fields_ = [("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("input_norm", ctypes.c_void_p), ("attn_out_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p),
                ("mlp_out_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("k_scales", ctypes.c_void_p), ("v_scales", ctypes.c_void_p), ("window", ctypes.c_int64),
                ("rope", ctypes.c_int64), ("lora", _Lora * 4)]


class _Ends(ctypes.Structure):
    _fields_ = [("embed", ctypes.c_void_p), ("vocab", ctypes.c_int64), ("embed_type", ctypes.c_int64),
                ("embed_row_bytes", ctypes.c_int64), ("embed_scale", ctypes.c_float), ("tables", ctypes.c_int32),
                ("cos", ctypes.c_void_p * 2), ("sin_signed", ctypes.c_void_p * 2), ("table_len", ctypes.c_int64),
                ("final_norm", ctypes.c_void_p)]


class _Shape(ctypes.Structure):
    _fields_ = [("layers", ctypes.c_int32), ("D", ctypes.c_int32), ("H", ctypes.c_int32), ("Hkv", ctypes.c_int32),
                ("d", ctypes.c_int32), ("I", ctypes.c_int32), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("norm_style", ctypes.c_int32), ("act", ctypes.c_int32),
                ("num_slots", ctypes.c_int64), ("max_len", ctypes.c_int64)]


def _linear(m) -> _Linear:
    return _Linear(m.packed.data_ptr(), m.bits, int(m.precise))


def _ptr(norm) -> int | None:
    """A norm's weight, or null where the layer has no such norm."""
    return None if norm is None else norm.weight.data_ptr()


def _loras(slots, i: int) -> list[_Lora]:
    """Layer i's adapters by fused linear (qkv, o, gate_up, down), from linear/lora.LoraSlots; empty (no
    adapters) where none is attached."""
    if slots is None:
        return [_Lora() for _ in LAYER_ROLES]
    from ..linear.lora import ROLE_TARGETS

    out = []
    for role in LAYER_ROLES:
        modules = ROLE_TARGETS[role]
        three = lambda v: v + [0] * (3 - len(v))  # noqa: E731
        out.append(_Lora(slots.A[(i, role)].data_ptr(),
                         (ctypes.c_void_p * 3)(*three([slots.B[(i, m)].data_ptr() for m in modules])),
                         (ctypes.c_void_p * 3)(*three([slots.scaling[(i, m)].data_ptr() for m in modules])),
                         (ctypes.c_int32 * 3)(*three([slots.slices[m][0] for m in modules])),
                         (ctypes.c_int32 * 3)(*three([slots.slices[m][1] - slots.slices[m][0] for m in modules])),
                         len(modules), slots.max_rank))
    return out


def _describe(layer, cache: KVCache, i: int, lora=None) -> _Layer:
    """Decoder layer i (llama.DecoderLayer) as the loop reads it: its linears, its norms by role (a
    sandwich layer's attention and MLP outputs normed too), q/k norms, window and RoPE table, and its
    slice of the cache."""
    a, m = layer.self_attn, layer.mlp
    if layer.sandwich:
        attn_out, mlp_in, mlp_out = (layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                                     layer.post_feedforward_layernorm)
    else:
        attn_out, mlp_in, mlp_out = None, layer.post_attention_layernorm, None
    return _Layer(_linear(a.qkv_proj), _linear(a.o_proj), _linear(m.gate_up_proj), _linear(m.down_proj),
                  _ptr(layer.input_layernorm), _ptr(attn_out), _ptr(mlp_in), _ptr(mlp_out), _ptr(a.q_norm),
                  _ptr(a.k_norm), cache.k[i].data_ptr(), cache.v[i].data_ptr(),
                  *scale_pointers(cache.k, *cache.scale_views(i)), a.window, layer.rope_kind,
                  (_Lora * 4)(*_loras(lora, i)))


LAYER_ROLES = ("qkv", "o", "gate_up", "down")


def possible(cfg, dtype: torch.dtype, quantization: str, device: torch.device) -> bool:
    """Whether a model in this mode can serve steps through the native loop, its layers' linears
    on the native quantized kernel: then those roles are served on it (precision.measure_mode), since
    a per-role timing cannot see the ~9 ms a batch-1 step saves in dispatch."""
    from ..linear import quant_matmul as QM
    from ..attention.decode import DecodeAttention

    return (device.type == "cpu" and dtype == torch.bfloat16 and quantization in ("int8", "int4", "kquant")
            and not (cfg.attention_bias or cfg.o_proj_bias) and QM.default_kernel() is not None
            and fused_ops.supports(cfg.hidden_size, cfg.head_dim, cfg.intermediate_size)
            and DecodeAttention.supports(dtype, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads))


def _embedding_table(embed) -> tuple[Tensor, int]:
    """(the table the step reads rows of, its GGML type or 0 for bfloat16 rows): an nn.Embedding's weight,
    or a quantized embedding's file blocks (linear/embedding.py)."""
    return (embed.raw, embed.ggml_type) if hasattr(embed, "ggml_type") else (embed.weight, 0)


def why_not(model) -> str | None:
    """Why the model's steps cannot take the native loop, or None when they can."""
    if not model.prepared or not model.uses_fused_ops:
        return "the elementwise ops are not fused (float32, or no native library)"
    if _embedding_table(model.model.embed_tokens)[0].dtype not in (torch.bfloat16, torch.uint8):
        return "activations are not bfloat16"
    for layer in model.model.layers:
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            if not isinstance(m, NativeQuantLinear):
                return f"a layer's linear runs on {getattr(m, 'kernel', type(m).__name__)}, not the native quantized kernel"
            if m.bias is not None:
                return "a linear has a bias"
    return None


class NativeStep:
    """`__call__(x, ropes, segments, cache)`: every layer of a step, x [..., D] in place."""

    PHASES = ("linears", "attention", "other")

    def __init__(self, lib: ctypes.CDLL, model):
        cfg = model.config
        self._fn = lib.lm_step_layers
        p, i32 = ctypes.c_void_p, ctypes.c_int
        self._fn.argtypes = [p, p, p, p, p, p, p, i32, i32, i32, i32, p, p]
        self._fn.restype = i32
        self._model_fn = lib.lm_step_model
        self._model_fn.argtypes = [p, p, p, p, p, p, p, i32, i32, i32, p, i32, p, i32, p, p]
        self._model_fn.restype = i32
        self.model = model
        self.n_layers = cfg.num_layers
        self.head_dim = cfg.head_dim
        self._layers = None  # (cache, ctypes array): rebuilt when another cache is passed
        self._shape = None
        self.phase_ns = None  # (c_int64 * 3): linears, attention, the rest, summed over calls (time_phases)

    def time_phases(self, on: bool) -> None:
        """Start (from zero) or stop summing each call's time per phase inside the loop (phase_seconds)."""
        self.phase_ns = (ctypes.c_int64 * 3)() if on else None

    def phase_seconds(self) -> dict[str, float]:
        return {k: (self.phase_ns[i] if self.phase_ns is not None else 0) / 1e9 for i, k in enumerate(self.PHASES)}

    @staticmethod
    def applies(segments, cache: KVCache | None) -> bool:
        """Whether the loop takes these segments (llama.Segment: ids, positions, meta): prompt
        segments on the prompt kernel, every token real (no padding rows), then at most one decode
        segment on the decode kernel, last."""
        if cache is None or cache.k.dtype not in (torch.bfloat16, torch.int8) or not segments:
            return False

        def dense_prompt(s) -> bool:
            return isinstance(s.meta, KernelPrompt) and s.meta.write_slot.shape[0] == s.input_ids.numel()

        *first, last = segments
        return all(map(dense_prompt, first)) and (isinstance(last.meta, KernelDecode) or dense_prompt(last))

    def _tables(self, cache: KVCache):
        lora = self.model.lora
        if self._layers is None or self._layers[0] is not cache or self._layers[2] is not lora:
            layers = self.model.model.layers
            arr = (_Layer * self.n_layers)(*(_describe(layer, cache, i, lora) for i, layer in enumerate(layers)))
            cfg = self.model.config
            self._shape = _Shape(cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, self.head_dim,
                                 cfg.intermediate_size, cfg.rms_norm_eps, cfg.attention_scale,
                                 fused_ops.NORM_STYLES[cfg.norm_style], fused_ops.ACTIVATIONS[cfg.hidden_act],
                                 cache.num_slots, cache.max_len)
            self._ends = self._model_ends()
            self._layers = (cache, arr, lora)
        return self._layers[1]

    def _model_ends(self) -> _Ends:
        inner = self.model.model
        (table, ggml_type), rotary = _embedding_table(inner.embed_tokens), inner.rotary
        tables = [(rotary.cos, rotary.sin_signed)]
        if self.model.config.rope_local_theta is not None:  # the sliding layers' own (DecoderLayer.rope_kind 1)
            tables.append((rotary.cos_local, rotary.sin_local))
        # the factor as the eager embedding multiplies by it: a bfloat16 value (LlamaModel.scale_embeddings)
        scale = float(torch.tensor(inner.embed_scale, dtype=torch.float32).to(torch.bfloat16))
        return _Ends(table.data_ptr(), table.shape[0], ggml_type, table.stride(0) * table.element_size(), scale,
                     len(tables), (ctypes.c_void_p * 2)(*(c.data_ptr() for c, _ in tables)),
                     (ctypes.c_void_p * 2)(*(s.data_ptr() for _, s in tables)), min(c.shape[0] for c, _ in tables),
                     inner.norm.weight.data_ptr())

    @staticmethod
    def _layout(segments):
        """(slots, positions, N, P, write_first) of the tokens: the prompt segments' first, then the decode rows."""
        metas = [s.meta for s in segments]
        decode = metas.pop() if isinstance(metas[-1], KernelDecode) else None  # metas: the prompt segments'
        slots = torch.cat([m.write_slot for m in metas] + ([decode.slots] if decode is not None else []))
        pos = torch.cat([m.write_pos for m in metas] + ([decode.starts] if decode is not None else []))
        P = sum(m.write_slot.shape[0] for m in metas)
        return slots, pos, slots.shape[0], P, int(decode is not None and decode.write_first)

    def _check(self, rc: int, cache: KVCache) -> None:
        if rc == 2:
            raise IndexError(f"native step: a token's slot or position lies outside the cache "
                             f"({cache.num_slots} slots x {cache.max_len} positions)")
        if rc == 3:
            raise IndexError("native step: a token id, a position or an output row is out of range")
        if rc:
            raise ValueError("native step: a kernel does not take this model's shapes")

    @staticmethod
    def _rows(lora) -> int | None:
        """The step's per-token adapter slots (linear/lora.LoraStep.row_slots), or null: no adapter rows."""
        return None if lora is None else lora.row_slots.data_ptr()

    def __call__(self, x: Tensor, ropes, segments, cache: KVCache, lora=None) -> Tensor:
        """x [..., D] bfloat16: the segments' tokens back to back (row-major within each) -> the last
        layer's output, same shape. ropes: ((cos, sin_signed) [..., 1, d] per token) of each table
        (Rotary.all_tables)."""
        layers = self._tables(cache)
        d = self.head_dim
        x = x.contiguous()
        cos = torch.stack([c.reshape(-1, d) for c, _ in ropes])  # [tables, N, d]
        sin_signed = torch.stack([s.reshape(-1, d) for _, s in ropes])
        slots, pos, N, P, write_first = self._layout(segments)
        if x.numel() != N * self._shape.D or cos.shape[1] != N:
            raise ValueError(f"native step: {N} tokens laid out but {x.numel() // self._shape.D} given")
        self._check(self._fn(ctypes.addressof(layers), ctypes.addressof(self._shape), x.data_ptr(), cos.data_ptr(),
                             sin_signed.data_ptr(), slots.data_ptr(), pos.data_ptr(), N, P, write_first,
                             torch.get_num_threads(), self.phase_ns, self._rows(lora)), cache)
        return x

    def head_input(self, ids: Tensor, positions: Tensor, segments, cache: KVCache, rows: Tensor, lora=None) -> Tensor:
        """The whole step up to the LM head in one call: ids, positions [N] (the segments' tokens back
        to back) -> the final norm of the last layer's output at flat indices `rows` [n]: [n, D].
        Bitwise what embedding, __call__, indexing and the model's final norm give one by one."""
        layers = self._tables(cache)
        slots, pos, N, P, write_first = self._layout(segments)
        if ids.numel() != N or positions.numel() != N:
            raise ValueError(f"native step: {N} tokens laid out but {ids.numel()} given")
        ids, positions, rows = (t.reshape(-1).to(torch.int64).contiguous() for t in (ids, positions, rows))
        out = torch.empty(rows.shape[0], self._shape.D, dtype=torch.bfloat16)
        self._check(self._model_fn(ctypes.addressof(layers), ctypes.addressof(self._shape), ctypes.addressof(self._ends),
                                   ids.data_ptr(), positions.data_ptr(), slots.data_ptr(), pos.data_ptr(), N, P,
                                   write_first, rows.data_ptr(), rows.shape[0], out.data_ptr(),
                                   torch.get_num_threads(), self.phase_ns, self._rows(lora)), cache)
        return out


__all__ = ["NativeStep", "LAYER_ROLES", "possible", "why_not"]
