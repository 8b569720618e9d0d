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

import mmap
import random
import shutil

import pytest
from torch.testing import assert_close

pytest.importorskip("transformers")

from family_helpers import FAMILIES, STEPS, VOCAB, hf_family, hf_greedy, prompts  # noqa: E402
from test_kv_cache import resident_pages  # noqa: E402
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


def shortest_hit(cfg, page_tokens: int, cached: int) -> int:
    """The shortest prefix hit an entry of `cached` positions serves: its sliding layers handed back the
    pages wholly below the window of its last query (position cached - 1), and a hit of m positions
    reads keys from m - w + 1 on."""
    last = cached - 1
    dropped = [max(0, last - w + 1) // page_tokens * page_tokens for w in set(cfg.layer_windows) if w]
    return max([d + w - 1 for d, w in zip(dropped, [w for w in set(cfg.layer_windows) if w]) if d], default=0)


async def test_chunked_prefill_and_a_prefix_hit_keep_the_tokens(family):
    """A prompt prefilled in chunks of 16 tokens (each continuing over the cache), then a second prompt
    sharing its first 70 tokens, served from the prefix cache where the first's entry still holds every
    window those 70 read (its sliding layers keep only the last window: where it does not, no hit), then
    the whole first conversation continued, served from its entry: all equal transformers."""
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
        third = first + a.token_ids + [rng.randrange(4, VOCAB) for _ in range(5)]
        c, _ = await collect(engine, Request(third, greedy(STEPS, ignore_eos=True)))
        whole = engine.stats().prefix_hit_tokens_total - before - hit
        page_tokens = engine.cache.page_tokens
    cached = len(first) + STEPS - 1  # the last token's K/V is never computed
    assert hit == (70 if shortest_hit(loaded.config, page_tokens, cached) <= 70 else 0)
    if name in ("mistral", "gemma3"):  # windows of 16 and 12 keys, pages of 32 positions: released keys
        assert hit == 0
    assert whole == cached
    assert a.token_ids == hf_greedy(hf, first)[0]
    assert b.token_ids == hf_greedy(hf, second)[0]
    assert c.token_ids == hf_greedy(hf, third)[0]


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
async def test_sliding_layers_keep_only_their_window_of_keys(name, trained_model_dir, native_kernels_dir, tmp_path):
    """A 40-token prompt decoded 100 steps (past windows of 16 and 12 keys many times; Gemma 3's n-gram
    drafts verified on the way): at each decode step every (layer, head) run of the slot holds exactly
    the pages of the positions written (global layers) or of those from the page of the window's first
    key on (sliding ones), counted with mincore (a page read would count too: no kernel reads below a
    window); the KV manager charges exactly that; what was handed back reads as zeros in the prefix
    entry the slot becomes; the tokens equal transformers'."""
    hf = hf_family(name)
    loaded = served(hf, tmp_path, trained_model_dir, native_kernels_dir)
    cfg = loaded.config
    prompt, steps = prompts(name)[0], 100
    seen = []
    with running(loaded) as engine:
        cache, kv = engine.cache, engine.scheduler.kv
        pt = cache.page_tokens
        page_bytes = pt * cfg.head_dim * 4  # one cache page of a run: a whole number of the system's pages

        def after(batch, logits):
            for i, seq in enumerate(batch.decode):
                runs = [[resident_pages(t[layer, seq.slot, h]) * mmap.PAGESIZE // page_bytes
                         for t in (cache.k, cache.v) for h in range(cfg.num_kv_heads)] for layer in range(cfg.num_layers)]
                seen.append((seq.num_cached, len(batch.draft_of(i)), kv.held(seq), runs))

        wrap_step(engine, after=after)
        result, _ = await collect(engine, Request(prompt, greedy(steps, ignore_eos=True)))
        (entry,) = kv.prefix_cache.entries()
        zeros = [int(cache.k[layer, entry.slot].abs().sum(-1).eq(0).sum()) for layer in range(cfg.num_layers)]
        unit = kv.page_weight
    assert result.token_ids == hf_greedy(hf, prompt, steps)[0]
    windows = [cfg.window(layer) for layer in range(cfg.num_layers)]
    assert any(windows) and max(windows) < 2 * pt and len(seen) > steps // 2
    top = len(prompt) - 1  # the highest position written so far (a rejected draft's too)
    for q, k, held, runs in seen:
        top = max(top, q + k)  # this step wrote positions q .. q + k
        pages = -(-(top + 1) // pt)
        expected = [pages - (max(0, q - w + 1) // pt if w else 0) for w in windows]
        assert runs == [[e] * (2 * cfg.num_kv_heads) for e in expected], q
        # a KV page spans num_layers / page_weight layers (all three for Mistral, one for this Gemma 3)
        assert held * cfg.num_layers == sum(expected) * unit, q
    # the sliding layers hold a window and at most two pages however long the sequence grows
    assert max(e for w, e in zip(windows, expected) if w) <= -(-max(windows) // pt) + 1 < pages
    # per layer, the positions reading as zeros: those never written and those handed back
    assert zeros == [cfg.num_kv_heads * (cache.max_len - (top + 1) + (max(0, q - w + 1) // pt * pt if w else 0))
                     for w in windows]


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
async def test_bfloat16_tokens_are_the_same_alone_batched_and_after_a_prefix_hit(name, trained_model_dir,
                                                                                  native_kernels_dir, tmp_path):
    """bfloat16 on the native CPU attention (sliding layers' prompt tokens as decode-kernel rows over their own
    windows, global layers' on the prompt kernel where the CPU has it): a request's greedy tokens do not depend
    on its batch, and after a prefix hit, or none where the entry's windows were handed back, they are the
    cold engine's (the default mode is batch-invariant)."""
    loaded = served(hf_family(name, seed=5), tmp_path, trained_model_dir, native_kernels_dir, "bfloat16")
    assert loaded.attention.name == "native"
    ps = prompts(name, seed=6)
    # the bfloat16 cache, both engines: `auto` times an int8 cache against it, and under load took int8,
    # whose pages of 512 positions hand no window back in these 121 positions (a hit where none is expected)
    with running(loaded, kv_cache_dtype="model") as engine:
        alone = [(await collect(engine, Request(p, greedy(32, ignore_eos=True))))[0].token_ids for p in ps]
        together = await results_of(engine, [Request(p, greedy(32, ignore_eos=True)) for p in ps])
        # 70 tokens of an entry whose sliding layers hold only the last window (no hit), then its whole
        # conversation continued (a hit of every position it cached)
        later = [ps[2][:70] + ps[0][:9], ps[2] + alone[2] + ps[0][:9]]
        hits, hot = [], []
        for p in later:
            before = engine.stats().prefix_hit_tokens_total
            hot.append((await collect(engine, Request(p, greedy(32, ignore_eos=True))))[0].token_ids)
            hits.append(engine.stats().prefix_hit_tokens_total - before)
        assert hits == [0, len(ps[2]) + 32 - 1]
    with running(loaded, prefix_cache=False, kv_cache_dtype="model") as engine:
        cold = [(await collect(engine, Request(p, greedy(32, ignore_eos=True))))[0].token_ids for p in later]
    assert [r.token_ids for r in together] == alone
    assert hot == cold
