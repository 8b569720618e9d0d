"""SmolLM2-135M-Instruct from its GGUF: our loader + model vs transformers' own GGUF import.

transformers dequantizes the GGUF and undoes llama.cpp's Q/K row permutation with its own
code, so it is an independent oracle for the reader, the config and the forward pass.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from lmserve.model.attention.sdpa import AttentionMetadata
from lmserve.model.kv_cache import KVCache
from lmserve.model.llama import LlamaForCausalLM
from lmserve.model.loader import LoadedModel, load_model

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CHAT = [{"role": "user", "content": "Write a short poem about the sea."}]
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
N_NEW = 32


@pytest.fixture(scope="module")
def ours(smollm2_gguf_path) -> LoadedModel:
    return load_model(smollm2_gguf_path, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def oracle(smollm2_gguf_path):
    transformers.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf_path.parent, gguf_file=smollm2_gguf_path.name, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def chat_ids(loaded: LoadedModel, messages: list[dict]) -> list[int]:
    return loaded.tokenizer.encode(loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


@torch.no_grad()
def greedy_with_cache(model: LlamaForCausalLM, prompt: list[int], n: int, eos: set[int], slot: int = 1) -> list[int]:
    """Prefill the prompt into one KV-cache slot, then decode one token per step, argmax, stop at eos."""
    cache = KVCache(model.config, num_slots=slot + 1, max_len=len(prompt) + n, dtype=torch.float32)
    slots = torch.tensor([slot])
    L = len(prompt)
    meta = AttentionMetadata.for_cache(slots, torch.tensor([0]), torch.tensor([L]))
    logits = model(torch.tensor([prompt]), torch.arange(L)[None], meta, cache, logits_index=torch.tensor([L - 1]))  # [1, V]
    out = [int(logits[0].argmax())]
    while len(out) < n and out[-1] not in eos:
        pos = L + len(out) - 1  # position of the token just produced
        meta = AttentionMetadata.for_cache(slots, torch.tensor([pos]), torch.tensor([1]))
        logits = model(torch.tensor([[out[-1]]]), torch.tensor([[pos]]), meta, cache)[:, -1]  # [1, V]
        out.append(int(logits[0].argmax()))
    return out


def eos_ids(oracle) -> set[int]:
    eos = oracle.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def test_config_matches_transformers_reading_of_the_gguf(ours, oracle):
    hf = oracle.config
    cfg = ours.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers) == (hf.vocab_size, hf.hidden_size, hf.num_hidden_layers)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) == \
        (hf.num_attention_heads, hf.num_key_value_heads, hf.intermediate_size)
    assert cfg.tie_word_embeddings == bool(hf.tie_word_embeddings)
    assert cfg.rms_norm_eps == pytest.approx(hf.rms_norm_eps)


@torch.no_grad()
def test_chat_prompt_logits_match_transformers(ours, oracle):
    ids = chat_ids(ours, QUESTION)
    L = len(ids)
    expected = oracle(input_ids=torch.tensor([ids])).logits[0]  # [L, V]
    got = ours.model(torch.tensor([ids]), torch.arange(L)[None], AttentionMetadata.fresh(torch.tensor([L])))[0]
    assert expected.abs().max() > 10  # real, confident logits
    assert_close(got, expected, rtol=1e-4, atol=1e-3)
    # the KV-cached prefill path gives the same final-position logits
    cache = KVCache(ours.config, num_slots=3, max_len=L, dtype=torch.float32)
    meta = AttentionMetadata.for_cache(torch.tensor([2]), torch.tensor([0]), torch.tensor([L]))
    last = ours.model(torch.tensor([ids]), torch.arange(L)[None], meta, cache, logits_index=torch.tensor([L - 1]))
    assert_close(last[0], expected[-1], rtol=1e-4, atol=1e-3)


@torch.no_grad()
def test_greedy_continuation_matches_transformers_generate(ours, oracle):
    ids = chat_ids(ours, CHAT)
    eos = eos_ids(oracle)
    prompt = torch.tensor([ids])
    generated = oracle.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=N_NEW,
                                do_sample=False, pad_token_id=next(iter(eos), 0))
    expected = generated[0, len(ids):].tolist()
    got = greedy_with_cache(ours.model, ids, N_NEW, eos)
    assert len(expected) == N_NEW, "the oracle stopped early: pick a prompt with a longer answer"
    assert got == expected, (ours.tokenizer.decode(got), ours.tokenizer.decode(expected))


def test_the_serving_engine_in_float32_matches_transformers_generate(ours, oracle):
    """Through the engine's own path: packed prefill, then decode steps on the CPU decode-attention kernel
    (ours loads it), alone and beside a second request. float32 stays token-exact with transformers."""
    import asyncio

    from lmserve.server.engine import Engine, EngineSettings, Request, SamplingParams

    assert ours.attention.name == "native"  # the path under test: the decode kernel
    ids = chat_ids(ours, CHAT)
    prompt = torch.tensor([ids])
    with torch.no_grad():
        generated = oracle.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=N_NEW,
                                    do_sample=False, pad_token_id=next(iter(eos_ids(oracle)), 0))
    expected = generated[0, len(ids):].tolist()
    other = chat_ids(ours, QUESTION)
    engine = Engine(ours, EngineSettings(max_batch=4, max_model_len=256, prefix_cache=False)).start()

    async def tokens(prompt_ids):
        out = []
        async for ch in engine.generate(Request(list(prompt_ids), SamplingParams(max_new_tokens=N_NEW, ignore_eos=True))):
            out += ch.token_ids
        return out

    async def both():
        return await asyncio.gather(tokens(ids), tokens(other))

    try:
        alone = asyncio.run(tokens(ids))
        batched, _ = asyncio.run(both())
    finally:
        engine.shutdown()
    assert alone == expected, (ours.tokenizer.decode(alone), ours.tokenizer.decode(expected))
    assert batched == expected
