"""Shared builders for the engine tests (this module holds no tests).

Models: the memorizing model trained by lmserve's trainer (tests/fixtures/trained_model.py, a plugin
of tests/conftest.py) and small random Llama models sharing its sentencepiece tokenizer, CPU float32.
Oracle: `greedy_reference` decodes by a full forward over the whole sequence at every step
(no KV cache, no scheduler, no runner), the independent check for the engine's cached path.
"""

from __future__ import annotations

import asyncio
import random
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import pytest
import torch

from fixtures.trained_model import prompt_continuations  # noqa: F401 - re-exported for the test modules
from lmserve.model.attention.sdpa import AttentionMetadata
from lmserve.model.config import ModelConfig
from lmserve.model.llama import LlamaForCausalLM
from lmserve.model.loader import LoadedModel, load_model
from lmserve.model.text.tokenizer import Tokenizer
from lmserve.server.engine import Engine
from lmserve.server.engine.outputs import GenerationChunk, GenerationResult
from lmserve.server.engine.request import Request, SamplingParams
from lmserve.server.engine.settings import EngineSettings

CPU = torch.device("cpu")
FIRST_PLAIN_ID = 4  # the trained tokenizer's ids 0..3 are unk, bos, eos, pad


# ---- models ---------------------------------------------------------------------------------

@contextmanager
def single_torch_thread() -> Iterator[None]:
    """Tiny matrices: one intra-op thread is as fast, and avoids thread oversubscription (spinning
    OpenMP workers of the engine thread and the test thread) that slows a busy machine 40-fold."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def one_torch_thread():
    with single_torch_thread():
        yield


@pytest.fixture(scope="session")
def trained(trained_model_dir, native_kernels_dir) -> LoadedModel:
    """The memorizing model: peaked logits, greedy decoding reproduces its corpus (its kernels in the
    session's cache, not the user's)."""
    return load_model(trained_model_dir, dtype=torch.float32, device="cpu", cache_dir=native_kernels_dir)


@pytest.fixture(scope="session")
def random_tiny(trained) -> LoadedModel:
    """A random (untrained) model over the trained tokenizer's vocabulary: flat, arbitrary logits."""
    return tiny_loaded(trained.tokenizer, seed=0)


def tiny_config(vocab_size: int, max_pos: int = 256) -> ModelConfig:
    return ModelConfig(vocab_size=vocab_size, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=16, intermediate_size=128, max_position_embeddings=max_pos,
                       bos_token_id=1, eos_token_ids=(2,), name="tiny-random")


def tiny_loaded(tokenizer: Tokenizer, seed: int = 0, vocab_size: int | None = None, std: float = 0.15,
                max_pos: int = 256) -> LoadedModel:
    """A random untied model. std 0.15 spreads the logits (std ~1) so that greedy choices are
    separated by far more than float32 batching noise."""
    cfg = tiny_config(vocab_size or tokenizer.vocab_size, max_pos)
    model = LlamaForCausalLM(cfg).init_weights(std, generator=torch.Generator().manual_seed(seed))
    model.eval().requires_grad_(False)
    return LoadedModel(model=model, tokenizer=tokenizer, config=cfg, source=None, dtype=torch.float32, device=CPU)


def corpus_prompt(tokenizer: Tokenizer, prefix: str) -> list[int]:
    """bos + tokens, the way the trainer framed each document."""
    return [tokenizer.bos_id, *tokenizer.encode(prefix)]


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_PLAIN_ID, vocab_size) for _ in range(length)]


# ---- the oracle -----------------------------------------------------------------------------

@torch.inference_mode()
def full_forward_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """Logits [L, V] of a whole sequence in one cache-free forward."""
    L = len(ids)
    meta = AttentionMetadata.fresh(torch.tensor([L]), L)
    return model(torch.tensor([ids]), torch.arange(L)[None], meta)[0]  # [L, V]


def greedy_reference(model: LlamaForCausalLM, prompt: list[int], max_new: int,
                     stop_ids: tuple[int, ...] = ()) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens by full recompute each step, and the logits row each token was chosen from."""
    ids, out, rows = list(prompt), [], []
    for _ in range(max_new):
        logits = full_forward_logits(model, ids)[-1]  # [V]
        tok = int(logits.argmax())
        out.append(tok)
        rows.append(logits)
        if tok in stop_ids:
            break
        ids.append(tok)
    return out, rows


# ---- running the engine ---------------------------------------------------------------------

@contextmanager
def running(loaded: LoadedModel, **settings) -> Iterator[Engine]:
    """A started engine, shut down on exit; then its slot and KV block accounting must balance."""
    engine = Engine(loaded, EngineSettings(**settings)).start()
    try:
        yield engine
    except BaseException:
        engine.shutdown()
        raise
    engine.shutdown()
    assert_kv_returned(engine)


def assert_kv_returned(engine: Engine) -> None:
    """Every slot handed to a request came back, the blocks still held are exactly the prefix cache's,
    and once the cache is dropped every block allocated was freed."""
    s = engine.stats()
    assert s.slots_used == 0 and s.slots_allocated_total == s.slots_freed_total
    assert s.kv_pages_used == s.prefix_cache_pages == s.kv_pages_allocated_total - s.kv_pages_freed_total
    engine.drop_prefix_cache()
    s = engine.stats()
    assert s.kv_pages_used == 0 and s.kv_pages_allocated_total == s.kv_pages_freed_total
    assert s.prefix_cache_entries == 0 and engine.scheduler.kv.slots.used == 0


async def collect(engine: Engine, request: Request) -> tuple[GenerationResult, list[GenerationChunk]]:
    """Submit and read the whole stream."""
    chunks = []
    result = GenerationResult(request.request_id)
    async for chunk in engine.generate(request):
        chunks.append(chunk)
        result.add(chunk)
    return result, chunks


async def results_of(engine: Engine, requests: list[Request]) -> list[GenerationResult]:
    return [r for r, _ in await asyncio.gather(*(collect(engine, q) for q in requests))]


async def wait_until(condition: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    """Poll until `condition()` holds; fail (not hang) if it never does."""
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


async def wait_idle(engine: Engine) -> None:
    """Wait until the engine holds no request and every slot it handed out came back."""
    def idle() -> bool:
        s = engine.stats()
        return s.running == 0 and s.waiting == 0 and s.slots_used == 0
    await wait_until(idle, "the engine to go idle")
    s = engine.stats()
    assert s.slots_allocated_total == s.slots_freed_total
    assert s.kv_pages_used == s.prefix_cache_pages == s.kv_pages_allocated_total - s.kv_pages_freed_total


def wrap_step(engine: Engine, after: Callable | None = None, before: Callable | None = None) -> list:
    """Wrap the runner's step: before(batch) runs first; after(batch, logits) may return new logits.

    Returns the list of batches seen, each as the request ids it held (prefill and decode).
    """
    inner = engine.runner.step
    seen: list[list[str]] = []

    def step(batch, previous=None):
        seen.append([c.seq.request_id for c in batch.prefill] + [s.request_id for s in batch.decode])
        if before is not None:
            before(batch)
        logits = inner(batch, previous)
        if after is not None:
            replaced = after(batch, logits)
            if replaced is not None:
                logits = replaced
        return logits

    engine.runner.step = step
    return seen


def greedy(max_new_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, **kw)
