"""Rendering a checkpoint's chat template: Jinja2 in a sandbox, with the helpers chat templates expect.

The environment mirrors the one chat templates are written against: `trim_blocks` and
`lstrip_blocks` on, the `loopcontrols` extension, a `tojson` filter that keeps non-ASCII text,
and the globals `raise_exception(msg)` and `strftime_now(fmt)`. Templates run in
`ImmutableSandboxedEnvironment`, so a template cannot reach Python internals or mutate the
messages it is given.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Private-use characters that bracket each message's content in a second rendering, so the content's
# place in the output is known (see `render_with_spans`); a pair absent from the input is chosen.
_MARKERS = tuple((chr(0xF0000 + 2 * i), chr(0xF0001 + 2 * i)) for i in range(64))


class ChatTemplateError(ValueError):
    """The template failed to compile, or refused the messages (e.g. via `raise_exception`)."""


class NoChatTemplateError(ChatTemplateError):
    """The checkpoint ships no chat template (a pretrained base model): it takes text, not messages."""


class _GenerationBlock(Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (used to mark assistant turns) and renders
    its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for part in version.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


class ChatTemplate:
    """A compiled chat template. `render` turns a list of `{"role", "content"}` dicts into prompt text."""

    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None):
        if _version_tuple(jinja2.__version__) < (3, 1, 6):
            # Earlier releases have known sandbox escapes; templates come from checkpoint files.
            raise ChatTemplateError(f"jinja2>=3.1.6 is required to render chat templates, found {jinja2.__version__}")
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc}") from exc
        self.source = source
        self._special = {"bos_token": bos_token or "", "eos_token": eos_token or ""}

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **variables: Any) -> str:
        """Render `messages`; extra keyword arguments (e.g. `tools`) become template variables.
        `tools` and `documents` are defined (as None) unless given, as templates expect."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ChatTemplateError("messages must be a list of dicts with 'role' and 'content'")
        context = {"tools": None, "documents": None, **self._special, **variables}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template rejected the messages: {exc}") from exc

    def render_with_spans(self, messages: list[dict], add_generation_prompt: bool = True,
                          **variables: Any) -> tuple[str, list[tuple[int, int]] | None]:
        """`render`'s text and the (start, end) spans of it that came from message contents.

        The conversation is rendered a second time with each content bracketed by two private-use
        characters (absent from the input); when removing them gives back exactly the first
        rendering, the brackets mark where every content went. Templates that `trim` contents are
        matched by bracketing the stripped content inside its whitespace. None when neither
        rendering lines up (the template changes its output for bracketed contents)."""
        text = self.render(messages, add_generation_prompt, **variables)
        marker = self._free_markers(messages)
        if marker is None:
            return text, None
        op, cl = marker
        for wrap in (_wrap_whole, _wrap_stripped):
            marked = [dict(m, content=wrap(m["content"], op, cl)) if isinstance(m.get("content"), str) else m
                      for m in messages]
            try:
                rendered = self.render(marked, add_generation_prompt, **variables)
            except ChatTemplateError:
                continue
            spans = _spans(rendered, op, cl)
            if spans is not None and rendered.replace(op, "").replace(cl, "") == text:
                return text, spans
        return text, None

    def _free_markers(self, messages: list[dict]) -> tuple[str, str] | None:
        used = "".join(m["content"] for m in messages if isinstance(m.get("content"), str)) + self.source
        return next(((op, cl) for op, cl in _MARKERS if op not in used and cl not in used), None)


def _wrap_whole(content: str, op: str, cl: str) -> str:
    return op + content + cl


def _wrap_stripped(content: str, op: str, cl: str) -> str:
    core = content.strip()
    if not core:
        return content
    lead = content[: len(content) - len(content.lstrip())]
    return lead + op + core + cl + content[len(lead) + len(core):]


def _spans(rendered: str, op: str, cl: str) -> list[tuple[int, int]] | None:
    """Spans between matched markers, in coordinates of the text without markers; None if unbalanced."""
    spans, removed, start = [], 0, None
    for i, ch in enumerate(rendered):
        if ch == op:
            if start is not None:
                return None
            start = i - removed
            removed += 1
        elif ch == cl:
            if start is None:
                return None
            spans.append((start, i - removed))
            start = None
            removed += 1
    return None if start is not None else spans
