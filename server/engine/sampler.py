"""Batched sampling with per-request parameters and one generator per seeded request.

Work follows what rows ask for. An all-greedy batch costs one `max` over the logits: it gives the
tokens and the row maxima, and a row whose maximum is not finite (NaN propagates through `max`)
fails alone. Only rows with a temperature, penalties or logprobs are copied out and worked on;
a sampled row ranks only what its filters look at (its top-k, or a top holding top_p of the mass)
and draws with one uniform number (inverse CDF), and log-probabilities come from one pass per row
for the log-sum-exp and the top values (row_max.row_stats): at Gemma 3's 262,144 ids a full sort and
an exponential per id cost ~25 ms a row on one core, a log_softmax and a topk over a copy ~1 ms
(docs/benchmarks.md, vocab-head). Penalty tallies are kept per request and
updated with each new token instead of being rebuilt from the history every step.

Constrained rows (a request with a compiled constraint) first have the ids their constraint does
not allow set to -inf, before any of that; their matcher takes the sampled token at once and, for a
sampled row, starts computing the next step's mask (constraints/state.py). A greedy row's token is its
argmax whenever the constraint allows that (one token checked, a microsecond or two), so its mask is
computed and applied only where it does not: ~1 token in 5 on a JSON schema with SmolLM2; and where no
mask is at hand, not before the row's next best ids have been offered to the constraint (the first it
allows is the argmax of the allowed logits). A greedy row's mask is not written into its logits: the
maximum of its allowed ids is read in place (row_max.masked_rows_max). A request's `logit_bias` is
added before either. The log-probabilities of those rows are the model's own, from the logits before the
mask and the bias.

`general_sample` is the straightforward reference (every row through every stage); the fast path
returns exactly its tokens, which the tests check row type by row type.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .constraints.state import ConstraintError, ConstraintState, mask_logits
from .ngram import kept
from .row_max import Stats, masked_rows_max, row_draw, row_scan, row_stats, rows_max
from .request import SamplingParams


@dataclass
class SampleOutput:
    """One step's tokens. `tokens` [N] stays on the logits' device, where the next step's decode inputs
    can read it without a round trip; `token_ids` and `ok` are read back to the host on first use, in
    one copy (on CUDA started without blocking when the sampler finished, so reading waits only for
    the step itself)."""

    tokens: Tensor | None
    logprobs: list[tuple[float, tuple[tuple[int, float], ...]] | None]  # chosen logprob, top-n
    host: tuple[list[int], list[bool]] | None = None  # token ids; ok (False: the row's logits were not finite)
    _copy: Any = None  # (host tensor [2, N] being filled, CUDA event) until read

    @classmethod
    def deferred(cls, tokens: Tensor, row_max: Tensor) -> "SampleOutput":
        """An all-greedy step's output on CUDA: the argmax tokens, and their ids and finiteness flags
        (a NaN row's maximum is not finite) on their way to the host, not waited for."""
        both = torch.stack([tokens, torch.isfinite(row_max).to(tokens.dtype)])  # [2, N]
        event = torch.cuda.Event()
        copy = both.to("cpu", non_blocking=True)  # into pinned memory: returns at once
        event.record()
        return cls(tokens, [None] * tokens.shape[0], _copy=(copy, event))

    def _read(self) -> tuple[list[int], list[bool]]:
        if self.host is None:
            both, event = self._copy
            event.synchronize()
            ids, finite = both.tolist()
            self.host, self._copy = (ids, [bool(f) for f in finite]), None
        return self.host

    @property
    def token_ids(self) -> list[int]:
        return self._read()[0]

    @property
    def ok(self) -> list[bool]:
        return self._read()[1]


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)


class PenaltyState:
    """One request's penalty tallies over the vocabulary, kept up to date token by token.

    seen [V] bool: the prompt's and output's tokens (repetition penalty, HF convention);
    counts [V]: how often each token was generated (presence / frequency penalties, output only).
    """

    def __init__(self, prompt_ids: list[int], output_ids: list[int], vocab: int, device: torch.device):
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        ids = [t for t in (*prompt_ids, *output_ids) if 0 <= t < vocab]
        if ids:
            self.seen[torch.tensor(ids, device=device)] = True
        for t in output_ids:
            self.add(t)

    def add(self, token: int) -> None:
        if 0 <= token < self.counts.shape[0]:
            self.seen[token] = True
            self.counts[token] += 1

    def apply(self, row: Tensor, p: SamplingParams) -> Tensor:
        """Penalised copy of one row of logits [V] (float32)."""
        if p.repetition_penalty != 1.0:
            penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row = torch.where(self.seen, penalised, row)
        if p.presence_penalty or p.frequency_penalty:
            row = row - (p.frequency_penalty * self.counts + p.presence_penalty * (self.counts > 0).to(row.dtype))
        return row


def filter_ask(t: float, top_k: int, top_p: float, min_p: float, V: int) -> tuple[float, int, bool] | None:
    """The row pass kept_tokens starts with, as row_stats' (t, n, lse): the top-k; for top-p a first top
    of 256; for min-p alone the best value and the log-sum-exp. None when no filter is set."""
    if top_k > 0:
        return t, min(top_k, V), False
    if top_p < 1.0:
        return t, min(V, 256), True
    if min_p > 0.0:
        return t, 1, True
    return None


def kept_tokens(row: Tensor, t: float, top_k: int, top_p: float, min_p: float,
                first: Stats | None = None) -> tuple[Tensor, Tensor] | None:
    """(ids, probabilities) of the tokens a row's filters keep, for softmax(t * row) (row [V] float32, t the
    inverse temperature): top-k, then top-p over what top-k kept (renormalized, as transformers' warpers
    chain), then min-p relative to the best; the best token always kept; probabilities as kept (the draw
    renormalizes). None when no filter is set. Only as much of the row is ranked as the filters look at:
    the top-k, or for top-p alone a growing top until it holds top_p of the mass (row_stats). `first`: the
    row's stats for filter_ask, when the step's row scan brought them (row_max.row_scan)."""
    V = row.shape[0]
    ask = filter_ask(t, top_k, top_p, min_p, V)
    if ask is None:
        return None
    lse, vals, idx = first if first is not None else row_stats(row[None], *ask)
    if top_k <= 0 and top_p >= 1.0:  # min-p alone: p_i >= min_p p_max  <=>  t x_i >= t x_max + log(min_p)
        ids = (row * t >= vals[0, 0] * t + math.log(min_p)).nonzero().squeeze(1)
        return ids, (row[ids] * t - lse[0]).exp()
    if top_k > 0:  # what follows sees the top-k's own distribution: no normalizer over the row needed
        p = (vals[0] * t).softmax(-1)  # [k] best first
    else:
        n = ask[1]
        while True:
            p = (vals[0] * t - lse[0]).exp()
            if n == V or float(p.sum()) >= top_p:
                break
            n = min(V, 8 * n)
            lse, vals, idx = row_stats(row[None], t, n)
    keep = (p.cumsum(0) - p) < top_p  # the smallest prefix reaching top_p (the best token always kept)
    keep &= p >= min_p * p[0]
    return idx[0][keep], p[keep]


def filter_logits(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor) -> Tensor:
    """Scale by temperature and mask (-inf) what top-k, top-p and min-p exclude (kept_tokens). logits [N, V]."""
    scaled = logits / temperature[:, None]
    out = torch.full_like(scaled, float("-inf"))
    for i in range(logits.shape[0]):
        kept = kept_tokens(logits[i].float(), 1.0 / float(temperature[i]), int(top_k[i]), float(top_p[i]),
                           float(min_p[i]))
        ids = torch.arange(logits.shape[1]) if kept is None else kept[0]
        out[i, ids] = scaled[i, ids]
    return out


def draw(ids: Tensor, probs: Tensor, gen: torch.Generator) -> int:
    """One of `ids` drawn with probabilities proportional to `probs` (inverse CDF of one uniform, in float64)."""
    cdf = probs.double().cumsum(0)
    u = torch.rand((), generator=gen, dtype=torch.float64, device=probs.device) * cdf[-1]
    return int(ids[torch.searchsorted(cdf, u, right=True).clamp_(max=ids.shape[0] - 1)])


def sample_ask(p: SamplingParams, V: int) -> tuple[float, int, bool]:
    """The row pass sample_row starts with (row_stats' t, n, lse): its filters' (filter_ask), else the
    log-sum-exp alone."""
    t = 1.0 / p.temperature
    return filter_ask(t, p.top_k, p.top_p, p.min_p, V) or (t, 0, True)


def sample_row(row: Tensor, p: SamplingParams, gen: torch.Generator, first: Stats | None = None) -> int:
    """A temperature > 0 row's token: logits [V] (float32, penalised) at the temperature, filtered, drawn by
    one uniform number (over the kept tokens, or over the whole row in one pass when nothing is filtered).
    `first`: the row's stats for sample_ask, when the step's row scan brought them."""
    t = 1.0 / p.temperature
    kept = kept_tokens(row, t, p.top_k, p.top_p, p.min_p, first)
    if kept is not None:
        return draw(*kept, gen)
    lse = float((first if first is not None else row_stats(row[None], t, 0))[0][0])
    return row_draw(row, t, lse, float(torch.rand((), generator=gen, dtype=torch.float64)))


def logprobs_of(row: Tensor, token: int, n: int, first: Stats | None = None) -> tuple[float, tuple[tuple[int, float], ...]]:
    """A row's log-probability of its token and its top-n (id, log-probability), row [V] (float32 or
    bfloat16, read in place): the log-sum-exp and the top values of one native pass (row_stats, or `first`,
    what the step's row scan brought for (1, n, lse)), not a log_softmax and a topk over a float32 copy."""
    lse, vals, idx = first if first is not None else row_stats(row[None], 1.0, n)
    lse = float(lse[0])
    return float(row[token]) - lse, tuple(zip(idx[0].tolist(), (vals[0] - lse).tolist()))


def _plain_greedy(p: SamplingParams) -> bool:
    """The row's token is its argmax and nothing else is asked of it."""
    return p.temperature == 0 and p.logprobs is None and not has_penalties(p)


@dataclass
class SamplingState:
    """A sequence's sampling state (Sequence.sampling), made on its first sampled step that needs it."""

    generator: torch.Generator | None = None  # made on the first temperature > 0 step
    penalties: PenaltyState | None = None  # made on the first penalised step
    bias: tuple[Tensor, Tensor] | None = None  # logit_bias as (ids [K], values [K]) on the logits' device


def _state(seq) -> SamplingState:
    if seq.sampling is None:
        seq.sampling = SamplingState()
    return seq.sampling


def _penalty_state(seq, vocab: int, device: torch.device) -> PenaltyState:
    state = _state(seq)
    if state.penalties is None:
        state.penalties = PenaltyState(seq.request.prompt_ids, seq.output_ids, vocab, device)
    return state.penalties


def _generator(seq, device: torch.device) -> torch.Generator:
    state = _state(seq)
    if state.generator is None:
        state.generator = make_generator(seq.request.params.seed, device)
    return state.generator


def add_logit_bias(logits: Tensor, seqs, rows: list[int]) -> None:
    """Add, in place, each row's request `logit_bias` to its logits [N, V] (the tensors made once per sequence)."""
    with torch.inference_mode():  # the model's logits are inference tensors: updated in place, not copied
        for i in rows:
            state = _state(seqs[i])
            if state.bias is None:
                ids, values = zip(*seqs[i].request.params.logit_bias)
                state.bias = (torch.tensor(ids, device=logits.device),
                              torch.tensor(values, dtype=logits.dtype, device=logits.device))
            logits[i].index_add_(0, *state.bias)


def _greedy_argmax(p: SamplingParams) -> bool:
    """The row's token is the argmax of its (biased) logits: greedy, no penalties."""
    return p.temperature == 0 and not has_penalties(p)


def _constraint_state(seq, lazy: bool = True) -> ConstraintState:
    if seq.constraint is None:  # lazy: a greedy row computes its mask only when its argmax is not allowed
        seq.constraint = seq.request.compiled.new_state(ahead=not (lazy and _greedy_argmax(seq.request.params)))
    return seq.constraint


# How many of a greedy constrained row's best ids are read (one more pass over its row) where its argmax is not
# allowed and no mask is at hand: they are offered to its constraint before a mask is computed. Inside a JSON
# string near its maxLength a mask walks every longer token (0.5-2 ms at Gemma 3's 262,144 ids, 0.1-0.5 ms at
# SmolLM2's 49,152); the pass costs ~40 us at 262,144 ids and checking an id a few microseconds.
CANDIDATES = 16


def _needing_masks(seqs, rows: list[int], drafts: list | None, logits: Tensor, tokens: Tensor,
                   row_max: Tensor) -> list[int]:
    """The constrained rows whose mask must be applied: all but the greedy rows (not verifying drafts)
    whose argmax the constraint allows, which is then also the argmax of their allowed logits (the first
    of equal maxima either way), and those where, with no mask at hand, it allows one of the row's next
    best ids (_next_best): the first it allows is then the argmax of the allowed logits, and it replaces
    the row's token and maximum (in place). A greedy row that needs its mask has the next one computed
    ahead (disagreements come in runs: a key, a forced separator); one that does not, none."""
    firsts, maxima = tokens.tolist(), row_max.tolist()
    needed, found = [], {}
    for i in rows:
        state = _constraint_state(seqs[i])
        if (drafts and drafts[i][0]) or not _greedy_argmax(seqs[i].request.params):
            needed.append(i)
            continue
        ok = state.allowed(firsts[i])
        if not ok and CANDIDATES > 1 and not state.has_mask and math.isfinite(maxima[i]):
            offered = _next_best(logits[i], firsts[i])
            k = state.first_allowed([t for t, _ in offered]) if offered else None
            if k is not None:
                found[i] = offered[k]
                ok = True
        state.ahead = not ok
        if not ok:
            needed.append(i)
    if found:
        index = torch.tensor(list(found))
        with torch.inference_mode():  # the scan's outputs (inference tensors where it ran in that mode)
            tokens[index] = torch.tensor([t for t, _ in found.values()], dtype=tokens.dtype)
            row_max[index] = torch.tensor([v for _, v in found.values()], dtype=row_max.dtype)
    return needed


def _next_best(row: Tensor, argmax: int) -> list[tuple[int, float]]:
    """(id, value) of a row's best ids after its argmax, in the order its allowed logits' argmax takes
    them (larger values first, of equal values the lower id): those above the CANDIDATES-th largest value,
    so that every id of a value as large is among them whatever order the top's ties came in. Finite
    values only (a row whose maximum is finite)."""
    _, vals, idx = row_stats(row[None], 1.0, min(CANDIDATES, row.shape[0]), lse=False)
    top = sorted(zip(vals[0].tolist(), idx[0].tolist()), key=lambda p: (-p[0], p[1]))
    last = top[-1][0]
    return [(t, v) for v, t in top if v > last and t != argmax and math.isfinite(v)]


def _constraint_masks(seqs, rows: list[int], drafts: list | None) -> Tensor:
    """[R, W] the bitmask of each constrained row. A verifying row j is masked as of the draft's first
    j tokens: the state consumes the draft row by row here (the scheduler drafted only what the
    constraint allows), and _advance_constraints rewinds it to what was kept."""
    masks = []
    for i in rows:
        state = _constraint_state(seqs[i])
        draft, j = drafts[i] if drafts else ((), 0)
        if j:
            state.advance(draft[j - 1])
        masks.append(state.mask().clone() if draft else state.mask())  # the next advance refills the buffer
    return torch.stack(masks)


def _advance_constraints(seqs, rows: list[int], drafts: list | None, tokens: list[int], ok: list[bool]) -> None:
    """Each constrained sequence's state moved to what its rows recorded: a plain row's token; for a
    verifying sequence (its state holds its whole draft), back to the drafts kept, then the token of
    the row after them."""
    for i in rows:
        draft, j = drafts[i] if drafts else ((), 0)
        if j:
            continue  # a verifying sequence is handled at its first row
        state = seqs[i].constraint
        try:
            keep = kept(tokens, ok, i, draft)
            if draft:  # (a rollback of nothing would restart the next mask's computation)
                state.rollback(len(draft) - keep)
            if ok[i + keep]:
                state.advance(tokens[i + keep])  # and the next step's mask starts computing
        except ConstraintError:  # fails this row alone (a matcher past its end: a dropped overlapped row)
            ok[i] = False


def _first_asks(seqs, V: int) -> dict[int, tuple[float, int, bool]]:
    """What each row's first pass over its logits is asked for beside its maximum (row_scan), where the
    logits it reads are final then: a sampled row's sample_ask, a greedy row's logprobs. Not a constrained
    row (masked after the maxima), a penalised one (its pass reads a penalised copy), nor the logprobs of
    a biased row (they come from a copy before the bias)."""
    asks = {}
    for i, seq in enumerate(seqs):
        p = seq.request.params
        if seq.request.compiled is not None or has_penalties(p):
            continue
        if p.temperature > 0:
            asks[i] = sample_ask(p, V)
        elif p.logprobs is not None and not p.logit_bias:
            asks[i] = (1.0, p.logprobs, True)
    return asks


class Sampler:
    """`lazy_masks` (the default): a greedy constrained row's mask is computed and applied only where the
    constraint does not allow the row's argmax (constraints/state.py); off, every constrained row's mask
    is (the reference the lazy path is tested and benchmarked against: the same tokens)."""

    def __init__(self, lazy_masks: bool = True):
        self.lazy_masks = lazy_masks

    @staticmethod
    def _greedy(logits: Tensor) -> SampleOutput:
        """A step whose every row is plain greedy (no constraint, bias, penalty or logprobs): one max over
        the batch on the logits' device is the whole answer, no per-row work; on CUDA not waited for."""
        row_max, tokens, _ = row_scan(logits, {})  # [N], [N]
        if logits.device.type == "cuda":
            return SampleOutput.deferred(tokens, row_max)
        return SampleOutput(tokens, [None] * tokens.shape[0], host=(tokens.tolist(), torch.isfinite(row_max).tolist()))

    def __call__(self, logits: Tensor, seqs: list, drafts: list | None = None) -> SampleOutput:
        """logits [N, V] (any float dtype), one row per sequence -> one token per row.

        Each sequence (engine.sequence.Sequence) brings its request's parameters and keeps its own
        generator and penalty tallies, which are updated with the sampled token. A sequence verifying
        k drafts has k + 1 consecutive rows (greedy); `drafts` gives each row (its draft, its place j
        in it), which a constrained row needs: its mask is the constraint's after the draft's first j
        tokens."""
        constrained, biased, plain = [], [], True
        for i, seq in enumerate(seqs):  # one look at each row's request
            p = seq.request.params
            if seq.request.compiled is not None:
                constrained.append(i)
            if p.logit_bias:
                biased.append(i)
            plain = plain and _plain_greedy(p)
        if plain and not constrained and not biased:
            return self._greedy(logits)
        unmasked = {i: logits[i].to(torch.float32, copy=True)  # [V] before the mask and the bias
                    for i in {*constrained, *biased} if seqs[i].request.params.logprobs is not None}
        if biased:
            add_logit_bias(logits, seqs, biased)
        # [N], [N]: greedy tokens (NaN propagates through max); and in the same pass over each row, what
        # the rows that sample or want logprobs read of it (row_scan: where the native library reads it)
        row_max, tokens, first = row_scan(logits, _first_asks(seqs, logits.shape[1]))
        if self.lazy_masks:
            masked = _needing_masks(seqs, constrained, drafts, logits, tokens, row_max) if constrained else []
        else:
            masked = constrained
            for i in masked:
                _constraint_state(seqs[i], lazy=False)
        if masked:
            bits = _constraint_masks(seqs, masked, drafts)  # [R, W]
            maxima = masked_rows_max(logits, masked, bits)  # native: only the allowed ids read, nothing written
            if maxima is None:  # elsewhere the rows are masked in place, then read
                mask_logits(logits, masked, bits)
                maxima = rows_max(logits, masked)
            else:  # the rows read again below (sampled, penalised) take the mask in place as well
                again = [r for r, i in enumerate(masked) if not _greedy_argmax(seqs[i].request.params)]
                if again:
                    mask_logits(logits, [masked[r] for r in again], bits[again])
            index = torch.tensor(masked, device=logits.device)
            with torch.inference_mode():  # the maxima of the masked rows replace theirs (inference tensors)
                row_max[index], tokens[index] = maxima
        ok = [math.isfinite(m) for m in row_max.tolist()]  # a constrained row with nothing allowed is not finite
        token_list = tokens.tolist()
        lps: list = [None] * len(seqs)
        V, dev = logits.shape[1], logits.device
        worked = False  # some row's token may differ from the max: `tokens` is rebuilt from the list
        for i, seq in enumerate(seqs):
            p = seq.request.params
            if not ok[i] or _plain_greedy(p):
                continue  # greedy: the max above is the whole answer
            worked = True
            if p.temperature > 0 or has_penalties(p):
                raw = logits[i].float()  # [V] a copy only for rows that need one (none for float32 logits)
                row = _penalty_state(seq, V, dev).apply(raw, p) if has_penalties(p) else raw
                if p.temperature > 0:
                    token_list[i] = sample_row(row, p, _generator(seq, dev), first.get(i))
                else:
                    token_list[i] = int(row.argmax())
            if p.logprobs is not None:  # the model's own logits (before a mask or a bias), read in place
                lps[i] = logprobs_of(unmasked.get(i, logits[i]), token_list[i], p.logprobs,
                                     first.get(i) if p.temperature == 0 else None)
        for i, seq in enumerate(seqs):
            if ok[i] and seq.sampling is not None and seq.sampling.penalties is not None:
                seq.sampling.penalties.add(token_list[i])
        _advance_constraints(seqs, constrained, drafts, token_list, ok)
        return SampleOutput(torch.tensor(token_list, device=dev) if worked else tokens, lps, host=(token_list, ok))
