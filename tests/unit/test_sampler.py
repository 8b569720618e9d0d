"""Sampler: greedy, filters, per-request generators, logprobs, penalties, non-finite rows."""

import torch

from lmserve.server.engine.request import SamplingParams
from lmserve.server.engine.sampler import Sampler, filter_logits, make_generator

V = 50


def sample(logits, params, gens=None, hist=None, prompts=None):
    n = len(params)
    return Sampler()(logits, params, gens or [make_generator(p.seed, torch.device("cpu")) for p in params],
                     hist or [[] for _ in range(n)], prompts or [[] for _ in range(n)])


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
