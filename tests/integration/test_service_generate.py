"""Generate and GenerateStream on a real server: memorized outputs, stream == unary, every input kind, chat."""

from __future__ import annotations

import json
import math

import pytest
import sentencepiece as spm
from jinja2.sandbox import ImmutableSandboxedEnvironment

from lmserve.client import Client
from lmserve.v1 import lmserve_pb2 as pb
from lmserve.v1 import lmserve_pb2_grpc as pb_grpc

UNSPECIFIED = pb.FINISH_REASON_UNSPECIFIED
CHAT = [("system", "You are terse."), ("user", "Tell me about the lighthouse keeper."),
        ("assistant", "He climbed the stairs."), ("user", "And the fox?")]


@pytest.fixture(scope="module")
def channel(trained_server):
    ch = trained_server.channel()
    yield ch
    ch.close()


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.TextGenerationStub(channel)


def chat_messages(turns=CHAT) -> pb.ChatMessages:
    return pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c) for r, c in turns])


def stream_all(stub, request) -> list[pb.GenerateStreamResponse]:
    return list(stub.GenerateStream(request, timeout=60))


def assert_stream_equals_unary(stub, request) -> pb.GenerateResponse:
    """Run both RPCs; the stream's deltas must concatenate to the unary result."""
    unary = stub.Generate(request, timeout=60)
    msgs = stream_all(stub, request)
    assert msgs, "the stream sent no message"
    assert "".join(m.text for m in msgs) == unary.text
    assert [t for m in msgs for t in m.token_ids] == list(unary.token_ids)
    assert [lp for m in msgs for lp in m.logprobs] == list(unary.logprobs)
    *head, last = msgs
    assert all(m.finish_reason == UNSPECIFIED for m in head), "finish_reason before the last message"
    assert not any(m.HasField("usage") or m.HasField("timing") for m in head), "usage/timing before the last message"
    assert last.finish_reason == unary.finish_reason != UNSPECIFIED
    assert last.HasField("timing")  # cached_prompt_tokens differs: the later request hits the earlier one's prefix
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (unary.usage.prompt_tokens,
                                                                        unary.usage.completion_tokens)
    assert last.matched_stop == unary.matched_stop
    assert all(m.request_id == request.request_id for m in msgs) and unary.request_id == request.request_id
    assert unary.usage.completion_tokens == len(unary.token_ids)
    return unary


def test_model_info_matches_checkpoint(stub, trained_model_dir, trained_server_flags):
    cfg = json.loads((trained_model_dir / "config.json").read_text())
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.architecture == "llama"
    assert info.vocab_size == cfg["vocab_size"]
    assert info.context_length == cfg["max_position_embeddings"]
    assert info.max_batch_size == trained_server_flags["max_batch"]
    assert info.max_new_tokens_limit == trained_server_flags["max_new_tokens_cap"]
    assert list(info.eos_token_ids) == [cfg["eos_token_id"]] and info.bos_token_id == cfg["bos_token_id"]
    assert info.has_chat_template and info.num_parameters > 0 and info.device == "cpu"


def test_greedy_reproduces_memorized_continuations(stub, training_prompts):
    """The fixture model memorized its corpus: greedy decoding of a prefix gives the rest, then EOS."""
    for prefix, continuation in training_prompts[1::3]:  # one prefix length per paragraph
        res = stub.Generate(pb.GenerateRequest(prompt=prefix, params=pb.SamplingParams(max_new_tokens=100)), timeout=60)
        assert res.text == continuation, prefix
        assert res.finish_reason == pb.FINISH_REASON_EOS


@pytest.mark.parametrize("params", [
    pb.SamplingParams(max_new_tokens=40),
    pb.SamplingParams(max_new_tokens=40, temperature=1.3, top_p=0.95, top_k=50, seed=1234, ignore_eos=True),
    pb.SamplingParams(max_new_tokens=30, temperature=0.8, seed=7, logprobs=3, repetition_penalty=1.1),
], ids=["greedy", "seeded-sampling", "logprobs"])
def test_stream_concatenates_to_unary(stub, params):
    request = pb.GenerateRequest(request_id="agree-1", prompt="On the far side of the bay,", params=params)
    unary = assert_stream_equals_unary(stub, request)
    assert unary.usage.completion_tokens >= 1


def test_seeded_sampling_is_reproducible_and_seed_dependent(stub):
    def run(seed):
        p = pb.SamplingParams(max_new_tokens=48, temperature=2.0, seed=seed, ignore_eos=True)
        return list(stub.Generate(pb.GenerateRequest(prompt="Numbers", params=p), timeout=60).token_ids)

    a = run(11)
    assert run(11) == a
    assert any(run(s) != a for s in (12, 13, 14)), "three other seeds all gave the same 48 sampled tokens"


def test_logprobs_are_consistent(stub):
    p = pb.SamplingParams(max_new_tokens=12, logprobs=5, ignore_eos=True)
    res = stub.Generate(pb.GenerateRequest(prompt="A red fox", params=p), timeout=60)
    assert [lp.token_id for lp in res.logprobs] == list(res.token_ids)
    for lp in res.logprobs:
        assert len(lp.top) == 5
        tops = [t.logprob for t in lp.top]
        assert tops == sorted(tops, reverse=True) and all(v <= 0 for v in tops)
        assert sum(math.exp(v) for v in tops) <= 1 + 1e-4
        assert lp.top[0].token_id == lp.token_id and lp.top[0].logprob == pytest.approx(lp.logprob)  # greedy


def test_logprobs_zero_gives_the_chosen_tokens_only(stub):
    p = pb.SamplingParams(max_new_tokens=6, logprobs=0, ignore_eos=True)
    res = assert_stream_equals_unary(stub, pb.GenerateRequest(request_id="lp0", prompt="A red fox", params=p))
    assert [lp.token_id for lp in res.logprobs] == list(res.token_ids)
    assert all(not lp.top and lp.logprob <= 0 for lp in res.logprobs)
    plain = stub.Generate(pb.GenerateRequest(prompt="A red fox", params=pb.SamplingParams(max_new_tokens=6)), timeout=60)
    assert not plain.logprobs


def test_concurrent_calls_may_share_a_request_id(trained_server, training_prompts):
    """Ids are the caller's business: two streams with one id each get their own tokens and the id echoed."""
    (p1, c1), (p2, c2) = training_prompts[0], training_prompts[3]
    with trained_server.channel() as ch:
        stub = pb_grpc.TextGenerationStub(ch)
        params = pb.SamplingParams(max_new_tokens=100)
        a = stub.GenerateStream(pb.GenerateRequest(request_id="same", prompt=p1, params=params), timeout=60)
        b = stub.GenerateStream(pb.GenerateRequest(request_id="same", prompt=p2, params=params), timeout=60)
        first_a = next(a)  # both are in flight together
        msgs_b, msgs_a = list(b), [first_a, *a]
    assert "".join(m.text for m in msgs_a) == c1 and "".join(m.text for m in msgs_b) == c2
    assert {m.request_id for m in msgs_a + msgs_b} == {"same"}


def test_token_ids_input_equals_text_input(stub, trained_model_dir):
    text = "The lighthouse keeper climbed"
    tok = stub.Tokenize(pb.TokenizeRequest(text=text), timeout=10)
    sp = spm.SentencePieceProcessor(model_file=str(trained_model_dir / "tokenizer.model"))
    assert list(tok.token_ids) == [sp.bos_id(), *sp.encode(text)]  # independent tokenizer, BOS prepended
    assert len(tok.tokens) == len(tok.token_ids)
    params = pb.SamplingParams(max_new_tokens=32)
    by_text = assert_stream_equals_unary(stub, pb.GenerateRequest(request_id="t", prompt=text, params=params))
    by_ids = assert_stream_equals_unary(stub, pb.GenerateRequest(
        request_id="i", token_ids=pb.TokenIds(ids=tok.token_ids), params=params))
    assert list(by_ids.token_ids) == list(by_text.token_ids) and by_ids.text == by_text.text
    assert by_text.usage.prompt_tokens == by_ids.usage.prompt_tokens == len(tok.token_ids)


def test_chat_messages_render_with_the_models_template(stub, trained_model_dir):
    """Oracle: the checkpoint's template rendered by jinja2 as Hugging Face does, encoded by sentencepiece."""
    config = json.loads((trained_model_dir / "tokenizer_config.json").read_text())
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    turns = [{"role": r, "content": c} for r, c in CHAT]
    expected = env.from_string(config["chat_template"]).render(messages=turns, add_generation_prompt=True)
    sp = spm.SentencePieceProcessor(model_file=str(trained_model_dir / "tokenizer.model"))
    tok = stub.Tokenize(pb.TokenizeRequest(messages=chat_messages(), add_generation_prompt=True), timeout=10)
    assert tok.text == expected
    assert list(tok.token_ids) == sp.encode(expected)  # the template carries no BOS; none is added

    params = pb.SamplingParams(max_new_tokens=24, ignore_eos=True)
    by_chat = assert_stream_equals_unary(stub, pb.GenerateRequest(request_id="c", messages=chat_messages(), params=params))
    by_ids = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=tok.token_ids), params=params), timeout=60)
    assert list(by_chat.token_ids) == list(by_ids.token_ids) and by_chat.text == by_ids.text
    assert by_chat.usage.prompt_tokens == len(tok.token_ids)


def test_stop_string_cuts_the_text(stub, training_prompts):
    prefix, continuation = training_prompts[0]
    stop = continuation.split()[3]
    p = pb.SamplingParams(max_new_tokens=100, stop=[stop])
    res = assert_stream_equals_unary(stub, pb.GenerateRequest(request_id="s", prompt=prefix, params=p))
    assert res.finish_reason == pb.FINISH_REASON_STOP and res.matched_stop == stop
    assert res.text == continuation[:continuation.index(stop)]


def test_max_new_tokens_ends_with_length(stub):
    p = pb.SamplingParams(max_new_tokens=7, ignore_eos=True)
    res = assert_stream_equals_unary(stub, pb.GenerateRequest(request_id="len", prompt="The baker", params=p))
    assert res.finish_reason == pb.FINISH_REASON_LENGTH and res.usage.completion_tokens == 7

def test_server_assigns_a_request_id_when_empty(stub):
    """The proto promises a server-assigned id when the caller sends none, the same on every chunk."""
    p = pb.SamplingParams(max_new_tokens=3)
    res = stub.Generate(pb.GenerateRequest(prompt="The baker", params=p), timeout=60)
    msgs = stream_all(stub, pb.GenerateRequest(prompt="The baker", params=p))
    assert res.request_id and msgs[0].request_id
    assert len({m.request_id for m in msgs}) == 1


def test_sdk_streams_the_same_completion(trained_server, stub):
    request = pb.GenerateRequest(prompt="A red fox lived", params=pb.SamplingParams(max_new_tokens=20))
    unary = stub.Generate(request, timeout=60)
    with Client(trained_server.target, timeout=60) as client:
        chunks = list(client.stream("A red fox lived", max_new_tokens=20))
        assert "".join(c.text for c in chunks) == unary.text
        assert [t for c in chunks for t in c.token_ids] == list(unary.token_ids)
        assert client.generate([*client.tokenize("A red fox lived").token_ids], max_new_tokens=20).text == unary.text

