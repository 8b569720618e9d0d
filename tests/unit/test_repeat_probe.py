"""Ending an output where the model starts an earlier part of it again (repeat_probe.py).

The parts are found in detokenized text whatever tokens spell their markers; the probe drafts the rest
of an ended earlier part only while the latest part begins like it. In the engine (real SmolLM2,
float32) the oracle is the same request without the probe: the probed output is a prefix of it, ending
inside the part where the unprobed output writes the earlier part again, to the letter."""

from __future__ import annotations

import asyncio

import pytest
import torch

from test_engine_helpers import collect, running  # noqa: F401 - fixtures are used by name
from lmserve.server.engine.repeat_probe import RepeatProbe
from lmserve.server.engine.request import FinishReason, Request, SamplingParams


def fed(pieces: list[str], begin: str = "<call>", end: str = "</call>") -> RepeatProbe:
    probe = RepeatProbe(begin, end)
    for i, text in enumerate(pieces):
        probe.push(i, text)
    return probe


def test_parts_are_found_whatever_tokens_spell_their_markers():
    pieces = ["Sure ", "<ca", "ll>", "x", "y", "</c", "all>", "\n<", "call", ">", "x"]
    probe = fed(pieces)
    assert probe.begins == [1, 7] and probe.bodies == [3, 10] and probe.ends == {0: 7}
    output = list(range(100, 100 + len(pieces)))
    assert probe.due
    # the latest body (token 10, "x") is not token 3's id: nothing is drafted
    assert probe.draft(output) == ()
    output[10] = output[3]  # the same token as the earlier body's first: the rest of that body
    assert probe.draft(output) == tuple(output[4:7])


def test_nothing_is_drafted_before_an_earlier_part_has_ended_or_after_the_latest_one_ends():
    probe = fed(["<call>", "x", "<call>", "x"])  # the first part never ended: not a part to repeat
    assert not probe.due and probe.draft([1, 2, 1, 2]) == ()
    probe = fed(["<call>", "x", "</call>", "<call>", "x", "</call>"])
    assert not probe.due and probe.draft([1, 2, 3, 1, 2, 3]) == ()
    probe = fed(["<call>", "x", "</call>", "<call>", "y"])
    assert probe.due and probe.draft([1, 2, 3, 1, 4]) == ()  # diverged from every earlier body


def test_an_end_inside_the_begin_token_is_not_the_parts_end():
    probe = fed(["</call><call>", "x", "</call>", "<call>"])
    assert probe.begins == [0, 3] and probe.ends == {0: 3}
    assert probe.draft([9, 5, 6, 9]) == (5, 6)


@pytest.fixture(scope="module")
def smol(smollm2_gguf_path):
    from lmserve.model.loader import load_model

    return load_model(smollm2_gguf_path, dtype=torch.float32, device="cpu")


PROMPT = "Items: [red apple] [red apple] [red apple] [red apple] [red apple]"


@pytest.mark.slow
@pytest.mark.parametrize("speculation", ["off", "ngram"])
def test_the_engine_ends_an_output_where_decoding_would_repeat_an_earlier_part(smol, speculation):
    ids = smol.tokenizer.encode(PROMPT, add_special_tokens=True)

    async def both():
        plain = Request(prompt_ids=ids, params=SamplingParams(max_new_tokens=24))
        probed = Request(prompt_ids=ids, params=SamplingParams(max_new_tokens=24, repeat_marker=("[", "]")))
        sampled = Request(prompt_ids=ids, params=SamplingParams(max_new_tokens=24, temperature=1.0, seed=1,
                                                                repeat_marker=("[", "]")))
        return [r for r, _ in await asyncio.gather(*(collect(engine, q) for q in (plain, probed, sampled)))]

    with running(smol, prefix_cache=False, speculation=speculation, overlap_steps=False) as engine:
        plain, probed, sampled = asyncio.run(both())
    text = smol.tokenizer.decode(plain.token_ids)
    assert text.count("[") >= 3, text  # the oracle: decoding alone writes its part again and again
    n = len(probed.token_ids)
    assert probed.finish_reason is FinishReason.EOS and n < len(plain.token_ids)
    assert list(probed.token_ids) == list(plain.token_ids[:n])
    assert probed.text == smol.tokenizer.decode(probed.token_ids)
    # it ends inside the second part (speculation may have taken some of it in an accepted draft), and
    # decoding alone writes that part to the letter as the first
    first, second = text.index("["), text.index("[", text.index("[") + 1)
    part = text[first: text.index("]", first) + 1]
    assert text[second: second + len(part)] == part
    assert second < len(probed.text) < second + len(part), (text, probed.text)
    # a sampled row is never probed (a draft is verified for greedy rows only): it runs to its length
    assert sampled.finish_reason is FinishReason.LENGTH and len(sampled.token_ids) == 24
