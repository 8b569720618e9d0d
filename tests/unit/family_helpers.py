"""Tiny random-weight checkpoints of every family transformers builds, and transformers' own greedy
decoding: the oracle of test_model_families.py and test_gguf_families.py (this module holds no tests)."""

from __future__ import annotations

import random

import torch
import transformers

STEPS = 64
VOCAB = 512  # the trained tokenizer's
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2, pad_token_id=3)
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(16)],
            "long_factor": [1.5 + 0.4 * i for i in range(16)]}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
# family -> (config class, model class, its options); sliding windows are 12-16 keys, prompts 40-90 tokens
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(rope_theta=1e6)),
    "qwen3_sliding": ("Qwen3Config", "Qwen3ForCausalLM", dict(use_sliding_window=True, sliding_window=16,
                                                              max_window_layers=1)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(sliding_window=12, query_pre_attn_scalar=24,
                                                              layer_types=["sliding_attention", "full_attention",
                                                                           "sliding_attention"])),
    "gemma3_linear_rope": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                           dict(sliding_window=16, num_key_value_heads=1, rope_scaling={"rope_type": "linear",
                                                                                        "factor": 4.0})),
    "phi3_longrope": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=16, rope_scaling=LONGROPE, hidden_size=128,
                                                            original_max_position_embeddings=48)),  # d = D / H
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=16, num_key_value_heads=1)),
    # a head size the native decode kernel does not take: decode rows on SDPA too
    "mistral_sdpa": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=12, head_dim=24)),
    "llama31": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)),
}


def hf_family(family: str, seed: int = 0, **overrides):
    """A transformers model of the family (its config options updated by `overrides`) with every
    parameter random: linear weights large enough that greedy choices are well separated, norm weights
    near their identity."""
    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**BASE, **extra, **overrides}, attn_implementation="eager")
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    g = torch.Generator().manual_seed(seed)
    identity = 0.0 if "Gemma" in config_cls else 1.0  # a Gemma norm scales by 1 + w
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(identity + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
    return model


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], n: int = STEPS) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens with its own KV cache (generate's loop), and the first token's logits."""
    out = hf(input_ids=torch.tensor([prompt]), use_cache=True)
    first = out.logits[0, -1].clone()
    tokens = []
    for _ in range(n):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = hf(input_ids=torch.tensor([[tokens[-1]]]), cache=out.past_key_values, use_cache=True)
    return tokens, first


def prompts(family: str, seed: int = 1) -> list[list[int]]:
    """Prompts longer than every sliding window; LongRoPE: shorter and longer than its original context."""
    rng = random.Random(seed)
    lengths = (40, 61, 90) if family.startswith("phi3") else (40, 57, 90)
    return [[rng.randrange(4, VOCAB) for _ in range(n)] for n in lengths]


