"""The prompts ``lmserve bench`` sends: the built-in synthetic workload or a JSON-lines file (the repeating
workloads are in bench_workloads.py).

Shared by the load generator (bench.py), its prefix-cache workloads (bench_prefix.py) and the
server's own benchmarks; it imports neither of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .cli_args import CliUsageError
from .types import ChatMessage

_SYSTEM = "You are a helpful assistant."
_TOPICS = (
    "the water cycle", "how a CPU cache works", "the printing press", "photosynthesis",
    "binary search", "the rules of chess", "why the sky is blue", "compound interest",
    "how vaccines work", "TCP congestion control", "plate tectonics", "the French Revolution",
)


@dataclass(frozen=True)
class WorkItem:
    """One prompt of the workload: a string or chat messages, and an optional length cap."""

    prompt: Any
    max_new_tokens: int | None = None


def synthetic_workload() -> list[WorkItem]:
    """A built-in set of chat prompts of short, medium and long length."""
    items: list[WorkItem] = []
    for i, topic in enumerate(_TOPICS):
        short = f"Explain {topic} in one sentence."
        medium = (f"Explain {topic} to a curious twelve-year-old. Use one concrete example, "
                  f"avoid jargon, and end with a two-sentence summary.")
        points = "\n".join(
            f"{k + 1}. A note about {topic}: its causes, its effects and one example worth remembering."
            for k in range(8 * (1 + i % 3))
        )
        long = f"Read the notes below and write a short, well-organised summary of {topic}.\n\n{points}"
        for text in (short, medium, long):
            items.append(WorkItem([ChatMessage("system", _SYSTEM), ChatMessage("user", text)]))
    return items


def load_prompts(path: str | Path) -> list[WorkItem]:
    """Reads JSON lines of ``{"prompt": str}`` or ``{"messages": [...]}``, optional ``max_new_tokens``."""
    items = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if "messages" in row:
                prompt: Any = [ChatMessage(str(m["role"]), str(m["content"])) for m in row["messages"]]
            else:
                prompt = str(row["prompt"])
            cap = row.get("max_new_tokens")
            items.append(WorkItem(prompt, int(cap) if cap is not None else None))
        except (ValueError, KeyError, TypeError) as e:
            raise CliUsageError(f"{path}:{n}: expected {{\"prompt\"}} or {{\"messages\"}} JSON: {e}") from e
    if not items:
        raise CliUsageError(f"{path}: no prompts")
    return items


def flatten_chat(prompt: Any) -> Any:
    """Chat messages -> plain text, for models without a chat template."""
    if isinstance(prompt, str):
        return prompt
    return "\n\n".join(m.content for m in prompt if m.role != "system") or ""
