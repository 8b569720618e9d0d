"""The client SDK (Client and AsyncClient) against real servers of the memorizing model.

Oracles: the training corpus (greedy decoding of a prefix gives the rest, then EOS), an independent
sentencepiece tokenizer, the checkpoint's config.json, the raw gRPC stubs, and the server's /metrics.

Servers: the shared trained server; plus, started together, a TLS server with bearer tokens, a
one-slot server without a queue (overload and retries), and one that a test kills mid-stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json

import pytest
from test_security import TOKENS, creds, pki  # noqa: F401  (pki: the module's certificate fixture)

import lmserve
from lmserve.client import (
    AsyncClient,
    ChatMessage,
    Client,
    DeadlineExceededError,
    GenerationResult,
    InvalidRequestError,
    LmserveError,
    ModelInfo,
    OverloadedError,
    RetryPolicy,
    SamplingParams,
    StreamChunk,
    UnauthenticatedError,
    UnavailableError,
)
from lmserve.v1 import lmserve_pb2 as pb
from lmserve.v1 import lmserve_pb2_grpc as pb_grpc

# Long and slow: 120 tokens (the trained server's cap; + a 3-token prompt fits the context of 128),
# each with 20 alternatives to rank and detokenize, so a stream stays in flight for many engine steps.
SLOW = dict(max_new_tokens=120, ignore_eos=True, logprobs=20)
CHAT = [ChatMessage("system", "You are terse."), ChatMessage("user", "Tell me about the fox.")]


@dataclasses.dataclass(frozen=True)
class RecordingPolicy(RetryPolicy):
    """A RetryPolicy that records, per logical call, how many attempts were made and which errors were retried."""

    calls: list = dataclasses.field(default_factory=list, compare=False, hash=False)

    def start(self, timeout, **kwargs):
        state = super().start(timeout, **kwargs)
        record = {"state": state, "retried": []}
        self.calls.append(record)
        after_failure = state.after_failure

        def recording_after_failure(error, *, received):
            delay = after_failure(error, received=received)  # raises when the error is not retried
            record["retried"].append(type(error))
            return delay

        state.after_failure = recording_after_failure
        return state

    def attempts(self, call: int = -1) -> int:
        return self.calls[call]["state"].attempt

    def retried(self, call: int = -1) -> list[type]:
        return self.calls[call]["retried"]


def fast_retries(max_retries: int = 1000) -> RecordingPolicy:
    return RecordingPolicy(max_retries=max_retries, initial_backoff=0.01, max_backoff=0.1)


@pytest.fixture(scope="module")
def config(trained_model_dir) -> dict:
    return json.loads((trained_model_dir / "config.json").read_text())


@pytest.fixture(scope="module")
def prompts(training_prompts):
    return training_prompts[1::3]  # one prefix length per paragraph


@pytest.fixture(scope="module")
def extra_servers(start_module_server, trained_model_dir, pki):  # noqa: F811
    """TLS + bearer tokens, one slot without a queue, and a server to kill: started together."""
    tls = start_module_server(trained_model_dir, credentials=creds(pki), wait=False, threads=1, metrics_port=None,
                              tls_cert=pki / "server.pem", tls_key=pki / "server.key",
                              auth_tokens_file=pki / "tokens.txt")
    one_slot = start_module_server(trained_model_dir, wait=False, threads=1, max_batch=1, max_queue=0,
                                   max_new_tokens_cap=120)
    doomed = start_module_server(trained_model_dir, wait=False, threads=1, metrics_port=None, max_new_tokens_cap=120)
    for srv in (tls, one_slot, doomed):
        srv.wait_ready()
    return {"tls": tls, "one_slot": one_slot, "doomed": doomed}


def assert_stream_matches(chunks: list[StreamChunk], result: GenerationResult) -> None:
    """Deltas concatenate to the unary result; only the last chunk carries finish_reason and usage."""
    assert chunks and all(isinstance(c, StreamChunk) for c in chunks)
    assert "".join(c.text for c in chunks) == result.text
    assert [t for c in chunks for t in c.token_ids] == result.token_ids
    *head, last = chunks
    assert all(c.finish_reason is None and c.usage is None and not c.is_last for c in head)
    assert last.is_last and last.finish_reason == result.finish_reason  # cached_prompt_tokens differs: the later request hits the earlier one's prefix
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (result.usage.prompt_tokens,
                                                                        result.usage.completion_tokens)
    assert len({c.request_id for c in chunks}) == 1


# ---- unary, streaming, tokenize, info, health -------------------------------------------------------

def test_generate_returns_the_memorized_continuation(server, prompts, sp):
    with Client(server.target, timeout=60) as client:
        for prefix, continuation in prompts:
            result = client.generate(prefix, max_new_tokens=100)
            assert isinstance(result, GenerationResult)
            assert result.text == continuation, prefix
            assert result.finish_reason == "eos" and result.matched_stop is None
            assert result.usage.prompt_tokens == 1 + len(sp.encode(prefix))  # BOS + the independent tokenizer
            assert result.usage.completion_tokens == len(result.token_ids) > 0
            assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens
            assert sp.decode(result.token_ids).strip() == continuation.strip()
            assert result.request_id and result.logprobs == []
            t = result.timing
            assert 0 <= t.queue_seconds <= t.time_to_first_token_seconds <= t.total_seconds


async def test_async_generate_returns_the_memorized_continuation(server, prompts):
    async with AsyncClient(server.target, timeout=60) as client:
        results = await asyncio.gather(*(client.generate(p, max_new_tokens=100, request_id=f"a{i}")
                                         for i, (p, _) in enumerate(prompts)))
    for i, (result, (prefix, continuation)) in enumerate(zip(results, prompts)):
        assert result.text == continuation and result.finish_reason == "eos", prefix
        assert result.request_id == f"a{i}"


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=40),
    SamplingParams(max_new_tokens=40, temperature=1.2, top_p=0.9, top_k=40, seed=99, ignore_eos=True, logprobs=2),
    SamplingParams(max_new_tokens=100, stop=("every",)),
], ids=["greedy", "seeded-sampling", "stop"])
def test_stream_concatenates_to_generate(server, params):
    prompt = "The lighthouse keeper"
    with Client(server.target, timeout=60) as client:
        result = client.generate(prompt, params)
        chunks = list(client.stream(prompt, params))
    assert_stream_matches(chunks, result)
    assert [lp for c in chunks for lp in c.logprobs] == result.logprobs
    if params.logprobs:
        assert [lp.token_id for lp in result.logprobs] == result.token_ids
        assert all(len(lp.top) == params.logprobs for lp in result.logprobs)
    if params.stop:
        assert result.finish_reason == "stop" and result.matched_stop == "every" and "every" not in result.text


async def test_async_stream_concatenates_to_generate(server, prompts):
    prefix, continuation = prompts[2]
    async with AsyncClient(server.target, timeout=60) as client:
        result = await client.generate(prefix, max_new_tokens=100)
        chunks = [c async for c in client.stream(prefix, max_new_tokens=100)]
    assert_stream_matches(chunks, result)
    assert result.text == continuation


def test_tokenize_matches_sentencepiece(server, sp):
    text = "A red fox lived under the roots"
    with Client(server.target, timeout=30) as client:
        tok = client.tokenize(text)
    assert tok.token_ids == [sp.bos_id(), *sp.encode(text)]
    assert tok.tokens[1:] == sp.encode(text, out_type=str)
    assert sp.decode(tok.token_ids) == text


def test_special_token_text_in_a_prompt_is_parsed_only_when_asked(server, sp):
    eos = sp.id_to_piece(sp.eos_id())  # "</s>"
    text = f"A red fox{eos}"
    with Client(server.target, timeout=30) as client:
        plain = client.tokenize(text)
        parsed = client.tokenize(text, parse_special_tokens=True)
        result = client.generate(text, parse_special_tokens=True, max_new_tokens=1)
        default = client.generate(text, max_new_tokens=1)
        for prompt in (CHAT, parsed.token_ids):  # nothing to parse: refused before anything is sent
            with pytest.raises(TypeError, match="parse_special_tokens"):
                client.generate(prompt, parse_special_tokens=True)
        with pytest.raises(TypeError, match="parse_special_tokens"):
            client.tokenize(CHAT, parse_special_tokens=True)
    assert parsed.token_ids == [sp.bos_id(), *sp.encode("A red fox"), sp.eos_id()]
    assert sp.eos_id() not in plain.token_ids and len(plain.token_ids) > len(parsed.token_ids)
    assert result.usage.prompt_tokens == len(parsed.token_ids)
    assert default.usage.prompt_tokens == len(plain.token_ids)


async def test_chat_messages_in_every_form_give_the_same_prompt(server):
    forms = [CHAT, [{"role": m.role, "content": m.content} for m in CHAT], [(m.role, m.content) for m in CHAT]]
    with server.channel() as channel:  # the raw stub is the oracle for what the SDK sends
        raw = pb_grpc.TextGenerationStub(channel).Tokenize(pb.TokenizeRequest(
            messages=pb.ChatMessages(messages=[pb.ChatMessage(role=m.role, content=m.content) for m in CHAT]),
            add_generation_prompt=True), timeout=30)
    async with AsyncClient(server.target, timeout=60) as client:
        for form in forms:
            assert (await client.tokenize(form)).token_ids == list(raw.token_ids)
        without_prompt = await client.tokenize(CHAT, add_generation_prompt=False)
        assert len(without_prompt.token_ids) < len(raw.token_ids)
        by_chat = await client.generate(CHAT, max_new_tokens=16, ignore_eos=True)
        by_ids = await client.generate(list(raw.token_ids), max_new_tokens=16, ignore_eos=True)
    assert by_chat.token_ids == by_ids.token_ids and by_chat.text == by_ids.text
    assert by_chat.usage.prompt_tokens == len(raw.token_ids)


def test_model_info_describes_checkpoint_and_limits(server, config, trained_server_flags):
    with Client(server.target, timeout=30) as client:
        info = client.model_info()
    assert isinstance(info, ModelInfo)
    assert info.architecture == "llama" and info.vocab_size == config["vocab_size"]
    assert info.context_length == config["max_position_embeddings"]
    assert info.eos_token_ids == [config["eos_token_id"]] and info.bos_token_id == config["bos_token_id"]
    assert info.max_batch_size == trained_server_flags["max_batch"]
    assert info.max_new_tokens_limit == trained_server_flags["max_new_tokens_cap"]
    assert info.server_version == lmserve.__version__ and info.has_chat_template
    assert info.to_dict()["vocab_size"] == config["vocab_size"]
    # the KV cache holds the model's dtype or int8 codes, and says why; float32 (the token-exact reference) never int8
    assert info.kv_cache_dtype in (info.dtype, "int8") and info.kv_cache_choice.startswith(info.kv_cache_dtype)
    assert info.dtype != "float32" or info.kv_cache_dtype == "float32"
    # speculation as served, with its cost where --speculation auto measured it (the server's own words)
    assert info.speculation.startswith(("ngram (", "off ("))
    cost = info.speculation_verify_cost
    assert cost is None or (cost > 0 and f"verifying {cost:.2f}x a decode step" in info.speculation)
    assert info.to_dict()["speculation_verify_cost"] == cost


async def test_health_reports_serving(server):
    with Client(server.target, timeout=10) as client:
        assert client.health() == "SERVING"
        assert client.health("lmserve.v1.TextGeneration") == "SERVING"
        with pytest.raises(LmserveError) as info:
            client.health("no.such.Service")
        assert info.value.code.name == "NOT_FOUND"
    async with AsyncClient(server.target, timeout=10) as client:
        assert await client.health() == "SERVING"


def test_server_default_max_new_tokens_fits_the_context(server, prompts):
    prefix, continuation = prompts[0]
    with Client(server.target, timeout=60) as client:
        assert client.generate(prefix).text == continuation


# ---- errors ------------------------------------------------------------------------------------------

def _duration_alone(client: Client) -> float:
    import time

    t0 = time.monotonic()
    assert client.generate("A red fox", **SLOW).usage.completion_tokens == SLOW["max_new_tokens"]
    return time.monotonic() - t0


async def test_per_call_timeout_raises_deadline_exceeded(server):
    policy = fast_retries(5)
    with Client(server.target, timeout=60, retry_policy=policy) as client:
        # far below what the generation needs alone, even if this shared machine speeds up meanwhile; the
        # deadline may even pass before the server sees the call: the SDK's behaviour is the same
        budget = min(_duration_alone(client), _duration_alone(client)) / 20
        with pytest.raises(DeadlineExceededError):
            client.generate("A red fox", timeout=budget, **SLOW)
        assert policy.attempts() == 1  # DEADLINE_EXCEEDED is not retried
        received = []
        with pytest.raises(DeadlineExceededError):
            for chunk in client.stream("A red fox", timeout=budget, **SLOW):
                received.append(chunk)
        assert all(not c.is_last for c in received)
    async with AsyncClient(server.target, timeout=budget) as client:  # the client default applies per call ...
        with pytest.raises(DeadlineExceededError):
            await client.generate("A red fox", **SLOW)
        done = await client.generate("A red fox", timeout=None, **SLOW)  # ... unless the call overrides it
        assert done.usage.completion_tokens == SLOW["max_new_tokens"]
    server.wait_idle()


@pytest.mark.parametrize("overrides, fields", [
    (dict(temperature=-1.0), {"params.temperature"}),
    (dict(temperature=-1.0, top_p=2.0, max_new_tokens=121), {"params.temperature", "params.top_p",
                                                            "params.max_new_tokens"}),
    (dict(logprobs=21), {"params.logprobs"}),
], ids=["temperature", "three-at-once", "logprobs"])
async def test_invalid_request_carries_the_servers_field_violations(server, overrides, fields):
    policy = fast_retries(5)
    async with AsyncClient(server.target, timeout=30, retry_policy=policy) as client:
        with pytest.raises(InvalidRequestError) as info:
            await client.generate("The baker", **{"max_new_tokens": 8, **overrides})
        assert policy.attempts() == 1  # never retried
        with pytest.raises(InvalidRequestError) as stream_info:
            async for _ in client.stream("The baker", **{"max_new_tokens": 8, **overrides}):
                raise AssertionError("an invalid stream produced a chunk")
    for error in (info.value, stream_info.value):
        assert error.code.name == "INVALID_ARGUMENT"
        assert {f for f, _ in error.field_violations} == fields
        assert all(description for _, description in error.field_violations)
        assert all(f in str(error) for f in fields)


def test_bad_prompts_name_their_input_field(server):
    with Client(server.target, timeout=30) as client:
        with pytest.raises(InvalidRequestError) as info:
            client.generate([], max_new_tokens=4)
        assert [f for f, _ in info.value.field_violations] == ["token_ids"]
        with pytest.raises(InvalidRequestError) as info:
            client.generate([ChatMessage("wizard", "hi")], max_new_tokens=4)
        assert [f for f, _ in info.value.field_violations] == ["messages[0].role"]


# ---- TLS and bearer tokens ---------------------------------------------------------------------------

def test_sync_client_over_tls_with_a_token(extra_servers, pki):  # noqa: F811
    srv = extra_servers["tls"]
    with Client(srv.target, ca_file=str(pki / "ca.pem"), token=TOKENS[0], timeout=30) as client:
        result = client.generate("The baker", max_new_tokens=6, ignore_eos=True)
        assert [t for c in client.stream("The baker", max_new_tokens=6, ignore_eos=True) for t in c.token_ids] \
            == result.token_ids
        assert client.tokenize("The baker").token_ids and client.model_info().vocab_size > 0
        assert client.health() == "SERVING"


async def test_async_client_over_tls_with_a_token(extra_servers, pki):  # noqa: F811
    srv = extra_servers["tls"]
    async with AsyncClient(srv.target, ca_file=str(pki / "ca.pem"), token=TOKENS[1], timeout=30) as client:
        result = await client.generate("The baker", max_new_tokens=6, ignore_eos=True)
        chunks = [c async for c in client.stream("The baker", max_new_tokens=6, ignore_eos=True)]
        assert_stream_matches(chunks, result)
        assert (await client.model_info()).vocab_size > 0


@pytest.mark.parametrize("token", [None, "not-a-token"], ids=["no token", "wrong token"])
async def test_missing_or_wrong_token_is_unauthenticated_and_not_retried(extra_servers, pki, token):  # noqa: F811
    srv = extra_servers["tls"]
    policy = fast_retries(5)
    async with AsyncClient(srv.target, ca_file=str(pki / "ca.pem"), token=token, timeout=30,
                           retry_policy=policy) as client:
        with pytest.raises(UnauthenticatedError) as info:
            async for _ in client.stream("The baker", max_new_tokens=4):
                raise AssertionError("an unauthenticated stream produced a chunk")
        assert policy.attempts() == 1
        assert TOKENS[0] not in str(info.value)
        with pytest.raises(UnauthenticatedError):
            await client.tokenize("hi")
        assert await client.health() == "SERVING"  # health needs no token


def test_plaintext_or_untrusting_client_cannot_reach_the_tls_server(extra_servers, pki):  # noqa: F811
    srv = extra_servers["tls"]
    with Client(srv.target, token=TOKENS[0], timeout=10, max_retries=0) as client:
        with pytest.raises(UnavailableError):
            client.model_info()
    with Client(srv.target, ca_file=str(pki / "other-ca.pem"), token=TOKENS[0], timeout=10, max_retries=0) as client:
        with pytest.raises(UnavailableError):
            client.model_info()


# ---- overload and retries ----------------------------------------------------------------------------

# The overload tests need the only slot held while the other calls arrive. A holder is not held up by
# its reader (the engine finishes it however slowly it is read), so a client delayed by a busy machine can
# arrive after it finished: such a run is inconclusive and runs again; its outputs are checked every time.
HOLD_TRIES = 3


async def test_overload_is_retried_before_the_first_chunk_until_a_slot_frees(extra_servers, training_prompts):
    srv = extra_servers["one_slot"]
    prefix, continuation = training_prompts[4]
    for _ in range(HOLD_TRIES):
        unary_policy, stream_policy = fast_retries(), fast_retries()
        async with AsyncClient(srv.target, timeout=60, max_retries=0) as plain, \
                AsyncClient(srv.target, timeout=60, retry_policy=unary_policy) as retrying_unary, \
                AsyncClient(srv.target, timeout=60, retry_policy=stream_policy) as retrying_stream:
            holder = plain.stream("The baker", **SLOW)
            first = await holder.__anext__()  # the only slot is taken for ~120 slow steps
            try:  # max_retries=0: the overload reaches the caller
                await plain.generate(prefix, max_new_tokens=100)
                overloaded = False
            except OverloadedError:
                overloaded = True

            async def stream_all():
                return [c async for c in retrying_stream.stream(prefix, max_new_tokens=100)]

            unary, chunks, rest = await asyncio.gather(
                retrying_unary.generate(prefix, max_new_tokens=100), stream_all(), _drain(holder))
        held = [first, *rest]
        assert held[-1].finish_reason == "length" and not any(c.is_last for c in held[:-1])
        assert sum(len(c.token_ids) for c in held) == SLOW["max_new_tokens"]
        assert unary.text == continuation and unary.finish_reason == "eos"
        assert_stream_matches(chunks, unary)  # a retried stream delivers each token once
        srv.wait_idle()
        if overloaded and unary_policy.attempts() >= 2 and stream_policy.attempts() >= 2:
            break
    else:
        raise AssertionError(f"the holder never held the slot while the other calls arrived ({HOLD_TRIES} runs)")
    for policy in (unary_policy, stream_policy):
        assert set(policy.retried()) == {OverloadedError}, policy.calls


def test_sync_client_retries_overload_too(extra_servers, training_prompts):
    srv = extra_servers["one_slot"]
    prefix, continuation = training_prompts[7]
    for _ in range(HOLD_TRIES):
        policy = fast_retries()
        with srv.channel() as channel:
            holder = pb_grpc.TextGenerationStub(channel).GenerateStream(pb.GenerateRequest(
                prompt="The baker", params=pb.SamplingParams(max_new_tokens=120, ignore_eos=True, logprobs=20)),
                timeout=60)
            head = next(holder)  # running in the only slot
            with Client(srv.target, timeout=60, retry_policy=policy) as client:
                chunks = list(client.stream(prefix, max_new_tokens=100))
            assert len(head.token_ids) + sum(len(m.token_ids) for m in holder) == 120
        assert "".join(c.text for c in chunks) == continuation
        srv.wait_idle()
        if policy.attempts() >= 2:
            break
    else:
        raise AssertionError(f"the holder never held the slot while the stream arrived ({HOLD_TRIES} runs)")
    assert set(policy.retried()) == {OverloadedError}


async def _kill_mid_stream(srv):
    """A sync and an async stream, each read for its first 3 chunks, then the server is killed. Returns the
    generation's token ids and, per stream, (chunks received, its retry policy); None when a stream ended
    before the kill (a client that falls behind a fast server gets its chunks merged, and may get them all)."""
    with Client(srv.target, timeout=60) as client:
        expected = client.generate("The baker", **SLOW).token_ids
    sync_policy, async_policy = fast_retries(5), fast_retries(5)
    sync_client = Client(srv.target, timeout=60, retry_policy=sync_policy)
    async_client = AsyncClient(srv.target, timeout=60, retry_policy=async_policy)
    broken = []
    try:
        sync_stream = sync_client.stream("The baker", **SLOW)
        async_stream = async_client.stream("The baker", **SLOW)
        sync_chunks = list(itertools.islice(sync_stream, 3))
        async_chunks = []
        for _ in range(3):
            try:
                async_chunks.append(await async_stream.__anext__())
            except StopAsyncIteration:
                break
        srv.kill()
        try:
            sync_chunks += list(sync_stream)
        except UnavailableError:
            broken.append("sync")
        try:
            async_chunks += [chunk async for chunk in async_stream]
        except UnavailableError:
            broken.append("async")
    finally:
        sync_client.close()
        await async_client.close()
    if broken != ["sync", "async"]:
        assert any(c.is_last for c in sync_chunks + async_chunks), "a stream ended without its last chunk"
        return None
    return expected, [(sync_chunks, sync_policy), (async_chunks, async_policy)]


async def test_stream_broken_mid_way_is_not_retried(extra_servers, start_server, trained_model_dir):
    """Killing the server mid-stream raises UnavailableError after the chunks already delivered, once each."""
    srv = extra_servers["doomed"]
    for _ in range(3):
        if (outcome := await _kill_mid_stream(srv)) is not None:
            break
        srv = start_server(trained_model_dir, threads=1, metrics_port=None, max_new_tokens_cap=120)  # a fresh one
    else:
        raise AssertionError("the streams ended before the server was killed, 3 times")
    expected, streams = outcome
    for chunks, policy in streams:
        received = [t for c in chunks for t in c.token_ids]
        assert not any(c.is_last for c in chunks)
        assert 3 <= len(received) < len(expected)
        assert received == expected[:len(received)]  # a prefix, nothing repeated
        assert policy.attempts() == 1 and policy.retried() == []


# ---- closing ------------------------------------------------------------------------------------------

def test_leaving_the_context_manager_closes_the_channel_and_cancels_calls(server):
    def leave_mid_stream() -> Client:
        with Client(server.target, timeout=60) as client:
            stream = client.stream("A red fox", **SLOW)
            assert not next(stream).is_last
        return client

    *_, client = server.until_cancelled(leave_mid_stream)
    with pytest.raises(ValueError):  # grpc refuses calls on a closed channel
        client.generate("A red fox", max_new_tokens=2)


async def test_leaving_the_async_context_manager_cancels_calls(server):
    async def leave_mid_stream() -> AsyncClient:
        async with AsyncClient(server.target, timeout=60) as client:
            stream = client.stream("A red fox", **SLOW)
            assert not (await stream.__anext__()).is_last
        return client

    loop = asyncio.get_running_loop()
    *_, client = await asyncio.to_thread(
        server.until_cancelled, lambda: asyncio.run_coroutine_threadsafe(leave_mid_stream(), loop).result())
    with pytest.raises(Exception):  # noqa: B017 - grpc.aio's own usage error
        await client.generate("A red fox", max_new_tokens=2)


async def _drain(stream) -> list[StreamChunk]:
    return [c async for c in stream]
