"""ModelConfig from config.json and GGUF metadata: each family's layer variants, and every option the
decoder does not implement refused by name (never loaded and served wrongly)."""

from __future__ import annotations

import math

import pytest

from lmserve.model.config import LongRopeScaling, ModelConfig, RopeScaling
from lmserve.model.errors import UnsupportedArchitectureError

transformers = pytest.importorskip("transformers")

from family_helpers import BASE, FAMILIES  # noqa: E402


def hf_dict(family: str, **overrides) -> dict:
    config_cls, _, extra = FAMILIES[family]
    return getattr(transformers, config_cls)(**{**BASE, **extra, **overrides}).to_dict()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_to_hf_reads_back_to_the_same_config(family):
    cfg = ModelConfig.from_hf(hf_dict(family))
    assert ModelConfig.from_hf(cfg.to_hf(), name=cfg.name) == cfg
    # and transformers builds the same family from it
    again = transformers.AutoConfig.for_model(**cfg.to_hf())
    assert ModelConfig.from_hf(again.to_dict(), name=cfg.name) == cfg


def test_hub_spellings_read_like_transformers_5s():
    """The Hub's config.json spells Gemma 3's RoPE as rope_theta + rope_local_base_freq (+ rope_scaling) and
    its layers as sliding_window_pattern; Phi-3's LongRoPE as rope_scaling with type 'su' or 'longrope'."""
    gemma = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
             "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4,
             "num_key_value_heads": 1, "head_dim": 256, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
             "rope_scaling": None, "sliding_window": 512, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
             "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 32768}
    cfg = ModelConfig.from_hf(gemma)
    assert [cfg.window(i) for i in range(18)] == [0 if (i + 1) % 6 == 0 else 512 for i in range(18)]
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.attention_scale) == (1e6, 1e4, 1 / 16)
    assert cfg.tie_word_embeddings and cfg.embed_scale == 640 ** 0.5 and cfg.hidden_act == "gelu_tanh"
    assert [cfg.rope_kind(i) for i in range(6)] == [1, 1, 1, 1, 1, 0]
    phi = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 32064, "hidden_size": 3072,
           "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 131072,
           "original_max_position_embeddings": 4096, "sliding_window": 262144, "rope_theta": 10000.0,
           "rope_scaling": {"type": "su", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48}}
    cfg = ModelConfig.from_hf(phi)
    s = cfg.rope_scaling
    assert isinstance(s, LongRopeScaling) and s.original_max_position_embeddings == 4096
    assert s.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    assert cfg.layer_windows == (262144,) * 32 and cfg.rms_norm_eps == 1e-5


def test_qwen_windows_follow_use_sliding_window():
    assert ModelConfig.from_hf(hf_dict("qwen3", sliding_window=16)).layer_windows == ()  # not used
    cfg = ModelConfig.from_hf(hf_dict("qwen3", use_sliding_window=True, sliding_window=16, max_window_layers=2))
    assert cfg.layer_windows == (0, 0, 16)


@pytest.mark.parametrize("family, change, named", [
    ("llama31", {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]}, "Gemma2ForCausalLM"),
    ("llama31", {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"}, "Gemma3ForConditional"),
    ("llama31", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "'yarn'"),
    ("mistral", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic'"),
    ("gemma3", {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "'chunked_attention'"),
    ("gemma3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma3", {"hidden_activation": "relu"}, "'relu'"),
    ("mistral", {"sliding_window": 0}, "sliding_window 0"),
    ("mistral", {"sliding_window": "4096"}, "sliding_window '4096'"),
    ("phi3_longrope", {"partial_rotary_factor": 0.75}, "partial_rotary_factor"),
    ("llama31", {"mlp_bias": True}, "mlp_bias"),
    ("gemma3", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types names 2 layers"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_an_option_the_decoder_lacks_fails_naming_it(family, change, named):
    cfg = {**hf_dict(family), **change}
    with pytest.raises(UnsupportedArchitectureError, match=named.replace("(", r"\(").replace("[", r"\[")):
        ModelConfig.from_hf(cfg)


def gemma3_metadata(**extra) -> dict:
    """The keys llama.cpp's converter writes for Gemma 3 270M."""
    p = "gemma3."
    return {"general.architecture": "gemma3", p + "context_length": 32768, p + "embedding_length": 640,
            p + "block_count": 18, p + "feed_forward_length": 2048, p + "attention.head_count": 4,
            p + "attention.head_count_kv": 1, p + "attention.key_length": 256, p + "attention.value_length": 256,
            p + "attention.layer_norm_rms_epsilon": 1e-6, p + "rope.freq_base": 1e6,
            p + "attention.sliding_window": 512, "tokenizer.ggml.tokens": ["x"] * 262144, "_tied": True, **extra}


def test_a_gemma3_gguf_takes_what_llama_cpp_assumes():
    cfg = ModelConfig.from_gguf(gemma3_metadata())
    assert [cfg.window(i) for i in range(18)] == [0 if (i + 1) % 6 == 0 else 512 for i in range(18)]
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.attention_scale) == (1e6, 1e4, 1 / 16)
    assert cfg.norm_style == "gemma" and cfg.sandwich_norms and cfg.qk_norm and cfg.hidden_act == "gelu_tanh"
    assert cfg.vocab_size == 262144 and cfg.tie_word_embeddings and cfg.embed_scale == 640 ** 0.5
    assert ModelConfig.from_gguf(gemma3_metadata(**{"gemma3.block_count": 62})).attention_scale == (640 // 4) ** -0.5
    with pytest.raises(UnsupportedArchitectureError, match="final_logit_softcapping"):
        ModelConfig.from_gguf(gemma3_metadata(**{"gemma3.final_logit_softcapping": 30.0}))
    with pytest.raises(UnsupportedArchitectureError, match="rope scaling type 'yarn'"):
        ModelConfig.from_gguf(gemma3_metadata(**{"gemma3.rope.scaling.type": "yarn"}))


def test_llama3_scaling_keeps_transformers_frequencies():
    """The float32 inverse frequencies are transformers' own, bit for bit (what makes 64 greedy steps exact)."""
    import torch

    from lmserve.model.config import rope_inv_freq

    hf = transformers.LlamaConfig(**BASE, **FAMILIES["llama31"][2])
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    cfg = ModelConfig.from_hf(hf.to_dict())
    assert isinstance(cfg.rope_scaling, RopeScaling)
    assert torch.equal(rope_inv_freq(cfg), expected)
