"""Prefix caching on SmolLM2-135M at its real shapes (30 layers, 3 KV heads of 64, float32, CPU).

A request sharing a ~480-token chat prefix with an earlier one must give a cold engine's greedy tokens
and first logits bit for bit (why that holds: tests/unit/test_engine_prefix.py). Here the first logits
are compared both ways, so a kernel that reorders sums at these shapes shows up as a named failure.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch

from lmserve.model.loader import load_model
from lmserve.server.engine import Engine
from lmserve.server.engine.request import Request, SamplingParams
from lmserve.server.engine.settings import EngineSettings

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
from test_engine_helpers import collect, wrap_step  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SYSTEM = ("You are a meticulous assistant for a logistics company. Answer questions about shipments, "
          "warehouses and delivery schedules. Always state assumptions, give numbers with units, and keep "
          "answers under five sentences. ") * 11


@pytest.fixture(scope="module")
def smol(smollm2_gguf_path):
    return load_model(smollm2_gguf_path, dtype=torch.float32, device="cpu")


def chat(loaded, question: str) -> list[int]:
    text = loaded.tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                 {"role": "user", "content": question}], add_generation_prompt=True)
    return loaded.tokenizer.encode(text)


def serve(loaded, requests, **settings):
    """Run requests one after another on a fresh engine; returns results and each one's first logits row."""
    async def main():
        engine = Engine(loaded, EngineSettings(max_model_len=1024, **settings)).start()
        first = {}

        def after(batch, logits):
            for i, seq in enumerate(batch.sampled()):
                first.setdefault(seq.request_id, logits[i].clone())
        wrap_step(engine, after=after)
        try:
            results = [(await collect(engine, r))[0] for r in requests]
            return results, first, engine.stats()
        finally:
            engine.shutdown()
    return asyncio.run(main())


def test_a_shared_system_prompt_hit_gives_the_cold_tokens_and_logits(smol):
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    first, second = chat(smol, "Where is shipment 4411?"), chat(smol, "How many pallets fit in a truck?")
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert shared > 300
    (_, hot), hot_logits, st = serve(smol, [Request(first, params), Request(second, params, request_id="b")])
    assert st.prefix_hit_tokens_total == shared
    (cold,), cold_logits, _ = serve(smol, [Request(second, params, request_id="b")], prefix_cache=False)
    assert hot.token_ids == cold.token_ids
    torch.testing.assert_close(hot_logits["b"], cold_logits["b"], atol=1e-3, rtol=0)  # near
    assert torch.equal(hot_logits["b"], cold_logits["b"])  # and exact
