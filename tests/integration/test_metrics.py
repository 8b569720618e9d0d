"""/metrics scraped from a real server and parsed with prometheus_client: names, types, and exact movement."""

from __future__ import annotations

import itertools
import json

import grpc
import pytest

from lmserve.v1 import lmserve_pb2 as pb

HISTOGRAMS = ("lmserve_time_to_first_token_seconds", "lmserve_inter_token_latency_seconds",
              "lmserve_request_duration_seconds", "lmserve_queue_time_seconds", "lmserve_request_prompt_tokens",
              "lmserve_request_generated_tokens", "lmserve_engine_step_duration_seconds")
COUNTERS = ("lmserve_requests", "lmserve_prompt_tokens", "lmserve_generated_tokens",  # samples end in _total
            "lmserve_prefix_cache_queried_tokens", "lmserve_prefix_cache_hit_tokens", "lmserve_prefix_cache_evictions",
            "lmserve_preemptions")
GAUGES = ("lmserve_running_requests", "lmserve_waiting_requests", "lmserve_kv_slots_used",
          "lmserve_kv_slots_capacity", "lmserve_kv_cache_bytes", "lmserve_batch_size", "process_resident_memory_bytes",
          "lmserve_kv_cache_committed_bytes", "lmserve_prefix_cache_bytes", "lmserve_prefix_cache_entries",
          "lmserve_model_step_weight_bytes")
PER_REQUEST = ("lmserve_time_to_first_token_seconds", "lmserve_request_duration_seconds",
               "lmserve_queue_time_seconds", "lmserve_request_prompt_tokens", "lmserve_request_generated_tokens")


def delta(after, before, sample: str, **labels) -> float:
    return after.total(sample, **labels) - before.total(sample, **labels)


def test_every_metric_is_exported_with_its_type(server):
    m = server.metrics()
    for name in HISTOGRAMS:
        assert m.families[name].type == "histogram", name
    for name in COUNTERS:
        assert m.families[name].type == "counter", name
    for name in GAUGES:
        assert m.families[name].type == "gauge", name
    # an info metric is a gauge of value 1 named *_info in the Prometheus text format
    assert m.families["lmserve_model_info"].type == "gauge" and m.get("lmserve_model_info", **m.labels(
        "lmserve_model_info")[0]) == 1
    assert m.get("lmserve_kv_cache_bytes") > m.get("lmserve_kv_cache_committed_bytes") >= m.get("lmserve_prefix_cache_bytes") >= 0


def test_static_values_follow_the_checkpoint_and_flags(server, trained_model_dir, trained_server_flags):
    cfg = json.loads((trained_model_dir / "config.json").read_text())
    m = server.metrics()
    slots, ctx = trained_server_flags["max_batch"], cfg["max_position_embeddings"]
    assert m.get("lmserve_kv_slots_capacity") == slots
    # the KV budget: 20% of this machine's memory (or its cgroup limit), whatever --max-batch says
    from lmserve.server.engine.engine import usable_memory_bytes

    assert m.get("lmserve_kv_cache_bytes") == int(0.2 * usable_memory_bytes())
    (info,) = m.labels("lmserve_model_info")
    assert info["architecture"] == "llama" and info["dtype"] == "float32" and info["device"] == "cpu"
    assert info["context_length"] == str(ctx) and info["model"]
    # a float32 step reads every linear's weights once, 4 bytes each: q|k|v, o, gate|up, down, the head
    h, heads, f = cfg["hidden_size"], cfg["num_attention_heads"], cfg["intermediate_size"]
    d = cfg.get("head_dim") or h // heads
    q, kv = heads * d, cfg.get("num_key_value_heads", heads) * d
    linears = cfg["num_hidden_layers"] * (h * (q + 2 * kv) + q * h + 3 * f * h) + cfg["vocab_size"] * h
    assert m.get("lmserve_model_step_weight_bytes") == 4 * linears


def test_values_move_by_exactly_what_was_served(server, stub, training_prompts):
    before = server.wait_idle()
    requests = [pb.GenerateRequest(prompt=p, params=pb.SamplingParams(max_new_tokens=80)) for p, _ in training_prompts[:3]]
    requests.append(pb.GenerateRequest(prompt="The baker", params=pb.SamplingParams(max_new_tokens=9, ignore_eos=True)))
    finals = []
    for i, req in enumerate(requests):
        if i % 2:
            finals.append(list(stub.GenerateStream(req, timeout=60))[-1])
        else:
            finals.append(stub.Generate(req, timeout=60))
    after = server.wait_idle()

    n = len(requests)
    prompt = sum(f.usage.prompt_tokens for f in finals)
    generated = sum(f.usage.completion_tokens for f in finals)
    assert delta(after, before, "lmserve_requests_total") == n
    assert delta(after, before, "lmserve_requests_total", status="ok", finish_reason="eos") == 3
    assert delta(after, before, "lmserve_requests_total", status="ok", finish_reason="length") == 1
    assert delta(after, before, "lmserve_prompt_tokens_total") == prompt
    assert delta(after, before, "lmserve_generated_tokens_total") == generated
    for name in PER_REQUEST:
        assert delta(after, before, f"{name}_count") == n, name
    assert delta(after, before, "lmserve_request_prompt_tokens_sum") == prompt
    assert delta(after, before, "lmserve_request_generated_tokens_sum") == generated
    # every token but a request's first has a gap to the one before it
    assert delta(after, before, "lmserve_inter_token_latency_seconds_count") == generated - n
    steps = delta(after, before, "lmserve_engine_step_duration_seconds_count")
    assert max(f.usage.completion_tokens for f in finals) <= steps <= generated  # one request at a time here
    # the histograms observe the very timings the responses carry
    assert delta(after, before, "lmserve_request_duration_seconds_sum") == pytest.approx(
        sum(f.timing.total_seconds for f in finals), rel=1e-6)
    assert delta(after, before, "lmserve_time_to_first_token_seconds_sum") == pytest.approx(
        sum(f.timing.time_to_first_token_seconds for f in finals), rel=1e-6)
    assert delta(after, before, "lmserve_queue_time_seconds_sum") == pytest.approx(
        sum(f.timing.queue_seconds for f in finals), rel=1e-6, abs=1e-9)
    for f in finals:
        assert 0 <= f.timing.queue_seconds <= f.timing.time_to_first_token_seconds <= f.timing.total_seconds
    assert after.get("lmserve_batch_size") == 1  # the last step decoded one request


def test_rejected_requests_are_not_counted_as_served(server, stub):
    before = server.wait_idle()
    with pytest.raises(grpc.RpcError):
        stub.Generate(pb.GenerateRequest(prompt="Hi", params=pb.SamplingParams(temperature=-1)), timeout=30)
    after = server.metrics()
    for sample in ("lmserve_requests_total", "lmserve_prompt_tokens_total", "lmserve_generated_tokens_total"):
        assert delta(after, before, sample) == 0, sample


def test_cancelled_stream_is_counted_as_cancelled(server, stub):
    def cancel_mid_stream() -> list:
        call = stub.GenerateStream(pb.GenerateRequest(
            prompt="A red fox", params=pb.SamplingParams(max_new_tokens=100, ignore_eos=True)), timeout=60)
        streamed = list(itertools.islice(call, 2))  # fewer if its chunks arrived merged and it finished first
        call.cancel()
        return streamed

    before, after, streamed = server.until_cancelled(cancel_mid_stream)
    assert delta(after, before, "lmserve_requests_total", status="cancelled", finish_reason="cancelled") == 1
    assert delta(after, before, "lmserve_requests_total") == 1
    generated = delta(after, before, "lmserve_generated_tokens_total")
    assert len(streamed) <= generated < 100
    assert delta(after, before, "lmserve_request_generated_tokens_sum") == generated


def test_prefix_cache_counters_move_by_the_tokens_looked_up_and_reused(server, stub):
    """The same prompt twice: the second reuses all but its last token (at least one is computed)."""
    before = server.wait_idle()
    req = pb.GenerateRequest(prompt="Zebra quartz violin umbrella " * 5,
                             params=pb.SamplingParams(max_new_tokens=4, ignore_eos=True))
    first, second = stub.Generate(req, timeout=60), stub.Generate(req, timeout=60)
    after = server.wait_idle()
    n = first.usage.prompt_tokens
    assert n > 16 and second.text == first.text
    assert delta(after, before, "lmserve_prefix_cache_queried_tokens_total") == 2 * n
    assert delta(after, before, "lmserve_prefix_cache_hit_tokens_total") == n - 1
    assert after.get("lmserve_prefix_cache_bytes") > 0 and after.get("lmserve_prefix_cache_entries") >= 1
    assert after.get("lmserve_kv_cache_committed_bytes") == after.get("lmserve_prefix_cache_bytes")  # idle
