"""What the three HTTP dialects share on the way out: one answer read as the engine streams it (its text,
and the calls read out of it where the request offered tools), and how it ended, in words each dialect
maps to its own (`finish_reason`, `stop_reason`, a response's status).
"""

from __future__ import annotations

import enum

from ..engine.outputs import GenerationChunk, Usage
from ..engine.request import FinishReason
from ..tools import ToolUse
from ..tools.parser import CallParser, Delta, ParsedCall


class Ending(enum.Enum):
    END = "end"  # the model ended its turn
    STOP = "stop"  # a stop string matched (`Reply.matched_stop`)
    LENGTH = "length"  # the token limit
    CALLS = "calls"  # complete calls, and the end (the model's, or the edge's at a repeated call)


def ending(finish: FinishReason | None, calls: CallParser | None = None) -> Ending:
    """How an answer ended. Where calls were read, one that ended after complete calls (or at a repeated
    call, which the edge ends) ended with its calls, whatever ended it but the token limit."""
    if calls is not None and (calls.repeated or (calls.complete_calls and finish is not FinishReason.LENGTH)):
        return Ending.CALLS
    if finish is FinishReason.LENGTH:
        return Ending.LENGTH
    if finish is FinishReason.STOP:
        return Ending.STOP
    return Ending.END


class Reply:
    """One answer, chunk by chunk: `read` returns what each chunk adds (content, or a call's start and its
    arguments' pieces: tools.parser.Delta); `due_end` says, once, that the edge should end the request, its
    answer being complete before the model ends it (a repeated call)."""

    def __init__(self, tools: ToolUse | None):
        self.calls = CallParser() if tools is not None and tools.calls_allowed else None
        self._text = ""
        self.finish: FinishReason | None = None
        self.usage: Usage | None = None
        self.matched_stop: str | None = None
        self._end_due = False

    def read(self, chunk: GenerationChunk) -> list[Delta]:
        if self.calls is None:
            self._text += chunk.text
            deltas = [Delta(content=chunk.text)] if chunk.text else []
        else:
            repeated = self.calls.repeated
            deltas = self.calls.feed(chunk.text)
            if self.calls.repeated and not repeated and not chunk.finished:
                self._end_due = True
            if chunk.finished:
                deltas += self.calls.finish()
        if chunk.finished:
            self.finish, self.usage, self.matched_stop = chunk.finish_reason, chunk.usage, chunk.matched_stop
        return deltas

    def due_end(self) -> bool:
        """True once, after the chunk that completed the answer early; the edge then ends the request."""
        due, self._end_due = self._end_due, False
        return due

    @property
    def content(self) -> str:
        return self._text if self.calls is None else self.calls.content

    @property
    def tool_calls(self) -> list[ParsedCall]:
        return [] if self.calls is None else self.calls.calls

    @property
    def ending(self) -> Ending:
        return ending(self.finish, self.calls)
