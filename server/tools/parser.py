"""Calls read back out of generated text, whole or as it streams: content, then calls in lmserve's envelope.

`CallParser.feed` takes the text of a choice piece by piece and returns what the pieces add: content,
a new call (its id and name, once the name is complete) and its arguments' text as it arrives, the
shape OpenAI streams as `delta.content` and `delta.tool_calls`. Text that could still become the
envelope's trigger (`<tool_call>`, written over several tokens), and whitespace before it, is held back
until the next piece says which it is. Where calls were allowed the output was constrained to the
envelope; text that does not follow it after a trigger stays content, and a call cut before its name
by the end of the text is dropped.

A call that repeats an earlier one of the same answer (the same function and arguments) ends the
answer (`repeated`): small models, offered parallel calls, otherwise write their call again and again
until the token limit. So the first call streams as it is written, and each later one once it is
complete and known to be new (a later call the end of the text cuts is dropped).
"""

from __future__ import annotations

from dataclasses import dataclass

from .spec import ARGUMENTS_KEY, BETWEEN, HEAD, TAIL, TRIGGER, new_call_id

_TEXT, _HEAD, _NAME, _KEY, _ARGS, _TAIL, _AFTER, _DONE = range(8)
_NEXT = BETWEEN + TRIGGER


@dataclass
class Delta:
    """What a piece of text added: content, or to call `index` its start (`id`, `name`) or its arguments."""

    content: str = ""
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""
    complete: bool = False


class CallParser:
    """One choice's text -> content and calls (not thread-safe; one per choice)."""

    def __init__(self):
        self.content = ""
        self.calls: list[ParsedCall] = []
        self.repeated = False  # the answer ended at a call repeating an earlier one (dropped)
        self._held: list[Delta] = []  # a later call's deltas, until it is complete and new
        self._buf = ""
        self._raw = ""  # the text of a call begun but not yet named (content again if it ends there)
        self._state = _TEXT
        self._depth = 0
        self._opened = self._in_string = self._escaped = False

    @property
    def complete_calls(self) -> int:
        return sum(c.complete for c in self.calls)

    def feed(self, text: str) -> list[Delta]:
        if self._state == _DONE:
            return []
        self._buf += text
        out: list[Delta] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Delta]:
        """The end of the text: what was held back, as content where no call took it. A later call cut by
        the end is dropped (the first, already streamed, stays as far as it got)."""
        out: list[Delta] = []
        if self._state in (_TEXT, _AFTER):
            self._content(out, self._buf)
        if len(self.calls) > 1 and not self.calls[-1].complete:
            self.calls.pop()
        self._buf, self._held = "", []
        return out

    # ---- the states ------------------------------------------------------------------
    def _step(self, out: list[Delta]) -> bool:
        """Consume what the state can from the buffer; True to go on."""
        buf, state = self._buf, self._state
        if state == _TEXT:
            at = buf.find(TRIGGER)
            if at >= 0:  # whitespace before a call is no content (unless the call turns out to be none)
                text = buf[:at].rstrip()
                self._content(out, text)
                self._take(at + len(TRIGGER), _HEAD, raw=buf[len(text):at] + TRIGGER)
                return True
            keep = next((k for k in range(min(len(TRIGGER) - 1, len(buf)), 0, -1) if buf.endswith(TRIGGER[:k])), 0)
            end = len(buf) - keep
            while end and buf[end - 1].isspace():
                end -= 1
            self._content(out, buf[:end])
            self._buf = buf[end:]
            return False
        if state in (_HEAD, _KEY, _TAIL):
            want = {_HEAD: HEAD, _KEY: ARGUMENTS_KEY, _TAIL: TAIL}[state]
            if not want.startswith(buf[: len(want)]):
                return self._off_envelope(out)
            if len(buf) < len(want):
                return False
            if state == _TAIL:
                self._complete(out)
                if self._state == _DONE:
                    return False
            self._take(len(want), {_HEAD: _NAME, _KEY: _ARGS, _TAIL: _AFTER}[state], raw=want if state == _HEAD else "")
            return True
        if state == _NAME:
            if buf and buf[0] != '"':
                return self._off_envelope(out)
            end = buf.find('"', 1)
            if end < 0:
                return False
            call = ParsedCall(new_call_id(), buf[1:end])
            self.calls.append(call)
            self._out(out).append(Delta(index=len(self.calls) - 1, id=call.id, name=call.name))
            self._raw = ""
            self._take(end + 1, _KEY)
            self._depth, self._opened, self._in_string, self._escaped = 0, False, False, False
            return True
        if state == _ARGS:
            end = self._arguments_end(buf)
            piece = buf if end is None else buf[:end]
            if piece:
                self.calls[-1].arguments += piece
                self._out(out).append(Delta(index=len(self.calls) - 1, arguments=piece))
            self._buf = "" if end is None else buf[end:]
            if end is not None:
                self._state = _TAIL
            return end is not None
        # _AFTER: more calls, or the end
        if buf.startswith(_NEXT):
            self._take(len(_NEXT), _HEAD, raw=_NEXT)
            return True
        if _NEXT.startswith(buf):
            return False
        self._state = _TEXT
        return True

    def _arguments_end(self, buf: str) -> int | None:
        """Where the arguments' JSON value ends in `buf` (scanning on from the last piece), or None."""
        for i, c in enumerate(buf):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
                self._opened = True
            elif c in "}]":
                if self._depth == 0:  # the envelope's closing brace after a number, true, false or null
                    return i
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None

    def _out(self, out: list[Delta]) -> list[Delta]:
        """Where a call's deltas go: out for the first call, held back for later ones."""
        return out if len(self.calls) == 1 else self._held

    def _complete(self, out: list[Delta]) -> None:
        call = self.calls[-1]
        if any((c.name, c.arguments) == (call.name, call.arguments) for c in self.calls[:-1]):
            self.calls.pop()
            self._held, self._buf, self._state, self.repeated = [], "", _DONE, True
            return
        call.complete = True
        out += self._held
        self._held = []

    def _take(self, n: int, state: int, raw: str = "") -> None:
        self._raw += raw
        self._buf = self._buf[n:]
        self._state = state

    def _off_envelope(self, out: list[Delta]) -> bool:
        """Text after a trigger that does not follow the envelope (only where calls were not constrained):
        the trigger's text, or what follows a call, is content again, and the rest is read anew."""
        if self._state in (_HEAD, _NAME):
            self._content(out, self._raw)
        self._raw = ""
        self._state = _TEXT
        return True

    def _content(self, out: list[Delta], text: str) -> None:
        if text:
            self.content += text
            out.append(Delta(content=text))
