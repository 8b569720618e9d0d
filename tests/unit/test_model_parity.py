"""Logits parity with Hugging Face transformers on tiny random Llama-family networks.

transformers (eager attention) is the oracle: the same random state_dict goes into both
models, and our config is built from transformers' own config dict.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

transformers = pytest.importorskip("transformers")

from lmserve.model.attention.sdpa import AttentionMetadata  # noqa: E402
from lmserve.model.config import ModelConfig  # noqa: E402
from lmserve.model.loader import build_model  # noqa: E402

PARITY = dict(rtol=1e-4, atol=1e-4)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
BASE = dict(vocab_size=131, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
            head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-5, attn_implementation="eager")
VARIANTS = {
    "llama_gqa": ("llama", dict(num_key_value_heads=2)),
    "llama_mha_tied": ("llama", dict(num_key_value_heads=6, tie_word_embeddings=True)),
    "llama_mqa": ("llama", dict(num_key_value_heads=1, rope_theta=1000.0)),
    "llama3_rope_scaling": ("llama", dict(num_key_value_heads=3, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)),
    "qwen2_bias": ("qwen2", dict(num_key_value_heads=2, rope_theta=1000000.0, tie_word_embeddings=True)),
}


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def hf_model(variant: str, seed: int = 0):
    """A transformers model with every parameter random (norm weights near 1, biases nonzero)."""
    kind, extra = VARIANTS[variant]
    if kind == "llama":
        config, cls = transformers.LlamaConfig(**BASE, **extra), transformers.LlamaForCausalLM
    else:
        config, cls = transformers.Qwen2Config(**BASE, **extra), transformers.Qwen2ForCausalLM
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def ours_from(hf, config_dict: dict | None = None):
    cfg = ModelConfig.from_hf(config_dict if config_dict is not None else hf.config.to_dict())
    return build_model(cfg, dict(hf.state_dict()), torch.float32, "cpu")


def batch(vocab: int, lengths: list[int], seed: int):
    """Right-padded ids [B, L], HF attention_mask [B, L], our positions [B, L] and q_lens [B]."""
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    ids = torch.randint(0, vocab, (len(lengths), L), generator=g)
    q_lens = torch.tensor(lengths)
    attn = (torch.arange(L)[None, :] < q_lens[:, None]).long()
    ids = ids * attn  # pad id 0
    return ids, attn, torch.arange(L).expand(len(lengths), L), q_lens


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(variant):
    hf = hf_model(variant)
    ours = ours_from(hf)
    assert ours.config.num_kv_heads == hf.config.num_key_value_heads
    assert ours.config.tie_word_embeddings == bool(hf.config.tie_word_embeddings)
    ids, _, positions, q_lens = batch(hf.config.vocab_size, [20, 20], seed=1)
    expected = hf(input_ids=ids).logits  # [B, L, V]
    got = ours(ids, positions, AttentionMetadata.fresh(q_lens))
    assert expected.abs().max() > 1.0  # logits are far from trivial
    assert_close(got, expected, **PARITY)


@pytest.mark.parametrize("variant", ["llama_gqa", "qwen2_bias"])
def test_right_padded_batch_matches_transformers_with_attention_mask(variant):
    hf = hf_model(variant, seed=2)
    ours = ours_from(hf)
    ids, attn, positions, q_lens = batch(hf.config.vocab_size, [17, 5, 11], seed=3)
    expected = hf(input_ids=ids, attention_mask=attn).logits  # [B, L, V]
    got = ours(ids, positions, AttentionMetadata.fresh(q_lens))
    real = attn.bool()
    assert_close(got[real], expected[real], **PARITY)


def test_llama3_rope_scaling_from_a_hub_style_config_json():
    """Checkpoints on the Hub spell it `rope_theta` + `rope_scaling`; transformers >= 5 nests both in `rope_parameters`."""
    hf = hf_model("llama3_rope_scaling", seed=4)
    hub = {k: v for k, v in hf.config.to_dict().items() if k != "rope_parameters"}
    hub |= {"rope_theta": 500000.0, "rope_scaling": dict(LLAMA3_ROPE), "architectures": ["LlamaForCausalLM"]}
    ours = ours_from(hf, hub)
    assert ours.config.rope_scaling is not None
    ids, _, positions, q_lens = batch(hf.config.vocab_size, [40], seed=5)
    expected = hf(input_ids=ids).logits
    assert_close(ours(ids, positions, AttentionMetadata.fresh(q_lens)), expected, **PARITY)
    # the scaling is visible at these positions: without it the logits differ
    plain = {k: v for k, v in hub.items() if k != "rope_scaling"}
    unscaled = ours_from(hf, plain)
    assert not torch.allclose(unscaled(ids, positions, AttentionMetadata.fresh(q_lens)), expected, **PARITY)


@pytest.mark.parametrize("variant", ["llama_mha_tied", "qwen2_bias"])
def test_saved_hf_directory_reads_back_to_transformers_logits(variant, tmp_path):
    """save_pretrained (config.json + safetensors, tied head dropped) -> read_hf_dir -> same logits."""
    from lmserve.model.loader import read_hf_dir

    hf = hf_model(variant, seed=6)
    hf.save_pretrained(tmp_path)
    cfg, tensors = read_hf_dir(tmp_path)
    ours = build_model(cfg, tensors, torch.float32, "cpu")
    ids, _, positions, q_lens = batch(hf.config.vocab_size, [12, 12], seed=7)
    assert_close(ours(ids, positions, AttentionMetadata.fresh(q_lens)), hf(input_ids=ids).logits, **PARITY)
