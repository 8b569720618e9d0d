"""Benchmark helpers: the matmul-only bound counts exactly the multiplies the forward runs, the
README summary is derived from the report, and the native-cache bounds leave operators in charge."""

from __future__ import annotations

import math
import os

import torch

from lmserve.model.config import ModelConfig
from lmserve.model.llama import LlamaForCausalLM
from lmserve.server.bench.bounds import layer_flops_per_token, matmul_bounds


def tiny() -> tuple[ModelConfig, LlamaForCausalLM]:
    cfg = ModelConfig(vocab_size=97, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                      intermediate_size=48, max_position_embeddings=64)
    return cfg, LlamaForCausalLM(cfg).init_weights(0.1, generator=torch.Generator().manual_seed(0)).eval()


def test_flops_per_token_match_the_config_before_and_after_fusing():
    cfg, model = tiny()
    D, d, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    per_layer = D * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * D + 3 * D * I
    expected = 2 * cfg.num_layers * per_layer
    assert layer_flops_per_token(model) == expected
    assert layer_flops_per_token(model.prepare_for_inference()) == expected  # fused: same work


def test_bounds_are_consistent_with_their_own_timings():
    cfg, model = tiny()
    model.prepare_for_inference()
    out = matmul_bounds(model, {1: 10, 4: 40}, max_new=8, token_budget=16, dtype=torch.float32,
                        device=torch.device("cpu"))
    assert out["weight_stream_gb_per_s"] > 0 and out["prefill_gflop_per_s"] > 0
    for c, row in out["by_concurrency"].items():
        assert row["wave_matmul_seconds"] > 7 * row["decode_step_matmul_seconds"] > 0  # 7 decode steps + prefill
        assert math.isclose(row["output_tokens_per_s_bound"], int(c) * 8 / row["wave_matmul_seconds"])


def test_markdown_summary_ratios_come_from_the_report_rows():
    from lmserve.server.bench.engine_bench import markdown_summary

    report = {
        "concurrency": [1, 8],
        "engine": [{"concurrency": 1, "output_tokens_per_s": 12.0}, {"concurrency": 8, "output_tokens_per_s": 40.0}],
        "transformers": [{"concurrency": 1, "output_tokens_per_s": 10.0}],  # c=8 missing: shown as a dash
        "matmul_bounds": {"by_concurrency": {"1": {"output_tokens_per_s_bound": 25.0}}},
    }
    rows = [line.split(" | ") for line in markdown_summary(report).splitlines()[2:]]
    assert rows[0][1:6] == ["12.0", "10.0", "1.20x", "25.0", "2.50x"]
    assert rows[1][1:4] == ["40.0", "–", "–"]
    # the loop the device does not default to, side by side with the default one
    report["engine_other_loop"] = {"overlap_steps": True, "rows": [{"concurrency": 8, "output_tokens_per_s": 38.5}]}
    assert markdown_summary(report).splitlines()[-1] == \
        "Engine steps sequential (the default here) / overlapped, tok/s: c=8: 40.0 / 38.5."


def scrape(**extra) -> dict[str, float]:
    base = {"lmserve_process_peak_resident_memory_bytes": 3.2 * 2**30, "process_resident_memory_bytes": 2.5 * 2**30,
            "lmserve_model_weights_bytes": 0.7 * 2**30, "lmserve_kv_cache_bytes": 2.0 * 2**30}
    return base | extra


def test_memory_is_checked_on_resident_memory_on_cpu_and_on_gpu_memory_on_cuda():
    from lmserve.server.bench.engine_bench import markdown_summary, memory_report

    allowance = 0.5 * 2**30 + 2.0 * 2**30 + 600 * 2**20  # parameters + KV budget + 600 MiB
    cpu = memory_report(scrape(), param_bytes=2**29)
    assert cpu["checked"] == "peak_resident_bytes" and cpu["allowance_bytes"] == allowance
    assert not cpu["within_allowance"]  # 3.20 GiB resident > 3.09 GiB
    cuda = memory_report(scrape(lmserve_cuda_memory_allocated_bytes=2.6 * 2**30,
                                lmserve_cuda_memory_reserved_bytes=2.8 * 2**30,
                                lmserve_cuda_memory_peak_allocated_bytes=2.7 * 2**30), param_bytes=2**29)
    assert cuda["checked"] == "cuda_peak_allocated_bytes" and cuda["within_allowance"]
    report = {"concurrency": [64], "grpc": {"rows": [], "memory": cuda, "start_to_ready_seconds": 5.0}}
    line = markdown_summary(report).splitlines()[-1]
    assert "peak GPU memory allocated 2.70 GiB (host peak resident 3.20 GiB)" in line and "(within)" in line


def test_native_cache_bounds_are_defaults_an_operator_can_override(monkeypatch):
    from lmserve.model.loader import bound_native_caches

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    bound_native_caches()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "32"
    assert os.environ["LRU_CACHE_CAPACITY"] == "7"


def test_step_bounds_take_the_larger_of_reading_the_bytes_and_doing_the_products():
    from lmserve.server.bench.machine_peaks import bounds, peak_bounds

    light = bounds(50.0, 500e9, weight_bytes=100_000_000, products_per_row=100_000_000)
    assert light["read_ms"] == 2.0 and light["products_ms_m1"] == 0.2 and light["products_ms_m8"] == 1.6
    assert light["bound_ms_m1"] == light["bound_ms_m8"] == 2.0 and light["m8_over_m1_bound"] == 1.0
    heavy = bounds(50.0, 500e9, weight_bytes=100_000_000, products_per_row=200_000_000)
    peaks = {"threads": 2, "read_gb_s": {"region_per_linear": 50.0}, "products_g_per_s": {"2_threads": 500.0}}
    assert peak_bounds(peaks, weight_bytes=100_000_000, products_per_row=200_000_000) == heavy  # a report's rates
    assert heavy["bound_ms_m8"] == 3.2 and heavy["m8_over_m1_bound"] == 1.6  # 8 rows of products outlast the read


def test_machine_peaks_read_every_byte_once_in_both_patterns_and_count_products(native_kernels_dir):
    import pytest

    from lmserve.server.bench import machine_peaks as MP

    from lmserve.model.native import build as native

    lib, why = native.build(native_kernels_dir)
    if lib is None:
        pytest.skip(f"no native kernels here: {why}")
    peaks = MP.Peaks(native_kernels_dir)  # built like them: must build wherever they do
    bufs, gbytes = MP.step_buffers([(32, 64, 4), (48, 96, 8), (16, 32, 4)])
    assert [b.numel() for b in bufs] == [2 * 2 * 320, 3 * 3 * 544, 1 * 1 * 320]  # groups x blocks x bytes
    expected = sum(int(b.view(torch.int64).sum()) for b in bufs)  # int64 words, wrapping like the kernel
    expected = (expected + 2**63) % 2**64 - 2**63
    for threads in (1, 2):
        for one_region in (False, True):
            assert peaks.read(bufs, gbytes, threads, one_region)() == expected
    assert peaks.read_gb_s(bufs, gbytes, 2, False, repeats=1) > 0
    if peaks.per_instruction:
        assert peaks.products_per_second(1, iters=120_000, repeats=1) > 0
        # every mix runs its 8 dot products a block: weights 1..8 against codes of 1 give 4 x 36 a lane,
        # summed over the lanes (AVX-512) or read from lane 0 (AVX2), 12 rows a thread; x3 with the scale
        lanes = 16 if peaks.per_instruction == 64 else 1
        for threads in (1, 2):
            per_thread = 12 * lanes * 144 * 1000
            assert peaks.block_mix(1000, threads, MP.BLOCK_MIXES["dots_only"]) == threads * per_thread
            assert peaks.block_mix(1000, threads, MP.BLOCK_MIXES["integer_scale_per_block"]) == 3 * threads * per_thread
            assert peaks.block_mix(1000, threads, MP.BLOCK_MIXES["float_steps_per_block"]) == threads * 12  # y != 0


def test_peer_bounds_are_each_servers_step_bytes_at_the_bandwidth_and_the_share_chat_reached():
    from lmserve.server.bench.peer_bench import _bounds

    servers = {"a": {"runs": [{"workload": "chat", "concurrency": 32, "tok_s": 900.0},
                              {"workload": "chat", "concurrency": 1, "tok_s": 250.0}]},
               "b": {"runs": []}}
    out = _bounds(servers, {"a": 100_000_000, "b": 50_000_000}, gb_s=50.0)
    assert out["a"] == {"step_mb": 100.0, "bound_ms_per_token": 2.0, "bound_tok_s_c1": 500.0,
                        "chat_c1_share_of_bound": 0.5}
    assert out["b"]["bound_tok_s_c1"] == 1000.0 and "chat_c1_share_of_bound" not in out["b"]  # no chat run


def test_peer_completions_send_the_chat_prompts_as_text_that_both_servers_read_with_eos_ignored():
    """--api completions: the chat workload's prompts as text (no system turn), sent to /v1/completions
    with the wave's max_tokens and ignore_eos, which lmserve's HTTP edge reads as EOS ignored."""
    from types import SimpleNamespace

    from lmserve.client.bench.load import BenchConfig
    from lmserve.client.bench.prompts import synthetic_workload
    from lmserve.client.openai_stream import OpenAIStreamClient
    from lmserve.server.bench import peer_bench as PB
    from lmserve.server.http.openai_requests import translate

    chat, api = PB.workload("chat", "lmserve")
    assert api == "lmserve" and chat == synthetic_workload()  # the chat runs are as they were
    items, api = PB.workload("chat", "completions")
    assert api == "openai" and len(items) == len(chat) == 36
    assert items[0].prompt == "Explain the water cycle in one sentence."
    assert [it.prompt for it in items] == [m.prompt[1].content for m in chat]  # the user turn of each
    assert PB.workload("repeat", "completions")[0][1].prompt.startswith("Repeat the following paragraph word for word")
    # a round's tag starts each last turn (the shapes bench's c=1 rounds: none finds the last one's prompts cached)
    tagged, _ = PB.workload("chat", "lmserve", tag="Round 2.")
    assert [m.prompt[0] for m in tagged] == [m.prompt[0] for m in chat]  # the system turn still shared
    assert [m.prompt[1].content for m in tagged] == [f"Round 2.\n{m.prompt[1].content}" for m in chat]
    assert PB.workload("chat", "completions", tag="Round 2.")[0][0].prompt == (
        "Round 2.\nExplain the water cycle in one sentence.")
    assert PB.apis(SimpleNamespace(api="completions")) == ("completions", "completions")
    assert PB.apis(SimpleNamespace(api="chat")) == ("lmserve", "openai")

    config = BenchConfig(concurrency=32, rate=None, requests=64, duration=None, warmup=2, max_new_tokens=128,
                         temperature=0.0, seed=0, ignore_eos=True, timeout=600)  # as wave() builds it
    path, body = OpenAIStreamClient("http://127.0.0.1:1/v1", model="gemma3")._payload(items[5].prompt,
                                                                                        config.params(5, items[5]))
    assert path == "/completions" and "messages" not in body
    assert (body["prompt"], body["max_tokens"], body["ignore_eos"]) == (items[5].prompt, 128, True)
    got = translate(body, chat=False).input
    assert (got.prompt, got.params.max_new_tokens, got.params.ignore_eos, got.params.temperature) == (
        items[5].prompt, 128, True, 0.0)


def test_the_peer_streams_the_ggufs_tensors_which_are_nearly_the_whole_file(smollm2_gguf_path):
    from lmserve.server.bench.bounds import step_read_bytes, tensor_bytes

    tensors = tensor_bytes(smollm2_gguf_path)
    n = step_read_bytes(tensors)
    size = smollm2_gguf_path.stat().st_size
    assert n == sum(tensors.values())  # tied: the embedding table is the head, read every step
    assert 0.9 * size < n < size  # the rest is metadata (the tokenizer's vocabulary and merges)


def test_a_safetensors_directorys_step_leaves_out_an_untied_embedding_table(tmp_path):
    from safetensors.torch import save_file

    from lmserve.server.bench.bounds import step_read_bytes, tensor_bytes

    embed = torch.zeros(100, 16, dtype=torch.bfloat16)
    layer = {"model.layers.0.mlp.down_proj.weight": torch.zeros(16, 48, dtype=torch.bfloat16),
             "model.norm.weight": torch.ones(16)}
    save_file({"model.embed_tokens.weight": embed, **layer}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"lm_head.weight": torch.zeros(100, 16, dtype=torch.float16)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    tensors = tensor_bytes(tmp_path)
    assert tensors == {"model.embed_tokens.weight": 3200, "model.layers.0.mlp.down_proj.weight": 1536,
                       "model.norm.weight": 64, "lm_head.weight": 3200}
    assert step_read_bytes(tensors) == 1536 + 64 + 3200  # the head, not the gathered table
    del tensors["lm_head.weight"]
    assert step_read_bytes(tensors) == 3200 + 1536 + 64  # tied: the table is the head
