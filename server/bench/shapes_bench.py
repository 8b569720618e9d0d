"""lmserve on the model shapes people serve (Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B with random weights,
model_shapes.py), beside llama.cpp's `llama-server` on the same files, in one run.

    lmserve bench shapes --llama-server /path/to/llama-server \\
        --shapes llama-3.2-1b:q4_k_m+q4_0,llama-3.2-3b:q4_k_m,llama-3.1-8b:q4_k_m

Each checkpoint is written once into --shapes-dir and reused. For each shape:
- lmserve starts on each format with its default flags (plus any --lmserve-flag) on an empty cache
  folder, alone (cold: the precision probe and every other start-time measurement run; the native
  library is built into it beforehand and timed apart);
- then every server of the shape is started again, one at a time, and kept up: lmserve on each format's
  folder (cached), and llama-server on each GGUF format and on both Q4_0 and Q4_K_M, so that the report
  names the peer's fastest format on this machine and lmserve's ratios against it too. Each start
  records its time to ready, the process's resident memory at ready and its peak (VmRSS and VmHWM of
  /proc/<pid>/status: the kernel's own accounting), a first token (TTFT of one request), and for
  lmserve the mode and kernels it chose (GetModelInfo);
- with all of them up, chat prompts, 128 new tokens with EOS ignored (peer_bench's workload): at c=1 in
  --c1-rounds rounds in which the servers take turns (each number the rounds' median; the read rate of
  these VMs drifts by tens of percent within minutes, and in turns a drift meets every server alike),
  then at c=32 once each; then each server's peak resident memory after that load, and the bytes of
  weights lmserve's decode step reads (lmserve_model_step_weight_bytes);
- the read-bandwidth bound of a batch-1 step: the bytes lmserve serves and the file's tensor bytes (what
  llama.cpp reads) at the highest read rate measured in this run (quant_kernels.read_bandwidth before and
  after the servers and before each c=1 round, machine_peaks over buffers of the shape's packed
  linears), and the share of it chat at c=1 reached;
- the product bound of the chat wave at c=32 (bounds.product_bound): every weight meeting every token in
  one int8 product at machine_peaks' measured peak, each distinct prompt prefix once, nothing else
  charged; the most tokens a second any engine on these instructions shows here, over llama.cpp's rate.
Shapes in --load-only (by default Llama-3.1-8B) only start (cold and cached) and give a first token.
The report goes through the harness (reports/shapes/<machine>.json); a markdown table is printed.
One server runs at a time; the others wait idle. A benchmark, not a test: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from . import served
from .machine import taking_turns
from .model_shapes import GGUF_FORMATS, HF_FORMATS, SHAPES
from .peer_bench import DEFAULT_BINARY, decode_rate, drive, peer_flags, rate

ROOT = Path(__file__).resolve().parents[2]
FLAGS = {"models_dir": None, "threads": os.cpu_count(), "requests": 8, "max_new_tokens": 128,
         "skip": ("cold", "llama.cpp", "peer-best", "peaks")}
PEER_CANDIDATES = ("q4_0", "q4_k_m")  # llama.cpp's fast formats: the report names the faster one here
GiB = 2**30


def _names(choices, what: str):
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(unknown) or repr(text)}: expected a "
                                             f"comma-separated list of {', '.join(choices)}")
        return names
    return parse


def _shapes(text: str) -> list[tuple[str, list[str] | None]]:
    """--shapes: shape names, each with its own formats after a colon (joined by +), else None: --formats'."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, _, formats = item.partition(":")
        _names(tuple(SHAPES), "shape")(name)
        out.append((name, _names(GGUF_FORMATS + HF_FORMATS, "format")(formats.replace("+", ",")) if formats else None))
    if not out:
        raise argparse.ArgumentTypeError(f"no shape in {text!r}: expected any of {', '.join(SHAPES)}")
    return out


def add_arguments(p) -> None:
    p.add_argument("--shapes", type=_shapes, default=[("llama-3.2-1b", None)],
                   help="comma-separated shapes, each with its own formats if given after a colon, joined by + "
                        "(llama-3.2-3b:q4_k_m+q4_0); default: llama-3.2-1b; any of " + ", ".join(SHAPES))
    p.add_argument("--formats", type=_names(GGUF_FORMATS + HF_FORMATS, "format"), default=["q4_k_m", "q4_0"],
                   help="comma-separated formats of a shape named without its own (default: q4_k_m,q4_0; any of "
                        + ", ".join(GGUF_FORMATS + HF_FORMATS) + ")")
    p.add_argument("--load-only", type=_names(tuple(SHAPES), "shape"), default=["llama-3.1-8b"],
                   help="shapes that only start and give a first token (default: llama-3.1-8b)")
    p.add_argument("--shapes-dir", type=Path, default=ROOT / ".cache" / "shapes",
                   help="where the checkpoints are written once and reused (default: .cache/shapes)")
    p.add_argument("--llama-server", type=Path, default=DEFAULT_BINARY, help="the peer's binary")
    p.add_argument("--lmserve-flag", action="append", default=[], help="extra `lmserve serve` flag (repeatable)")
    p.add_argument("--c1-rounds", type=int, default=3,
                   help="rounds of the c=1 chat run, the servers taking turns in each (default: 3)")
    p.add_argument("--c32-requests", type=int, default=64, help="measured requests at c=32 (default: 64)")
    p.add_argument("--startup-timeout", type=float, default=1800, help="seconds a server may take to be ready")


# ---------------------------------------------------------------- one server's start and load

def _first_token(target: str, api: str) -> dict:
    """One request of 8 tokens on a server nothing has warmed: its TTFT."""
    from lmserve.client.bench.load import wave

    _, agg = wave(target, 1, 1, 8, api=api, warmup=0, timeout=600)
    return {"completed": agg.completed, "output_tokens": agg.output_tokens,
            "ttft_ms": round(1e3 * agg.ttft.p50, 1) if agg.ttft else None}


def _lmserve_start(s: served.Served) -> dict:
    """What a started lmserve says about itself, and its memory at ready."""
    from lmserve.client import Client

    memory = s.memory()
    line = next((x for x in s.log.read_text(errors="replace").splitlines() if "lmserve listening" in x), "")
    with Client(s.grpc_target, timeout=30) as client:
        info = client.model_info()
    return {"ready_seconds": round(s.ready_seconds, 2), "memory_at_ready": memory,
            "ready_line": line.split("lmserve listening", 1)[-1].strip(),
            "mode": info.dtype + ("" if info.quantization in ("", "none") else f"+{info.quantization}"),
            "kernels": info.kernels, "precision_choice": info.precision_choice,
            "kv_cache_dtype": info.kv_cache_dtype,
            "first_token": _first_token(s.grpc_target, "lmserve")}


def lmserve_cold(path: Path, args, stack: contextlib.ExitStack) -> tuple[dict, list[str]]:
    """lmserve's record for `path` with its cold start (unless skipped: then the server's own cache folder,
    what this machine measured before), and the flags a cached start takes: the cold start's cache folder,
    removed when `stack` closes."""
    from lmserve.model.native import build as native

    out: dict = {"flags": list(args.lmserve_flag)}
    flags = ["--model", str(path), "--threads", str(args.threads), *args.lmserve_flag]
    if "cold" in args.skip:
        return out, flags
    cache = Path(tempfile.mkdtemp(prefix="lmserve-cache-", dir=args.shapes_dir))
    stack.callback(shutil.rmtree, cache, ignore_errors=True)
    flags += ["--cache-dir", str(cache)]
    t0 = time.perf_counter()
    _, why = native.build(cache)  # the compiler's seconds apart from the start's
    out["native_build_seconds"] = round(time.perf_counter() - t0, 1)
    out["native_build"] = why
    try:
        with served.lmserve(flags, metrics=False, startup_timeout=args.startup_timeout) as s:
            out["cold"] = _lmserve_start(s)
    except served.StartFailed as exc:  # e.g. killed for memory: a cached start would measure again
        out["cold"] = exc.record()
    print(json.dumps({"lmserve cold": out["cold"]}), flush=True)
    return out, flags


def start_lmserve_cached(flags: list[str], record: dict, args, stack: contextlib.ExitStack) -> served.Served | None:
    """lmserve started again on its cold start's folder, kept up until `stack` closes: its start into
    `record["cached"]`; None when it did not start."""
    try:
        s = stack.enter_context(served.lmserve(flags, metrics=True, startup_timeout=args.startup_timeout))
    except served.StartFailed as exc:
        record["cached"] = exc.record()
        return None
    record["cached"] = _lmserve_start(s)
    print(json.dumps({"lmserve cached": record["cached"]}), flush=True)
    return s


def start_peer(path: Path, record: dict, args, stack: contextlib.ExitStack) -> served.Served | None:
    """llama-server on `path`, kept up until `stack` closes: its flags, time to ready, memory and a first
    token into `record`; None when it did not start."""
    record["flags"] = peer_flags(args.threads)
    try:
        s = stack.enter_context(served.llama_server(args.llama_server, path, record["flags"],
                                                    startup_timeout=args.startup_timeout))
    except served.StartFailed as exc:
        record |= exc.record()
        return None
    record |= {"ready_seconds": round(s.ready_seconds, 2), "memory_at_ready": s.memory(),
               "first_token": _first_token(s.http_url, "openai")}
    return s


def median_run(rounds: list[dict]) -> dict:
    """One record of a run repeated in rounds: its counts summed, each rate and latency the rounds' median."""
    out = dict(rounds[0])
    for k, v in rounds[0].items():
        if k in ("requests", "completed", "failed", "output_tokens"):
            out[k] = sum(r[k] for r in rounds)
        elif isinstance(v, float) or k.endswith("_ms") or k == "tok_s":
            values = [r[k] for r in rounds if r.get(k) is not None]
            out[k] = round(statistics.median(values), 2) if values else None
    out["rounds"] = len(rounds)
    return out


def side_by_side(servers: dict[str, tuple[str, str]], args) -> tuple[dict[str, dict], list[float]]:
    """Chat on servers that are all up at once, name -> (target, api): c=1 in --c1-rounds rounds taking
    turns (each round's prompts tagged with its number: no round finds the last one's in a prefix cache),
    the read bandwidth measured before each round, then c=32 once each in turn. On these VMs the
    read rate drifts by tens of percent within minutes, so servers measured one after the other are not
    compared at the same moment; in turns, a drift reaches each of them alike. Per server: "runs" (c=1 as
    the rounds' medians, c=32) and "c1_rounds"; and the readings."""
    from .quant_kernels import read_bandwidth

    rounds: dict[str, list[dict]] = {name: [] for name in servers}
    readings = []
    for rnd in range(args.c1_rounds):
        readings.append(read_bandwidth()["median_gb_s"])
        for name, (where, api) in taking_turns(servers.items(), rnd):
            rounds[name].append(drive(where, api, "chat", 1, args.requests, args.max_new_tokens, tag=f"Round {rnd + 1}."))
    c32 = {name: drive(where, api, "chat", 32, args.c32_requests, args.max_new_tokens)
           for name, (where, api) in taking_turns(servers.items(), args.c1_rounds)}
    return {name: {"runs": [median_run(rounds[name]), c32[name]], "c1_rounds": rounds[name]}
            for name in servers}, readings


# ---------------------------------------------------------------- bounds, ratios and the table (pure)

def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def peer_best(peer_runs: dict[str, dict]) -> dict | None:
    """Of llama-server's runs by format, the one with the highest chat rate at c=1, and both rates."""
    rated = {fmt: (rate(r, "chat", 1), rate(r, "chat", 32)) for fmt, r in peer_runs.items() if rate(r, "chat", 1)}
    if not rated:
        return None
    best = max(rated, key=lambda f: rated[f][0])
    return {"format": best, "chat_c1_tok_s": rated[best][0], "chat_c32_tok_s": rated[best][1],
            "by_format": {f: {"chat_c1_tok_s": c1, "chat_c32_tok_s": c32} for f, (c1, c32) in rated.items()}}


def entry_bounds(entry: dict, gb_s: float) -> dict:
    """The batch-1 read bound of one file at `gb_s`: of the bytes lmserve serves (with the share its chat at
    c=1 reached) and of the file's tensor bytes (with lmserve's and the peer's shares)."""
    from .bounds import read_bound

    lm, peer = entry.get("lmserve", {}), entry.get("llama.cpp", {})
    lm_c1, peer_c1 = rate(lm, "chat", 1), rate(peer, "chat", 1)
    lm_decode = decode_rate(lm, "chat", 1)
    out = {"gb_s": gb_s, "file": read_bound(entry["file_step_bytes"], gb_s, peer_c1, decode_rate(peer, "chat", 1))}
    for name, r in (("chat", lm_c1), ("decode", lm_decode)):
        if r:
            out["file"][f"lmserve_{name}_c1_share_of_bound"] = round(r * entry["file_step_bytes"] / (gb_s * 1e9), 3)
    if lm.get("step_weight_bytes"):
        out["lmserve_served"] = read_bound(lm["step_weight_bytes"], gb_s, lm_c1, lm_decode)
    return out


def entry_ratios(entry: dict, best: dict | None) -> dict:
    """lmserve / llama.cpp chat rates: on the same file, and against the peer's fastest format."""
    lm, peer = entry.get("lmserve", {}), entry.get("llama.cpp", {})
    out = {}
    for c in (1, 32):
        out[f"chat_c{c}_over_llama_cpp_same_file"] = _ratio(rate(lm, "chat", c), rate(peer, "chat", c))
        if best:
            out[f"chat_c{c}_over_llama_cpp_best"] = _ratio(rate(lm, "chat", c), best[f"chat_c{c}_tok_s"])
    # a stream's rate once its prompt is read: what the tokens' arrival shows, TTFT apart
    out["decode_c1_over_llama_cpp_same_file"] = _ratio(decode_rate(lm, "chat", 1), decode_rate(peer, "chat", 1))
    return {k: v for k, v in out.items() if v is not None}


def _gib(memory: dict | None) -> str:
    return f"{memory['peak_resident_bytes'] / GiB:.2f}" if memory else "-"


def _ready(start: dict | None) -> str:
    if not start:
        return "-"
    return f"failed ({start['failed']}, {start['seconds']:.0f} s)" if "failed" in start else f"{start['ready_seconds']:.1f}"


def _pair(a, b, ratio=None, decode_ratio=None) -> str:
    if a is None:
        return "-"
    text = f"{a:.1f}" if b is None else f"{a:.1f} / {b:.1f}"
    if ratio and decode_ratio:
        return text + f" ({ratio:.2f}x; decode {decode_ratio:.2f}x)"
    return text + (f" ({ratio:.2f}x)" if ratio else "")


def table(shapes: list[dict]) -> str:
    """The report as a markdown table: a row per shape and format."""
    head = ("| shape | format (file GB) | lmserve mode | ready cold / cached s | peak RSS cold / cached / after load GiB "
            "| chat c=1 lmserve / llama.cpp | chat c=32 lmserve / llama.cpp | llama.cpp best c=1 (format) "
            "| c=1 bound: served / file bytes | c=1 share of served bound: chat / decode "
            "| chat c=32 product bound (over llama.cpp) |")
    rows = [head, "| " + " | ".join(["---"] * 3 + ["---:"] * 8) + " |"]
    for sh in shapes:
        best = sh.get("peer_best")
        for e in sh["entries"]:
            lm, peer = e.get("lmserve", {}), e.get("llama.cpp", {})
            cold, cached = lm.get("cold"), lm.get("cached") or {}
            ready = " / ".join(_ready(s) for s in (cold, cached))
            at_ready = [s and (s.get("memory_at_ready") or s.get("memory_last_read")) for s in (cold, cached)]
            rss = " / ".join(_gib(m) for m in (*at_ready, lm.get("after_load")))
            r = e.get("ratios", {})
            b = e.get("bounds", {})
            served_b, file_b = b.get("lmserve_served", {}), b.get("file", {})
            bound = (f"{served_b.get('bound_tok_s_c1', '-')} / {file_b.get('bound_tok_s_c1', '-')}" if b else "-")
            share = " / ".join(f"{served_b[k]:.2f}" if served_b.get(k) else "-"
                               for k in ("chat_c1_share_of_bound", "decode_c1_share_of_bound"))
            best_text = f"{best['chat_c1_tok_s']:.1f} ({best['format']})" if best else "-"
            pb = sh.get("chat_c32_product_bound") or {}
            over = pb.get(f"bound_over_llama_cpp_{e['format']}")
            product = _pair(pb.get("bound_tok_s"), None, over) if pb else "-"
            rows.append(" | ".join([
                f"| {sh['shape']}" + (" (load only)" if sh.get("load_only") else ""),
                f"{e['format']} ({e['file_bytes'] / 1e9:.2f})", cached.get("mode", "-"), ready, rss,
                _pair(rate(lm, "chat", 1), rate(peer, "chat", 1), r.get("chat_c1_over_llama_cpp_same_file"),
                      r.get("decode_c1_over_llama_cpp_same_file")),
                _pair(rate(lm, "chat", 32), rate(peer, "chat", 32), r.get("chat_c32_over_llama_cpp_same_file")),
                best_text, bound, share if served_b else "-", product]) + " |")
    return "\n".join(rows)


# ---------------------------------------------------------------- the run

def _shape_step(shape, vocab: int) -> list[tuple[int, int, int]]:
    """machine_peaks.decoder_step of a shape: its linears (out, in, bits) in a decode step's order, head last."""
    from . import machine_peaks as MP

    return MP.decoder_step(shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.ffn,
                           shape.layers, vocab)


def _step_peaks(shape, vocab: int) -> dict:
    """machine_peaks over buffers of the shape's linears packed at 4 bits (int8 head)."""
    from . import machine_peaks as MP

    step = _shape_step(shape, vocab)
    try:
        return MP.measure(*MP.step_buffers(step))
    except RuntimeError as exc:  # no native build here: the sum's bandwidth still bounds every server
        return {"not_measured": str(exc)}


def measure_shape(name: str, formats: list[str], args, tokenizer_gguf: Path) -> dict:
    from . import model_shapes as MS
    from .bounds import step_read_bytes, tensor_bytes
    from .quant_kernels import read_bandwidth

    shape, load_only = SHAPES[name], name in args.load_only
    peer = "llama.cpp" not in args.skip and not load_only
    out: dict = {"shape": name, "load_only": load_only, "formats": formats, "entries": []}

    def file(fmt: str) -> Path:
        t0 = time.perf_counter()
        path = MS.write(name, fmt, args.shapes_dir, tokenizer_gguf)
        out.setdefault("write_seconds", {})[fmt] = round(time.perf_counter() - t0, 1)
        return path

    out["read_bandwidth_before"] = read_bandwidth()
    peer_runs: dict[str, dict] = {}
    with contextlib.ExitStack() as stack:
        up: dict[str, tuple[served.Served, dict]] = {}  # every server of the shape, started one at a time
        cached_flags = []
        for fmt in formats:
            path = file(fmt)
            size = sum(f.stat().st_size for f in path.iterdir()) if path.is_dir() else path.stat().st_size
            entry = {"format": fmt, "file": path.name, "file_bytes": size,
                     "file_step_bytes": step_read_bytes(tensor_bytes(path))}
            print(f"== {name} {fmt}: {path}", flush=True)
            entry["lmserve"], flags = lmserve_cold(path, args, stack)  # cold starts alone
            out["entries"].append(entry)
            cached_flags.append(flags)
        for entry, flags in zip(out["entries"], cached_flags):
            if "failed" not in entry["lmserve"].get("cold", {}):
                s = start_lmserve_cached(flags, entry["lmserve"], args, stack)
                if s is not None:
                    up[f"lmserve {entry['format']}"] = (s, entry["lmserve"])
        if peer:
            own = [f for f in formats if f in GGUF_FORMATS]
            for fmt in own + [f for f in PEER_CANDIDATES if f not in own and "peer-best" not in args.skip]:
                print(f"== {name} {fmt}: llama.cpp" + ("" if fmt in own else " only"), flush=True)
                s = start_peer(file(fmt), peer_runs.setdefault(fmt, {}), args, stack)
                if s is not None:
                    up[f"llama.cpp {fmt}"] = (s, peer_runs[fmt])
        if not load_only and up:
            runs, out["read_bandwidth_rounds"] = side_by_side(
                {n: (s.grpc_target, "lmserve") if s.grpc_target else (s.http_url, "openai") for n, (s, _) in up.items()},
                args)
            for n, (s, record) in up.items():
                record |= runs[n]
        for n, (s, record) in up.items():
            try:
                record["after_load"] = s.memory()
                if s.metrics_url:
                    record["step_weight_bytes"] = int(s.metrics()["lmserve_model_step_weight_bytes"])
            except OSError as exc:  # it died under the load: /proc or /metrics gone
                record["error"] = str(exc)
        for entry in out["entries"]:
            if entry["format"] in peer_runs:
                entry["llama.cpp"] = peer_runs[entry["format"]]
    if peer and "peer-best" not in args.skip:
        out["peer_only"] = {f: r for f, r in peer_runs.items() if f not in formats}
    out["peer_best"] = peer_best({f: r for f, r in peer_runs.items() if f in PEER_CANDIDATES})
    out["read_bandwidth_after"] = read_bandwidth()
    readings = [out["read_bandwidth_before"]["median_gb_s"], out["read_bandwidth_after"]["median_gb_s"],
                *out.get("read_bandwidth_rounds", [])]
    if not load_only and "peaks" not in args.skip:
        out["machine_peaks"] = _step_peaks(shape, _vocab(tokenizer_gguf))
        readings.append(out["machine_peaks"].get("read_gb_s", {}).get("one_region", 0.0))
    # the highest reading: a bound is the most the machine showed, so a share of it is not flattered
    out["bounds_at_gb_s"] = max(readings)
    if "products_g_per_s" in out.get("machine_peaks", {}):
        out["chat_c32_product_bound"] = chat_c32_product_bound(shape, out, peer_runs, args, tokenizer_gguf)
    for entry in out["entries"]:
        if not load_only:
            entry["bounds"] = entry_bounds(entry, out["bounds_at_gb_s"])
        entry["ratios"] = entry_ratios(entry, out["peer_best"])
    return out


def chat_c32_product_bound(shape, out: dict, peer_runs: dict, args, tokenizer_gguf: Path) -> dict:
    """bounds.product_bound of the chat wave at c=32 (its requests' prompts as the SmolLM2 template renders
    them) at the machine's int8 product peak, the rates each server reached on it, and the bound over
    llama.cpp's rate on the same file: the most lmserve / llama.cpp any engine could show here."""
    from lmserve.client.bench.prompts import synthetic_workload
    from lmserve.model.text.tokenizer import Tokenizer

    from .bounds import product_bound
    from .model_shapes import _tokenizer_fields

    fields, vocab = _tokenizer_fields(tokenizer_gguf)
    tok, items = Tokenizer.from_gguf_fields(fields), synthetic_workload()
    prompts = [tok.encode_chat([{"role": m.role, "content": m.content} for m in items[i % len(items)].prompt])[0]
               for i in range(args.c32_requests)]
    step = _shape_step(shape, vocab)
    peaks = out["machine_peaks"]
    measured = {f"lmserve_{e['format']}": rate(e.get("lmserve", {}), "chat", 32) for e in out["entries"]}
    measured |= {f"llama_cpp_{fmt}": rate(r, "chat", 32) for fmt, r in peer_runs.items()}
    bound = product_bound(prompts, args.max_new_tokens, [(n, k) for n, k, _ in step[:-1]], step[-1][:2],
                          peaks["products_g_per_s"][f"{peaks['threads']}_threads"], measured)
    for fmt, r in peer_runs.items():
        if rate(r, "chat", 32):
            bound[f"bound_over_llama_cpp_{fmt}"] = round(bound["bound_tok_s"] / rate(r, "chat", 32), 2)
    return bound


def _vocab(tokenizer_gguf: Path) -> int:
    from .model_shapes import _tokenizer_fields

    return _tokenizer_fields(tokenizer_gguf)[1]


def run(args) -> dict:
    from lmserve.model.checkpoints.catalog import default_models_dir, pull

    if "llama.cpp" not in args.skip and not args.llama_server.exists():
        raise SystemExit(f"{args.llama_server} is missing: pass --llama-server PATH, run "
                         "`sh server/bench/build_llama_server.sh`, or --skip llama.cpp")
    args.shapes_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_gguf = pull("smollm2", args.models_dir or default_models_dir(), progress=False)
    shapes = [measure_shape(name, formats or args.formats, args, tokenizer_gguf) for name, formats in args.shapes]
    text = table(shapes)
    print(text)
    return {"shapes": shapes, "table": text}
