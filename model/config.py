"""ModelConfig: one frozen description of a decoder-only network, built from its checkpoint.

One decoder (llama.py) serves every family; what differs between families is a field here:
- the norm style: "llama" scales the normalized row, cast to the activation dtype, by w; "gemma"
  scales it by (1 + w) in float32, then casts (Gemma 3);
- `sandwich_norms`: the attention and MLP outputs are normed too before their residual add, four
  norms per layer (Gemma 3);
- the MLP's activation (SiLU, or GELU with the tanh approximation);
- `qk_norm`: an RMSNorm over each query and key head before RoPE (Qwen3, Gemma 3);
- per-layer sliding windows (`layer_windows`: a query at position p sees keys p - w + 1 .. p) and
  the RoPE base of the sliding layers (`rope_local_theta`, Gemma 3);
- RoPE scaling: Llama 3's, linear, Phi-3's LongRoPE (short / long factors), or per-dimension
  frequency factors (a GGUF's rope_freqs);
- `embed_scale` (Gemma: sqrt(hidden)), `query_scale` (Gemma: query_pre_attn_scalar ** -0.5).
Phi-3's fused qkv and gate_up projections are split at load (loader.py), so they need no field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .errors import UnsupportedArchitectureError

# HF `model_type` -> (our family name, its `architectures` entry)
HF_FAMILIES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3_text": ("gemma3", "Gemma3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
}
HF_ARCHITECTURES = {arch for _, arch in HF_FAMILIES.values()}
HF_MODEL_TYPES = set(HF_FAMILIES)
GGUF_ARCHITECTURES = {"llama", "qwen2", "qwen3", "gemma3", "phi3"}
SLIDING_FAMILIES = {"mistral", "qwen2", "qwen3", "gemma3", "phi3"}  # the HF families whose layers may slide
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
# llama.cpp hard-codes what a gemma3 GGUF does not say: every 6th layer global, local RoPE base 10000
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_THETA = 10000.0


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type = "llama3"


@dataclass(frozen=True)
class LinearRopeScaling:
    """Every frequency divided by `factor` (position interpolation)."""

    factor: float
    rope_type = "linear"


@dataclass(frozen=True)
class LongRopeScaling:
    """Phi-3's LongRoPE: frequency i is divided by short_factor[i], or by long_factor[i] once the
    sequence is longer than original_max_position_embeddings; cos and sin are multiplied by
    attention_factor. Which set a token takes: `Rotary` (llama.py)."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float = 1.0
    rope_type = "longrope"


@dataclass(frozen=True)
class FrequencyFactors:
    """Frequency i divided by factors[i] (a GGUF's `rope_freqs` tensor: how llama.cpp's converter
    writes Llama 3's scaling)."""

    factors: tuple[float, ...]
    rope_type = "factors"


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | LinearRopeScaling | LongRopeScaling | FrequencyFactors | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    o_proj_bias: bool = False  # the output projection too (Llama, Qwen3 or Gemma 3 with attention_bias)
    model_type: str = "llama"
    name: str = "model"
    norm_style: str = "llama"  # "llama": w * x.to(dtype); "gemma": ((1 + w) * x).to(dtype), in float32
    sandwich_norms: bool = False  # post-attention and pre/post-feedforward norms: four per layer (Gemma 3)
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_tanh"
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
    embed_scale: float = 1.0  # embeddings multiplied by it, in the activation dtype (Gemma: sqrt(hidden))
    query_scale: float | None = None  # attention's score scale; None: 1 / sqrt(head_dim)
    layer_windows: tuple[int, ...] = ()  # per layer: 0 = full attention, w = keys p - w + 1 .. p; () = all full
    rope_local_theta: float | None = None  # the sliding layers' RoPE base, unscaled (Gemma 3); None: the global RoPE

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "intermediate_size"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f} must be positive, got {getattr(self, f)}")
        if self.norm_style not in ("llama", "gemma"):
            raise ValueError(f"norm_style must be 'llama' or 'gemma', got {self.norm_style!r}")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"hidden_act must be 'silu' or 'gelu_tanh', got {self.hidden_act!r}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers")
        if any(w < 0 for w in self.layer_windows):
            raise ValueError(f"a sliding window must be positive (0: full attention), got {self.layer_windows}")
        s = self.rope_scaling
        if isinstance(s, (LongRopeScaling, FrequencyFactors)):
            for name in ("short_factor", "long_factor") if isinstance(s, LongRopeScaling) else ("factors",):
                if len(getattr(s, name)) != self.head_dim // 2:
                    raise UnsupportedArchitectureError(
                        f"rope_scaling {name} has {len(getattr(s, name))} entries; head_dim {self.head_dim} needs "
                        f"{self.head_dim // 2}")

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window (0: it attends to every earlier key)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def sliding_window(self) -> int:
        """The widest sliding window of any layer (0: none slides)."""
        return max(self.layer_windows, default=0)

    def rope_kind(self, layer: int) -> int:
        """Which RoPE table layer `layer` takes: 0 the global one, 1 the sliding layers' own base."""
        return int(self.rope_local_theta is not None and self.window(layer) > 0)

    def rope_row_offset(self, prompt_len: int) -> int:
        """What a sequence whose prompt has prompt_len tokens adds to its positions to find its RoPE table
        rows: max_position_embeddings when LongRoPE takes its long factors from position 0 (the prompt is
        longer than the original context, as transformers' generate decides), else 0 (llama.Rotary)."""
        s = self.rope_scaling
        long = isinstance(s, LongRopeScaling) and prompt_len > s.original_max_position_embeddings
        return self.max_position_embeddings if long else 0

    @property
    def attention_scale(self) -> float:
        return self.query_scale if self.query_scale is not None else 1.0 / math.sqrt(self.head_dim)

    # ---- Hugging Face config.json -------------------------------------------------
    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any] | str | Path, name: str | None = None) -> "ModelConfig":
        if not isinstance(cfg, Mapping):
            path = Path(cfg)
            if path.is_dir():
                path = path / "config.json"
            name = name or path.parent.name
            cfg = json.loads(path.read_text())
        archs = set(cfg.get("architectures") or [])
        model_type = cfg.get("model_type", "llama")
        if (archs and not archs & HF_ARCHITECTURES) or model_type not in HF_FAMILIES:
            raise UnsupportedArchitectureError(
                f"architecture {sorted(archs) or model_type!r} is not supported; "
                f"supported: {sorted(HF_ARCHITECTURES)}"
            )
        family = HF_FAMILIES[model_type][0]
        gemma = family == "gemma3"
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or hidden // heads
        layers = cfg["num_hidden_layers"]
        _refuse_hf_options(cfg, family)
        theta, scaling, local_theta = _hf_rope(cfg, family, head_dim)
        act = cfg.get("hidden_activation") if gemma else None
        act = act or cfg.get("hidden_act") or "silu"
        if act not in ACTIVATIONS:
            raise UnsupportedArchitectureError(f"activation {act!r} is not supported; supported: {sorted(ACTIVATIONS)}")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        bias = bool(cfg.get("attention_bias", family == "qwen2"))
        windows = _hf_windows(cfg, family, layers)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            intermediate_size=cfg["intermediate_size"],
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5 if family == "phi3" else 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=cfg.get("pad_token_id"),
            attention_bias=bias,
            o_proj_bias=bias and family in ("llama", "qwen3", "gemma3"),
            model_type=family,
            name=name or cfg.get("_name_or_path") or "model",
            norm_style="gemma" if gemma else "llama",
            sandwich_norms=gemma,
            hidden_act=ACTIVATIONS[act],
            qk_norm=family in ("qwen3", "gemma3"),
            embed_scale=hidden ** 0.5 if gemma else 1.0,
            query_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma else None,
            layer_windows=windows if any(windows) else (),
            rope_local_theta=local_theta if any(windows) else None,
        )

    def to_hf(self) -> dict[str, Any]:
        """The config.json that `from_hf` reads back (and transformers understands)."""
        hf_type = next(t for t, (fam, _) in HF_FAMILIES.items() if fam == self.model_type)
        out = {
            "architectures": [HF_FAMILIES[hf_type][1]],
            "model_type": hf_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "pad_token_id": self.pad_token_id,
            "attention_bias": self.attention_bias,
            "hidden_act": {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}[self.hidden_act],
            "torch_dtype": "float32",
        }
        s = self.rope_scaling
        if isinstance(s, RopeScaling):
            out["rope_scaling"] = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                                   "high_freq_factor": s.high_freq_factor,
                                   "original_max_position_embeddings": s.original_max_position_embeddings}
        elif isinstance(s, LinearRopeScaling):
            out["rope_scaling"] = {"rope_type": "linear", "factor": s.factor}
        elif isinstance(s, LongRopeScaling):
            out["rope_scaling"] = {"rope_type": "longrope", "short_factor": list(s.short_factor),
                                   "long_factor": list(s.long_factor), "attention_factor": s.attention_factor}
            out["original_max_position_embeddings"] = s.original_max_position_embeddings
        elif s is not None:
            raise ValueError(f"rope scaling {s.rope_type!r} has no config.json form")
        if self.layer_windows:
            out["sliding_window"] = self.sliding_window
            if len(set(w for w in self.layer_windows if w)) > 1:
                raise ValueError("config.json holds one sliding window for every sliding layer")
            out["layer_types"] = ["sliding_attention" if w else "full_attention" for w in self.layer_windows]
            if self.model_type in ("qwen2", "qwen3"):
                out["use_sliding_window"] = True
        if self.model_type == "gemma3":
            out["hidden_activation"] = out["hidden_act"]
            out["query_pre_attn_scalar"] = round(self.attention_scale ** -2)
            out["rope_local_base_freq"] = self.rope_local_theta or GEMMA3_LOCAL_THETA
        return out

    # ---- GGUF metadata -------------------------------------------------------------
    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], name: str | None = None) -> "ModelConfig":
        """Build from GGUF key/value metadata already decoded to Python values (plus `_tied`: the file has
        no output.weight; `_rope_factors`: rope_freqs, or (long, short) rope_factors tensors' values)."""
        arch = meta.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"GGUF architecture {arch!r} is not supported; supported: {sorted(GGUF_ARCHITECTURES)}"
            )
        p = f"{arch}."
        gemma = arch == "gemma3"
        hidden = int(meta[p + "embedding_length"])
        heads = int(meta[p + "attention.head_count"])
        kv_heads = int(meta.get(p + "attention.head_count_kv", heads))
        head_dim = int(meta.get(p + "attention.key_length", hidden // heads))
        layers = int(meta[p + "block_count"])
        vocab = meta.get(p + "vocab_size")
        if vocab is None:
            vocab = len(meta["tokenizer.ggml.tokens"])
        eos = meta.get("tokenizer.ggml.eos_token_id")
        _refuse_gguf_options(meta, p, head_dim)
        windows = _gguf_windows(meta, p, arch, layers)
        scaling = _gguf_rope_scaling(meta, p, head_dim)
        return cls(
            vocab_size=int(vocab),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=int(meta[p + "feed_forward_length"]),
            rope_theta=float(meta.get(p + "rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            rms_norm_eps=float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
            tie_word_embeddings=bool(meta.get("_tied", False)),
            max_position_embeddings=int(meta.get(p + "context_length", 2048)),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
            pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
            attention_bias=arch == "qwen2",
            model_type=arch,
            name=name or meta.get("general.name") or "model",
            norm_style="gemma" if gemma else "llama",
            sandwich_norms=gemma,
            hidden_act="gelu_tanh" if gemma else "silu",
            qk_norm=arch in ("qwen3", "gemma3"),
            embed_scale=hidden ** 0.5 if gemma else 1.0,
            # llama.cpp: 1 / sqrt(head_dim), but Gemma 3 27B's (62 layers) is 1 / sqrt(hidden / heads)
            query_scale=(hidden // heads if layers == 62 else head_dim) ** -0.5 if gemma else None,
            layer_windows=windows,
            rope_local_theta=GEMMA3_LOCAL_THETA if gemma and windows else None,
        )


def _refuse_hf_options(cfg: Mapping[str, Any], family: str) -> None:
    """Options of a config.json that the decoder does not implement: refused by name."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise UnsupportedArchitectureError(f"{key} ({cfg[key]}) is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedArchitectureError("use_bidirectional_attention (non-causal attention) is not supported")
    if cfg.get("mlp_bias"):
        raise UnsupportedArchitectureError("mlp_bias (biases on the MLP projections) is not supported")
    rp = cfg.get("rope_parameters") or {}
    partial = cfg.get("partial_rotary_factor") or (rp.get("partial_rotary_factor") if isinstance(rp, Mapping) else None)
    if partial is not None and float(partial) != 1.0:
        raise UnsupportedArchitectureError(f"partial_rotary_factor {partial} (partial rotary embeddings) is not supported")


def _hf_rope(cfg: Mapping[str, Any], family: str, head_dim: int):
    """(global theta, global scaling, sliding layers' theta) from a config.json, in either spelling:
    the Hub's `rope_theta` + `rope_scaling` (+ Gemma's `rope_local_base_freq`), or transformers 5's
    `rope_parameters` (per layer type for Gemma 3)."""
    rp = cfg.get("rope_parameters") or {}
    local = None
    if "full_attention" in rp or "sliding_attention" in rp:  # per layer type
        glob = dict(rp.get("full_attention") or {})
        local = dict(rp.get("sliding_attention") or {})
    else:
        glob = dict(rp)
    if cfg.get("rope_scaling"):  # the Hub's spelling wins, its type too
        glob = {**glob, **cfg["rope_scaling"], "rope_type": _rope_type(cfg["rope_scaling"])}
    theta = float(glob.get("rope_theta", cfg.get("rope_theta", 1_000_000.0 if family == "gemma3" else 10000.0)))
    local_theta = None
    if family == "gemma3":
        if local and _rope_type(local) not in ("default", None):
            raise UnsupportedArchitectureError(f"rope scaling {_rope_type(local)!r} on sliding layers is not supported")
        local_theta = float((local or {}).get("rope_theta", cfg.get("rope_local_base_freq", GEMMA3_LOCAL_THETA)))
    rope_type = _rope_type(glob)
    if rope_type in (None, "default"):
        return theta, None, local_theta
    if rope_type == "llama3":
        return theta, RopeScaling(
            factor=float(glob["factor"]),
            low_freq_factor=float(glob["low_freq_factor"]),
            high_freq_factor=float(glob["high_freq_factor"]),
            original_max_position_embeddings=int(glob["original_max_position_embeddings"]),
        ), local_theta
    if rope_type == "linear":
        return theta, LinearRopeScaling(float(glob["factor"])), local_theta
    if rope_type in ("longrope", "su"):
        orig = glob.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
        if orig is None:
            raise UnsupportedArchitectureError("longrope scaling without original_max_position_embeddings")
        orig = int(orig)
        factor = glob.get("factor")
        if factor is None:
            factor = int(cfg.get("max_position_embeddings", 2048)) / orig
        attention = glob.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        return theta, LongRopeScaling(tuple(float(x) for x in glob["short_factor"]),
                                      tuple(float(x) for x in glob["long_factor"]), orig, float(attention)), local_theta
    raise UnsupportedArchitectureError(f"rope_scaling type {rope_type!r} is not supported; "
                                       "supported: default, llama3, linear, longrope")


def _rope_type(params: Mapping[str, Any]) -> str | None:
    return params.get("rope_type", params.get("type"))


def _hf_windows(cfg: Mapping[str, Any], family: str, layers: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention), as transformers reads them for the family."""
    if family not in SLIDING_FAMILIES:
        return (0,) * layers
    window = cfg.get("sliding_window")
    if family in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = None
    types = cfg.get("layer_types")
    if types is None:
        if family == "gemma3":
            pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
            types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
        elif family in ("qwen2", "qwen3"):
            first = int(cfg.get("max_window_layers", layers))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        else:  # mistral, phi3: every layer
            types = ["sliding_attention"] * layers
    if len(types) != layers:
        raise UnsupportedArchitectureError(f"layer_types names {len(types)} layers, the model has {layers}")
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise UnsupportedArchitectureError(f"layer type {unknown[0]!r} is not supported; "
                                           "supported: full_attention, sliding_attention")
    if window is None or "sliding_attention" not in types:
        return (0,) * layers
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise UnsupportedArchitectureError(f"sliding_window {window!r} cannot be honoured: it must be a positive "
                                           "number of positions")
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def _refuse_gguf_options(meta: Mapping[str, Any], p: str, head_dim: int) -> None:
    """What a GGUF's metadata asks that the decoder does not implement: refused by name."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if meta.get(p + key):
            raise UnsupportedArchitectureError(f"{key} ({meta[p + key]}) is not supported")
    rope_dims = meta.get(p + "rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise UnsupportedArchitectureError(
            f"partial rotary embeddings ({rope_dims} of {head_dim} dims) are not supported")


def _gguf_windows(meta: Mapping[str, Any], p: str, arch: str, layers: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention), or () when no layer slides, as llama.cpp reads a
    GGUF: gemma3's layers by their pattern (every 6th one global where none is written), phi3's all."""
    window = int(meta.get(p + "attention.sliding_window", 0) or 0)
    if arch == "gemma3":
        pattern = meta.get(p + "attention.sliding_window_pattern", GEMMA3_SLIDING_PATTERN)
        if isinstance(pattern, list):  # per layer: true = sliding
            sliding = [bool(x) for x in pattern]
        else:
            sliding = [(i + 1) % int(pattern) != 0 for i in range(layers)]
    else:
        sliding = [arch == "phi3"] * layers  # phi3: every layer; the others' converters write no window
    windows = tuple(window if s and window > 0 else 0 for s in sliding) if window > 0 else ()
    return windows if any(windows) else ()


def _gguf_rope_scaling(meta: Mapping[str, Any], p: str, head_dim: int):
    """A GGUF's RoPE scaling: linear (rope.scaling.type/factor), LongRoPE (rope_factors_long/short
    tensors, read into `_rope_factors`), or per-dimension frequency factors (a rope_freqs tensor)."""
    kind = meta.get(p + "rope.scaling.type")
    factors = meta.get("_rope_factors")
    if factors is not None:
        if isinstance(factors, dict):  # phi3: long and short
            orig = meta.get(p + "rope.scaling.original_context_length")
            if orig is None:
                raise UnsupportedArchitectureError("GGUF LongRoPE factors without rope.scaling.original_context_length")
            return LongRopeScaling(tuple(factors["short"]), tuple(factors["long"]), int(orig),
                                   float(meta.get(p + "rope.scaling.attn_factor", 1.0)))
        return FrequencyFactors(tuple(factors))
    if kind in (None, "none"):
        return None
    factor = float(meta.get(p + "rope.scaling.factor", 1.0) or 1.0)
    if kind == "linear":
        return LinearRopeScaling(factor) if factor != 1.0 else None
    raise UnsupportedArchitectureError(f"GGUF rope scaling type {kind!r} is not supported; supported: none, linear")


def rope_inv_freq(cfg: ModelConfig, theta: float | None = None, scaled: bool = True, long: bool = False):
    """Inverse frequencies [d/2] (float32) of RoPE with base `theta` (default: the config's global one), scaled
    as configured unless `scaled` is False; `long`: LongRoPE's long factors instead of the short ones.
    Computed in float32 in transformers' order, so the tables match its rotary embeddings bit for bit."""
    import torch

    d = cfg.head_dim
    base = cfg.rope_theta if theta is None else theta
    s = cfg.rope_scaling if scaled else None
    exponents = torch.arange(0, d, 2, dtype=torch.int64).float() / d  # [d/2]
    if isinstance(s, LongRopeScaling):
        ext = torch.tensor(s.long_factor if long else s.short_factor, dtype=torch.float32)
        return 1.0 / (ext * base ** exponents)
    inv = 1.0 / (base ** exponents)
    if s is None:
        return inv
    if isinstance(s, LinearRopeScaling):
        return inv / s.factor
    if isinstance(s, FrequencyFactors):
        return inv / torch.tensor(s.factors, dtype=torch.float32)
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled_inv = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    mid = (1 - smooth) * scaled_inv / s.factor + smooth * scaled_inv
    is_mid = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_mid, mid, scaled_inv)
