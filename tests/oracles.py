"""Test oracles: slow, obviously-correct references the product is held to. Not product code.

- `explicit_attention`: softmax(QK^T / sqrt(d), masked over keys) @ V, written out.
- `ExplicitAttention`: a step attention (model/attention/backend.py) that writes the cache like the
  SDPA metadata it wraps, then computes the same attention as one explicit call over its full mask;
  keeps the last call's weights.
- `general_sample`: every sampling stage for every row (the engine's Sampler skips work).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lmserve.model.attention.sdpa import AttentionMetadata
from lmserve.model.kv_cache import KVCache
from lmserve.server.engine.request import SamplingParams
from lmserve.server.engine.sampler import PenaltyState, SampleOutput, has_penalties, sample_row


def explicit_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor,
                       scale: float | None = None) -> tuple[Tensor, Tensor]:
    """q [N, H, L, d], k/v [N, Hkv, S, d], mask [N, 1, L, S] bool (True = may attend).
    Returns (output [N, H, L, d], weights [N, H, L, S])."""
    G = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(G, dim=1)  # [N, H, S, d]
    v = v.repeat_interleave(G, dim=1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale  # [N, H, L, S]
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)  # over keys
    return weights @ v, weights


class ExplicitAttention:
    """The explicit attention over an SDPA metadata's layout (fresh, or one view of the cache)."""

    def __init__(self, meta: AttentionMetadata):
        self.meta = meta
        self.last_weights: Tensor | None = None  # [R, H, L, S] of the latest layer

    def attend(self, q: Tensor, k: Tensor, v: Tensor, cache: KVCache | None, layer: int, window: int = 0,
               scale: float | None = None) -> Tensor:
        meta = self.meta
        B, L, H, d = q.shape
        if cache is not None and meta.write_b is not None:
            meta.write(k, v, cache, layer)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, L, d]
        if meta.read_cache:
            k, v = cache.view(layer, meta.lo, meta.hi, meta.mask.shape[-1])  # [R, Hkv, S, d] views
            if meta.rows is not None:
                q_rows = q.new_zeros(meta.hi - meta.lo, *q.shape[1:])  # [R, H, L, d]
                q_rows[meta.rows] = q
                q = q_rows
        out, self.last_weights = explicit_attention(q, k, v, meta.window_mask(window) if window else meta.mask, scale)
        if meta.read_cache and meta.rows is not None:
            out = out[meta.rows]  # [B, H, L, d]
        return out.transpose(1, 2).reshape(B, L, H * d)


def top_logprobs(lp_row: Tensor, token: int, n: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The chosen token's log-probability and the top n (id, log-probability) of one log_softmax row."""
    chosen = float(lp_row[token])
    if n == 0:
        return chosen, ()
    vals, idx = lp_row.topk(n)
    return chosen, tuple(zip(idx.tolist(), vals.tolist()))


def general_sample(logits: Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                   histories: list[list[int]], prompts: list[list[int]]) -> SampleOutput:
    """The reference: every row through every stage (validity, logprobs, logit bias, penalties rebuilt from the
    whole history, then the draw of sampler.sample_row: temperature, filters, inverse CDF; test_sampler holds
    those to their definitions). The engine uses `Sampler`, which skips what a row does not ask for; the
    tests hold it to these tokens."""
    logits = logits.float()
    ok = torch.isfinite(logits.max(dim=-1).values)  # [N]
    logits = torch.where(ok[:, None], logits, torch.zeros_like(logits))
    raw_logprobs = logits.log_softmax(dim=-1)
    logits = logits.clone()
    V = logits.shape[1]
    for i, p in enumerate(params):
        for token, bias in p.logit_bias:
            logits[i, token] += bias
        if has_penalties(p):
            logits[i] = PenaltyState(prompts[i], histories[i], V, logits.device).apply(logits[i], p)
    tokens = logits.argmax(dim=-1)  # [N]
    for i, p in enumerate(params):
        if p.temperature > 0:
            tokens[i] = sample_row(logits[i], p, generators[i])
    token_list = tokens.tolist()
    lp = [None if p.logprobs is None else top_logprobs(raw_logprobs[i], token_list[i], p.logprobs)
          for i, p in enumerate(params)]
    return SampleOutput(None, lp, host=(token_list, ok.tolist()))
