"""The decoder (RMSNorm, RoPE, grouped-query attention, a gated MLP) on explicit inputs.

Parameter names follow Hugging Face's LlamaForCausalLM (and, for the layers other families add,
their own: q_norm / k_norm, pre_ / post_feedforward_layernorm), so HF safetensors load as-is and
the trainer's checkpoints are plain HF directories. What differs between families is a field of
ModelConfig (config.py), read here once per module: the norm style, sandwich norms, the MLP's
activation, q/k norms, each layer's sliding window and RoPE table, the embedding scale. One forward serves training, prefill
(many tokens per sequence) and decode (one token per sequence); what differs is the step
attention passed (attention/backend.py: the per-step metadata, which owns the cache write and the
kernel) and whether a KVCache is passed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention.backend import StepAttention
from .config import LongRopeScaling, ModelConfig, rope_inv_freq
from .linear.serving import fuse_linears, held_bytes
from .native import step as native_step
from .kv_cache import KVCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, gemma: bool = False, fused=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.gemma = gemma  # scaled by (1 + weight) in float32, then cast (config.norm_style "gemma")
        self.style = "gemma" if gemma else "llama"
        # linear/fused_ops.FusedOps: bfloat16 rows on CPU in one native pass
        self.fused = fused

    def forward(self, x: Tensor) -> Tensor:
        if self.fused is not None and self.fused.applies(x):
            return self.fused.add_rmsnorm(x, None, self.weight, self.eps, self.style)[1]
        # normalized in float32, cast back, then scaled (HF's order). Written out rather than
        # F.rms_norm, which is slower on CPU; in-place where the tensor is our own temporary.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True).add_(self.eps))
        if self.gemma:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)

    def add_norm(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(s, norm(s)) for s = residual + x: a residual add and the next norm, in one pass where fused."""
        if self.fused is not None and self.fused.applies(x):
            return self.fused.add_rmsnorm(x, residual, self.weight, self.eps, self.style)
        s = residual + x
        return s, self(s)


class Rotary(nn.Module):
    """cos/sin tables indexed by each token's explicit position (rotate-half convention).

    Rotate-half: x * cos + cat(-x2, x1) * sin. The minus sign lives in the table instead
    (`sin_signed` = cat(-sin1, sin2)), so a rotation is cat(x2, x1), a multiply and a multiply-add.

    Two tables where sliding layers have their own base (config.rope_local_theta): `cos`/`sin_signed`
    for the global layers, `cos_local`/`sin_local` for the sliding ones. LongRoPE: a token takes the
    long factors once the sequence is longer than original_max_position_embeddings, as transformers'
    generate does (a prompt longer than that is taken with the long factors whole; a shorter one's
    tokens switch at that position). The table then holds 2P rows: row p is position p by the
    position's own length, row P + p position p of a sequence whose prompt was already long; the
    engine picks a token's row (config.rope_row_offset); a plain forward passes positions as rows.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        s = cfg.rope_scaling
        self.long_after = s.original_max_position_embeddings if isinstance(s, LongRopeScaling) else None
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin_signed", torch.empty(0), persistent=False)
        self.register_buffer("cos_local", torch.empty(0), persistent=False)
        self.register_buffer("sin_local", torch.empty(0), persistent=False)

    def _table(self, device, dtype: torch.dtype, theta: float | None = None) -> tuple[Tensor, Tensor]:
        cfg, s = self.cfg, self.cfg.rope_scaling
        P = cfg.max_position_embeddings
        t = torch.arange(P, device=device, dtype=torch.float32)
        if theta is not None:  # the sliding layers' own base, unscaled
            freqs, gain = torch.outer(t, rope_inv_freq(cfg, theta, scaled=False).to(device)), 1.0  # [P, d/2]
        elif self.long_after is None:
            freqs, gain = torch.outer(t, rope_inv_freq(cfg).to(device)), 1.0
        else:
            short = torch.outer(t, rope_inv_freq(cfg).to(device))
            long = torch.outer(t, rope_inv_freq(cfg, long=True).to(device))
            by_position = torch.where((t < self.long_after)[:, None], short, long)
            freqs, gain = torch.cat([by_position, long]), s.attention_factor  # [2P, d/2]
        cos, sin = freqs.cos(), freqs.sin()
        if gain != 1.0:  # transformers scales cos and sin in float32 before the cast
            cos, sin = cos * gain, sin * gain
        return torch.cat([cos, cos], dim=-1).to(dtype), torch.cat([-sin, sin], dim=-1).to(dtype)  # [P, d]

    def build(self, device: torch.device | str, dtype: torch.dtype) -> None:
        self.cos, self.sin_signed = self._table(device, dtype)
        if self.cfg.rope_local_theta is not None:
            self.cos_local, self.sin_local = self._table(device, dtype, self.cfg.rope_local_theta)

    def tables(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin_signed [B, L, 1, d] for positions [B, L]; looked up once per forward, shared by all layers."""
        return self.cos[positions][:, :, None], self.sin_signed[positions][:, :, None]

    def all_tables(self, positions: Tensor) -> tuple[tuple[Tensor, Tensor], ...]:
        """tables(positions), then the sliding layers' own where they have one (index: config.rope_kind)."""
        if self.cfg.rope_local_theta is None:
            return (self.tables(positions),)
        return self.tables(positions), (self.cos_local[positions][:, :, None], self.sin_local[positions][:, :, None])

    @staticmethod
    def apply(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
        """x [B, L, heads, d] rotated by its tokens' positions."""
        x1, x2 = x.chunk(2, dim=-1)
        return torch.addcmul(x * cos, torch.cat([x2, x1], dim=-1), sin_signed)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, fused=None):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window = cfg.window(layer)  # 0: every earlier key; w: keys p - w + 1 .. p
        self.scale = cfg.query_scale  # None: 1 / sqrt(d)
        b = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.d, bias=b)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.d, bias=b)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.d, bias=b)
        self.o_proj = nn.Linear(self.n_heads * self.d, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.qkv_proj: nn.Module | None = None  # q|k|v in one GEMM, set by fuse_projections()
        self.q_norm = self.k_norm = None  # per-head RMSNorm before RoPE (config.qk_norm)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps, cfg.norm_style == "gemma")
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps, cfg.norm_style == "gemma")
        # linear/fused_ops.FusedOps: the q/k norms and RoPE of bfloat16 q|k on CPU in one native pass
        self.fused = fused
        self.lora = None  # linear/lora.LoraSlots: each row's adapter product added after the fused linears

    def fuse_projections(self, make=fuse_linears) -> None:
        self.qkv_proj = make("qkv", self.q_proj, self.k_proj, self.v_proj)
        self.o_proj = make("o", self.o_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def project(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """Rotated q [B, L, H, d], rotated k and v [B, L, Hkv, d]."""
        B, L, _ = x.shape
        H, Hkv, d = self.n_heads, self.n_kv, self.d
        if self.qkv_proj is None:
            q, k, v = self.q_proj(x).view(B, L, H, d), self.k_proj(x).view(B, L, Hkv, d), self.v_proj(x).view(B, L, Hkv, d)
        else:
            qkv = self.qkv_proj(x)
            if self.lora is not None:
                qkv = self.lora.add(self.layer, "qkv", x, qkv)
            qkv = qkv.view(B, L, H + 2 * Hkv, d)
            if self.fused is not None and self.fused.applies(qkv):  # q/k norms and RoPE in one pass
                norms = None if self.q_norm is None else (self.q_norm, self.k_norm)
                qk = self.fused.rope(qkv, *rope, H + Hkv, H, norms)
                return qk[:, :, :H], qk[:, :, H:], qkv[:, :, H + Hkv:]
            if self.q_norm is None:
                qk = Rotary.apply(qkv[:, :, : H + Hkv], *rope)  # q and k heads rotated in one pass
                return qk[:, :, :H], qk[:, :, H:], qkv[:, :, H + Hkv:]
            q, k, v = qkv[:, :, :H], qkv[:, :, H: H + Hkv], qkv[:, :, H + Hkv:]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return Rotary.apply(q, *rope), Rotary.apply(k, *rope), v

    def attend(self, meta: StepAttention, q: Tensor, k: Tensor, v: Tensor, cache: KVCache | None) -> Tensor:
        """The step's attention of this layer: its window and scale, [B, L, H*d]."""
        return meta.attend(q, k, v, cache, self.layer, self.window, self.scale)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], meta: StepAttention, cache: KVCache | None) -> Tensor:
        return self.o_proj(self.attend(meta, *self.project(x, rope), cache))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, fused=None, layer: int = 0):
        super().__init__()
        self.layer = layer
        self.lora = None  # linear/lora.LoraSlots, as Attention's
        self.act = cfg.hidden_act  # "silu" or "gelu_tanh"
        # linear/fused_ops.FusedOps: act(gate) * up of bfloat16 rows on CPU in one native pass
        self.fused = fused
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None  # gate|up in one GEMM, set by fuse_projections()

    def fuse_projections(self, make=fuse_linears) -> None:
        self.gate_up_proj = make("gate_up", self.gate_proj, self.up_proj)
        self.down_proj = make("down", self.down_proj)
        del self.gate_proj, self.up_proj

    def activation(self, gate: Tensor) -> Tensor:
        return F.silu(gate) if self.act == "silu" else F.gelu(gate, approximate="tanh")

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))
        gate_up = self.gate_up_proj(x)
        if self.lora is not None:
            gate_up = self.lora.add(self.layer, "gate_up", x, gate_up)
        if self.fused is not None and self.fused.applies(gate_up):
            return self.down(self.fused.act_mul(gate_up, self.act))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down(self.activation(gate) * up)

    def down(self, h: Tensor) -> Tensor:
        y = self.down_proj(h)
        return y if self.lora is None else self.lora.add(self.layer, "down", h, y)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, fused=None):
        super().__init__()
        self.self_attn = Attention(cfg, layer, fused)
        self.mlp = MLP(cfg, fused, layer)
        gemma = cfg.norm_style == "gemma"
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, gemma, fused)
        # without sandwich norms: the MLP's input norm; with them: the attention output's norm
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, gemma, fused)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, gemma, fused)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, gemma, fused)
        self.rope_kind = cfg.rope_kind(layer)  # which of Rotary.all_tables it takes

    def forward(self, x, rope, meta, cache):
        q, k, v = self.enter(x, *rope)
        return self.exit(x, self.self_attn.attend(meta, q, k, v, cache))

    # The work between attentions, as two functions of tensors only: what compile.py compiles
    # (the cache write and SDPA stay eager between them).
    def enter(self, x: Tensor, cos: Tensor, sin_signed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """RMSNorm, q|k|v projection and RoPE: rotated q [B, L, H, d], k, v [B, L, Hkv, d]."""
        return self.self_attn.project(self.input_layernorm(x), (cos, sin_signed))

    def exit(self, x: Tensor, attn: Tensor) -> Tensor:
        """o_proj and residual, then RMSNorm, gated MLP and residual: the layer's output [B, L, D].
        Sandwich norms: each branch's output normed before its residual add too."""
        o = self.self_attn.o_proj(attn)
        if self.self_attn.lora is not None:
            o = self.self_attn.lora.add(self.self_attn.layer, "o", attn, o)
        if self.sandwich:
            x, h = self.pre_feedforward_layernorm.add_norm(self.post_attention_layernorm(o), x)
            return x + self.post_feedforward_layernorm(self.mlp(h))
        x, h = self.post_attention_layernorm.add_norm(o, x)
        return x + self.mlp(h)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, fused=None):
        super().__init__()
        shape = (cfg.vocab_size, cfg.hidden_size)
        # a model built on the meta device (the loaders') gets its weights assigned: skip the random
        # initialisation, whose first call on meta costs ~2 s
        meta = torch.get_default_device().type == "meta"
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape) if meta else None)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, fused) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_style == "gemma", fused)
        self.rotary = Rotary(cfg)
        self.embed_scale = cfg.embed_scale

    def embed(self, ids: Tensor) -> Tensor:
        """Token embeddings [..., D], times embed_scale (rounded to float32, then to the weights' dtype, as
        transformers' Gemma does)."""
        return self.scale_embeddings(self.embed_tokens(ids))

    def scale_embeddings(self, x: Tensor) -> Tensor:
        """Looked-up embedding rows times embed_scale."""
        if self.embed_scale != 1.0:
            x = x * torch.tensor(self.embed_scale, dtype=torch.float32, device=x.device).to(x.dtype)
        return x


@dataclass(frozen=True)
class Segment:
    """One batch of a multi-batch forward: token ids and explicit positions [B, L], its attention."""

    input_ids: Tensor
    positions: Tensor
    meta: StepAttention


class LlamaForCausalLM(nn.Module):
    """`fused_ops` (linear/fused_ops.FusedOps): bfloat16 RMSNorm (either style), q/k norms with RoPE
    and the gated activation on CPU in native passes; None: the torch ops."""

    def __init__(self, cfg: ModelConfig, fused_ops=None):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, fused_ops)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.prepared = False  # set by prepare_for_inference()
        self.native_step = None  # native/step.NativeStep: a step's layers in one native call (prepare_for_inference)
        self.lora = None  # linear/lora.LoraSlots: the resident adapters (attach_lora)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if not self.model.embed_tokens.weight.is_meta:
            self.model.rotary.build(self.model.embed_tokens.weight.device, self.model.embed_tokens.weight.dtype)

    @torch.no_grad()
    def prepare_for_inference(self, make=fuse_linears, native_lib=None) -> "LlamaForCausalLM":
        """Fuse same-input projections and rebuild every linear for serving (see linear/serving.py).

        make(role, *linears) -> module computing the linears' concatenated outputs; role is one of
        kernels.ROLES. The default keeps the dtype and prepacks float32 on CPU for oneDNN.
        native_lib (native/build.py's library): a step's layers run in one native call (native/step.py)
        when every layer can (native.step.why_not).
        One-way: the result serves forward passes only (no training, no HF-named state_dict).
        """
        if not self.prepared:
            for layer in self.model.layers:
                layer.self_attn.fuse_projections(make)
                layer.mlp.fuse_projections(make)
            self.lm_head = make("head", self.lm_head)
            self.prepared = True
        if native_lib is not None and native_step.why_not(self) is None:
            self.native_step = native_step.NativeStep(native_lib, self)
        return self

    def attach_lora(self, slots) -> None:
        """Serve LoRA adapters from `slots` (linear/lora.LoraSlots) on the fused linears of every layer;
        a step names each row's adapter (forward_segments' `lora`)."""
        if not self.prepared:
            raise ValueError("LoRA adapters are served on a prepared model (prepare_for_inference)")
        self.lora = slots
        for layer in self.model.layers:
            layer.self_attn.lora = layer.mlp.lora = slots

    def weight_bytes(self) -> int:
        """Bytes of weights held, prepacked copies included (a tied LM head's packed copy counts)."""
        return held_bytes(self)

    @property
    def uses_fused_ops(self) -> bool:
        return self.model.norm.fused is not None

    def freeze_attributes(self) -> "LlamaForCausalLM":
        """Serving: every module's submodules, parameters and buffers also become plain instance
        attributes, so the ~800 attribute reads of a decode step find them directly instead of
        through nn.Module.__getattr__ (~0.7 ms of a 7 ms batch-1 step on the 2-core EPYC). The
        loader calls it once the module tree is final, before compiling (a compiled layer's guards
        read the attributes, so freezing later would recompile it). A conversion (.to(), .float(),
        ...) drops the copies first (_apply below), since it replaces buffers; assigning a module,
        parameter or buffer afterwards is not meant for a frozen model (nn.Module drops a stale copy
        for modules and parameters only)."""
        for m in self.modules():
            for registry in (m._modules, m._parameters, m._buffers):
                m.__dict__.update(registry)  # None entries too (a linear's absent bias)
        return self

    def thaw_attributes(self) -> None:
        """Undo freeze_attributes: attributes resolve through nn.Module again."""
        for m in self.modules():
            for registry in (m._modules, m._parameters, m._buffers):
                for name in registry:
                    m.__dict__.pop(name, None)

    def _apply(self, fn, recurse=True):
        self.thaw_attributes()  # conversions replace buffers (and may replace parameters)
        return super()._apply(fn, recurse)

    def forward(self, input_ids: Tensor, positions: Tensor, meta: StepAttention,
                cache: KVCache | None = None, logits_index: Tensor | None = None) -> Tensor:
        """input_ids, positions [B, L] -> logits [B, L, V], or [N, V] at flat indices logits_index into B*L."""
        x = self.model.embed(input_ids)  # [B, L, D]
        ropes = self.model.rotary.all_tables(positions)
        one = [Segment(input_ids, positions, meta)] if self.native_step is not None else None
        if one is not None and self.native_step.applies(one, cache):
            x = self.native_step(x, ropes, one, cache)
        else:
            for layer in self.model.layers:
                x = layer(x, ropes[layer.rope_kind], meta, cache)
        if logits_index is not None:
            x = x.reshape(-1, x.shape[-1])[logits_index]  # [N, D]
        return self.lm_head(self.model.norm(x))

    def forward_segments(self, segments: list[Segment], cache: KVCache, logits_index: Tensor, lora=None) -> Tensor:
        """Several batches in one pass (a serving step: decodes, continued prompt chunks, new packed
        prompts). Their tokens go back to back in one row [1, N], so every layer's work between
        attentions (`enter` / `exit`: norms, projections, RoPE, MLP; compiled when the model is)
        runs once over all of them and the weights are read once per step; attention runs per batch
        with its own metadata. Logits [n, V] at flat indices `logits_index` into the N tokens
        (batch i's tokens, row-major, after batch i-1's).

        lora: the step's rows by adapter (linear/lora.LoraStep), None when no row has one. The native step
        adds each row's adapter product itself (native_step.cpp's lora_add); elsewhere the torch layers
        add it (LoraSlots.add) after each fused linear."""
        if lora is None:
            return self._forward_segments(segments, cache, logits_index)
        if self.native_step is not None and self.native_step.applies(segments, cache) and self.lora.max_rank <= 256:
            return self._forward_segments(segments, cache, logits_index, lora)  # the native step adds them
        self.lora.step = lora
        try:
            return self._forward_segments(segments, cache, logits_index, native=False)
        finally:
            self.lora.step = None

    def _forward_segments(self, segments: list[Segment], cache: KVCache, logits_index: Tensor,
                          lora=None, native: bool = True) -> Tensor:
        shapes = [tuple(s.input_ids.shape) for s in segments]
        sizes = [B * L for B, L in shapes]
        ids = torch.cat([s.input_ids.reshape(-1) for s in segments])[None]  # [1, N]
        positions = torch.cat([s.positions.reshape(-1) for s in segments])[None]  # [1, N]
        if native and self.native_step is not None and self.native_step.applies(segments, cache):  # embedding to final norm
            return self.lm_head(self.native_step.head_input(ids, positions, segments, cache, logits_index, lora=lora))
        x = self.model.embed(ids)  # [1, N, D]
        ropes = self.model.rotary.all_tables(positions)
        H, Hkv, d = self.config.num_heads, self.config.num_kv_heads, self.config.head_dim
        for layer in self.model.layers:
            q, k, v = layer.enter(x, *ropes[layer.rope_kind])  # [1, N, heads, d]
            attn = layer.self_attn
            outs = [attn.attend(seg.meta, qi.reshape(B, L, H, d), ki.reshape(B, L, Hkv, d), vi.reshape(B, L, Hkv, d),
                                cache).reshape(1, B * L, H * d)
                    for qi, ki, vi, (B, L), seg in zip(q.split(sizes, 1), k.split(sizes, 1), v.split(sizes, 1),
                                                       shapes, segments)]
            x = layer.exit(x, torch.cat(outs, dim=1) if len(outs) > 1 else outs[0])  # [1, N, D]
        x = x.reshape(-1, x.shape[-1])[logits_index]  # [n, D]
        return self.lm_head(self.model.norm(x))

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> "LlamaForCausalLM":
        """Random init for training from scratch and for tiny test models."""
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.fill_(0.0 if self.config.norm_style == "gemma" else 1.0)  # a gemma norm scales by 1 + w
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=generator)
        return self
