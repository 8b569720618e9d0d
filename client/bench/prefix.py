"""Workloads for ``lmserve bench load`` that show prefix caching: a shared system prompt, and conversations.

``--shared-prefix-tokens N`` puts the same system message of about N tokens in front of every
request (what a chat product's system prompt or a few-shot preamble looks like). ``--multi-turn K``
runs conversations of K turns: each turn sends the whole conversation so far (system, every user
message and every answer received) plus one new user message, so a server with a prefix cache
prefills only the new message and the previous answer's tail. Per-turn TTFT shows the effect.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from typing import Any

from .request import timed_request
from .stats import RequestRecord
from .prompts import WorkItem
from ..types import ChatMessage

# Short common words: byte-level BPE vocabularies (SmolLM2, Llama 3, Qwen2) give each, with its leading
# space, one token; sentencepiece vocabularies about the same. The report's prompt_tokens give the count.
_WORDS = ("the", "of", "and", "to", "in", "is", "for", "on", "with", "as", "at", "by", "from", "that", "this",
          "we", "you", "it", "be", "are", "or", "an", "will", "can", "all", "one", "use", "each", "any", "new")
_FOLLOW_UPS = ("Can you give one more example?", "Why does that matter in practice?",
               "Summarise what you said in two sentences.", "What is a common misconception about it?",
               "How would you explain it to an engineer?", "What should I read next?")


def shared_system_prompt(tokens: int, seed: int = 0) -> str:
    """About `tokens` tokens of deterministic text (the same for every request of a run)."""
    rng = random.Random(seed)
    words = [rng.choice(_WORDS) for _ in range(max(1, tokens - 7))]
    return "Follow the house rules below.\n" + " ".join(words)


def with_shared_prefix(items: list, tokens: int) -> list:
    """Each work item's system message replaced by one shared system prompt of about `tokens` tokens."""
    system = ChatMessage("system", shared_system_prompt(tokens))
    out = []
    for it in items:
        msgs = [ChatMessage("user", it.prompt)] if isinstance(it.prompt, str) else [m for m in it.prompt if m.role != "system"]
        out.append(WorkItem([system, *msgs], it.max_new_tokens))
    return out


async def run_conversations(client, items: list, turns: int, concurrency: int, conversations: int,
                            params_for, timeout: float | None, flatten=None) -> tuple[list[RequestRecord], list[int], float]:
    """`conversations` conversations of `turns` turns, `concurrency` at a time. Returns each request's
    record, its turn number (1-based) in the same order, and the wall duration."""
    records: list[RequestRecord] = []
    turn_of: list[int] = []
    next_conv = iter(range(conversations))
    run_start = time.perf_counter()

    async def conversation(c: int) -> None:
        item = items[c % len(items)]
        history = list(item.prompt) if not isinstance(item.prompt, str) else [ChatMessage("user", item.prompt)]
        for t in range(turns):
            if t:
                history.append(ChatMessage("user", _FOLLOW_UPS[(c + t) % len(_FOLLOW_UPS)]))
            prompt: Any = flatten(history) if flatten else history
            params = params_for(c * turns + t, item)
            text: list[str] = []
            record = await timed_request(client, prompt, params, timeout, run_start, text)
            records.append(record)
            turn_of.append(t + 1)
            if record.error:
                return
            history.append(ChatMessage("assistant", "".join(text)))

    async def worker() -> None:
        for c in next_conv:
            await conversation(c)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records, turn_of, time.perf_counter() - run_start



def per_turn_table(records: list[RequestRecord], turn_of: list[int]) -> str:
    """TTFT and prompt tokens by turn: with a prefix cache, later turns' TTFT stays flat as prompts grow."""
    lines = ["turn  requests  prompt tokens (mean)  TTFT mean (ms)  TTFT p50 (ms)"]
    for t in sorted(set(turn_of)):
        rs = [r for r, k in zip(records, turn_of) if k == t and not r.error and r.events]
        if not rs:
            continue
        ttft = [r.events[0][0] * 1e3 for r in rs]
        lines.append(f"{t:>4}  {len(rs):>8}  {statistics.mean(r.prompt_tokens for r in rs):>20.0f}  "
                     f"{statistics.mean(ttft):>14.1f}  {statistics.median(ttft):>13.1f}")
    return "\n".join(lines)
