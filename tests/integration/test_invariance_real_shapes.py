"""The default mode's promise at real shapes, on this machine's instruction set: a request's greedy tokens
and their logprobs are bitwise the same alone on one thread, batched on two, with its prompt prefilled in
16-token chunks, and after a prefix hit.

Models: SmolLM2-135M in bfloat16+int4 (its Q4_1 file as it is), Gemma 3 270M in bfloat16+kquant (its own
Q4_K_M blocks; sliding and global layers), and two layers of the Llama-3.2-1B shape in bfloat16+kquant
(random Q4_K_M blocks: the 1B model's matrix and head shapes, where a kernel's reduction order could
change with the rows it is given). The oracle is the property itself: the same request computed four ways.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lmserve.model.loader import load_model
from lmserve.server.bench.model_shapes import SHAPES, write_gguf
from lmserve.server.engine.request import Request, SamplingParams

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
from test_engine_helpers import collect, results_of, running, single_torch_thread  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TEXTS = ("Name three colors of the rainbow, say where each one comes from in the sky, and why the order never changes.",
         "What is a prime number? Give two examples and one number that is not prime, with the reason.",
         "Write a short note to a neighbour asking them to water the plants while you are away for a week "
         "in the mountains, and thank them for the help last summer with the garden fence.",
         "List four animals that live in the ocean, one line each, with what they eat and how deep they swim.")
NEW_TOKENS = 10


@pytest.fixture(scope="module", params=["smollm2", "gemma3", "llama-3.2-1b-layers"])
def served(request, native_kernels_dir, tmp_path_factory):
    """(name, the model loaded in the mode it is served in by default on a CPU)."""
    name = request.param
    if name == "smollm2":
        path, quantization = request.getfixturevalue("smollm2_gguf_path"), "int4"
    elif name == "gemma3":
        path, quantization = request.getfixturevalue("gemma3_gguf_path"), "kquant"
    else:
        shape = replace(SHAPES["llama-3.2-1b"], layers=2)
        path = write_gguf(shape, "q4_k_m", tmp_path_factory.mktemp("shape") / "1b-layers.gguf",
                          request.getfixturevalue("smollm2_gguf_path"))
        quantization = "kquant"
    return name, load_model(path, dtype=torch.bfloat16, quantization=quantization, device="cpu",
                            cache_dir=native_kernels_dir)


def _requests(loaded) -> list[Request]:
    tok = loaded.tokenizer
    return [Request(tok.encode(t), SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                                  logprobs=0)) for t in TEXTS]


def _answers(results) -> list[tuple[list[int], list[float]]]:
    return [(list(r.token_ids), [lp.logprob for lp in r.logprobs]) for r in results]


def test_greedy_tokens_and_logprobs_are_the_same_alone_batched_chunked_and_after_a_hit(served):
    name, loaded = served

    async def alone(engine):
        return [(await collect(engine, r))[0] for r in _requests(loaded)]

    with single_torch_thread(), running(loaded, prefix_cache=False) as engine:  # the engine takes 1 thread
        reference = _answers(asyncio.run(alone(engine)))
    assert all(len(t) == NEW_TOKENS and len(lp) == NEW_TOKENS for t, lp in reference)
    with running(loaded, prefix_cache=False) as engine:
        batched = _answers(asyncio.run(results_of(engine, _requests(loaded))))
    with running(loaded, prefix_cache=False, token_budget=16) as engine:
        chunked = _answers(asyncio.run(results_of(engine, _requests(loaded))))
    with running(loaded) as engine:
        asyncio.run(results_of(engine, _requests(loaded)))
        hot, hits = [], []
        for r in _requests(loaded):  # one at a time, each finding its own prompt cached
            before = engine.stats().prefix_hit_tokens_total
            hot.append(_answers([asyncio.run(collect(engine, r))[0]])[0])
            hits.append(engine.stats().prefix_hit_tokens_total - before)
    for way, got in (("batched", batched), ("chunked", chunked), ("after a prefix hit", hot)):
        for text, want, have in zip(TEXTS, reference, got):
            assert have == want, f"{name}: {way} differs from alone for {text!r}"
    assert all(h > 0 for h in hits), hits  # (a prompt shorter than a cache page would find none)
