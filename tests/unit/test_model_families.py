"""Every family served token-exact against transformers, through the path `lmserve serve` runs.

A tiny random-weight checkpoint of each family (Qwen3, Gemma 3, Phi-3 with LongRoPE, Mistral's
sliding window, Llama 3.1's RoPE scaling, and variants) is written by transformers with
save_pretrained, loaded by `load_model` in float32 on the CPU (the native decode-attention kernel
where the head size takes it, SDPA for prompts) and served by the engine. The oracle is transformers
itself: greedy decoding with its own KV cache, step by step, as `generate` does. The prompts are
longer than the sliding windows, and LongRoPE's prompts cross its original context in both ways
(a short prompt whose answer grows past it; a prompt already past it).
"""

from __future__ import annotations

import random
import shutil

import pytest
from torch.testing import assert_close

pytest.importorskip("transformers")

from family_helpers import FAMILIES, STEPS, VOCAB, hf_family, hf_greedy, prompts  # noqa: E402
from test_engine_helpers import collect, greedy, one_torch_thread, results_of, running, wrap_step  # noqa: E402,F401
from lmserve.model.loader import load_model  # noqa: E402
from lmserve.server.engine.request import Request  # noqa: E402


def served(hf, path, trained_model_dir, native_kernels_dir, dtype: str = "float32"):
    """hf saved to `path` with the trained tokenizer beside it, loaded as `lmserve serve` loads a directory."""
    hf.save_pretrained(path)
    for f in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(trained_model_dir / f, path / f)
    return load_model(path, dtype=dtype, quantization="none", device="cpu", cache_dir=native_kernels_dir)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, trained_model_dir, native_kernels_dir, tmp_path_factory):
    """(name, transformers model, the engine's LoadedModel) of one family, from a saved directory."""
    hf = hf_family(request.param)
    return request.param, hf, served(hf, tmp_path_factory.mktemp(request.param), trained_model_dir, native_kernels_dir)


def test_the_configs_read_back_as_their_family(family):
    name, hf, loaded = family
    cfg = loaded.config
    assert cfg.model_type == {"qwen3_sliding": "qwen3", "gemma3_linear_rope": "gemma3", "phi3_longrope": "phi3",
                              "llama31": "llama", "mistral_sdpa": "mistral"}.get(name, name)
    windows = [cfg.window(i) for i in range(cfg.num_layers)]
    expected = {"qwen3": [0, 0, 0], "qwen3_sliding": [0, 16, 16], "gemma3": [12, 0, 12],
                "gemma3_linear_rope": [16, 16, 16], "phi3_longrope": [16] * 3, "mistral": [16] * 3, "mistral_sdpa": [12] * 3,
                "llama31": [0] * 3}
    assert windows == expected[name]
    assert type(cfg.rope_scaling).__name__ == {"gemma3_linear_rope": "LinearRopeScaling",
                                               "phi3_longrope": "LongRopeScaling",
                                               "llama31": "RopeScaling"}.get(name, "NoneType")


async def test_greedy_tokens_equal_transformers_alone_and_batched(family):
    """64 greedy steps of each prompt: alone, then all at once (batch-invariant serving)."""
    name, hf, loaded = family
    ps = prompts(name)
    expected = [hf_greedy(hf, p)[0] for p in ps]
    with running(loaded) as engine:
        alone = [(await collect(engine, Request(p, greedy(STEPS, ignore_eos=True))))[0].token_ids for p in ps]
        together = await results_of(engine, [Request(p, greedy(STEPS, ignore_eos=True)) for p in ps])
    assert alone == expected
    assert [r.token_ids for r in together] == expected


async def test_first_logits_equal_transformers(family):
    name, hf, loaded = family
    p = prompts(name, seed=2)[1]
    _, expected = hf_greedy(hf, p, 1)
    seen = []
    with running(loaded) as engine:
        wrap_step(engine, after=lambda batch, logits: seen.append(logits[0].clone()) if batch.sampled() else None)
        await collect(engine, Request(p, greedy(1, ignore_eos=True)))
    assert expected.abs().max() > 1.0
    assert_close(seen[0], expected, rtol=1e-4, atol=1e-4)


async def test_chunked_prefill_and_a_prefix_hit_keep_the_tokens(family):
    """A prompt prefilled in chunks of 16 tokens (each continuing over the cache), then a second prompt
    sharing its first 70 tokens, served from the prefix cache: both equal transformers."""
    name, hf, loaded = family
    rng = random.Random(3)
    shared = [rng.randrange(4, VOCAB) for _ in range(70)]
    first = shared + [rng.randrange(4, VOCAB) for _ in range(6)]
    second = shared + [rng.randrange(4, VOCAB) for _ in range(9)]
    with running(loaded, token_budget=16) as engine:
        a, _ = await collect(engine, Request(first, greedy(STEPS, ignore_eos=True)))
        before = engine.stats().prefix_hit_tokens_total
        b, _ = await collect(engine, Request(second, greedy(STEPS, ignore_eos=True)))
        hit = engine.stats().prefix_hit_tokens_total - before
    assert hit == 70
    assert a.token_ids == hf_greedy(hf, first)[0]
    assert b.token_ids == hf_greedy(hf, second)[0]


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
async def test_bfloat16_tokens_are_the_same_alone_batched_and_after_a_prefix_hit(name, trained_model_dir,
                                                                                  native_kernels_dir, tmp_path):
    """bfloat16 on the native CPU attention (sliding layers' prompt tokens as decode-kernel rows over their own
    windows, global layers' on the prompt kernel where the CPU has it): a request's greedy tokens do not depend
    on its batch, and a prefix hit gives the cold engine's tokens (the default mode is batch-invariant)."""
    loaded = served(hf_family(name, seed=5), tmp_path, trained_model_dir, native_kernels_dir, "bfloat16")
    assert loaded.attention.name == "native"
    ps = prompts(name, seed=6)
    with running(loaded) as engine:
        alone = [(await collect(engine, Request(p, greedy(32, ignore_eos=True))))[0].token_ids for p in ps]
        together = await results_of(engine, [Request(p, greedy(32, ignore_eos=True)) for p in ps])
        before = engine.stats().prefix_hit_tokens_total
        hot, _ = await collect(engine, Request(ps[2][:70] + ps[0][:9], greedy(32, ignore_eos=True)))
        assert engine.stats().prefix_hit_tokens_total - before == 70
    with running(loaded, prefix_cache=False) as engine:
        cold, _ = await collect(engine, Request(ps[2][:70] + ps[0][:9], greedy(32, ignore_eos=True)))
    assert [r.token_ids for r in together] == alone
    assert hot.token_ids == cold.token_ids
