"""The serving layout of the linear layers (fused projections, oneDNN-prepacked weights).

Oracle: the same model before `prepare_for_inference` (plain nn.Linear per HF projection).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from lmserve.model.attention.sdpa import AttentionMetadata
from lmserve.model.config import ModelConfig
from lmserve.model.linear.serving import inference_linear
from lmserve.model.linear.kernels import OneDNNLinear
from lmserve.model.linear.kernels import DenseLinear
from lmserve.model.kv_cache import KVCache
from lmserve.model.llama import LlamaForCausalLM


def make_pair(bias: bool, tied: bool, dtype=torch.float32, seed: int = 0):
    cfg = ModelConfig(vocab_size=101, hidden_size=48, num_layers=2, num_heads=6, num_kv_heads=2, head_dim=8,
                      intermediate_size=80, max_position_embeddings=64, attention_bias=bias,
                      tie_word_embeddings=tied)
    plain = LlamaForCausalLM(cfg).init_weights(0.2, generator=torch.Generator().manual_seed(seed)).eval()
    if bias:  # init_weights zeroes biases: make them matter
        with torch.no_grad():
            for name, p in plain.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    plain = plain.to(dtype)
    return cfg, plain, copy.deepcopy(plain).prepare_for_inference()


@pytest.mark.parametrize("bias,tied", [(False, True), (True, False)])
def test_prepared_model_matches_the_plain_one_in_prefill_and_cached_decode(bias, tied):
    cfg, plain, fast = make_pair(bias, tied)
    ids = torch.randint(0, cfg.vocab_size, (3, 9), generator=torch.Generator().manual_seed(1))
    q_lens = torch.tensor([9, 5, 7])
    outs = []
    with torch.no_grad():
        for model in (plain, fast):
            cache = KVCache(cfg, 3, 16, torch.float32)
            slots = torch.arange(3)
            meta = AttentionMetadata.for_cache(slots, torch.zeros(3, dtype=torch.long), q_lens, 9)
            prefill = model(ids, torch.arange(9).expand(3, 9), meta, cache)
            nxt = prefill[torch.arange(3), q_lens - 1].argmax(-1)[:, None]  # [3, 1]
            meta = AttentionMetadata.for_cache(slots, q_lens, torch.ones(3, dtype=torch.long), 1)
            decode = model(nxt, q_lens[:, None], meta, cache)
            outs.append((prefill, decode))
    (p_plain, d_plain), (p_fast, d_fast) = outs
    valid = torch.arange(9)[None, :] < q_lens[:, None]
    assert_close(p_fast[valid], p_plain[valid], rtol=1e-5, atol=1e-5)
    assert_close(d_fast, d_plain, rtol=1e-5, atol=1e-5)
    assert p_plain.abs().max() > 1.0  # logits far from zero: the comparison means something


def test_cpu_float32_takes_the_prepacked_path_and_other_dtypes_the_dense_kernel():
    _, _, fast = make_pair(False, True)
    attn, mlp = fast.model.layers[0].self_attn, fast.model.layers[0].mlp
    for layer in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj, fast.lm_head):
        assert isinstance(layer, OneDNNLinear)
    assert not hasattr(attn, "q_proj") and not hasattr(mlp, "up_proj")  # originals released
    _, _, bf16 = make_pair(False, True, dtype=torch.bfloat16)
    assert type(bf16.model.layers[0].self_attn.qkv_proj) is DenseLinear


def test_bf16_fallback_still_matches_the_plain_model():
    cfg, plain, fast = make_pair(True, False, dtype=torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3))
    meta = AttentionMetadata.fresh(torch.tensor([6, 6]))
    with torch.no_grad():
        a = plain(ids, torch.arange(6).expand(2, 6), meta)
        b = fast(ids, torch.arange(6).expand(2, 6), meta)
    assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-2)  # bf16: fused GEMM rounds differently


def test_prepacked_rows_do_not_depend_on_the_batch_size():
    """Greedy batch invariance relies on it: row i is bitwise the same whatever else is in the batch."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(300, 64, generator=g), torch.randn(300, generator=g)
    layer = inference_linear(w, b)
    x = torch.randn(40, 64, generator=g)
    full = layer(x)
    assert_close(full, x @ w.T + b, rtol=1e-5, atol=1e-4)
    for n in (1, 3, 8, 17):
        assert torch.equal(layer(x[:n]), full[:n])


def test_weight_bytes_count_the_prepacked_copies():
    cfg, plain, fast = make_pair(False, True)
    D, V = cfg.hidden_size, cfg.vocab_size
    # tied: the plain model holds the embedding once; the prepared one adds a packed LM head copy
    assert fast.weight_bytes() == plain.weight_bytes() + V * D * 4
    cfg, plain, fast = make_pair(True, False)
    assert fast.weight_bytes() == plain.weight_bytes()


def test_prepare_is_idempotent():
    _, _, fast = make_pair(False, True)
    head = fast.lm_head
    assert fast.prepare_for_inference().lm_head is head


def forward_once(model, cfg, ids):
    cache = KVCache(cfg, ids.shape[0], 16, next(model.parameters()).dtype)
    meta = AttentionMetadata.for_cache(torch.arange(ids.shape[0]), torch.zeros(ids.shape[0], dtype=torch.long),
                                       torch.full((ids.shape[0],), ids.shape[1]), ids.shape[1])
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1]).expand(*ids.shape), meta, cache)


@pytest.mark.parametrize("bias", [False, True])
def test_frozen_attributes_serve_the_same_logits_and_a_conversion_drops_them(bias):
    """freeze_attributes only changes how attributes are found (the instance dict, not nn.Module's
    registries): the same logits, bit for bit. A later conversion replaces buffers and parameters;
    the plain copies must go with it, or the model would compute with the old tensors."""
    cfg, model, _ = make_pair(bias, False)  # unprepared: its linears convert between dtypes
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(2))
    before = forward_once(model, cfg, ids)
    model.freeze_attributes()
    layer = model.model.layers[0]
    assert "q_proj" in layer.self_attn.__dict__ and "weight" in layer.input_layernorm.__dict__
    assert torch.equal(forward_once(model, cfg, ids), before)
    model.to(torch.bfloat16)
    assert "q_proj" not in layer.self_attn.__dict__ and layer.input_layernorm.weight.dtype == torch.bfloat16
    converted = forward_once(model, cfg, ids)
    assert converted.dtype == torch.bfloat16
    assert_close(converted.float(), before, rtol=0.1, atol=0.1)
