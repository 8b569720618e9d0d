"""Batched sampling with per-request parameters as tensors and one generator per request."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .request import SamplingParams


@dataclass
class SampleOutput:
    token_ids: list[int]
    ok: list[bool]  # False: the row's logits were not finite; the request must fail
    logprobs: list[tuple[float, tuple[tuple[int, float], ...]] | None]  # chosen logprob, top-n


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def apply_penalties(logits: Tensor, params: list[SamplingParams], histories: list[list[int]],
                    prompts: list[list[int]]) -> Tensor:
    """Repetition (prompt + output, HF convention), presence and frequency (output only) penalties."""
    rows = [i for i, p in enumerate(params)
            if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty]
    for i in rows:  # penalties are rare and per-row; a short loop keeps this readable
        p = params[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(prompts[i]) | set(histories[i])), dtype=torch.long, device=logits.device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if histories[i] and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(torch.tensor(histories[i], device=logits.device), minlength=logits.shape[1])
            counts = counts[: logits.shape[1]].to(logits.dtype)  # [V]
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_logits(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor) -> Tensor:
    """Scale by temperature and mask (-inf) what top-k, top-p and min-p exclude. logits [N, V]."""
    V = logits.shape[1]
    logits = logits / temperature[:, None]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # [N, V]
    rank = torch.arange(V, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, V)[:, None]
    drop = rank >= k  # top-k
    probs = sorted_logits.softmax(dim=-1)
    cum_before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
    drop |= cum_before >= top_p[:, None]  # top-p keeps the smallest prefix reaching p (best token always kept)
    drop |= probs < min_p[:, None] * probs[:, :1]  # min-p relative to the best token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


class Sampler:
    def __call__(self, logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator],
                 histories: list[list[int]], prompts: list[list[int]]) -> SampleOutput:
        """logits [N, V] (any float dtype) -> one token per row."""
        logits = logits.float()
        ok = torch.isfinite(logits).all(dim=-1)  # [N]
        logits = torch.where(ok[:, None], logits, torch.zeros_like(logits))
        raw_logprobs = logits.log_softmax(dim=-1) if any(p.logprobs is not None for p in params) else None

        logits = apply_penalties(logits, params, histories, prompts)
        greedy_tok = logits.argmax(dim=-1)  # [N]
        sample_rows = [i for i, p in enumerate(params) if p.temperature > 0]
        tokens = greedy_tok.clone()
        if sample_rows:
            idx = torch.tensor(sample_rows, device=logits.device)
            dev = logits.device
            ps = [params[i] for i in sample_rows]
            filtered = filter_logits(
                logits[idx],
                torch.tensor([p.temperature for p in ps], device=dev),
                torch.tensor([p.top_k for p in ps], device=dev),
                torch.tensor([p.top_p for p in ps], device=dev),
                torch.tensor([p.min_p for p in ps], device=dev),
            )
            probs = filtered.softmax(dim=-1)  # [n, V]
            # exponential race: argmax p_i / E_i with E_i ~ Exp(1) samples from p; each row uses its own generator
            noise = torch.stack([torch.empty_like(probs[0]).exponential_(generator=generators[i]) for i in sample_rows])
            tokens[idx] = (probs / noise).argmax(dim=-1)

        token_list = tokens.tolist()
        lp: list = [None] * len(params)
        if raw_logprobs is not None:
            n_top = max(p.logprobs or 0 for p in params)
            top_vals, top_idx = raw_logprobs.topk(n_top, dim=-1)  # [N, n_top]
            chosen = raw_logprobs.gather(1, tokens[:, None])[:, 0].tolist()
            top_vals, top_idx = top_vals.tolist(), top_idx.tolist()
            for i, p in enumerate(params):
                if p.logprobs is not None:
                    lp[i] = (chosen[i], tuple(zip(top_idx[i][: p.logprobs], top_vals[i][: p.logprobs])))
        return SampleOutput(token_ids=token_list, ok=ok.tolist(), logprobs=lp)
