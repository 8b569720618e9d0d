"""`lmserve bench shapes`' pure parts: the kernel's memory accounting read for a process, the read bound and
the ratios on recorded runs, the machine-peaks step of a shape, the flags, and the markdown table."""

from __future__ import annotations

import mmap
import os
import resource

import pytest
from lmserve.client.bench.harness import build_parser
from lmserve.client.bench.registry import BENCHMARKS
from lmserve.server.bench import shapes_bench as SB
from lmserve.server.bench.bounds import (
    distinct_prefix_tokens,
    product_bound,
    read_bound,
)
from lmserve.server.bench.machine_peaks import decoder_step
from lmserve.server.bench.model_shapes import SHAPES
from lmserve.server.bench.served import process_memory

MiB = 2**20


def test_the_memory_read_from_proc_is_the_kernels_peak_and_follows_an_allocation():
    before = process_memory(os.getpid())
    # fresh anonymous pages, each written, so resident: a heap allocation may land on freed pages the process
    # still holds (a long test session's), which add nothing (seen: +0.4 MB for 128 MiB of bytes)
    block = mmap.mmap(-1, 128 * MiB)
    for at in range(0, len(block), mmap.PAGESIZE):
        block[at] = 1
    during = process_memory("self")
    assert during["resident_bytes"] - before["resident_bytes"] >= 100 * MiB
    assert during["peak_resident_bytes"] >= during["resident_bytes"]
    block.close()
    after = process_memory(os.getpid())
    # a high-water mark keeps the block after it is freed (the kernel's counters lag by a few pages)
    assert after["peak_resident_bytes"] - before["resident_bytes"] >= 100 * MiB
    # ru_maxrss is the same mark (in KiB), taken over this process's images: never below VmHWM
    assert after["peak_resident_bytes"] <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def test_the_read_bound_is_the_step_bytes_at_the_bandwidth_and_the_share_a_rate_reached():
    # 669 MB at 26 GB/s bounds a step near 39 tokens/s; 25.5 tokens/s is 66% of it
    b = read_bound(669_000_000, 26.0, 25.5)
    assert b == {"step_mb": 669.0, "bound_ms_per_token": 25.731, "bound_tok_s_c1": 38.9, "chat_c1_share_of_bound": 0.656}
    assert "chat_c1_share_of_bound" not in read_bound(669_000_000, 26.0)


def test_a_shapes_machine_peaks_step_multiplies_every_parameter_but_the_norms_once():
    vocab = 49152
    for name in ("llama-3.2-1b", "llama-3.1-8b"):
        s = SHAPES[name]
        step = decoder_step(s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim, s.ffn, s.layers, vocab)
        norms = (2 * s.layers + 1) * s.hidden
        gathered = 0 if s.tied else vocab * s.hidden  # an untied embedding table is only gathered from
        assert sum(n * k for n, k, _ in step) == s.parameters(vocab) - norms - gathered
        assert step[-1] == (vocab, s.hidden, 8) and {b for _, _, b in step[:-1]} == {4}


def test_the_product_bound_counts_a_shared_prefix_once_and_every_later_token_through_layers_and_head():
    # two prompts sharing their first two tokens, a third equal to the first: 3 + 1 distinct prefixes
    prompts = [[1, 2, 3], [1, 2, 4], [1, 2, 3]]
    assert distinct_prefix_tokens(prompts) == 4
    assert distinct_prefix_tokens([[5, 6], [6, 5]]) == 4  # the same tokens at other places are other prefixes
    layers, head = [(6, 4), (4, 6)], (10, 4)  # 48 products a token through the layers, 40 through the head
    b = product_bound(prompts, 5, layers, head, 1e-9, {"a": 15 / (4 * 48 + 3 * 40 + 3 * 4 * 88), "b": None})
    # 4 prefix tokens through the layers, the head after each of 3 prompts, then 4 more tokens each through both
    assert b["g_products"] == round((4 * 48 + 3 * 40 + 3 * 4 * 88) / 1e9, 1)
    assert b["least_seconds"] == 4 * 48 + 3 * 40 + 3 * 4 * 88
    assert b["bound_tok_s"] == round(15 / b["least_seconds"], 1) and b["output_tokens"] == 15
    assert b["a_share_of_bound"] == 1.0 and "b_share_of_bound" not in b
    assert (b["prompt_tokens"], b["distinct_prefix_tokens"], b["requests"]) == (9, 4, 3)


def _runs(c1, c32, c1_tpot_ms=None):
    return {"runs": [{"workload": "chat", "concurrency": 1, "tok_s": c1, "tpot_mean_ms": c1_tpot_ms},
                     {"workload": "chat", "concurrency": 32, "tok_s": c32}]}


def _start(ready, peak):
    return {"ready_seconds": ready, "memory_at_ready": {"resident_bytes": peak // 2, "peak_resident_bytes": peak},
            "mode": "bfloat16+int4"}


def test_ratios_bounds_and_the_peers_best_format_from_recorded_runs():
    peer = {"q4_k_m": _runs(20.0, 100.0), "q4_0": _runs(25.0, 90.0)}
    best = SB.peer_best(peer)
    assert best["format"] == "q4_0" and (best["chat_c1_tok_s"], best["chat_c32_tok_s"]) == (25.0, 90.0)
    assert best["by_format"]["q4_k_m"] == {"chat_c1_tok_s": 20.0, "chat_c32_tok_s": 100.0}
    assert SB.peer_best({"q4_0": {"runs": []}}) is None  # nothing ran: no best

    entry = {"format": "q4_k_m", "file_bytes": 700_000_000, "file_step_bytes": 650_000_000,
             "lmserve": {**_runs(30.0, 400.0, 25.0), "step_weight_bytes": 500_000_000}, "llama.cpp": peer["q4_k_m"]}
    assert SB.entry_ratios(entry, best) == {"chat_c1_over_llama_cpp_same_file": 1.5, "chat_c32_over_llama_cpp_same_file": 4.0,
                                            "chat_c1_over_llama_cpp_best": 1.2, "chat_c32_over_llama_cpp_best": 4.44}
    b = SB.entry_bounds(entry, 25.0)
    assert b["lmserve_served"]["bound_tok_s_c1"] == 50.0 and b["lmserve_served"]["chat_c1_share_of_bound"] == 0.6
    assert b["file"]["bound_tok_s_c1"] == 38.5 and b["file"]["chat_c1_share_of_bound"] == 0.52  # the peer's
    assert b["file"]["lmserve_chat_c1_share_of_bound"] == 0.78
    # 25 ms a token once the prompt is read: 40 tok/s, 0.8 of the 50 the served bytes allow (the peer ran no tpot)
    assert b["lmserve_served"]["decode_c1_share_of_bound"] == 0.8 and b["file"]["lmserve_decode_c1_share_of_bound"] == 1.04
    assert "decode_c1_share_of_bound" not in b["file"]
    # lmserve alone (a bf16 directory the peer does not read): no ratio, the bound still given
    alone = {**entry, "llama.cpp": {}}
    assert SB.entry_ratios(alone, None) == {}
    assert "chat_c1_share_of_bound" not in SB.entry_bounds(alone, 25.0)["file"]


def test_a_run_repeated_in_rounds_is_one_record_of_its_medians_and_summed_counts():
    rounds = [{"workload": "chat", "concurrency": 1, "requests": 8, "completed": 8, "failed": 0, "output_tokens": 1024,
               "tok_s": t, "itl_p50_ms": i, "ttft_p50_ms": None, "tpot_mean_ms": i + 1.0}
              for t, i in ((30.0, 20.0), (41.0, 18.0), (35.0, 25.5))]
    m = SB.median_run(rounds)
    assert (m["tok_s"], m["itl_p50_ms"], m["tpot_mean_ms"], m["ttft_p50_ms"]) == (35.0, 20.0, 21.0, None)
    assert (m["requests"], m["completed"], m["failed"], m["output_tokens"], m["rounds"]) == (24, 24, 0, 3072, 3)
    assert (m["workload"], m["concurrency"]) == ("chat", 1)
    # the decode ratio, from both servers' time per output token, beside the chat rates' in the table
    lm, peer = SB.median_run(rounds[:1]), {**rounds[1], "tok_s": 20.0, "tpot_mean_ms": 31.5}
    entry = {"lmserve": {"runs": [lm]}, "llama.cpp": {"runs": [peer]}}
    assert SB.entry_ratios(entry, None) == {"chat_c1_over_llama_cpp_same_file": 1.5,
                                            "decode_c1_over_llama_cpp_same_file": 1.5}
    assert SB._pair(30.0, 20.0, 1.5, 1.5) == "30.0 / 20.0 (1.50x; decode 1.50x)"


def test_the_table_has_a_row_per_shape_and_format_and_dashes_for_what_did_not_run():
    entry = {"format": "q4_k_m", "file_bytes": 669_000_000, "file_step_bytes": 650_000_000,
             "lmserve": {**_runs(30.0, 400.0, 25.0), "step_weight_bytes": 500_000_000, "cold": _start(18.0, 2 * 2**30),
                         "cached": _start(4.0, 2**30), "after_load": {"peak_resident_bytes": 3 * 2**29}},
             "llama.cpp": _runs(20.0, 100.0)}
    best = SB.peer_best({"q4_k_m": entry["llama.cpp"], "q4_0": _runs(25.0, 90.0)})
    entry["ratios"], entry["bounds"] = SB.entry_ratios(entry, best), SB.entry_bounds(entry, 25.0)
    load_only = {"format": "q4_k_m", "file_bytes": 4_900_000_000, "file_step_bytes": 4_000_000_000,
                 "lmserve": {"runs": [], "cached": _start(60.0, 6 * 2**30), "after_load": {"peak_resident_bytes": 6 * 2**30}},
                 "ratios": {}}
    failed = {"format": "bf16", "file_bytes": 16_000_000_000, "file_step_bytes": 16_000_000_000,
              "lmserve": {"cold": {"failed": "exited with status -9", "seconds": 95.2, "log_tail": [],
                                   "memory_last_read": {"resident_bytes": 20 * 2**30, "peak_resident_bytes": 21 * 2**30}}},
              "ratios": {}}
    text = SB.table([{"shape": "llama-3.2-1b", "entries": [entry], "peer_best": best,
                      "chat_c32_product_bound": {"bound_tok_s": 420.0, "bound_over_llama_cpp_q4_k_m": 4.2}},
                     {"shape": "llama-3.1-8b", "load_only": True, "entries": [load_only, failed],
                      "peer_best": None}])
    lines = text.splitlines()
    assert len(lines) == 5 and lines[0].count("|") == lines[1].count("|") == lines[2].count("|") == 12
    assert lines[2] == ("| llama-3.2-1b | q4_k_m (0.67) | bfloat16+int4 | 18.0 / 4.0 | 2.00 / 1.00 / 1.50 | 30.0 / 20.0 (1.50x) "
                        "| 400.0 / 100.0 (4.00x) | 25.0 (q4_0) | 50.0 / 38.5 | 0.60 / 0.80 | 420.0 (4.20x) |")
    assert lines[3] == ("| llama-3.1-8b (load only) | q4_k_m (4.90) | bfloat16+int4 | - / 60.0 | - / 6.00 / 6.00 | - | - "
                        "| - | - | - | - |")
    assert lines[4] == ("| llama-3.1-8b (load only) | bf16 (16.00) | - | failed (exited with status -9, 95 s) / - "
                        "| 21.00 / - / - | - | - | - | - | - | - |")  # the last memory read before the kernel killed it


def test_flags_take_comma_separated_shapes_and_formats_and_name_the_choices_on_a_typo(capsys):
    parser = build_parser(BENCHMARKS["shapes"], SB)
    args = parser.parse_args(["--shapes", "llama-3.2-1b,llama-3.2-3b:q4_k_m+q4_0", "--formats", "q4_k_m,bf16"])
    assert args.shapes == [("llama-3.2-1b", None), ("llama-3.2-3b", ["q4_k_m", "q4_0"])]
    assert args.formats == ["q4_k_m", "bf16"]
    assert args.load_only == ["llama-3.1-8b"] and args.max_new_tokens == 128
    with pytest.raises(SystemExit):
        parser.parse_args(["--formats", "q4_k_m,q5_k_m"])
    err = capsys.readouterr().err
    assert "unknown format q5_k_m" in err and "q4_k_m, q4_0, q8_0, bf16, f16" in err
    for wrong, words in (("llama-3.2-1b:q5_k_m", "unknown format q5_k_m"), ("llama-3-8b", "unknown shape llama-3-8b")):
        with pytest.raises(SystemExit):
            parser.parse_args(["--shapes", wrong])
        assert words in capsys.readouterr().err
