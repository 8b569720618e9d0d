"""GGUF files of the families llama.cpp's converter writes (gemma3, qwen3, phi3) load to transformers' logits.

Each tiny random checkpoint is written the way convert_hf_to_gguf.py writes it: tensor names from the
gguf package's own TensorNameMap, float32 data, Gemma's norm weights stored as 1 + w, Phi-3's fused
q|k|v and gate|up kept fused, its LongRoPE factors as rope_factors_long / rope_factors_short tensors
with rope.scaling.original_context_length and rope.scaling.attn_factor. What a gemma3 file does not
say (the sliding pattern, the local RoPE base, the query scale) is what llama.cpp assumes, so the
oracle model is a Gemma 3 that fits it: every 6th layer global, local base 10000,
query_pre_attn_scalar = head_dim.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from family_helpers import VOCAB, hf_family  # noqa: E402
from lmserve.model.attention.sdpa import AttentionMetadata  # noqa: E402
from lmserve.model.config import ModelConfig  # noqa: E402
from lmserve.model.checkpoints.gguf_reader import read_gguf  # noqa: E402
from lmserve.model.loader import build_model  # noqa: E402

ARCHS = {"qwen3": gguf.MODEL_ARCH.QWEN3, "gemma3_text": gguf.MODEL_ARCH.GEMMA3, "phi3": gguf.MODEL_ARCH.PHI3}
# the families as llama.cpp's gemma3 reads them: six layers, the sixth global; the query scale 1 / sqrt(head_dim)
LLAMA_CPP_GEMMA3 = dict(num_hidden_layers=6, layer_types=None, sliding_window=12, query_pre_attn_scalar=32)


def write_like_the_converter(hf, path):
    """hf's config and weights as convert_hf_to_gguf.py writes them (float32 tensors)."""
    c = hf.config
    arch = ARCHS[c.model_type]
    name = gguf.MODEL_ARCH_NAMES[arch]
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    w = gguf.GGUFWriter(str(path), name)
    for add, value in ((w.add_context_length, c.max_position_embeddings), (w.add_embedding_length, c.hidden_size),
                       (w.add_block_count, c.num_hidden_layers), (w.add_feed_forward_length, c.intermediate_size),
                       (w.add_head_count, c.num_attention_heads), (w.add_head_count_kv, c.num_key_value_heads),
                       (w.add_layer_norm_rms_eps, c.rms_norm_eps), (w.add_key_length, head_dim),
                       (w.add_value_length, head_dim), (w.add_rope_freq_base, rope["rope_theta"])):
        add(value)
    if name == "gemma3":
        w.add_sliding_window(c.sliding_window)
    if name == "phi3":
        orig = rope["original_max_position_embeddings"]
        w.add_rope_dimension_count(head_dim)
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_sliding_window(c.sliding_window or 0)
        if rope.get("long_factor"):
            scale = c.max_position_embeddings / orig
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0)
            w.add_tensor("rope_factors_long.weight", torch.tensor(rope["long_factor"], dtype=torch.float32).numpy())
            w.add_tensor("rope_factors_short.weight", torch.tensor(rope["short_factor"], dtype=torch.float32).numpy())
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    w.add_eos_token_id(2)
    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    for hf_name, t in hf.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        t = t.float()
        if name == "gemma3" and hf_name.endswith("norm.weight"):
            t = t + 1  # Gemma3RMSNorm scales by 1 + w: the converter stores the sum
        w.add_tensor(names.get_name(hf_name, try_suffixes=(".weight", ".bias")), t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("family, extra", [("qwen3", {}), ("gemma3", LLAMA_CPP_GEMMA3), ("phi3_longrope", {})],
                         ids=["qwen3", "gemma3", "phi3_longrope"])
def test_a_converted_gguf_gives_the_hf_directorys_logits(tmp_path, family, extra):
    hf = hf_family(family, seed=4, **extra)
    ckpt = read_gguf(write_like_the_converter(hf, tmp_path / "m.gguf"))
    from_hf = ModelConfig.from_hf(hf.config.to_dict())
    for field in ("model_type", "norm_style", "sandwich_norms", "hidden_act", "qk_norm", "layer_windows",
                  "tie_word_embeddings"):
        assert getattr(ckpt.config, field) == getattr(from_hf, field), field
    for field in ("rope_theta", "rope_local_theta", "attention_scale", "embed_scale"):
        assert getattr(ckpt.config, field) == pytest.approx(getattr(from_hf, field)), field
    scaling, expected = ckpt.config.rope_scaling, from_hf.rope_scaling
    assert type(scaling) is type(expected)
    if expected is not None:  # the factors went through float32 tensors
        assert {k: pytest.approx(v) for k, v in vars(scaling).items()} == vars(expected)
    assert bool(ckpt.config.layer_windows) == (family != "qwen3")
    model = build_model(ckpt.config, ckpt.tensors, torch.float32, "cpu")
    g = torch.Generator().manual_seed(5)
    for L in (20, 70):  # inside, then past, the windows (and the LongRoPE original context of 48)
        ids = torch.randint(4, VOCAB, (1, L), generator=g)
        with torch.no_grad():
            expected = hf(input_ids=ids).logits
            rows = torch.arange(L)[None] + ckpt.config.rope_row_offset(L)  # LongRoPE: a long prompt's rows
            got = model(ids, rows, AttentionMetadata.fresh(torch.tensor([L])))
        assert_close(got, expected, rtol=1e-4, atol=1e-4)
