"""lmserve beside llama.cpp's `llama-server` in one run: the same GGUF, prompts and token counts.

    sh server/bench/build_llama_server.sh      # once: builds the peer into .cache/peers (~10 min)
    lmserve bench peer [--rounds 3] [--model gemma3 --api completions --skip json profile]

One server at a time, each driven by the load generator's clients (lmserve through gRPC, the peer through
its OpenAI API; with --api completions both through /v1/completions, the prompts sent as text, for a model
without a chat template), streaming:
- chat: the built-in chat prompts, 128 new tokens with EOS ignored, at c=1 and c=32;
- repeat: answers that repeat the prompt (code editing, quoting, document QA), greedy, at c=1, each
  to its end (EOS), at most 256 tokens; the peer runs without and with its n-gram speculation
  (ngram-simple, ngram-mod), lmserve with speculation on and off. These five servers run at once
  and take turns, round after round (--rounds), and each reports its median round;
- json: the same chat questions under a JSON schema (`response_format` over both OpenAI APIs), c=1:
  tokens/s and the share of outputs that validate, beside the same questions unconstrained.
The report names the machine (lscpu), the modes each server ran and every run's numbers, and what
bounds them on this machine: the read bandwidth (before and after the servers ran), the rate at which
a step's weights can be read the way lmserve's native loop reads them and the int8 product rate
(machine_peaks.py), each server's batch-1 bound (the bytes a decode step streams at that bandwidth)
and the share of it chat at c=1 reached, and lmserve's batch-1 step by phase (step_profile.py, run
after the servers). A benchmark, not a test: run it on a quiet machine. llama.cpp is a reference
here, never a dependency.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

from . import served
from .constrained_bench import QUESTIONS, SCHEMA

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_BINARY = ROOT / ".cache" / "peers" / "llama.cpp" / "bin" / "llama-server"
FLAGS = {"model": "smollm2", "models_dir": None, "threads": os.cpu_count(), "requests": 8, "max_new_tokens": 128,
         "rounds": 3, "skip": ("lmserve", "llama.cpp", "chat", "repeat", "json", "profile")}


def add_arguments(p) -> None:
    p.add_argument("--llama-server", type=Path, default=DEFAULT_BINARY, help="the peer's binary")
    p.add_argument("--repeat-max-new-tokens", type=int, default=256, help="most tokens of a repeat answer")
    p.add_argument("--lmserve-flag", action="append", default=[], help="extra `lmserve serve` flag (repeatable)")
    p.add_argument("--api", choices=("chat", "completions"), default="chat",
                   help="chat: the prompts as chat messages (lmserve through gRPC, the peer's /v1/chat/completions); "
                        "completions: the same prompts as text to both servers' /v1/completions (a base model)")


def workload(name: str, api: str, tag: str = "") -> tuple[list, str]:
    """The workload's prompts and the load generator's API for `api` ("lmserve" or "openai": chat
    messages; "completions": the same prompts as text, which an OpenAI client sends to /v1/completions).
    tag: a line that starts every request's last message, so that a run repeated with another tag finds
    none of its prompts in a server's prefix cache (the system prompt before it is still shared)."""
    from lmserve.client.bench import prompts as P
    from lmserve.client.types import ChatMessage

    items = P.repeating_workload() if name == "repeat" else P.synthetic_workload()
    if tag:
        items = [P.WorkItem([*it.prompt[:-1], ChatMessage(it.prompt[-1].role, f"{tag}\n{it.prompt[-1].content}")],
                            it.max_new_tokens) for it in items]
    if api != "completions":
        return items, api
    return [P.WorkItem(P.flatten_chat(it.prompt), it.max_new_tokens) for it in items], "openai"


def apis(args) -> tuple[str, str]:
    """The API lmserve and the peer are driven through: (lmserve's gRPC, the peer's chat) or both completions."""
    return ("completions", "completions") if args.api == "completions" else ("lmserve", "openai")


def drive(where: str, api: str, name: str, concurrency: int, requests: int, max_new: int, tag: str = "") -> dict:
    """chat: EOS ignored (`ignore_eos` in gRPC's SamplingParams and in both OpenAI APIs' bodies), every
    request decodes max_new tokens; repeat: the answer as a user gets it (to EOS). api, tag: workload()'s."""
    from lmserve.client.bench.load import wave

    items, api = workload(name, api, tag)
    _, agg = wave(where, concurrency, requests, max_new, api=api, items=items, warmup=min(2, requests),
                  ignore_eos=name != "repeat", timeout=600)
    out = {"workload": name, "concurrency": concurrency, "requests": requests, "completed": agg.completed,
           "failed": agg.failed, "output_tokens": agg.output_tokens,
           "tok_s": round(agg.output_token_throughput, 1),
           "itl_p50_ms": round(1e3 * agg.itl.p50, 2) if agg.itl else None,
           "ttft_p50_ms": round(1e3 * agg.ttft.p50, 1) if agg.ttft else None,
           # the time a token takes once the prompt is read (tok_s also counts the prompts' prefill)
           "tpot_mean_ms": round(1e3 * agg.tpot.mean, 2) if agg.tpot else None}
    if agg.failed:
        out["errors"] = agg.errors  # what failed, by error code
    print(json.dumps(out), flush=True)
    return out


def peer_flags(threads: int) -> list[str]:
    """llama-server's flags in every comparison: the threads lmserve has, 32 slots of 1,024 tokens each."""
    return ["-t", str(threads), "-np", "32", "-c", str(32 * 1024)]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def _json_runs(http_url: str, model: str, max_new: int, rounds: int) -> dict:
    """c=1: each question with and without the schema; tok/s from the reply's usage over wall time."""
    import jsonschema

    out = {}
    for constrained in (False, True):
        tokens, seconds, valid, n, cut, valid_finished = 0, 0.0, 0, 0, 0, 0
        for r in range(rounds):
            for i, q in enumerate(QUESTIONS):
                body = {"model": model, "max_tokens": max_new, "temperature": 0,
                        "messages": [{"role": "user", "content": f"{q} (#{r * len(QUESTIONS) + i})"}]}
                if constrained:
                    body["response_format"] = {"type": "json_schema",
                                               "json_schema": {"name": "person", "schema": SCHEMA}}
                t0 = time.perf_counter()
                reply = _post(http_url + "/chat/completions", body)
                seconds += time.perf_counter() - t0
                tokens += reply["usage"]["completion_tokens"]
                n += 1
                was_cut = reply["choices"][0].get("finish_reason") == "length"
                cut += was_cut
                if constrained:
                    try:
                        jsonschema.validate(json.loads(reply["choices"][0]["message"]["content"]), SCHEMA)
                        valid += 1
                        valid_finished += not was_cut
                    except (ValueError, jsonschema.ValidationError):
                        pass
        key = "json_schema" if constrained else "unconstrained"
        out[key] = {"requests": n, "tok_s": round(tokens / seconds, 1), "completion_tokens": tokens,
                    "cut_by_max_tokens": cut}
        if constrained:
            out[key]["valid_fraction"] = round(valid / n, 3)
            out[key]["valid_among_finished"] = f"{valid_finished}/{n - cut}"  # one cut by max_tokens may not close
    out["constrained_over_unconstrained_tok_s"] = round(out["json_schema"]["tok_s"] / out["unconstrained"]["tok_s"], 3)
    print(json.dumps(out), flush=True)
    return out


def _repeat_rounds(starts: dict, rounds: int, max_new: int) -> dict[str, dict]:
    """The repeat workload on every server in `starts` (name -> (start, api, flags)), all started
    at once and measured in alternating rounds, so that the slow minutes of a shared machine fall on
    each of them alike. Per server: its median round, with every round's tok/s beside it."""
    import statistics

    with contextlib.ExitStack() as stack:
        live = {name: (stack.enter_context(start()), api) for name, (start, api, _) in starts.items()}
        rows: dict[str, list[dict]] = {name: [] for name in live}
        for _ in range(rounds):
            for name, (s, api) in live.items():
                time.sleep(1.0)  # the previous server's worker threads stop spinning
                rows[name].append(drive(_where(s, api), api, "repeat", 1, 6, max_new))
    out = {}
    for name, rs in rows.items():
        mid = statistics.median(r["tok_s"] for r in rs)
        row = dict(min(rs, key=lambda r: abs(r["tok_s"] - mid)))
        out[name] = {**row, "tok_s": round(mid, 1), "rounds_tok_s": [r["tok_s"] for r in rs]}
    return out


def _where(s: served.Served, api: str) -> str:
    """The address a server is driven at: lmserve's gRPC target, or the OpenAI API's base URL."""
    return s.grpc_target if api == "lmserve" else s.http_url


def _step_profile(model: str, models_dir) -> dict | None:
    """lmserve's batch-1 decode step by phase in the default mode (step_profile.py in a process of its
    own, after the servers stopped): its summary, mode, kernels and the bytes a step streams."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "step_profile.json"
        cmd = [sys.executable, "-m", "lmserve.client.cli", "bench", "step-profile", "--out", str(out), "--rounds", "3",
               "--model", model]
        if models_dir:
            cmd += ["--models-dir", str(models_dir)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not out.exists():
            print("step profile failed:", done.stderr[-500:], flush=True)
            return None
        r = json.loads(out.read_text())
    return {k: r[k] for k in ("mode", "kernels", "linear_weight_bytes", "summary")}


def _bounds(servers: dict, nbytes: dict[str, int], gb_s: float) -> dict:
    """Each server's batch-1 bound on this machine: its decode step's bytes at the read bandwidth, as
    tokens a second, and the share of it chat at c=1 reached."""
    from .bounds import read_bound

    return {name: read_bound(b, gb_s, rate(servers.get(name, {}), "chat", 1)) for name, b in nbytes.items()}


def rate(server: dict, workload: str, concurrency: int) -> float | None:
    """A server record's tok/s for one workload and concurrency (None: not run)."""
    return next((r["tok_s"] for r in server.get("runs", [])
                 if r["workload"] == workload and r["concurrency"] == concurrency), None)


def decode_rate(server: dict, workload: str, concurrency: int) -> float | None:
    """A stream's tokens a second once its prompt is read (1 / mean time per output token), or None."""
    ms = next((r.get("tpot_mean_ms") for r in server.get("runs", [])
               if r["workload"] == workload and r["concurrency"] == concurrency), None)
    return round(1e3 / ms, 1) if ms else None


def _model_id(http_url: str) -> str:
    with urllib.request.urlopen(http_url + "/models", timeout=30) as r:
        return json.load(r)["data"][0]["id"]


def _chat_runs(where: str, api: str, args) -> list[dict]:
    """The chat workload at c=1 (--requests requests) and at c=32 (64), unless skipped."""
    if "chat" in args.skip:
        return []
    return [drive(where, api, "chat", 1, args.requests, args.max_new_tokens),
            drive(where, api, "chat", 32, 64, args.max_new_tokens)]


def _each_alone(args, gguf: Path, lm_flags: list[str], peer: list[str]) -> dict:
    """lmserve, then llama-server, each serving alone: the chat runs and the json ones, unless skipped;
    per server its record (lmserve's with its startup line, the peer's with its flags)."""
    servers = {}
    lm_api, peer_api = apis(args)
    if "lmserve" not in args.skip:
        with served.lmserve(lm_flags) as s:
            line = next((x for x in s.log.read_text().splitlines() if "lmserve listening" in x), "")
            servers["lmserve"] = {"startup_line": line.split("lmserve listening", 1)[-1].strip(),
                                  "runs": _chat_runs(_where(s, lm_api), lm_api, args)}
            if "json" not in args.skip:
                servers["lmserve"]["json"] = _json_runs(s.http_url, _model_id(s.http_url), 96, 2)
    if "llama.cpp" not in args.skip:
        with served.llama_server(args.llama_server, gguf, peer) as s:
            servers["llama.cpp"] = {"flags": peer, "runs": _chat_runs(s.http_url, peer_api, args)}
            if "json" not in args.skip:
                servers["llama.cpp"]["json"] = _json_runs(s.http_url, _model_id(s.http_url), 96, 2)
    return servers


def _repeat_servers(args, gguf: Path, lm_flags: list[str], peer: list[str]) -> dict:
    """The servers the repeat workload compares, name -> (start, api, flags): lmserve with speculation on
    and off, llama-server without and with its n-gram speculation (those not skipped)."""
    starts = {}
    lm_api, peer_api = apis(args)
    if "lmserve" not in args.skip:
        starts["lmserve"] = (lambda: served.lmserve(lm_flags), lm_api, lm_flags)
        off = [*lm_flags, "--speculation", "off"]
        starts["lmserve --speculation off"] = (lambda: served.lmserve(off), lm_api, off)
    if "llama.cpp" not in args.skip:
        for spec in (None, "ngram-simple", "ngram-mod"):
            flags = [*peer, "--spec-type", spec] if spec else peer
            starts[f"llama.cpp --spec-type {spec}" if spec else "llama.cpp"] = (
                lambda flags=flags: served.llama_server(args.llama_server, gguf, flags), peer_api, flags)
    return starts


RATIOS = {  # name -> (server, the one it is set over, workload, concurrency)
    "chat_c1_lmserve_over_llama_cpp": ("lmserve", "llama.cpp", "chat", 1),
    "chat_c32_lmserve_over_llama_cpp": ("lmserve", "llama.cpp", "chat", 32),
    "repeat_c1_lmserve_over_its_speculation_off": ("lmserve", "lmserve --speculation off", "repeat", 1),
    "repeat_c1_lmserve_over_llama_cpp_ngram_simple": ("lmserve", "llama.cpp --spec-type ngram-simple", "repeat", 1),
    "repeat_c1_lmserve_over_llama_cpp_ngram_mod": ("lmserve", "llama.cpp --spec-type ngram-mod", "repeat", 1),
}


def _ratios(servers: dict) -> dict[str, float]:
    """Each of RATIOS whose two servers both ran its workload: the first's tok/s over the second's."""
    ratios = {}
    for name, (a, b, w, c) in RATIOS.items():
        x, y = rate(servers.get(a, {}), w, c), rate(servers.get(b, {}), w, c)
        if x and y:
            ratios[name] = round(x / y, 2)
    return ratios


def _machine_peaks() -> dict | str:
    """machine_peaks.py's readings for SmolLM2's decode step, or why there are none."""
    from . import machine_peaks as MP

    try:
        return MP.measure(*MP.step_buffers(MP.smollm2_step(4)))
    except RuntimeError as exc:  # no native build here: the sum's bandwidth still bounds every server
        return f"not measured: {exc}"


def run(args) -> dict:
    from lmserve.model.checkpoints.catalog import resolve_model

    from .bounds import step_read_bytes, tensor_bytes
    from .quant_kernels import read_bandwidth

    if "llama.cpp" not in args.skip and not args.llama_server.exists():
        raise SystemExit(f"{args.llama_server} is missing: run `sh server/bench/build_llama_server.sh` first")
    if args.api == "completions" and "json" not in args.skip:
        raise SystemExit("the json runs ask /v1/chat/completions for a schema; with --api completions add --skip json")
    gguf = resolve_model(args.model, args.models_dir)
    memory = {"read_bandwidth_before": read_bandwidth()}
    lm_flags = ["--model", str(gguf), "--threads", str(args.threads), *args.lmserve_flag]
    peer = peer_flags(args.threads)
    servers = _each_alone(args, gguf, lm_flags, peer)
    if "repeat" not in args.skip:
        starts = _repeat_servers(args, gguf, lm_flags, peer)
        for name, row in _repeat_rounds(starts, args.rounds, args.repeat_max_new_tokens).items():
            servers.setdefault(name, {"flags": starts[name][2], "runs": []})
            servers[name]["runs"].append(row)
    ratios = _ratios(servers)
    memory["read_bandwidth_after"] = read_bandwidth()
    memory["machine_peaks"] = _machine_peaks()
    profile = None if "profile" in args.skip else _step_profile(args.model, args.models_dir)
    nbytes = {"llama.cpp": step_read_bytes(tensor_bytes(gguf))}
    if profile is not None:
        nbytes["lmserve"] = profile["linear_weight_bytes"]
    # the higher reading: a bound is the most the machine showed, so a share of it is not flattered
    gb_s = max(memory["read_bandwidth_before"]["median_gb_s"], memory["read_bandwidth_after"]["median_gb_s"])
    report = {"gguf": gguf.name, "api": args.api, "ratios": ratios, "memory": memory,
              "bounds_at_gb_s": gb_s, "bounds": _bounds(servers, nbytes, gb_s), "lmserve_step_profile": profile,
              "servers": servers}
    print(json.dumps(ratios, indent=2))
    return report
