"""Constrained decoding: a request's output held to a JSON schema, any JSON object, a regex, a
Lark grammar or a choice among strings.

spec.py        what a request asks for, and the size limits (plain data, no library)
vocabulary.py  lmserve tokenizer -> the matcher library's vocabulary (the bytes of every id)
compiler.py    constraint -> compiled matcher: limits, compile deadline, LRU cache by content
state.py       one request's matcher: next-token mask (computed ahead), advance, rollback

The matcher library is llguidance, chosen by measurement (`lmserve bench matcher-choice`).
"""

from .spec import Constraint, ConstraintKind, ConstraintLimits

__all__ = ["Constraint", "ConstraintKind", "ConstraintLimits"]
