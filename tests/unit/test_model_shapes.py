"""The benchmark's random-weight checkpoints: blocks the gguf package decodes to weights of the intended
size, llama.cpp's Q4_K_M type recipe, and files lmserve reads back as the shape they claim."""

from __future__ import annotations

import numpy as np
import pytest

from lmserve.model.config import ModelConfig
from lmserve.model.checkpoints.gguf_reader import read_gguf
from lmserve.server.bench.model_shapes import SHAPES, SIGMA, Shape, random_blocks, tensor_types, write_gguf, write_hf_dir

gguf = pytest.importorskip("gguf")


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_random_blocks_decode_to_centred_weights_of_the_intended_spread(qtype):
    rows, cols = 64, 1024
    raw = random_blocks(qtype, rows, cols, np.random.default_rng(1))
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])  # the package's own decoder
    assert w.shape == (rows, cols) and np.isfinite(w).all()
    assert abs(w.mean()) < 0.15 * SIGMA  # Q4_0's codes -8..7 average half a step below 0
    assert 0.8 * SIGMA < w.std() < 1.2 * SIGMA


def test_q4_k_m_recipe_gives_more_bits_to_an_eighth_at_each_end_and_every_third_between():
    shape = SHAPES["llama-3.2-1b"]  # 16 layers: 0, 1, 14, 15 and (i - 2) % 3 == 2: 4, 7, 10, 13
    types = tensor_types(shape, "q4_k_m")
    six = sorted(int(n.split(".")[1]) for n, t in types.items() if t == "Q6_K" and "ffn_down" in n)
    assert six == [0, 1, 4, 7, 10, 13, 14, 15]
    assert all(t == "Q4_K" for n, t in types.items() if "attn_q" in n or "ffn_gate" in n)
    untied = tensor_types(SHAPES["llama-3.1-8b"], "q4_k_m")
    assert untied["output.weight"] == "Q6_K" and "output.weight" not in types


TINY = Shape("tiny", hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, ffn=512, tied=False)


@pytest.mark.parametrize("fmt", ["q4_k_m", "q4_0"])
def test_a_written_gguf_reads_back_as_its_shape(fmt, tmp_path, smollm2_gguf_path):
    path = write_gguf(TINY, fmt, tmp_path / "tiny.gguf", smollm2_gguf_path)
    ckpt = read_gguf(path)
    cfg = ckpt.config
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == \
        (256, 2, 4, 2, 64, 512)
    assert cfg.vocab_size == len(ckpt.metadata["tokenizer.ggml.tokens"]) and not cfg.tie_word_embeddings
    q = ckpt.tensors["model.layers.1.mlp.down_proj.weight"]
    assert q.shape == (256, 512) and 0.8 * SIGMA < float(q.std()) < 1.2 * SIGMA


def test_a_written_hf_directory_reads_back_with_the_tokenizer(tmp_path, smollm2_gguf_path):
    from lmserve.model.loader import read_hf_dir
    from lmserve.model.text.tokenizer import Tokenizer

    out = write_hf_dir(TINY, "bf16", tmp_path / "tiny", smollm2_gguf_path)
    cfg, tensors = read_hf_dir(out)
    assert cfg == ModelConfig.from_hf(out / "config.json", name="tiny")
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (256, 256)
    text = "Write a haiku about the sea. <|im_start|>"
    with open(smollm2_gguf_path, "rb") as f:
        import mmap

        from lmserve.model.checkpoints.gguf_reader import read_directory
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            original = Tokenizer.from_gguf_fields(read_directory(buf)[0])
    saved = Tokenizer.from_dir(out)
    assert saved.encode(text) == original.encode(text)
    assert (saved.bos_id, saved.eos_ids, saved.chat_template) == (original.bos_id, original.eos_ids, original.chat_template)
