"""One request's matcher: the allowed-token mask for its next token, advanced on every accepted token.

Computed ahead (`ahead=True`, for sampled rows, which need the whole mask): the mask for step k+1
starts computing on `MaskWorker`'s thread as soon as step k's token is accepted (`advance`), and the
library releases the GIL while it computes, so the work overlaps the rest of the step and the next
forward; `mask()` waits only for what is left of it.

On demand (`ahead=False`, for greedy rows): no mask is computed until one is asked for. A greedy row's
token is the argmax of its allowed logits, which is the argmax of all of them whenever that token is
allowed; the sampler asks `allowed(argmax)` (the matcher checks one token and what the grammar forces
next, ~1 + 15 us against ~50 us for a mask of SmolLM2's vocabulary) and computes the mask only when
the model's choice is not allowed, and then has the next one computed ahead (`ahead` is the
sampler's to set: disagreements come in runs). On a 2-core CPU a mask computed ahead is not free: its
thread takes a core from the forward's. `allowed` answers as the mask's bit does; a test holds every
id's answer to the mask along walks over each kind of constraint (llguidance is pinned).

End of sequence is allowed exactly where the constraint is complete (the library puts the eos ids
in the mask then, and only them once nothing can follow: `finished_at`, where the engine ends the
output without generating that token). `rollback(n)` undoes the last n tokens
and `count_valid(tokens)` says how many of a draft the constraint accepts: the two calls
speculative decoding needs to verify a draft and rewind the rejected part.
"""

from __future__ import annotations

import ctypes
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor

from .vocabulary import Vocabulary


def new_bitmask(vocab: int) -> Tensor:
    """[1, ceil(vocab / 32)] int32, all allowed (the library overwrites every word)."""
    return torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)


def fill_bitmask(matcher, bits: Tensor) -> None:
    """Write `matcher`'s next-token mask into `bits` [1, W] (the library releases the GIL meanwhile).
    Called directly rather than through the library's torch helpers, whose import pulls in torch.compile."""
    matcher.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * bits.element_size())


class MaskWorker:
    """The thread that computes masks ahead of the sampler (one: masks are ~50 us each; a batch of
    32 fits well within a forward, and the forward needs the cores)."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lmserve-mask")
        self._lock = threading.Lock()  # masks are counted from this thread and the sampler's
        self.computed = 0  # masks computed by every state that uses this worker, ahead or on demand
        self.seconds = 0.0  # their time

    def submit(self, fn) -> Future:
        return self._pool.submit(fn)

    def count(self, seconds: float) -> None:
        with self._lock:
            self.computed += 1
            self.seconds += seconds

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class ConstraintError(RuntimeError):
    """A token the constraint does not allow reached the matcher (a bug upstream, never the request's)."""


class ConstraintState:
    """The matcher of one request (not thread-safe: one sequence, one caller at a time)."""

    def __init__(self, matcher, vocabulary: Vocabulary, worker: MaskWorker, ahead: bool = True):
        self._m = matcher
        self._vocab = vocabulary
        self._worker = worker
        self.ahead = ahead
        self._bits = new_bitmask(vocabulary.size)  # [1, W] int32, bit t of word t//32
        self._words = self._bits[0].numpy()  # the same words, read one at a time without a tensor op each
        self._pending: Future | None = None
        self._stale = True  # the bits are not this position's mask (nor being computed)
        self.tokens = 0  # accepted so far
        # after how many tokens nothing but the end may follow (None: not yet); read from the library where no
        # mask is computing (its calls are serial), so never waited for
        self.finished_at: int | None = 0 if matcher.is_stopped() else None
        self._start_mask()

    def _fill(self) -> None:
        t = time.perf_counter()
        fill_bitmask(self._m, self._bits)
        self._worker.count(time.perf_counter() - t)

    def _start_mask(self) -> None:
        if self.ahead:
            self._pending = self._worker.submit(self._fill)
        self._stale = not self.ahead

    def _wait(self) -> None:
        if self._pending is not None:
            try:
                self._pending.result()
            except Exception:  # noqa: BLE001 - the library failed on this matcher: nothing is allowed, the row fails alone
                self._bits.zero_()
            self._pending = None

    def mask(self) -> Tensor:
        """[W] int32 bitmask of the ids allowed next (waits for its computation if it is still running;
        computes it here if none was started)."""
        self._wait()
        if self._stale:
            try:
                self._fill()
            except Exception:  # noqa: BLE001 - as in _wait: nothing is allowed, the row fails alone
                self._bits.zero_()
            self._stale = False
        return self._bits[0]

    def allowed(self, token: int) -> bool:
        """Whether `token` may come next: read from the mask where it is computed (or being computed),
        else asked of the matcher for this one token."""
        if not 0 <= token < self._vocab.size:
            return False
        if self._stale and self._pending is None:
            if token in self._vocab.eos_ids:  # the mask allows end of sequence exactly where the output is
                return self._m.is_accepting()  # complete; validate_tokens refuses it even there
            if self._m.validate_tokens([int(token)]) != 1:
                return False
            # where the grammar forces the next bytes, the mask holds only their first token as the
            # tokenizer writes them (validate_tokens would take any split of them), or, where no whole
            # token is forced, the tokens extending them: that mask is computed below
            forced = self._m.compute_ff_tokens()
            if forced:
                return token == forced[0]
            if not self._m.compute_ff_bytes():
                return True
        self.mask()
        return bool((int(self._words[token // 32]) >> (token % 32)) & 1)

    @property
    def has_mask(self) -> bool:
        """This position's mask is computed or being computed."""
        return not self._stale or self._pending is not None

    def first_allowed(self, tokens: list[int]) -> int | None:
        """The place in `tokens` of the first one that may come next (as `allowed` answers), or None. Where no
        mask is computed (nor being computed) and the grammar forces the next bytes, None without a look: the
        mask, which holds one token there and costs little, is the one to ask."""
        if self._stale and self._pending is None:
            if self._m.compute_ff_bytes():
                return None
            for k, token in enumerate(tokens):  # nothing forced: `allowed`'s answer is validate_tokens'
                if token in self._vocab.eos_ids:
                    if self._m.is_accepting():
                        return k
                elif 0 <= token < self._vocab.size and self._m.validate_tokens([int(token)]) == 1:
                    return k
            return None
        self.mask()
        words = self._words
        return next((k for k, token in enumerate(tokens) if 0 <= token < self._vocab.size
                     and (int(words[token // 32]) >> (token % 32)) & 1), None)

    def advance(self, token: int) -> None:
        """Accept `token` and start computing the next mask. Raises ConstraintError if the constraint
        does not allow it (the sampler only offers allowed tokens, so that is a bug)."""
        self._wait()
        if not self._m.consume_token(int(token)):
            raise ConstraintError(f"token {token} is not allowed by the constraint: {self._m.get_error()[:200]}")
        self.tokens += 1
        if self.finished_at is None and self._m.is_stopped():
            self.finished_at = self.tokens
        self._start_mask()

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens."""
        self._wait()
        if n:
            if n > self.tokens or not self._m.rollback(n):
                raise ConstraintError(f"cannot roll back {n} of {self.tokens} tokens")
            self.tokens -= n
            if self.finished_at is not None and self.finished_at > self.tokens:
                self.finished_at = None
        self._start_mask()

    def count_valid(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the constraint accepts from here (the state is unchanged)."""
        self._wait()
        return self._m.validate_tokens([int(t) for t in tokens])

    @property
    def is_complete(self) -> bool:
        """The output so far satisfies the constraint (end of sequence is allowed now)."""
        self._wait()
        return self._m.is_accepting()

    @property
    def is_finished(self) -> bool:
        """Nothing but end of sequence may follow (`finished_at`: no wait for the mask computing ahead)."""
        return self.finished_at is not None


def unpack(bitmasks: Tensor, vocab: int) -> Tensor:
    """[R, W] int32 bitmasks -> [R, vocab] bool (True = allowed), on the bitmasks' device."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmasks.device)  # [32]
    bits = (bitmasks[:, :, None] >> shifts) & 1  # [R, W, 32]
    return bits.reshape(bitmasks.shape[0], -1)[:, :vocab].bool()  # [R, vocab]


class _NativeMask:
    """logit_mask.cpp through ctypes: the mask applied in one pass per row, in place."""

    def __init__(self, lib):
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._fns = {torch.float32: lib.lm_mask_logits_f32, torch.bfloat16: lib.lm_mask_logits_bf16}
        for fn in self._fns.values():
            fn.argtypes, fn.restype = [p, i64, p, p, i32, i32, i32, i32], i32

    def applies(self, logits: Tensor) -> bool:
        return logits.device.type == "cpu" and logits.dtype in self._fns and logits.stride(1) == 1

    def __call__(self, logits: Tensor, rows: list[int], bitmasks: Tensor) -> None:
        index = torch.tensor(rows, dtype=torch.int64)
        self._fns[logits.dtype](logits.data_ptr(), logits.stride(0), index.data_ptr(), bitmasks.data_ptr(),
                                len(rows), bitmasks.shape[1], logits.shape[1], torch.get_num_threads())


def _native_mask() -> _NativeMask | None:
    from lmserve.model.native import build as native

    return native.bound(_NativeMask)  # the model loader's library on CPU; never built here


def mask_logits(logits: Tensor, rows: list[int], bitmasks: Tensor) -> None:
    """Set to -inf, in place, the logits [N, V] of ids each constrained row's bitmask ([R, W] int32,
    ConstraintState.mask of its state) does not allow (ids past the bitmasks' width are never allowed).
    On CPU with the native kernels loaded, one pass per row (logit_mask.cpp); otherwise the bits are
    unpacked and applied with torch ops."""
    if not rows:
        return
    native = _native_mask()
    if native is not None and native.applies(logits):
        native(logits, rows, bitmasks)
        return
    V = logits.shape[1]
    allowed = unpack(bitmasks.to(logits.device, non_blocking=True), V)  # [R, V]
    if allowed.shape[1] < V:  # logits wider than the vocabulary: the extra ids are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, V - allowed.shape[1]), value=False)
    index = torch.tensor(rows, device=logits.device)
    with torch.inference_mode():  # the model's logits are inference tensors: updated in place, not copied
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


__all__ = ["ConstraintError", "ConstraintState", "MaskWorker", "fill_bitmask", "mask_logits", "new_bitmask", "unpack"]
