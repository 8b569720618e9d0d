"""Stall-free prefill: how many prompt tokens a step may take so that it stays near a target time.

A step runs every decoding sequence's next token plus a slice of prompt prefill. Each decoding
stream waits for the whole step, so a large prefill chunk stalls every stream at once; a tiny
chunk wastes the fixed cost of a prefill pass and stretches the long prompt's time to first token.
This module learns what a step costs on the machine it runs on and sizes the chunk from that.

Cost model (milliseconds), refitted online from every step the engine runs:

    t = a_0 + a_d [decoding?] + b * decode_rows + e * decode_keys/1000
            + a_p [prefilling?] + c * prefill_tokens + d * prefill_pairs/1000

a_0 is what any step costs (reading the weights once, the per-layer work of a pass); a_d and a_p
what a step pays on top for having decode rows or prompt tokens at all. A step that runs decode
rows and a prompt chunk in one forward pays a_0 once, which a fit with only a_d and a_p would
count twice (so it would predict mixed steps too dear and cut their chunks short).

decode_keys: keys the decode rows attend over; prefill_pairs: query-key pairs of the prefill
chunks (a chunk of n tokens after s cached ones has n*s + n(n+1)/2), the attention term that makes
late chunks of a long prompt dearer than early ones. Each kind of step (decode-only, mixed,
prefill-only) keeps its own exponentially forgotten least-squares statistics, forgotten only when a
step of that kind arrives, so a long decode-only stretch does not erase what a prefill costs. The
fit is non-negative least squares (a cost never shrinks with more work). One model per engine, so
per device and precision, with nothing tuned on one machine.

Policy, only when sequences are decoding (otherwise nobody's pace is at stake and the fixed
token budget applies, as without it):

- target = max_step_ms, or by default AUTO_FACTOR x the predicted decode-only step for these rows,
  stretched by (requests waiting for their first token) / (decoding rows) when more wait than
  decode: the stall each decoding stream takes is weighed against the wait of the prompts queued
  behind it. A burst (32 requests at once) otherwise spends most of its time prefilling in small
  chunks between the decode steps of its first few requests (engine, bfloat16: 8.8 s against 6.3 s
  unbudgeted). An explicit max_step_ms is a hard target and is not stretched;
- a step with prefill may always take (1 + PASS_SLACK) x its fixed part (decode rows plus an empty
  prefill pass), so a target below the fixed cost of a prefill pass (a GPU running prefill eagerly)
  does not shrink chunks to nothing for no gain;
- the chunk is the largest n whose predicted step fits, clamped to [min_chunk, token_budget - rows]:
  a waiting prompt always progresses, and decode rows are never dropped to make room;
- new prompts of at most 4 x min_chunk tokens are not split (whole_short_prompts): the budget
  stretches to the end of the last one it reaches.
"""

from __future__ import annotations

import math
from typing import Iterable

AUTO_FACTOR = 2.5  # auto target: this many decode-only steps (streams' ITL p99 <= 3x their p50, with margin)
PASS_SLACK = 0.25
FORGET = 0.95  # per step of the same kind: the last ~20 steps of each kind dominate the fit
OUTLIER = 3.0  # once fitted, an observation is clipped to [pred / OUTLIER, pred * OUTLIER]
RIDGE = 1e-3
KINDS = ("decode", "mixed", "prefill")
# the features' (and coefficients') positions
ANY_STEP, HAS_DECODE, DECODE_ROWS, DECODE_KEYS_K, HAS_PREFILL, PREFILL_TOKENS, PREFILL_PAIRS_K = range(7)
_N = 7


def step_kind(decode_rows: int, prefill_tokens: int) -> str:
    """"decode" (decode-only), "mixed" or "prefill" (prefill-only)."""
    if prefill_tokens and decode_rows:
        return "mixed"
    return "prefill" if prefill_tokens else "decode"


def prefill_pairs(start: int, length: int) -> int:
    """Query-key pairs of a causal chunk of `length` tokens after `start` cached ones."""
    return length * start + length * (length + 1) // 2


def features(decode_rows: int, decode_keys: int, prefill_tokens: int, pairs: int) -> list[float]:
    x = [0.0] * _N
    x[ANY_STEP] = float(decode_rows > 0 or prefill_tokens > 0)
    x[HAS_DECODE], x[DECODE_ROWS], x[DECODE_KEYS_K] = float(decode_rows > 0), float(decode_rows), decode_keys / 1000.0
    x[HAS_PREFILL], x[PREFILL_TOKENS], x[PREFILL_PAIRS_K] = float(prefill_tokens > 0), float(prefill_tokens), pairs / 1000.0
    return x


class StepCostModel:
    """Online non-negative least squares of step milliseconds on `features`."""

    def __init__(self, forget: float = FORGET, ridge: float = RIDGE):
        self.forget = forget
        self.ridge = ridge
        self._xx = {k: [[0.0] * _N for _ in range(_N)] for k in KINDS}
        self._xy = {k: [0.0] * _N for k in KINDS}
        self.counts = dict.fromkeys(KINDS, 0)
        self._coef: list[float] | None = None  # None: observations since the last solve
        self._last: list[float] | None = None  # the last solution, possibly a few observations old
        self._unsolved = 0  # observations since

    @property
    def ready(self) -> bool:
        """Seen a step with decode rows and a step with prefill: enough to predict a mixed step."""
        c = self.counts
        return (c["decode"] + c["mixed"]) > 0 and (c["prefill"] + c["mixed"]) > 0

    def observe(self, x: list[float], ms: float) -> None:
        if not (ms >= 0 and math.isfinite(ms)):
            return
        kind = step_kind(int(x[DECODE_ROWS]), int(x[PREFILL_TOKENS]))
        if self.counts[kind] >= 5:  # a step slowed by something else (another process) must not swing the fit
            if self._last is None or self._unsolved >= 32:
                self.coef  # refit now and then; between refits the last fit serves (a solve costs ~0.2 ms)
            pred = sum(c * v for c, v in zip(self._last, x))
            if pred > 0:
                ms = min(max(ms, pred / OUTLIER), pred * OUTLIER)
        xx, xy, f = self._xx[kind], self._xy[kind], self.forget
        for i in range(_N):
            xy[i] = f * xy[i] + x[i] * ms
            row = xx[i]
            for j in range(_N):
                row[j] = f * row[j] + x[i] * x[j]
        self.counts[kind] += 1
        self._coef = None
        self._unsolved += 1

    @property
    def coef(self) -> list[float]:
        if self._coef is None:
            xx = [[sum(self._xx[k][i][j] for k in KINDS) for j in range(_N)] for i in range(_N)]
            xy = [sum(self._xy[k][i] for k in KINDS) for i in range(_N)]
            self._coef = self._last = _nnls(xx, xy, self.ridge)
            self._unsolved = 0
        return self._coef

    def predict(self, x: list[float]) -> float:
        return sum(c * v for c, v in zip(self.coef, x))


def _nnls(xx: list[list[float]], xy: list[float], ridge: float) -> list[float]:
    """argmin ||X b - y||^2 + ridge ||b||^2 with b >= 0, from the normal equations (active set: a
    negative coefficient's feature is dropped and the rest refitted)."""
    active = [i for i in range(len(xy)) if xx[i][i] > 0]
    while True:
        sol = _solve([[xx[i][j] + (ridge if i == j else 0.0) for j in active] for i in active], [xy[i] for i in active])
        worst = min(range(len(active)), key=sol.__getitem__, default=None)
        if worst is None or sol[worst] >= 0:
            out = [0.0] * len(xy)
            for i, v in zip(active, sol):
                out[i] = v
            return out
        active.pop(worst)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting on a small dense system (a is positive definite)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[piv] = m[piv], m[col]
        if m[col][col] == 0:
            continue
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            if f:
                for k in range(col, n + 1):
                    m[r][k] -= f * m[col][k]
    x = [0.0] * n
    for i in range(n - 1, -1, -1):
        if m[i][i] != 0:
            x[i] = (m[i][n] - sum(m[i][k] * x[k] for k in range(i + 1, n))) / m[i][i]
    return x


class StepPacer:
    """Sizes each step's prefill from a StepCostModel fed by the engine (an EngineObserver).

    max_step_ms: the target step time while sequences decode; None = AUTO_FACTOR x the predicted
    decode-only step for the rows at hand.
    """

    def __init__(self, max_step_ms: float | None = None, model: StepCostModel | None = None):
        if max_step_ms is not None and not max_step_ms > 0:
            raise ValueError(f"max_step_ms must be positive (or None for automatic), got {max_step_ms}")
        self.max_step_ms = max_step_ms
        self.model = model or StepCostModel()
        self.last_target_ms: float | None = None  # what the last budgeted step aimed at (None: no decode rows)

    def target_ms(self, decode_rows: int, decode_keys: int) -> float:
        if self.max_step_ms is not None:
            return self.max_step_ms
        return AUTO_FACTOR * self.model.predict(features(decode_rows, decode_keys, 0, 0))

    def prefill_tokens(self, decode_rows: int, decode_keys: int, context: int, cap: int, floor: int,
                       queued: int = 0) -> int:
        """Prefill tokens for a step with these decode rows when the next chunk starts after `context`
        cached tokens and `queued` requests wait for their first token: within [floor, cap] (cap wins
        if smaller)."""
        cap = max(cap, floor)
        if decode_rows == 0:
            self.last_target_ms = None
            return cap
        if not self.model.ready:  # no measurement yet: protect the streams
            self.last_target_ms = None
            return floor
        coef = self.model.coef
        base = self.model.predict(features(decode_rows, decode_keys, 0, 0)) + coef[HAS_PREFILL]
        c, d = coef[PREFILL_TOKENS], coef[PREFILL_PAIRS_K] / 1000.0  # per token, per query-key pair

        def step_ms(n: int) -> float:
            return base + c * n + d * prefill_pairs(context, n)

        target = self.target_ms(decode_rows, decode_keys)
        if self.max_step_ms is None and queued > decode_rows:
            target *= queued / decode_rows
        target = max(target, (1 + PASS_SLACK) * step_ms(0))
        self.last_target_ms = target
        room = target - base
        # largest n with (d/2) n^2 + (c + d*(context + 1/2)) n <= room
        qa, qb = d / 2, c + d * (context + 0.5)
        if qa > 0:
            n = (-qb + math.sqrt(qb * qb + 4 * qa * room)) / (2 * qa)
        elif qb > 0:
            n = room / qb
        else:
            n = cap  # prefill measured as free: nothing to protect against
        return int(min(max(n, floor), cap))

    # ---- EngineObserver ----------------------------------------------------------------------
    def on_step(self, seconds: float, batch) -> None:
        self.model.observe(batch_features(batch.decode, batch.prefill, batch.drafts), seconds * 1000.0)

    def on_tokens(self, seq, count, gap_seconds) -> None:
        pass

    def on_finish(self, seq, final) -> None:
        pass


def batch_features(decode: Iterable, prefill: Iterable, drafts: Iterable = ()) -> list[float]:
    """Features of a batch that has run (its decode rows' new tokens are cached: num_cached keys each).
    A decode row verifying k drafts is k + 1 rows, the j-th attending over num_cached - k + j keys."""
    decode = list(decode)
    chunks = list(prefill)
    ks = list(drafts) or [()] * len(decode)
    rows = sum(1 + len(k) for k in ks)
    keys = sum((len(k) + 1) * (s.num_cached - len(k)) + len(k) * (len(k) + 1) // 2 for s, k in zip(decode, ks))
    return features(rows, keys, sum(c.length for c in chunks), sum(prefill_pairs(c.start, c.length) for c in chunks))


def prefill_tokens(pacer: "StepPacer | None", decode: list, running: list, waiting, token_budget: int,
                   min_chunk: int) -> int:
    """The scheduler's prefill tokens for a step: the fixed token budget less the decode rows when
    `pacer` is None, else what the StepPacer allows for these decode rows and the next chunk."""
    cap = max(token_budget - len(decode), min_chunk)
    if pacer is None or not (waiting or any(s.in_prefill for s in running)):  # no prefill work: no fit needed
        return cap
    context = next((s.num_cached for s in running if s.in_prefill), None)
    queued = len(waiting) + sum(1 for s in running if s.in_prefill)
    n = pacer.prefill_tokens(len(decode), sum(s.num_cached + 1 for s in decode), context or 0, cap, min_chunk, queued)
    return n if context is not None else whole_short_prompts(n, waiting, cap, WHOLE_PROMPT_CHUNKS * min_chunk)


WHOLE_PROMPT_CHUNKS = 4


def whole_short_prompts(budget: int, waiting, cap: int, short: int) -> int:
    """The budget moved to a boundary between the short prompts (<= `short` tokens) at the head of the
    queue, so none of them is split: splitting a short prompt saves little time, and a prompt prefilled
    in one pass gives the same tokens alone and among others (a split depends on the load and changes
    the kernels' reduction order). Only longer prompts are cut to the budget."""
    total = 0
    for seq in waiting:
        if total >= budget or seq.prompt_len > short or total + seq.prompt_len > cap:
            break
        total += seq.prompt_len
    return max(total, budget) if total < budget else total
