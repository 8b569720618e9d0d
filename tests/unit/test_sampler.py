"""Sampler: greedy, filters, per-request generators, logprobs, penalties, non-finite rows; the fast
path (work only for the rows that ask) against the general reference, token for token."""

import pytest
import torch

from lmserve.server.engine.request import Request, SamplingParams
from lmserve.server.engine.sampler import Sampler, SamplingState, filter_logits, make_generator
from oracles import general_sample
from lmserve.server.engine.sequence import Sequence

V = 50
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Rows of 50k floats: one thread is as fast, and spares a busy machine's cores from spinning."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def seqs_for(params, gens=None, hist=None, prompts=None):
    seqs = []
    for i, p in enumerate(params):
        seq = Sequence(Request(list(prompts[i]) if prompts else [], p))
        seq.output_ids = list(hist[i]) if hist else []
        seq.sampling = SamplingState(generator=gens[i] if gens else None)
        seqs.append(seq)
    return seqs


def assert_same_logprobs(fast, ref):
    """The same ids, and log-probabilities equal to log_softmax's within float32 rounding (the sampler takes
    them from one log-sum-exp pass, not from a log_softmax)."""
    assert [None if r is None else [i for i, _ in r[1]] for r in fast] == \
        [None if r is None else [i for i, _ in r[1]] for r in ref]
    for f, r in zip(fast, ref):
        if r is not None:
            assert f[0] == pytest.approx(r[0], abs=2e-5)
            assert [v for _, v in f[1]] == pytest.approx([v for _, v in r[1]], abs=2e-5)


def sample(logits, params, gens=None, hist=None, prompts=None):
    return Sampler()(logits, seqs_for(params, gens, hist, prompts))


def test_greedy_is_argmax_and_logprobs_match_log_softmax():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    out = sample(logits, [SamplingParams(logprobs=5)] * 3)
    assert out.token_ids == logits.argmax(-1).tolist()
    ref = logits.log_softmax(-1)
    for i in range(3):
        chosen, top = out.logprobs[i]
        assert abs(chosen - ref[i, out.token_ids[i]].item()) < 1e-6
        vals, idx = ref[i].topk(5)
        assert [t for t, _ in top] == idx.tolist()
        assert torch.allclose(torch.tensor([v for _, v in top]), vals)


def test_seeded_row_independent_of_batch_neighbours():
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=1.0, seed=42)
    alone = [sample(logits[:1], [p]).token_ids[0] for _ in range(1)]
    mixed = sample(logits, [p] + [SamplingParams(temperature=0.7, seed=i) for i in range(5)]).token_ids[0]
    assert alone[0] == mixed
    # and the sequence of draws from one generator is reproducible
    g1, g2 = make_generator(7, torch.device("cpu")), make_generator(7, torch.device("cpu"))
    p7 = SamplingParams(temperature=1.0, seed=7)
    a = [sample(logits[:1], [p7], gens=[g1]).token_ids[0] for _ in range(10)]
    b = [sample(logits[:1], [p7], gens=[g2]).token_ids[0] for _ in range(10)]
    assert a == b and len(set(a)) > 1


def test_sampling_follows_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2] + [1e-9] * (V - 3)]))
    g = make_generator(0, torch.device("cpu"))
    p = SamplingParams(temperature=1.0, seed=0)
    counts = torch.bincount(torch.tensor([sample(logits, [p], gens=[g]).token_ids[0] for _ in range(3000)]), minlength=V)
    freq = counts[:3].float() / 3000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.04)


def test_filters_top_k_top_p_min_p():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    one = torch.ones(1)

    def kept(top_k=0, top_p=1.0, min_p=0.0):
        f = filter_logits(logits.clone(), one, torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))
        return torch.isfinite(f[0]).nonzero().flatten().tolist()

    assert kept(top_k=2) == [0, 1]
    assert kept(top_p=0.65) == [0, 1]  # 0.4 < 0.65, 0.4 + 0.3 >= 0.65
    assert kept(top_p=0.69) == [0, 1]
    assert kept(top_p=0.71) == [0, 1, 2]
    assert kept(top_p=0.01) == [0]  # the best token is always kept
    assert kept(min_p=0.45) == [0, 1, 2]  # p >= 0.45 * 0.4
    assert kept(min_p=0.55) == [0, 1]
    assert kept() == [0, 1, 2, 3]


    assert kept(top_k=2, top_p=0.5) == [0]  # top-p over what top-k kept: 0.4 / 0.7 >= 0.5


@pytest.mark.parametrize("top_k, top_p, min_p", [(0, 0.9, 0.0), (40, 0.8, 0.0), (0, 1.0, 0.05), (25, 0.95, 0.02),
                                                  (0, 0.3, 0.0), (300, 1.0, 0.0)])
def test_filters_keep_what_transformers_warpers_keep(top_k, top_p, min_p):
    """Top-k, then top-p, then min-p, each over what the previous kept, as transformers' generate chains its
    warpers (a vocabulary of 5,000: top-p ranks only a growing top of it)."""
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(top_k + int(100 * top_p))
    logits = torch.randn(1, 5000, generator=g) * 3
    temperature = 0.7
    hf = logits / temperature
    if top_k:
        hf = TopKLogitsWarper(top_k)(None, hf)
    if top_p < 1:
        hf = TopPLogitsWarper(top_p)(None, hf)
    if min_p:
        hf = MinPLogitsWarper(min_p)(None, hf)
    ours = filter_logits(logits, torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]),
                         torch.tensor([min_p]))
    assert torch.equal(torch.isfinite(ours), torch.isfinite(hf))


def test_a_filtered_draw_follows_the_kept_distribution():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1] + [1e-9] * (V - 4)]))
    g = make_generator(1, CPU)
    p = SamplingParams(temperature=1.0, top_k=2, seed=1)
    counts = torch.bincount(torch.tensor([sample(logits, [p], gens=[g]).token_ids[0] for _ in range(3000)]),
                            minlength=V)
    assert counts[2:].sum() == 0
    assert torch.allclose(counts[:2].float() / 3000, torch.tensor([4 / 7, 3 / 7]), atol=0.04)


def test_penalties_change_greedy_choice():
    logits = torch.tensor([[2.0, 1.9] + [0.0] * (V - 2)])
    assert sample(logits.clone(), [SamplingParams()]).token_ids == [0]
    assert sample(logits.clone(), [SamplingParams(repetition_penalty=1.2)], prompts=[[0]]).token_ids == [1]
    assert sample(logits.clone(), [SamplingParams(presence_penalty=0.5)], hist=[[0]]).token_ids == [1]
    assert sample(logits.clone(), [SamplingParams(frequency_penalty=0.05)], hist=[[0, 0, 0]]).token_ids == [1]
    assert sample(logits.clone(), [SamplingParams(frequency_penalty=0.05)], hist=[[0]]).token_ids == [0]


def test_non_finite_row_flagged_alone():
    logits = torch.randn(3, V)
    logits[1, 4] = float("nan")
    out = sample(logits, [SamplingParams()] * 3)
    assert out.ok == [True, False, True]
    assert out.token_ids[0] == logits[0].argmax().item() and out.token_ids[2] == logits[2].argmax().item()


MIXED = [
    SamplingParams(),
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(temperature=1.3, top_k=7, seed=2),
    SamplingParams(temperature=0.9, top_p=0.8, seed=3),
    SamplingParams(temperature=1.0, min_p=0.1, seed=4),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.02, seed=5),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(presence_penalty=0.7, frequency_penalty=0.3),
    SamplingParams(temperature=0.9, repetition_penalty=1.2, frequency_penalty=0.5, seed=6),
    SamplingParams(logprobs=3),
    SamplingParams(temperature=0.6, logprobs=0, seed=7),
    SamplingParams(repetition_penalty=0.8, logprobs=5),
]


@pytest.mark.parametrize("vocab", [V, 49152])
def test_fast_path_gives_the_general_paths_tokens_and_logprobs_step_after_step(vocab):
    """Twelve rows of every kind decoded for 12 steps: the fast sampler (incremental penalty tallies,
    greedy rows by one max, filters only where asked) and the reference (penalties rebuilt from the
    history, every stage for every row) agree on every token and logprob, with seeded generators."""
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, vocab, (5,), generator=gen).tolist() for _ in MIXED]
    fast_seqs = seqs_for(MIXED, prompts=prompts)
    ref_gens = [make_generator(p.seed, CPU) if p.temperature > 0 else None for p in MIXED]
    hist = [[] for _ in MIXED]
    sampler = Sampler()
    for _ in range(12):
        logits = torch.randn(len(MIXED), vocab, generator=gen) * 3
        logits[:, :4] += 4  # a few strong candidates, so penalties and filters change choices
        fast = sampler(logits, fast_seqs)
        ref = general_sample(logits, MIXED, ref_gens, hist, prompts)
        assert fast.token_ids == ref.token_ids and fast.ok == ref.ok
        assert_same_logprobs(fast.logprobs, ref.logprobs)
        for i, t in enumerate(fast.token_ids):
            fast_seqs[i].output_ids.append(t)
            hist[i].append(t)
    assert len({tuple(h) for h in hist}) > 6  # the rows really differ


BIASED = [
    SamplingParams(logit_bias=((3, -100.0), (17, 6.5))),
    SamplingParams(logit_bias=((0, 100.0),), logprobs=2),
    SamplingParams(temperature=0.9, seed=8, logit_bias=tuple((t, -100.0) for t in range(8)), logprobs=1),
    SamplingParams(repetition_penalty=1.2, logit_bias=((5, 3.0), (6, -2.5))),
    SamplingParams(),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logit_bias_is_added_before_every_stage_and_logprobs_stay_the_models(dtype):
    """Rows with a bias beside rows without, greedy and sampled, with penalties and logprobs, for 8
    steps: the reference's tokens (the bias added to the logits first) and its log-probabilities
    (before the bias); -100 keeps a token out, +100 chooses it."""
    gen = torch.Generator().manual_seed(12)
    prompts = [[1, 2, 3]] * len(BIASED)
    fast_seqs = seqs_for(BIASED, prompts=prompts)
    ref_gens = [make_generator(p.seed, CPU) if p.temperature > 0 else None for p in BIASED]
    hist = [[] for _ in BIASED]
    sampler = Sampler()
    for _ in range(8):
        logits = (torch.randn(len(BIASED), V, generator=gen) * 3).to(dtype)
        logits[:, :8] += 5
        ref = general_sample(logits.clone(), BIASED, ref_gens, hist, prompts)
        fast = sampler(logits, fast_seqs)
        assert fast.token_ids == ref.token_ids
        assert_same_logprobs(fast.logprobs, ref.logprobs)
        assert fast.token_ids[0] != 3 and fast.token_ids[1] == 0 and fast.token_ids[2] >= 8
        for i, t in enumerate(fast.token_ids):
            fast_seqs[i].output_ids.append(t)
            hist[i].append(t)


def test_a_nan_row_fails_alone_in_a_mixed_batch_and_the_others_keep_their_tokens():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(len(MIXED), V, generator=gen)
    poisoned = logits.clone()
    poisoned[2, 9] = float("nan")
    poisoned[5, :] = float("inf")
    clean = Sampler()(logits, seqs_for(MIXED))
    out = Sampler()(poisoned, seqs_for(MIXED))
    bad = {2, 5}
    assert out.ok == [i not in bad for i in range(len(MIXED))]
    assert [t for i, t in enumerate(out.token_ids) if i not in bad] == [t for i, t in enumerate(clean.token_ids) if i not in bad]


def test_greedy_ties_go_to_the_lowest_id_as_argmax_does():
    logits = torch.zeros(2, V)
    logits[0, [3, 7, 9]] = 1.0
    logits[1, [40, 41]] = 2.0
    assert sample(logits, [SamplingParams()] * 2).token_ids == [3, 40] == logits.argmax(-1).tolist()


def test_logits_are_not_modified():
    logits = torch.randn(len(MIXED), V, generator=torch.Generator().manual_seed(5))
    before = logits.clone()
    Sampler()(logits, seqs_for(MIXED, prompts=[[1, 2, 3]] * len(MIXED), hist=[[4, 4]] * len(MIXED)))
    assert torch.equal(logits, before)


def test_with_the_native_row_passes_loaded(native_kernels_dir):
    """Where the model loader has loaded the native library (a CPU server), the top values, log-sum-exps
    and draws come from row_max.cpp: the filters still keep what transformers' warpers keep, the fast path
    still gives the reference's tokens, and logprobs still match log_softmax."""
    from lmserve.model.native import build as native
    from lmserve.server.engine import row_max as RM

    lib, why = native.load(native_kernels_dir)
    if lib is None:
        pytest.skip(why)
    assert native.bound(RM._NativeRows) is not None
    for args in [(0, 0.9, 0.0), (40, 0.8, 0.0), (0, 1.0, 0.05), (25, 0.95, 0.02)]:
        test_filters_keep_what_transformers_warpers_keep(*args)
    test_fast_path_gives_the_general_paths_tokens_and_logprobs_step_after_step(49152)
    test_greedy_is_argmax_and_logprobs_match_log_softmax()
    test_a_filtered_draw_follows_the_kept_distribution()
    test_sampling_follows_distribution()
