"""Constraint -> compiled matcher, with the size limits, a compile deadline and an LRU cache by content.

`ConstraintCompiler.compile` is called where a request is validated: on the edge's worker threads,
never on the event loop or the engine thread. The work itself runs on the compiler's own small
pool so that a deadline can be kept; a failure becomes a `RequestValidationError` naming the
constraint's field and the reason. A compiled constraint holds the matcher's initial state, which
each request copies (microseconds), so a cache hit costs nothing but a dictionary look-up.

The cache is bounded by entry count and by the total size of the sources it holds; the library's
compiled form grows with the source (its lexer states are bounded per grammar by its own limits).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from ..errors import RequestValidationError
from .spec import Constraint, ConstraintKind, ConstraintLimits
from .state import ConstraintState, MaskWorker, fill_bitmask, new_bitmask
from .vocabulary import Vocabulary, build_vocabulary

log = logging.getLogger("lmserve.constraints")
MAX_REASON_CHARS = 400
UNSATISFIABLE = "no text this model's vocabulary can write satisfies it (nothing may come first)"
# JSON is written the way people write it on one line: no free whitespace between tokens, which a
# small model would otherwise fill until its length limit.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class CompiledConstraint:
    """A constraint compiled for one vocabulary: `new_state()` gives a request its own matcher."""

    constraint: Constraint
    vocabulary: Vocabulary
    compile_seconds: float
    _initial: object = field(repr=False)  # the library's matcher at the start, never advanced
    _worker: MaskWorker = field(repr=False)

    def new_state(self, ahead: bool = True) -> ConstraintState:
        """A fresh matcher for one request; with `ahead`, its first mask starts computing at once (else
        masks are computed when asked for: constraints/state.py)."""
        return ConstraintState(self._initial.deep_copy(), self.vocabulary, self._worker, ahead)


@dataclass
class CompilerStats:
    hits: int = 0
    misses: int = 0
    compile_seconds: float = 0.0  # total over misses
    entries: int = 0
    source_chars: int = 0


class ConstraintCompiler:
    """Compiles constraints for one model's vocabulary; thread-safe."""

    def __init__(self, tokenizer, logits_size: int | None = None, limits: ConstraintLimits | None = None,
                 max_entries: int = 256, max_cached_chars: int = 4_000_000, compile_threads: int = 2):
        self.limits = limits or ConstraintLimits()
        self.max_entries = max_entries
        self.max_cached_chars = max_cached_chars
        self._tokenizer = tokenizer
        self._logits_size = logits_size
        self._vocab: Vocabulary | None = None
        self._lock = threading.Lock()
        self._vocab_lock = threading.Lock()
        self._cache: OrderedDict[tuple, CompiledConstraint | str] = OrderedDict()  # value: compiled, or the refusal
        self._pool = ThreadPoolExecutor(compile_threads, thread_name_prefix="lmserve-compile")
        self.worker = MaskWorker()
        self.stats = CompilerStats()

    @property
    def vocabulary(self) -> Vocabulary:
        """The model's vocabulary index, built on first use (about a second for 50k ids)."""
        if self._vocab is None:
            with self._vocab_lock:
                if self._vocab is None:
                    t = time.perf_counter()
                    self._vocab = build_vocabulary(self._tokenizer, self._logits_size)
                    log.info("constraint vocabulary: %d ids indexed in %.2fs", self._vocab.size, time.perf_counter() - t)
        return self._vocab

    def compile(self, constraint: Constraint) -> CompiledConstraint:
        """The compiled form of `constraint`, from the cache when it was compiled before.

        Raises RequestValidationError([(constraint.field, reason)]) when it is too large, malformed,
        uses what the library does not support, cannot be met by this vocabulary, or takes longer
        than the limits allow to compile."""
        v = constraint.violations(self.limits)
        if v:
            raise RequestValidationError(v)
        key = constraint.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.stats.hits += 1
        if hit is None:
            hit = self._compile_now(constraint)
            with self._lock:
                self.stats.misses += 1
                if isinstance(hit, CompiledConstraint):
                    self.stats.compile_seconds += hit.compile_seconds
                self._insert(key, hit)
        if isinstance(hit, str):
            raise RequestValidationError([(constraint.field, hit)])
        return hit

    def _insert(self, key: tuple, value) -> None:
        if key in self._cache:
            return
        self._cache[key] = value
        self.stats.source_chars += len(key[1])
        while self._cache and (len(self._cache) > self.max_entries or self.stats.source_chars > self.max_cached_chars):
            old, _ = self._cache.popitem(last=False)
            self.stats.source_chars -= len(old[1])
        self.stats.entries = len(self._cache)

    def _compile_now(self, constraint: Constraint) -> CompiledConstraint | str:
        vocab = self.vocabulary
        future = self._pool.submit(_build, constraint, vocab)
        try:
            matcher, seconds = future.result(timeout=self.limits.compile_timeout_s)
        except FutureTimeout:
            return (f"took longer than {self.limits.compile_timeout_s:g}s to compile; "
                    "simplify it (fewer alternatives, bounded repetitions)")
        if isinstance(matcher, str):
            return matcher
        return CompiledConstraint(constraint, vocab, seconds, matcher, self.worker)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.worker.close()


def _grammar_text(constraint: Constraint) -> str:
    from llguidance import LLMatcher

    kind = constraint.kind
    if kind is ConstraintKind.JSON_SCHEMA:
        return LLMatcher.grammar_from_json_schema(constraint.source, defaults=JSON_OPTIONS)
    if kind is ConstraintKind.JSON_OBJECT:
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind is ConstraintKind.REGEX:
        return LLMatcher.grammar_from_regex(constraint.source)
    if kind is ConstraintKind.GRAMMAR:
        return LLMatcher.grammar_from_lark(constraint.source)
    # a choice: one Lark alternative per string, each a JSON-escaped literal
    return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in constraint.choices))


def _build(constraint: Constraint, vocab: Vocabulary):
    """(the library's initial matcher, seconds) or (the reason it is refused, 0). Runs on the pool;
    the library releases the GIL while it builds."""
    from llguidance import LLMatcher, LLParserLimits

    t = time.perf_counter()
    try:
        grammar = _grammar_text(constraint)
    except (ValueError, TypeError) as exc:  # the schema text is not a JSON object
        return _reason(constraint, str(exc)), 0.0
    matcher = LLMatcher(vocab.ll_tokenizer, grammar, log_level=0, limits=LLParserLimits(verbose_errors=False))
    if not matcher.is_error():  # the first mask: a constraint no token can start is refused here
        mask = new_bitmask(vocab.size)
        fill_bitmask(matcher, mask)
        nothing = "NoExtension" in matcher.get_error() and not matcher.is_accepting()  # the language is empty
        if nothing or (not matcher.is_error() and not matcher.is_accepting() and not _any_text_token(mask, vocab)):
            return UNSATISFIABLE, 0.0
    if matcher.is_error():
        return _reason(constraint, matcher.get_error()), 0.0
    return matcher, time.perf_counter() - t


def _any_text_token(mask, vocab: Vocabulary) -> bool:
    """Whether the [1, W] bitmask allows any id besides the end-of-sequence ones."""
    row = mask[0].clone()
    for e in vocab.eos_ids:
        row[e // 32] &= ~(1 << (e % 32))
    return bool(row.any())


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*?)\]")


def _reason(constraint: Constraint, message: str) -> str:
    """A message a person can act on, from the library's: what is wrong, in the constraint's terms."""
    message = message.strip().split("\n<state>")[0]
    found = _UNIMPLEMENTED.search(message)
    if found:
        return f"unsupported JSON-schema keyword(s): {found.group(1).replace(chr(34), '')}"
    if "too large" in message or "fuel" in message.lower() or "limit" in message.lower():
        return f"too complex to compile ({_trim(message)}); simplify it"
    what = {ConstraintKind.JSON_SCHEMA: "invalid JSON schema", ConstraintKind.REGEX: "invalid regular expression",
            ConstraintKind.GRAMMAR: "invalid grammar (Lark syntax)"}.get(constraint.kind, "invalid")
    return f"{what}: {_trim(message)}"


def _trim(message: str) -> str:
    message = " ".join(message.split())
    return message if len(message) <= MAX_REASON_CHARS else message[: MAX_REASON_CHARS - 3] + "..."


__all__ = ["CompiledConstraint", "CompilerStats", "ConstraintCompiler", "JSON_OPTIONS"]
