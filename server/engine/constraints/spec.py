"""What a request may constrain its output to, and the size limits checked before any compiling.

A `Constraint` is plain data (no library, no torch): the edge builds one from the request, the
engine's `ConstraintCompiler` turns it into a matcher. Its `key` is its content, which the compile
cache is keyed by. Violations name the request field the constraint came from.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass


class ConstraintKind(str, enum.Enum):
    JSON_SCHEMA = "json_schema"  # a JSON value valid under a JSON schema
    JSON_OBJECT = "json_object"  # any JSON object
    REGEX = "regex"  # text the regular expression matches whole
    GRAMMAR = "grammar"  # text a context-free grammar (Lark syntax) derives from `start`
    CHOICE = "choice"  # exactly one of a list of strings


@dataclass(frozen=True)
class ConstraintLimits:
    """Bounds on what one request may ask to compile, so that none can stall the server.

    The library adds its own fuel limits on lexer and parser work, which turn a pathological input
    (a regex whose automaton explodes, a schema whose alternatives multiply) into an error instead
    of a long compile; `compile_timeout_s` is the last resort."""

    max_source_chars: int = 64_000  # a schema's JSON text, a grammar
    max_regex_chars: int = 4_000
    max_schema_depth: int = 32  # nesting of objects and arrays in the schema document
    max_grammar_rules: int = 500
    max_choices: int = 256
    max_choice_chars: int = 1_000  # each
    compile_timeout_s: float = 5.0


@dataclass(frozen=True)
class Constraint:
    """One request's output constraint. `source` is the schema (compact JSON text), the regex, the
    grammar, or the choices (a JSON list); json_object has none."""

    kind: ConstraintKind
    source: str = ""

    @classmethod
    def json_schema(cls, schema: "str | dict") -> "Constraint":
        """A schema as JSON text or as a parsed dict. Text that is not JSON is kept as is, for the
        compiler to refuse with the parser's message."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError):  # not JSON, or nested past what the parser recurses into
                return cls(ConstraintKind.JSON_SCHEMA, schema)
        # keys in the schema's own order: the matcher writes properties in the order they are declared
        return cls(ConstraintKind.JSON_SCHEMA, json.dumps(schema, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> "Constraint":
        return cls(ConstraintKind.JSON_OBJECT)

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        return cls(ConstraintKind.REGEX, pattern)

    @classmethod
    def grammar(cls, lark: str) -> "Constraint":
        return cls(ConstraintKind.GRAMMAR, lark)

    @classmethod
    def choice(cls, options) -> "Constraint":
        return cls(ConstraintKind.CHOICE, json.dumps(list(options), ensure_ascii=False))

    @property
    def field(self) -> str:
        """The request field this constraint is set by (SamplingParams.<field>)."""
        return "choice.options" if self.kind is ConstraintKind.CHOICE else self.kind.value

    @property
    def choices(self) -> list[str]:
        return json.loads(self.source) if self.kind is ConstraintKind.CHOICE else []

    @property
    def key(self) -> tuple[str, str]:
        return self.kind.value, self.source

    def violations(self, limits: ConstraintLimits) -> list[tuple[str, str]]:
        """Size limits, checked in time proportional to the source's size (before any compiling)."""
        f, kind, n = self.field, self.kind, len(self.source)
        if kind is ConstraintKind.REGEX:
            if not self.source:
                return [(f, "must not be empty")]
            if n > limits.max_regex_chars:
                return [(f, f"at most {limits.max_regex_chars} characters, got {n}")]
        elif kind is ConstraintKind.CHOICE:
            options = self.choices
            if not options:
                return [(f, "must list at least one string")]
            if len(options) > limits.max_choices:
                return [(f, f"at most {limits.max_choices} strings, got {len(options)}")]
            long = [i for i, o in enumerate(options) if len(o) > limits.max_choice_chars]
            if long:
                return [(f"{f}[{long[0]}]", f"at most {limits.max_choice_chars} characters, "
                                            f"got {len(options[long[0]])}")]
        elif kind in (ConstraintKind.JSON_SCHEMA, ConstraintKind.GRAMMAR):
            if not self.source.strip():
                return [(f, "must not be empty")]
            if n > limits.max_source_chars:
                return [(f, f"at most {limits.max_source_chars} characters, got {n}")]
            if kind is ConstraintKind.JSON_SCHEMA:
                depth = _json_depth(self.source)
                if depth > limits.max_schema_depth:
                    return [(f, f"nests {depth} levels deep; at most {limits.max_schema_depth}")]
            else:
                rules = _rule_count(self.source)
                if rules > limits.max_grammar_rules:
                    return [(f, f"defines {rules} rules; at most {limits.max_grammar_rules}")]
        return []


def _json_depth(text: str) -> int:
    """Deepest nesting of [ and { in JSON text, outside strings (a linear scan: no recursion, so a
    schema nested 100,000 deep is measured, not parsed)."""
    depth = deepest = 0
    in_string = escaped = False
    for c in text:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest


def _rule_count(lark: str) -> int:
    """Rules and terminals a Lark grammar defines: lines of the form `name:` or `NAME.prio:`."""
    count = 0
    for line in lark.splitlines():
        head, colon, _ = line.partition(":")
        name = head.strip().lstrip("?!").split(".")[0]
        if colon and name and (name.replace("_", "").isalnum()) and not head.startswith((" ", "\t", "|")):
            count += 1
    return count


__all__ = ["Constraint", "ConstraintKind", "ConstraintLimits"]
