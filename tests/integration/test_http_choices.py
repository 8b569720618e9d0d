"""n choices and logit_bias through the OpenAI edge of the shared trained-model server.

Oracles: the gRPC path of the same server (token ids and the top alternatives of a greedy step), the
n=1 answer with the same seed (choice 0), the streamed events against the whole response, and the
prefix cache's hit counter (the samples copy the prompt's K/V instead of computing it)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from lmserve.v1 import lmserve_pb2 as pb


def test_n_choices_are_independent_samples_counted_together(client, model_id):
    kw = dict(model=model_id, prompt="The", max_tokens=12, temperature=1.5, seed=11)
    one = client.completions.create(**kw)
    many = client.completions.create(n=4, **kw)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == one.choices[0].text  # sample 0 keeps the seed
    assert len({c.text for c in many.choices}) > 1
    assert many.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    counted = client.completions.create(n=4, logprobs=0, **kw)
    assert counted.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in counted.choices)
    again = client.completions.create(n=4, **kw)
    assert [c.text for c in again.choices] == [c.text for c in many.choices]  # seeded: reproducible


def test_streamed_choices_are_the_whole_ones_interleaved(client, model_id):
    kw = dict(model=model_id, messages=[{"role": "user", "content": "The fox"}], max_tokens=10, temperature=1.2,
              seed=5, n=3)
    whole = client.chat.completions.create(**kw)
    events = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    texts, roles, finishes = ["", "", ""], set(), {}
    for e in events[:-1]:
        (c,) = e.choices
        roles |= {c.index} if c.delta.role == "assistant" else set()
        texts[c.index] += c.delta.content or ""
        if c.finish_reason:
            finishes[c.index] = c.finish_reason
    assert roles == {0, 1, 2}
    assert texts == [c.message.content for c in whole.choices]
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_the_samples_share_the_prompts_kv_through_the_prefix_cache(server, client, model_id, training_prompts):
    prompt = "choices share: " + " ".join(p for p, _ in training_prompts[3:6])  # new to this server
    before = server.wait_idle()
    res = client.completions.create(model=model_id, prompt=prompt, max_tokens=4, temperature=1.0, n=3)
    after = server.wait_idle()
    n_prompt = res.usage.prompt_tokens
    assert n_prompt > 16
    hits = after.total("lmserve_prefix_cache_hit_tokens_total") - before.total("lmserve_prefix_cache_hit_tokens_total")
    assert hits == 3 * (n_prompt - 1)  # each sample computed its last prompt token only
    assert res.usage.prompt_tokens_details.cached_tokens == 0  # the prompt itself was computed once, here


def test_logit_bias_bans_and_forces_tokens(client, model_id, stub):
    plain = stub.Generate(pb.GenerateRequest(prompt="The baker", params=pb.SamplingParams(
        max_new_tokens=1, logprobs=3)), timeout=60)
    (first,) = plain.logprobs
    second, third = first.top[1], first.top[2]
    banned = client.completions.create(model=model_id, prompt="The baker", max_tokens=1, temperature=0,
                                       logprobs=1, logit_bias={str(first.token_id): -100})
    assert banned.choices[0].logprobs.tokens[0].strip() == second.text.strip()
    # log-probabilities stay the model's own, before the bias
    assert banned.choices[0].logprobs.token_logprobs[0] == pytest.approx(second.logprob, abs=1e-5)
    for chat in (False, True):  # +100: sampled or not, the token is chosen
        kw = dict(model=model_id, max_tokens=1, temperature=0.8, seed=3, logprobs=True if chat else 0,
                  logit_bias={str(third.token_id): 100})
        if chat:
            res = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kw)
            token = res.choices[0].logprobs.content[0].token
        else:
            token = client.completions.create(prompt="The baker", **kw).choices[0].logprobs.tokens[0]
        assert token.strip() == third.text.strip()


@pytest.mark.parametrize("bias, words", [({"5": 100.5}, "[-100, 100]"), ({"5": -101}, "[-100, 100]"),
                                         ({"999999": 1}, "outside the vocabulary"), ({"x": 1}, "token ids"),
                                         ({"5": "high"}, "must be a number")])
def test_a_bad_logit_bias_is_a_400_naming_it(client, model_id, bias, words):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       logit_bias=bias)
    assert err.value.body["param"] == "logit_bias" and words in err.value.body["message"], err.value.body


@pytest.mark.parametrize("n, words", [(0, "at least 1"), (129, "at most 128"), (17, "--max-batch")])
def test_too_many_or_too_few_choices_are_a_400(server, model_id, n, words):
    r = httpx.post(f"{server.http_url}/completions", json={"model": model_id, "prompt": "x", "n": n}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and words in r.json()["error"]["message"]
    assert json.loads(r.text)["error"]["type"] == "invalid_request_error"
