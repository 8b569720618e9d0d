"""The line logged when the server is ready: at most READY_LINE_CHARS characters, every address whole,
the model's name shortened (its end kept) only where it would not fit."""

from __future__ import annotations

import itertools

from lmserve.server.app import READY_LINE_CHARS, ready_line

IPV6 = "2001:0db8:85a3:0000:0000:8a2e:0370:7334"  # the longest an IPv6 address is written
HOSTS = ("127.0.0.1", "0.0.0.0", "localhost", "255.255.255.255", IPV6)
MODES = ("float32 on cpu", "bfloat16+int4 on cpu", "bfloat16+int8 on cpu", "bfloat16 on cuda")


def line(host="127.0.0.1", metrics_host=None, model="smollm2", mode="bfloat16+int4 on cpu", **kw):
    args = dict(port=50051, tls=False, http_port=8000, metrics=(metrics_host or host, 9400), model=model, mode=mode,
                kv_gib=3.14, kv_dtype="int8", seconds=12.34) | kw
    return ready_line(host, **args)


def test_the_default_start_reads_whole():
    assert line() == ("lmserve listening on 127.0.0.1:50051 (plaintext), HTTP :8000, metrics :9400; model smollm2, "
                      "bfloat16+int4 on cpu, KV 3.1 GiB int8, ready in 12.3s")
    assert line(http_port=None, metrics=None, tls=True).startswith(
        "lmserve listening on 127.0.0.1:50051 (TLS), HTTP off, metrics off; model smollm2,")
    assert "metrics 0.0.0.0:9400;" in line(metrics_host="0.0.0.0")


def test_it_stays_within_the_limit_for_any_model_name_and_keeps_every_address():
    names = ["m", "SmolLM2-135M-Instruct", "/models/" + "x" * 300 + "/Q4_K_M.gguf", "a/" * 200 + "model.gguf"]
    for host, mode, name, kv_gib, seconds in itertools.product(HOSTS, MODES, names, (0.5, 9999.9), (0.1, 9999.9)):
        for metrics_host in (host, "0.0.0.0") if host != IPV6 else (host,):
            text = line(host, metrics_host, name, mode, kv_gib=kv_gib, kv_dtype="bfloat16", seconds=seconds)
            assert len(text) <= READY_LINE_CHARS, text
            assert text.startswith(f"lmserve listening on {host}:50051 ")
            assert f"{mode}, KV {kv_gib:.1f} GiB bfloat16, ready in {seconds:.1f}s" in text
            shown = text.split("; model ", 1)[1].split(f", {mode}", 1)[0]
            assert shown == name or (shown.startswith("...") and name.endswith(shown[3:])), (name, shown)
    assert "model SmolLM2-135M-Instruct," in line(IPV6, model="SmolLM2-135M-Instruct")  # fits: shown whole


def test_the_start_up_line_names_every_phase_and_the_time_since_the_process_started():
    from lmserve.server.app import process_age, startup_line

    phases = {"read": 0.04, "precision plan": 12.345, "KV choice": 1.25, "speculation": 0.5}
    text = startup_line(phases, 20.0)
    assert text == ("start-up: read 0.0s, precision plan 12.3s, KV choice 1.2s, speculation 0.5s; "
                    "20.0s since the process started")
    assert startup_line(phases, None).endswith("speculation 0.5s")
    age = process_age()  # this test process started before this test ran, and not before the machine booted
    assert age is None or 0.0 < age < 10 ** 7
