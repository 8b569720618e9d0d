"""Quality of a precision mode, measured the way llama.cpp reports its quantizations.

Two numbers over a fixed held-out text, each against a float32 reference forward of the same
checkpoint: perplexity of the text, and the mean KL divergence KL(P_ref || P_mode) of the
next-token distributions at every position. The text ships with the package so every machine
measures the same thing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..attention.sdpa import AttentionMetadata

HELD_OUT_TEXT = (Path(__file__).with_name("quality_text.txt")).read_text(encoding="utf-8")

# Bounds a mode must meet to be served by `auto` (and that the tests assert, with margin, on
# SmolLM2-135M). Measured on SmolLM2-135M Q4_1 (see README "Precision modes"): bfloat16 and int4
# (the file's own Q4_1 codes) stay far inside; int8 re-quantizes the already 4-bit weights.
MAX_MEAN_KL = 0.02  # nats per token
MAX_PPL_RATIO = 1.03  # perplexity / reference perplexity
# tokens of the held-out text the precision probe scores, in two samples of FIRST_TOKENS, each its own
# window: the second is scored only when the first's verdict is near a bound (Quality.settled), and the
# verdict is then both together (Quality.merged). A first start of a 1B model spent 9 s of its 20 on the
# probe, most of it the float32 reference. The int8 KV check scores the first sample too, so the probe's
# float32 reference of it, computed once at a first start, serves both (precision.Plan.reference).
PROBE_TOKENS = 256
FIRST_TOKENS = 128
# A first sample's verdict stands within this fraction of both bounds or past this multiple of one. The
# second sample builds every layer again (the reference's float32 weights dequantized anew): a random
# 8B measured mean KL 0.0124 on each sample (0.62 of the bound) and, scored twice, took 111 s to probe
# where one pass over 256 tokens had taken 71 s.
SETTLED_WITHIN, SETTLED_PAST = 0.75, 1.5


@dataclass(frozen=True)
class Quality:
    tokens: int
    perplexity: float
    reference_perplexity: float
    mean_kl: float  # nats per token, KL(reference || mode)
    top1_agreement: float  # fraction of positions whose argmax matches the reference

    @property
    def ppl_ratio(self) -> float:
        return self.perplexity / self.reference_perplexity

    def within_bounds(self) -> bool:
        return self.mean_kl <= MAX_MEAN_KL and self.ppl_ratio <= MAX_PPL_RATIO

    def merged(self, other: "Quality") -> "Quality":
        """This sample's numbers and another's as one sample of both (token-weighted; perplexities from
        their summed log-likelihoods)."""
        n = self.tokens + other.tokens

        def ppl(a: float, b: float) -> float:
            return math.exp((self.tokens * math.log(a) + other.tokens * math.log(b)) / n)
        return Quality(n, ppl(self.perplexity, other.perplexity), ppl(self.reference_perplexity, other.reference_perplexity),
                       (self.tokens * self.mean_kl + other.tokens * other.mean_kl) / n,
                       (self.tokens * self.top1_agreement + other.tokens * other.top1_agreement) / n)

    def settled(self) -> bool:
        """Whether a verdict from this (first, shorter) sample stands without scoring more of the text:
        both numbers within SETTLED_WITHIN of their bounds, or one past SETTLED_PAST times its bound.
        Nearer a bound the sample's noise could tip it either way."""
        kl, ppl = self.mean_kl / MAX_MEAN_KL, (self.ppl_ratio - 1) / (MAX_PPL_RATIO - 1)
        return (kl <= SETTLED_WITHIN and ppl <= SETTLED_WITHIN) or kl > SETTLED_PAST or ppl > SETTLED_PAST

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "perplexity": self.perplexity, "reference_perplexity": self.reference_perplexity,
                "ppl_ratio": self.ppl_ratio, "mean_kl": self.mean_kl, "top1_agreement": self.top1_agreement}


@torch.inference_mode()
def logits_of(model, ids: list[int], window: int = 512, attention=None, cache_dtype: torch.dtype | None = None) -> Tensor:
    """Full-sequence logits [T, V] (float32) of one text, in windows of `window` tokens (each window is
    scored on its own, as llama.cpp's perplexity tool does with its context size). Without a cache by
    default; with an attention backend and `cache_dtype`, every window is prefilled into a KV cache of
    that dtype through the backend, so each token attends over K/V read back from it (an int8 cache's
    codes and scales included)."""
    from ..kv_cache import KVCache

    out = []
    device = next(iter(model.buffers())).device
    for start in range(0, len(ids), window):
        chunk = torch.tensor(ids[start:start + window], device=device)[None]  # [1, L]
        L = chunk.shape[1]
        if attention is None:
            out.append(model(chunk, torch.arange(L, device=device)[None], AttentionMetadata.fresh(torch.tensor([L]))
                             )[0].float())
            continue
        meta, pos = attention.packed(torch.tensor([0], device=device), torch.tensor([L], device=device))
        out.append(model(chunk, pos, meta, KVCache(model.config, 1, L, cache_dtype, device))[0].float())
    return torch.cat(out)  # [T, V]


COMPARE_ROWS = 32  # positions compared at a time: a few [rows, V] temporaries, not [T, V] ones


def compare(ref_logits: Tensor, logits: Tensor, ids: list[int], window: int = 512) -> Quality:
    """Quality of `logits` against `ref_logits` ([T, V] each) on the text `ids` (the first token of each
    window predicts nothing). Positions are taken COMPARE_ROWS at a time (a 1B model's log-probabilities
    over 256 positions are 131 MB a copy), their sums added in float64."""
    targets = torch.tensor(ids)
    keep = torch.ones(len(ids), dtype=torch.bool)
    keep[::window] = False  # position t predicts token t+1 within its window
    pred = torch.nonzero(keep).squeeze(1) - 1  # logits rows that have a target
    tgt = targets[keep]
    nll_ref = nll = kl = agree = 0.0
    for r0 in range(0, len(pred), COMPARE_ROWS):
        rows, t = pred[r0:r0 + COMPARE_ROWS], tgt[r0:r0 + COMPARE_ROWS, None]
        ref_lp = torch.log_softmax(ref_logits[rows], -1)  # [rows, V]
        lp = torch.log_softmax(logits[rows], -1)
        nll_ref -= float(ref_lp.gather(1, t).double().sum())
        nll -= float(lp.gather(1, t).double().sum())
        kl += float((ref_lp.exp() * (ref_lp - lp)).sum(-1).double().sum())
        agree += float((ref_lp.argmax(-1) == lp.argmax(-1)).sum())
    n = int(pred.numel())
    return Quality(n, math.exp(nll / n), math.exp(nll_ref / n), kl / n, agree / n)


def text_ids(tokenizer, max_tokens: int | None = None) -> list[int]:
    ids = tokenizer.encode(HELD_OUT_TEXT, add_special_tokens=False)
    return ids if max_tokens is None else ids[:max_tokens]


__all__ = ["HELD_OUT_TEXT", "MAX_MEAN_KL", "MAX_PPL_RATIO", "PROBE_TOKENS", "FIRST_TOKENS", "Quality", "logits_of", "compare", "text_ids"]
