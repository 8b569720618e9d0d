"""The prompts the load generator sends: the built-in chat workload, the workloads whose answers
repeat their prompt, or a JSON-lines file.

Shared by the load generator (load.py), its prefix-cache workloads (prefix.py) and the server's own
benchmarks; it imports neither of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cli_args import CliUsageError
from ..types import ChatMessage

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


# Workloads whose answers repeat their input: where speculative decoding from the context pays
# (docs/speculative-decoding.md). `lmserve bench load --workload repeat` and `lmserve bench speculation`.
CODE = '''def mean_and_spread(values):
    total = 0.0
    for v in values:
        total += v
    mean = total / len(values)
    spread = 0.0
    for v in values:
        spread += (v - mean) ** 2
    return mean, (spread / len(values)) ** 0.5
'''

PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He carried a brass lamp, "
           "a tin of oil and a notebook in which he wrote down the colour of the sea. On stormy nights he "
           "stayed awake until dawn, watching the beam sweep across the water and counting the ships that "
           "passed safely into the harbour.")

DOCUMENT = ("Shipping notice. The ferry to the northern islands leaves at 7:15 every weekday from pier 4. "
            "Tickets cost 12 euros for adults and 6 euros for children under twelve. Bicycles travel free. "
            "On Saturdays the first ferry leaves at 9:30, and there is no service on Sundays. In storms the "
            "harbour master may cancel crossings; cancellations are posted on the board beside the ticket office.")

REPEATING = {
    "code_edit": f"Rename the variable `total` to `acc` in this function and show the whole function:\n\n{CODE}",
    "quote": f"Repeat the following paragraph word for word:\n\n{PASSAGE}",
    "document_qa": f"{DOCUMENT}\n\nQuote the sentences of the notice that say when the ferries leave.",
}


def repeating_workload() -> list[WorkItem]:
    """Editing code, quoting a passage, answering from a document by quoting it."""
    return [WorkItem([ChatMessage("user", text)]) for text in REPEATING.values()]


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
