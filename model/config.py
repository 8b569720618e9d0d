"""ModelConfig: one frozen description of a Llama-family network, built from its checkpoint."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

from .errors import UnsupportedArchitectureError

# HF `architectures` / `model_type` values and GGUF `general.architecture` values we run.
HF_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}
HF_MODEL_TYPES = {"llama", "mistral", "qwen2"}
GGUF_ARCHITECTURES = {"llama", "qwen2"}


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


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
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    model_type: str = "llama"
    name: str = "model"

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "intermediate_size"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f} must be positive, got {getattr(self, f)}")

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

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
        if (archs and not archs & HF_ARCHITECTURES) or model_type not in HF_MODEL_TYPES:
            raise UnsupportedArchitectureError(
                f"architecture {sorted(archs) or model_type!r} is not supported; "
                f"supported: {sorted(HF_ARCHITECTURES)}"
            )
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or None  # transformers >= 5 nests it
        scaling = None
        if rs and rs.get("rope_type", rs.get("type")) == "llama3":
            scaling = RopeScaling(
                factor=float(rs["factor"]),
                low_freq_factor=float(rs["low_freq_factor"]),
                high_freq_factor=float(rs["high_freq_factor"]),
                original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
            )
        elif rs and rs.get("rope_type", rs.get("type")) not in (None, "default"):
            raise UnsupportedArchitectureError(f"rope_scaling type {rs.get('rope_type', rs.get('type'))!r} is not supported")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        theta = cfg.get("rope_theta")
        if theta is None:  # transformers >= 5 may nest it
            theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            intermediate_size=cfg["intermediate_size"],
            rope_theta=float(theta),
            rope_scaling=scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=cfg.get("pad_token_id"),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            model_type=model_type,
            name=name or cfg.get("_name_or_path") or "model",
        )

    def to_hf(self) -> dict[str, Any]:
        """The config.json that `from_hf` reads back (and transformers understands)."""
        arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}[self.model_type]
        out = {
            "architectures": [arch],
            "model_type": self.model_type,
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
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if self.rope_scaling is not None:
            out["rope_scaling"] = {"rope_type": "llama3", **asdict(self.rope_scaling)}
        return out

    # ---- GGUF metadata -------------------------------------------------------------
    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], name: str | None = None) -> "ModelConfig":
        """Build from GGUF key/value metadata already decoded to Python values."""
        arch = meta.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"GGUF architecture {arch!r} is not supported; supported: {sorted(GGUF_ARCHITECTURES)}"
            )
        p = f"{arch}."
        hidden = int(meta[p + "embedding_length"])
        heads = int(meta[p + "attention.head_count"])
        kv_heads = int(meta.get(p + "attention.head_count_kv", heads))
        head_dim = int(meta.get(p + "attention.key_length", hidden // heads))
        vocab = meta.get(p + "vocab_size")
        if vocab is None:
            vocab = len(meta["tokenizer.ggml.tokens"])
        eos = meta.get("tokenizer.ggml.eos_token_id")
        scaling = None
        if meta.get(p + "rope.scaling.type") not in (None, "none", "linear") or meta.get(p + "rope.scaling.factor"):
            raise UnsupportedArchitectureError("GGUF rope scaling is not supported")
        return cls(
            vocab_size=int(vocab),
            hidden_size=hidden,
            num_layers=int(meta[p + "block_count"]),
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
        )


def rope_inv_freq(cfg: ModelConfig):
    """Inverse frequencies for RoPE, with Llama-3 scaling applied when configured."""
    import torch

    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))  # [d/2]
    s = cfg.rope_scaling
    if s is None:
        return inv.float()
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    mid = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled).float()
