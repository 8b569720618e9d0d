"""lmserve bench load's shared-prefix and multi-turn workloads, against a fake streaming client."""

import asyncio

from lmserve.client.bench.load import BenchConfig, WorkItem, synthetic_workload
from lmserve.client.bench.prefix import per_turn_table, run_conversations, shared_system_prompt, with_shared_prefix
from lmserve.client.types import ChatMessage, StreamChunk, Usage


def test_shared_prefix_is_one_system_message_for_every_item():
    items = with_shared_prefix(synthetic_workload() + [WorkItem("plain text", 5)], 300)
    systems = {it.prompt[0] for it in items}
    assert len(systems) == 1 and next(iter(systems)).role == "system"
    assert all(len([m for m in it.prompt if m.role == "system"]) == 1 for it in items)
    assert items[-1].prompt[1] == ChatMessage("user", "plain text") and items[-1].max_new_tokens == 5
    assert shared_system_prompt(300) == shared_system_prompt(300) != shared_system_prompt(301)
    assert 280 <= len(shared_system_prompt(300).split()) <= 300  # about one token per word


class FakeClient:
    """Streams 'answer-<n>' for the n-th call and records what each call sent."""

    def __init__(self):
        self.sent = []

    async def stream(self, prompt, params, timeout=None):
        self.sent.append(list(prompt))
        n = len(self.sent)
        await asyncio.sleep(0)
        yield StreamChunk(request_id=str(n), text=f"answer-{n}", token_ids=[1, 2])
        yield StreamChunk(request_id=str(n), text="", token_ids=[], finish_reason="length",
                          usage=Usage(prompt_tokens=10 * sum(len(m.content) for m in prompt), completion_tokens=2))


def test_each_turn_resends_the_conversation_with_the_answers_received():
    client = FakeClient()
    items = with_shared_prefix(synthetic_workload()[:2], 50)
    config = BenchConfig(concurrency=1, rate=None, requests=2, duration=None, warmup=0, max_new_tokens=8,
                         temperature=0.0, seed=None, ignore_eos=True, timeout=None)
    records, turns, _ = asyncio.run(run_conversations(client, items, 3, 1, 2, config.params, None))
    assert turns == [1, 2, 3, 1, 2, 3] and len(records) == 6 and not any(r.error for r in records)
    first, second, third = client.sent[:3]
    assert second[: len(first)] == first and third[: len(second)] == second  # each turn extends the last
    assert second[len(first)] == ChatMessage("assistant", "answer-1") and second[-1].role == "user"
    assert third[len(second)] == ChatMessage("assistant", "answer-2")
    assert client.sent[3][0] == first[0]  # the next conversation shares the system prompt
    table = per_turn_table(records, turns)
    assert table.splitlines()[0].startswith("turn") and len(table.splitlines()) == 4
