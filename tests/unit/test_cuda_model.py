"""The model and the engine on CUDA: SDPA on the GPU, in float32 and in bfloat16 (the CUDA default).

CI has no GPU, so this module is skipped there. On a CUDA host:

    pytest tests/unit/test_cuda_model.py tests/integration/test_cuda_metrics.py

Oracles: the explicit attention and transformers in float32 on the CPU, and the corpus the trained
fixture memorized. Each check prints what it measured, so a run on a GPU host is also a report.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.testing import assert_close

from lmserve.model.attention.sdpa import AttentionMetadata, attend_calls
from oracles import explicit_attention
from lmserve.model.kv_cache import KVCache
from lmserve.model.loader import load_model
from lmserve.server.engine.cuda_graphs import DecodeGraphs
from lmserve.server.engine.request import FinishReason, Request
from fixtures.trained_model import corpus_paragraphs, prompt_continuations
from test_engine_helpers import corpus_prompt, greedy, results_of, running

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")

CUDA = torch.device("cuda")
DTYPES = [torch.float32, torch.bfloat16]
# bfloat16 keeps 8 significant bits: attention outputs of order 1 agree with float32 to a few 1e-2.
ATTENTION_TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}
FUSED_SDPA = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
              "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward")


def _cpu(x):
    return x.cpu() if torch.is_tensor(x) else x


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_calls_on_cuda_match_the_explicit_attention(dtype):
    # scattered slots, mixed cache and query lengths (chunk continuations with right padding), GQA
    slots, starts, q_lens = (torch.tensor(x, device=CUDA) for x in ([6, 1, 3, 0, 9], [40, 2, 7, 0, 3], [1, 3, 1, 2, 4]))
    meta = AttentionMetadata.for_cache(slots, starts, q_lens)
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, d = 6, 2, 64
    k_cache, v_cache = (torch.randn(12, kv_heads, 64, d, generator=g).to(dtype).float() for _ in range(2))
    L = meta.mask.shape[2]
    q = (torch.randn(len(q_lens), heads, L, d, generator=g) * 3).to(dtype).float()  # inputs exact in both dtypes
    out = attend_calls(q.to(CUDA, dtype), k_cache.to(CUDA, dtype), v_cache.to(CUDA, dtype), meta).float().cpu()

    rows, mask, S = _cpu(meta.rows), meta.mask.cpu(), meta.mask.shape[-1]
    q_rows = q.new_zeros(meta.hi - meta.lo, heads, L, d)
    q_rows[rows] = q
    ref, _ = explicit_attention(q_rows, k_cache[meta.lo: meta.hi, :, :S], v_cache[meta.lo: meta.hi, :, :S], mask)
    real = torch.arange(L)[None, :] < q_lens.cpu()[:, None]  # padding queries are not compared
    got, want = out.transpose(1, 2)[real], ref[rows].transpose(1, 2)[real]
    print(f"{dtype}: max |cuda - explicit| = {(got - want).abs().max():.2e}")
    assert_close(got, want, **ATTENTION_TOL[dtype])


def _paragraph_ids(loaded, n_tokens: int = 64) -> list[list[int]]:
    return [[loaded.tokenizer.bos_id, *loaded.tokenizer.encode(p)][:n_tokens] for p in corpus_paragraphs()]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@torch.inference_mode()
def test_logits_on_cuda_match_transformers_on_the_cpu(trained_model_dir, dtype):
    transformers = pytest.importorskip("transformers")
    oracle = transformers.AutoModelForCausalLM.from_pretrained(trained_model_dir, dtype=torch.float32).eval()
    ours = load_model(trained_model_dir, dtype=dtype, device=CUDA)
    worst, disagreements, decided = 0.0, 0, 0
    for ids in _paragraph_ids(ours):
        L = len(ids)
        want = oracle(input_ids=torch.tensor([ids])).logits[0]  # [L, V]
        meta = AttentionMetadata.fresh(torch.tensor([L], device=CUDA))
        got = ours.model(torch.tensor([ids], device=CUDA), torch.arange(L, device=CUDA)[None], meta)[0].float().cpu()
        if dtype == torch.float32:
            assert_close(got, want, rtol=1e-4, atol=1e-3)
        worst = max(worst, float((got - want).abs().max() / want.abs().max()))
        top2 = want.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.05 * want.abs().max()  # decisions bf16 rounding cannot flip
        decided += int(clear.sum())
        disagreements += int((got.argmax(-1) != want.argmax(-1))[clear].sum())
    print(f"{dtype}: max |cuda - transformers| / max |logit| = {worst:.2e}; "
          f"argmax disagreements on {decided} clear positions: {disagreements}")
    assert decided > 100 and disagreements == 0
    assert worst < (1e-4 if dtype == torch.float32 else 3e-2)


@torch.inference_mode()
def test_sdpa_runs_fused_kernels_on_cuda_in_bfloat16(trained_model_dir):
    """Packed prefill (causal calls) and decode over the cache (masked calls) both reach a fused
    SDPA backend; the math fallback would be correct but slow and memory-hungry."""
    from torch.profiler import ProfilerActivity, profile

    loaded = load_model(trained_model_dir, dtype=torch.bfloat16, device=CUDA)
    prompts = _paragraph_ids(loaded, 24)[:3]
    lens = torch.tensor([len(p) for p in prompts], device=CUDA)
    slots = torch.tensor([2, 0, 1], device=CUDA)
    cache = KVCache(loaded.config, 3, 64, torch.bfloat16, CUDA)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        meta, positions = AttentionMetadata.packed(slots, lens)
        ids = torch.tensor([t for p in prompts for t in p], device=CUDA)[None]
        last = loaded.model(ids, positions, meta, cache, logits_index=lens.cumsum(0) - 1).argmax(-1)  # [3]
        meta = AttentionMetadata.for_cache(slots, lens, torch.ones_like(lens))
        loaded.model(last[:, None], lens[:, None], meta, cache)
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages()}
    sdpa = sorted(n for n in names if "attention" in n.lower() or "fmha" in n.lower() or "flash" in n.lower())
    print("attention ops and kernels:", *sdpa, sep="\n  ")
    assert not any("_scaled_dot_product_attention_math" in n for n in names), sdpa
    assert any(any(f in n for f in FUSED_SDPA) for n in names), sdpa


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@torch.inference_mode()
def test_graph_replayed_decode_matches_the_eager_decode(trained_model_dir, dtype):
    """Replays in every bucket (padding rows included) give the eager decode's logits and K/V writes,
    with the caches full of other sequences' keys."""
    loaded = load_model(trained_model_dir, dtype=dtype, device=CUDA)
    cfg, slots_n, max_len = loaded.config, 8, 64
    eager, cached = KVCache(cfg, slots_n, max_len, dtype, CUDA), KVCache(cfg, slots_n, max_len, dtype, CUDA)
    graphs = DecodeGraphs(loaded.model, cached, slots_n)
    assert graphs.buckets == [1, 2, 4, 8]
    g = torch.Generator(device=CUDA).manual_seed(0)
    eager.k.normal_(generator=g)
    eager.v.normal_(generator=g)
    cached.k.copy_(eager.k)
    cached.v.copy_(eager.v)
    rng = random.Random(0)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for n in (1, 3, 8, 2, 5):  # buckets 1, 4, 8, 2, 8: padded rows in two of them
        slots = rng.sample(range(slots_n), n)
        positions = [rng.randrange(max_len) for _ in range(n)]
        ids = [rng.randrange(cfg.vocab_size) for _ in range(n)]
        pos_t = torch.tensor(positions, device=CUDA)
        meta = AttentionMetadata.for_cache(torch.tensor(slots, device=CUDA), pos_t, torch.ones_like(pos_t), 1)
        want = loaded.model(torch.tensor(ids, device=CUDA)[:, None], pos_t[:, None], meta, eager)[:, 0].float()
        got = graphs.run(torch.tensor(ids, device=CUDA), positions, slots).float()
        scale = float(want.abs().max())
        print(f"{dtype} n={n}: max |graph - eager| / max |logit| = {float((got - want).abs().max()) / scale:.2e}")
        assert float((got - want).abs().max()) <= tol * scale
        assert_close(cached.k.float(), eager.k.float(), rtol=tol, atol=tol)
    assert graphs.replays == 5


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
async def test_engine_on_cuda_reproduces_the_memorized_corpus(trained_model_dir, dtype, graphs):
    """Every training prompt at once through the engine (packed prefill, batched decode, sampling on
    the GPU): each continues its paragraph word for word and stops at eos."""
    loaded = load_model(trained_model_dir, dtype=dtype, device=CUDA)
    tok = loaded.tokenizer
    pairs = prompt_continuations()
    prompts = [corpus_prompt(tok, prefix) for prefix, _ in pairs]
    with running(loaded, max_batch=len(prompts), cuda_graphs=graphs) as engine:
        results = await results_of(engine, [Request(p, greedy(120 - len(p))) for p in prompts])
        stats = engine.stats()
        replays = engine.runner.graphs.replays if graphs else 0
    wrong = [(prefix, res.text) for (prefix, continuation), res in zip(pairs, results)
             if res.finish_reason is not FinishReason.EOS or res.text != continuation]
    print(f"{dtype}: {len(results) - len(wrong)} of {len(results)} continuations exact")
    assert not wrong, wrong
    assert stats.slots_allocated_total == stats.slots_freed_total == len(prompts)
    assert (replays > 50) is graphs  # the decode steps did run from graphs


async def test_overlapped_decode_steps_launch_without_waiting_for_the_device(trained_model_dir):
    """The engine's default on CUDA: each decode step is launched while the one before it runs. Its
    inputs (fed by the previous step's tokens on the device), the graph replay and greedy sampling run
    under CUDA's sync debug mode set to error, so any call among them that waits for the device
    raises and fails the step's requests; the corpus must still come out word for word."""
    loaded = load_model(trained_model_dir, dtype=torch.bfloat16, device=CUDA)
    pairs = prompt_continuations()
    prompts = [corpus_prompt(loaded.tokenizer, prefix) for prefix, _ in pairs]
    with running(loaded, max_batch=len(prompts)) as engine:
        assert engine.overlap and engine.runner.graphs is not None
        inner, guarded = engine.runner.run, []

        def run(batch, previous=None):
            if previous is None or batch.prefill:
                return inner(batch, previous)
            torch.cuda.set_sync_debug_mode("error")
            try:
                out = inner(batch, previous)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            guarded.append(len(batch.decode))
            return out

        engine.runner.run = run
        results = await results_of(engine, [Request(p, greedy(120 - len(p))) for p in prompts])
    wrong = [(prefix, res.text, res.error) for (prefix, continuation), res in zip(pairs, results)
             if res.finish_reason is not FinishReason.EOS or res.text != continuation]
    print(f"{len(guarded)} decode steps launched without a device sync")
    assert not wrong, wrong
    assert len(guarded) > 50


# ---- the paged attention (model/attention/paged.py, model/paged_kv_cache.py) --------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_kernel_on_cuda_matches_the_reference_and_is_batch_invariant(dtype):
    """The compiled Triton kernel against the torch reference of the same contract (float32 on the CPU),
    with GQA, a sliding window, decode rows and chunks in one call; a sequence's rows bitwise the same
    alone as in the batch."""
    pytest.importorskip("triton")
    from lmserve.model.attention.paged import Tiles, paged_attention, paged_attention_reference, tile_rows

    g = torch.Generator().manual_seed(0)
    H, Hkv, d, page = 8, 2, 64, 16
    lengths, q_lens = [5, 40, 17, 64, 16], [1, 12, 1, 30, 16]
    num_pages = sum(-(-n // page) for n in lengths) + 1
    ids = torch.randperm(num_pages - 1, generator=g) + 1
    table = torch.zeros(len(lengths), 4, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lengths):
        k = -(-n // page)
        table[i, :k] = ids[used: used + k]
        used += k
    k_pool = torch.randn(num_pages, page, Hkv, d, generator=g).to(dtype)
    v_pool = torch.randn(num_pages, page, Hkv, d, generator=g).to(dtype)
    rows = torch.tensor([i for i, m in enumerate(q_lens) for _ in range(m)])
    positions = torch.tensor([p for n, m in zip(lengths, q_lens) for p in range(n - m, n)])
    q = torch.randn(len(rows), H, d, generator=g).to(dtype)
    block_m = tile_rows(H, Hkv)[0]
    for window in (0, 20):
        tiles = Tiles.of_runs(q_lens, block_m, CUDA)
        got = paged_attention(q.to(CUDA), k_pool.to(CUDA), v_pool.to(CUDA), table.to(CUDA), rows.to(CUDA),
                              positions.to(CUDA), tiles, window=window).float().cpu()
        want = paged_attention_reference(q.float(), k_pool.float(), v_pool.float(), table, rows, positions, window=window)
        print(f"{dtype} window={window}: max |paged - reference| = {(got - want).abs().max():.2e}")
        assert_close(got, want, **ATTENTION_TOL[dtype])
        mine = slice(1, 13)  # sequence 1's 12 tokens, alone
        alone = paged_attention(q[mine].to(CUDA), k_pool.to(CUDA), v_pool.to(CUDA), table.to(CUDA), rows[mine].to(CUDA),
                                positions[mine].to(CUDA), Tiles.of_runs([12], block_m, CUDA), window=window).float().cpu()
        assert torch.equal(alone, got[mine])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@torch.inference_mode()
def test_paged_graph_replayed_decode_matches_the_eager_decode(trained_model_dir, dtype):
    """Decode graphs over a paged cache (block table, slots and positions as static inputs): replays in
    every bucket give the eager paged decode's logits, pages mapped between replays included."""
    pytest.importorskip("triton")
    from lmserve.model.attention.backend import PagedBackend
    from lmserve.model.paged_kv_cache import PagedKVCache

    loaded = load_model(trained_model_dir, dtype=dtype, device=CUDA)
    cfg, slots_n = loaded.config, 8
    backend = PagedBackend(CUDA, cfg)
    eager, cached = (PagedKVCache(cfg, slots_n, 64, 40, dtype, CUDA) for _ in range(2))
    graphs = DecodeGraphs(loaded.model, cached, slots_n, attention=backend)
    g = torch.Generator(device=CUDA).manual_seed(0)
    eager.k.normal_(generator=g)
    eager.v.normal_(generator=g)
    cached.k.copy_(eager.k)
    cached.v.copy_(eager.v)
    rng = random.Random(0)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for n in (1, 3, 8, 2, 5):
        slots = rng.sample(range(slots_n), n)
        positions = [rng.randrange(60) for _ in range(n)]
        for cache in (eager, cached):
            for s, p in zip(slots, positions):
                cache.map(s, p + 1)
        ids = [rng.randrange(cfg.vocab_size) for _ in range(n)]
        meta, pos_t = backend.decode(slots, positions)
        want = loaded.model(torch.tensor(ids, device=CUDA)[:, None], pos_t, meta, eager)[:, 0].float()
        got = graphs.run(torch.tensor(ids, device=CUDA), positions, slots).float()
        scale = float(want.abs().max())
        print(f"{dtype} n={n}: max |graph - eager| / max |logit| = {float((got - want).abs().max()) / scale:.2e}")
        assert float((got - want).abs().max()) <= tol * scale
    assert graphs.replays == 5
