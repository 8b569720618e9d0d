"""Throughput benchmark: the offline engine, Hugging Face `generate`, and the gRPC server, side by side.

    lmserve bench engine [--concurrency 1 8 32 64] [--device cuda] [--time-limit 150]

Every section decodes the same chat prompts for the same number of tokens (EOS ignored), so
output tokens/s compare directly: one server driven through gRPC and its HTTP API (the edges taking
turns at each concurrency), the engine in this process, transformers' `generate`. The in-process
waves also record every engine step (its kind, decode rows, prompt tokens, milliseconds, KV pages
held), and the run measures what a batch-1 decode step can reach here: the weights streamed by the
served linears (matmul-only) and by a plain read of memory. A section that fails is recorded and the
others run on; with --time-limit a wave that would end past it is skipped and recorded as such.
A table is printed; `--table REPORT` prints an old report's. This is a benchmark, not a test: run it
on a quiet machine.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from lmserve.client.bench.harness import MODEL

from . import engine_wave, served

FLAGS = {**MODEL, "threads": None, "concurrency": [1, 8, 32, 64], "max_new_tokens": 128,
         "skip": ("engine", "other-loop", "hf", "grpc", "http", "kernels", "quality", "prefill")}
# shares of --time-limit: the served edges, then the engine in this process; transformers has the rest
SHARES = {"served": 0.45, "engine": 0.6}
PREDICT_MARGIN = 1.5  # a wave of 2c is predicted to take this much more than 2x the wave of c at most


def add_arguments(p) -> None:
    p.add_argument("--max-model-len", type=int, default=1024, help="context per request (sizes the KV cache)")
    p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="skip the waves predicted to end past this many seconds from the start (default: none)")
    p.add_argument("--table", metavar="REPORT", help="print the markdown summary of an existing report and exit")


class Deadline:
    """Wall-clock seconds a part of the run may take (None: unlimited). A wave of concurrency c is run only
    if the last wave's time scaled to c (tokens grow with c) fits in what is left; a section's first wave
    whenever the whole run (the root deadline) has time left."""

    def __init__(self, seconds: float | None, parent: "Deadline | None" = None):
        end = None if seconds is None else time.monotonic() + seconds
        if parent is not None and parent.end is not None:
            end = parent.end if end is None else min(end, parent.end)
        self.end = end
        self.root = parent.root if parent is not None else self

    def left(self) -> float | None:
        return None if self.end is None else self.end - time.monotonic()

    def share(self, fraction: float) -> "Deadline":
        """A part of what is left."""
        left = self.left()
        return Deadline(None if left is None else max(0.0, left) * fraction, self)

    def skip(self, c: int, last: tuple[int, float] | None) -> str | None:
        """Why the wave of c is skipped (None: run it); `last`: (concurrency, seconds) of the wave before."""
        left = self.left()
        if left is None:
            return None
        if last is None:  # a section's first wave runs while the whole run has time: each gives one number
            left = self.root.left()
        if left <= 0:
            return "the time limit was reached"
        if last is not None:
            predicted = last[1] * max(1.0, c / last[0]) * PREDICT_MARGIN
            if predicted > left:
                return f"predicted {predicted:.0f} s (from c={last[0]}: {last[1]:.1f} s) > {left:.0f} s left"
        return None


class StepLog:
    """Every engine step of a wave (an EngineObserver): kind, decode rows, prompt tokens, milliseconds (the
    device's, read from CUDA events, where steps overlap) and the KV pages held when it was recorded."""

    def __init__(self, engine):
        self.kv = engine.scheduler.kv
        self.steps: list[tuple[str, int, int, float, int]] = []

    def on_step(self, seconds, batch) -> None:
        from ..engine.step_cost import step_kind

        prefill = sum(c.length for c in batch.prefill)
        rows = len(batch.decode) + sum(map(len, batch.drafts))
        self.steps.append((step_kind(len(batch.decode), prefill), rows, prefill, seconds * 1e3, self.kv.pages_used))

    def on_tokens(self, seq, count, gap_seconds) -> None:
        pass

    def on_finish(self, seq, final) -> None:
        pass

    def summary(self, concurrency: int, tokens: int) -> dict:
        """Per-step statistics of the wave: steps per generated token, the first step in which all
        `concurrency` requests decoded, and by kind the steps' count, rows, prompt tokens and milliseconds."""
        steps = self.steps
        by_kind = {}
        for kind in ("decode", "mixed", "prefill"):
            mine = [s for s in steps if s[0] == kind]
            if not mine:
                continue
            ms = sorted(s[3] for s in mine)
            by_kind[kind] = {"steps": len(mine), "rows_mean": sum(s[1] for s in mine) / len(mine),
                             "prefill_tokens_mean": sum(s[2] for s in mine) / len(mine),
                             "ms_mean": sum(ms) / len(ms), "ms_p50": ms[len(ms) // 2], "ms_max": ms[-1]}
        first_all = next((i for i, s in enumerate(steps, 1) if s[1] >= concurrency), None)
        pages = [s[4] for s in steps]
        return {"steps": len(steps), "steps_per_token": len(steps) / max(1, tokens), "all_decoding_from_step": first_all,
                "by_kind": by_kind, "kv_pages_held_max": max(pages, default=0),
                "kv_pages_held_mean": sum(pages) / max(1, len(pages)), "kv_pages_capacity": self.kv.kv_pages}


def chat_messages(n: int) -> list[list[dict]]:
    from lmserve.client.bench.prompts import synthetic_workload

    items = synthetic_workload()
    return [[{"role": m.role, "content": m.content} for m in items[i % len(items)].prompt] for i in range(n)]


def _p50(values: list[float]) -> float | None:
    values = sorted(values)
    return values[len(values) // 2] if values else None


def bench_engine(loaded, concurrencies, max_new, max_model_len, overlap_steps: bool | None = None,
                 deadline: Deadline | None = None) -> list[dict]:
    """Waves of c requests through the engine's async API; `overlap_steps` None: the device's default loop.
    Each row holds the wave's TTFT and ITL medians, its decode rate and its steps (StepLog.summary)."""
    from ..engine import Engine, EngineSettings

    tok = loaded.tokenizer
    deadline = deadline or Deadline(None)
    # no prefix cache: every wave sends the same prompts, and transformers gets no such reuse either
    engine = Engine(loaded, EngineSettings(max_batch=max(concurrencies), max_model_len=max_model_len,
                                           prefix_cache=False, overlap_steps=overlap_steps)).start()
    label = "engine" if overlap_steps is None else ("overlapped" if overlap_steps else "sequential")

    def wave(c: int, n_tokens: int):
        w = engine_wave.greedy(engine, engine_wave.chat_prompts(tok, c), n_tokens)
        assert all(len(s.token_ids) == n_tokens for s in w.streams), [len(s.token_ids) for s in w.streams]
        return w

    rows, last = [], None
    try:
        wave(2, 8)  # warm-up
        for c in concurrencies:
            why = deadline.skip(c, last)
            if why:
                rows.append({"concurrency": c, "skipped": why})
                print(f"{label:13s} c={c:3d}: skipped ({why})", flush=True)
                continue
            log = StepLog(engine)
            engine.observers.append(log)
            try:
                w = wave(c, max_new)
            finally:
                engine.observers.remove(log)
            dt = w.seconds
            last = (c, dt)
            ttft = _p50([s.arrivals[0][0] - w.start for s in w.streams])
            itl = _p50([g for s in w.streams for g in s.gaps()])
            rows.append({"concurrency": c, "seconds": dt, "output_tokens_per_s": c * max_new / dt,
                         "ttft_p50_ms": ttft * 1e3, "itl_p50_ms": itl * 1e3 if itl is not None else None,
                         "decode_tokens_per_s": w.decode_rate(), "steps": log.summary(c, w.tokens)})
            st = rows[-1]["steps"]
            print(f"{label:13s} c={c:3d}: {c * max_new / dt:8.1f} tok/s ({dt:.1f} s), {st['steps']} steps, "
                  f"all decoding from step {st['all_decoding_from_step']}, "
                  + ", ".join(f"{k} {v['steps']} x {v['ms_mean']:.2f} ms" for k, v in st["by_kind"].items()), flush=True)
    finally:
        engine.shutdown()
    return rows


def bench_hf(path: Path, concurrencies, max_new, device, dtype, deadline: Deadline | None = None) -> list[dict]:
    """transformers `generate` on the same prompts and weights (a GGUF file or a Hugging Face directory): a
    batch of c, left-padded, SDPA attention."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    d, where = (str(path), {}) if path.is_dir() else (str(path.parent), {"gguf_file": path.name})
    tok = AutoTokenizer.from_pretrained(d, **where)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(d, **where, dtype=dtype, attn_implementation="sdpa")
    model = model.to(device).eval()
    rows, last = [], None
    deadline = deadline or Deadline(None)
    for c in concurrencies:
        why = deadline.skip(c, last)
        if why:
            rows.append({"concurrency": c, "skipped": why})
            print(f"transformers  c={c:3d}: skipped ({why})", flush=True)
            continue
        texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in chat_messages(c)]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        with torch.inference_mode():
            model.generate(**enc, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
            sync()
            t0 = time.perf_counter()
            out = model.generate(**enc, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
            sync()
            dt = time.perf_counter() - t0
        assert out.shape[1] - enc["input_ids"].shape[1] == max_new
        last = (c, dt)
        rows.append({"concurrency": c, "seconds": dt, "output_tokens_per_s": c * max_new / dt})
        print(f"transformers  c={c:3d}: {c * max_new / dt:8.1f} tok/s ({dt:.1f} s)", flush=True)
    del model
    return rows


def bench_quality(path: Path, window: int = 512) -> dict:
    """Perplexity of the held-out text and mean KL of next-token distributions vs transformers float32
    on the same GGUF, for every precision mode (as llama.cpp reports its quantizations)."""
    import torch
    from transformers import AutoModelForCausalLM

    from lmserve.model.tuning import quality as Q
    from lmserve.model.loader import load_model
    from lmserve.model.tuning.precision import PrecisionError

    out = {}
    ref_model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    ref = None
    for dtype, quant in (("float32", "none"), ("bfloat16", "none"), ("bfloat16", "int8"), ("bfloat16", "int4"),
                         ("bfloat16", "kquant")):
        try:
            loaded = load_model(path, dtype=dtype, quantization=quant, device="cpu")
        except PrecisionError as e:  # kquant on a file with a type it does not serve as stored
            out[f"{dtype}+{quant}"] = {"refused": str(e)}
            print(f"quality       {dtype}+{quant} refused: {e}", flush=True)
            continue
        ids = Q.text_ids(loaded.tokenizer)
        if ref is None:
            with torch.inference_mode():
                ref = torch.cat([ref_model(input_ids=torch.tensor([ids[i:i + window]])).logits[0].float()
                                 for i in range(0, len(ids), window)])
        q = Q.compare(ref, Q.logits_of(loaded.model, ids, window), ids, window)
        out[loaded.mode] = {**q.as_dict(), "kernels": loaded.kernels,
                            "within_bounds": q.within_bounds()}
        print(f"quality       {loaded.mode:16s} ppl {q.perplexity:7.3f} (transformers fp32 {q.reference_perplexity:.3f})"
              f"  mean KL {q.mean_kl:.5f}  top-1 {q.top1_agreement:.3f}", flush=True)
        del loaded
    out["bounds"] = {"max_mean_kl": Q.MAX_MEAN_KL, "max_ppl_ratio": Q.MAX_PPL_RATIO}
    return out


def bench_prefill(loaded, prompt_tokens: int = 1500, repeats: int = 2) -> dict:
    """Prompt tokens/s of one ~1,500-token prompt through the engine (prefill in token-budget chunks)."""
    from lmserve.model.tuning import quality as Q

    from ..engine import Engine, EngineSettings

    ids = Q.text_ids(loaded.tokenizer)
    ids = (ids * (prompt_tokens // len(ids) + 1))[:prompt_tokens]
    # no prefix cache: the repeats would find the whole prompt cached and time nothing
    engine = Engine(loaded, EngineSettings(max_batch=2, max_model_len=prompt_tokens + 8, prefix_cache=False)).start()
    try:
        best = min(engine_wave.greedy(engine, [ids], 1).seconds for _ in range(repeats))
    finally:
        engine.shutdown()
    print(f"prefill       {prompt_tokens} tokens: {prompt_tokens / best:8.1f} prompt tok/s", flush=True)
    return {"prompt_tokens": prompt_tokens, "seconds": best, "prompt_tokens_per_s": prompt_tokens / best}


def parameter_bytes(count: int, dtype) -> int:
    """Bytes of `count` parameters at the serving dtype (a torch dtype or its name, as GetModelInfo gives
    it): what the memory allowance counts."""
    import torch

    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return count * torch.finfo(dtype).bits // 8


def bench_grpc(args, device, edges: tuple[str, ...] = ("grpc",), deadline: Deadline | None = None) -> dict:
    """Start `lmserve serve`, time it to SERVING, drive each concurrency through each of `edges` ("grpc",
    "http": its OpenAI API) in turn, read memory. Runs before anything is loaded in this process, whose
    threads and memory would otherwise share the machine with the server. Returns {edge: {"rows": ...}},
    gRPC's with the start and the memory; each row holds the wave's steps by kind, read from /metrics."""
    from lmserve.client import Client
    from lmserve.client.bench.load import wave

    flags = ["--model", args.model, "--max-batch", str(max(args.concurrency)), "--max-model-len",
             str(args.max_model_len), "--prefix-cache", "false", "--device", str(device), "--dtype", args.dtype,
             "--quantization", args.quantization, *(["--models-dir", args.models_dir] if args.models_dir else []),
             *(["--threads", str(args.threads)] if args.threads else [])]
    deadline = deadline or Deadline(None)
    out: dict = {edge: {"rows": []} for edge in edges}
    result = out.setdefault("grpc", {"rows": []})
    with served.lmserve(flags, http="http" in edges, metrics=True) as server:
        with Client(server.grpc_target) as client:
            info = client.model_info()
        result["start_to_ready_seconds"] = server.ready_seconds
        result["served"] = {"dtype": info.dtype, "quantization": info.quantization, "kernels": info.kernels}
        param_bytes = parameter_bytes(info.num_parameters, info.dtype)
        print(f"server ready in {result['start_to_ready_seconds']:.1f} s", flush=True)
        targets = {"grpc": (server.grpc_target, "lmserve"), "http": (server.http_url, "openai")}
        for edge in edges:
            wave(*targets[edge][:1], 2, 2, 8, api=targets[edge][1])  # warm-up
        last: dict[str, tuple[int, float]] = {}
        for c in args.concurrency:
            for edge in edges:
                why = deadline.skip(c, last.get(edge))
                if why:
                    out[edge]["rows"].append({"concurrency": c, "skipped": why})
                    print(f"{edge:13s} c={c:3d}: skipped ({why})", flush=True)
                    continue
                before = step_metrics(server.metrics_url)
                run, agg = wave(targets[edge][0], c, c, args.max_new_tokens, api=targets[edge][1])
                last[edge] = (c, run.duration)
                row = {"concurrency": c, "seconds": run.duration, "output_tokens_per_s": agg.output_token_throughput,
                       "failed": agg.failed,
                       "ttft_p50_ms": agg.ttft.p50 * 1e3, "ttft_p99_ms": agg.ttft.p99 * 1e3,
                       "itl_p50_ms": agg.itl.p50 * 1e3, "itl_p99_ms": agg.itl.p99 * 1e3,
                       "steps": steps_between(before, step_metrics(server.metrics_url), max(1, agg.output_tokens))}
                out[edge]["rows"].append(row)
                print(f"{edge:13s} c={c:3d}: {row['output_tokens_per_s']:8.1f} tok/s  ttft p50 {row['ttft_p50_ms']:.0f} ms"
                      f"  itl p50 {row['itl_p50_ms']:.1f} ms", flush=True)
        result["memory"] = memory_report(server.metrics(), param_bytes)
    return out


def step_metrics(metrics_url: str) -> dict[str, dict[str, float]]:
    """The server's step histograms by kind (lmserve_step_duration_seconds, lmserve_step_prefill_tokens): for
    each kind, steps, their seconds and their prompt tokens, from one /metrics scrape."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    out: dict[str, dict[str, float]] = {}
    names = {"lmserve_step_duration_seconds_count": "steps", "lmserve_step_duration_seconds_sum": "seconds",
             "lmserve_step_prefill_tokens_sum": "prefill_tokens"}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if sample.name in names and "kind" in sample.labels:
                out.setdefault(sample.labels["kind"], {})[names[sample.name]] = sample.value
    return out


def steps_between(before: dict, after: dict, tokens: int) -> dict:
    """What the server's steps did between two step_metrics scrapes: steps per generated token, and by kind
    the steps, their mean milliseconds and mean prompt tokens."""
    by_kind = {}
    for kind, now in after.items():
        was = before.get(kind, {})
        n = now.get("steps", 0) - was.get("steps", 0)
        if n > 0:
            by_kind[kind] = {"steps": int(n), "ms_mean": 1e3 * (now.get("seconds", 0) - was.get("seconds", 0)) / n,
                             "prefill_tokens_mean": (now.get("prefill_tokens", 0) - was.get("prefill_tokens", 0)) / n}
    steps = sum(v["steps"] for v in by_kind.values())
    return {"steps": steps, "steps_per_token": steps / tokens, "by_kind": by_kind}


MEMORY_HEADROOM = 600 * 2**20  # bytes the serving process may hold beyond its weights and KV memory


def memory_report(m: dict[str, float], param_bytes: int | None) -> dict:
    """The serving process's memory from one /metrics scrape, checked against weights + KV + 600 MiB.

    On CPU the check is on peak resident memory; on CUDA on the peak of GPU memory allocated (the
    weights and the KV cache live there; host memory then holds the CUDA runtime instead)."""
    mem = {
        "peak_resident_bytes": m["lmserve_process_peak_resident_memory_bytes"],
        "resident_bytes": m["process_resident_memory_bytes"],
        "weights_held_bytes": m["lmserve_model_weights_bytes"],  # prepacked copies included
        "parameter_bytes": param_bytes,
        "kv_cache_budget_bytes": m["lmserve_kv_cache_bytes"],
        "checked": "peak_resident_bytes",
    }
    if "lmserve_cuda_memory_peak_allocated_bytes" in m:
        mem.update(cuda_allocated_bytes=m["lmserve_cuda_memory_allocated_bytes"],
                   cuda_reserved_bytes=m["lmserve_cuda_memory_reserved_bytes"],
                   cuda_peak_allocated_bytes=m["lmserve_cuda_memory_peak_allocated_bytes"],
                   checked="cuda_peak_allocated_bytes")
    # the allowance counts the checkpoint's parameters, not the extra prepacked LM head copy
    weights = param_bytes if param_bytes is not None else mem["weights_held_bytes"]
    mem["allowance_bytes"] = weights + mem["kv_cache_budget_bytes"] + MEMORY_HEADROOM
    mem["within_allowance"] = mem[mem["checked"]] <= mem["allowance_bytes"]
    return mem


def markdown_summary(report: dict) -> str:
    """The README's benchmark table and memory line, from a report written by this module."""
    eng, hf = measured(report.get("engine")), measured(report.get("transformers"))
    grpc = measured(report.get("grpc", {}).get("rows"))
    bounds = report.get("matmul_bounds", {}).get("by_concurrency", {})
    dash = "–"

    def tps(row):
        return f"{row['output_tokens_per_s']:.1f}" if row else dash

    lines = ["| concurrency | engine tok/s | transformers tok/s | engine / transformers | matmul-only bound tok/s "
             "| bound / transformers | gRPC tok/s | gRPC / engine | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c in report["concurrency"]:
        e, h, g, b = eng.get(c), hf.get(c), grpc.get(c), bounds.get(str(c))
        bound = b["output_tokens_per_s_bound"] if b else None
        cells = [str(c), tps(e), tps(h),
                 f"{e['output_tokens_per_s'] / h['output_tokens_per_s']:.2f}x" if e and h else dash,
                 f"{bound:.1f}" if bound else dash,
                 f"{bound / h['output_tokens_per_s']:.2f}x" if bound and h else dash,
                 tps(g), f"{g['output_tokens_per_s'] / e['output_tokens_per_s']:.2f}" if g and e else dash,
                 f"{g['ttft_p50_ms'] / 1e3:.1f} / {g['ttft_p99_ms'] / 1e3:.1f}" if g else dash,
                 f"{g['itl_p50_ms']:.0f} / {g['itl_p99_ms']:.0f}" if g else dash]
        lines.append("| " + " | ".join(cells) + " |")
    other = report.get("engine_other_loop")
    if other and eng:
        names = ("sequential", "overlapped") if other["overlap_steps"] else ("overlapped", "sequential")
        pairs = ", ".join(f"c={r['concurrency']}: {eng[r['concurrency']]['output_tokens_per_s']:.1f} / "
                          f"{r['output_tokens_per_s']:.1f}" for r in measured(other["rows"]).values()
                          if r["concurrency"] in eng)
        lines += ["", f"Engine steps {names[0]} (the default here) / {names[1]}, tok/s: {pairs}."]
    mem = report.get("grpc", {}).get("memory")
    if mem:
        gib = 2**30
        weights = mem["allowance_bytes"] - mem["kv_cache_budget_bytes"] - MEMORY_HEADROOM
        lines.append("")
        checked = mem.get("checked", "peak_resident_bytes")
        what = "peak GPU memory allocated" if checked == "cuda_peak_allocated_bytes" else "peak resident"
        host = (f" (host peak resident {mem['peak_resident_bytes'] / gib:.2f} GiB)"
                if checked != "peak_resident_bytes" else "")
        lines.append(
            f"Memory at concurrency {max(report['concurrency'])}: "
            f"{what} {mem[checked] / gib:.2f} GiB{host}; "
            f"allowance = parameters {weights / gib:.2f} GiB + KV memory {mem['kv_cache_budget_bytes'] / gib:.2f} GiB "
            f"+ 600 MiB = {mem['allowance_bytes'] / gib:.2f} GiB ({'within' if mem['within_allowance'] else 'OVER'}); "
            f"weights held {mem['weights_held_bytes'] / gib:.2f} GiB (with the prepacked LM head copy). "
            f"Start to ready with the model pulled: {report['grpc']['start_to_ready_seconds']:.1f} s.")
    return "\n".join(lines)


def step_summary(report: dict) -> str:
    """The in-process waves' steps beside the served edges' rates, and the weight-stream bound at c=1."""
    eng = {c: r for c, r in measured(report.get("engine")).items() if "steps" in r}  # older reports: no steps
    http = measured(report.get("http", {}).get("rows"))
    grpc = measured(report.get("grpc", {}).get("rows"))
    if not eng:
        return ""
    dash = "–"
    lines = ["| concurrency | engine tok/s | gRPC tok/s | HTTP tok/s | steps / token | all decoding from step "
             "| decode steps x ms | mixed steps x ms (prompt tokens) | prefill steps x ms | KV pages held (max) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c in report["concurrency"]:
        e = eng.get(c)
        if e is None:
            continue
        st = e["steps"]
        k = st["by_kind"]

        def kind(name, tokens=False):
            v = k.get(name)
            return (f"{v['steps']} x {v['ms_mean']:.2f}" + (f" ({v['prefill_tokens_mean']:.0f})" if tokens else "")
                    if v else dash)

        cells = [str(c), f"{e['output_tokens_per_s']:.1f}",
                 f"{grpc[c]['output_tokens_per_s']:.1f}" if c in grpc else dash,
                 f"{http[c]['output_tokens_per_s']:.1f}" if c in http else dash,
                 f"{st['steps_per_token']:.3f}", str(st["all_decoding_from_step"] or dash),
                 kind("decode"), kind("mixed", True), kind("prefill"), str(st["kv_pages_held_max"])]
        lines.append("| " + " | ".join(cells) + " |")
    ws = report.get("weight_stream")
    if ws:
        parts = [f"{name} {b['gb_per_s']:.0f} GB/s: {b['bound_tok_s_c1']:.0f} tok/s"
                 + (f" (decode at c=1 reached {b['decode_c1_share_of_bound']:.0%})" if b.get("decode_c1_share_of_bound")
                    else "") for name, b in ws.items()]
        lines += ["", f"Weight-stream bound of a batch-1 step ({next(iter(ws.values()))['step_mb']:.0f} MB): "
                  + "; ".join(parts) + "."]
    return "\n".join(lines)


def precision_summary(report: dict) -> str:
    """The README's kernel-bound and quality tables, from a report written by this module."""
    lines = []
    kb = report.get("kernel_bounds")
    if kb:
        rows = list(next(iter(kb["by_kernel"].values()))["decode_step_ms"])
        lines += ["| mode / kernels | " + " | ".join(f"matmul-only step M={r} (ms)" for r in rows)
                  + " | prefill chunk (prompt tok/s) |", "| --- |" + " ---: |" * (len(rows) + 1)]
        for name, v in kb["by_kernel"].items():
            cells = [f"**{v['decode_step_ms'][r]:.2f}**" if kb["fastest"][r] == name else f"{v['decode_step_ms'][r]:.2f}"
                     for r in rows]
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {1e3 / v['prefill_ms_per_token']:.0f} |")
        lines.append("")
    q = report.get("quality")
    if q:
        lines += ["| mode | perplexity (transformers fp32) | mean KL vs transformers fp32 | top-1 agreement | within bounds |",
                  "| --- | ---: | ---: | ---: | --- |"]
        for mode, v in q.items():
            if mode == "bounds":
                continue
            if "refused" in v:
                lines.append(f"| {mode} | refused: {v['refused']} | | | no |")
                continue
            lines.append(f"| {mode} | {v['perplexity']:.3f} ({v['reference_perplexity']:.3f}) | {v['mean_kl']:.5f} "
                         f"| {v['top1_agreement']:.3f} | {'yes' if v['within_bounds'] else 'no'} |")
    return "\n".join(lines)


def measured(rows) -> dict[int, dict]:
    """A section's rows that measured a rate (not skipped), by concurrency."""
    return {r["concurrency"]: r for r in rows or [] if "output_tokens_per_s" in r} if isinstance(rows, list) else {}


def _section(report: dict, name: str, what):
    """report[name] = what(), or {"failed": ...} if it raised: the other sections still run and the report
    is still written (a GPU host lent for minutes gets one try)."""
    import traceback

    try:
        report[name] = what()
    except Exception as exc:  # noqa: BLE001 - recorded in the report and printed, the run goes on
        traceback.print_exc()
        report[name] = {"failed": f"{type(exc).__name__}: {exc}"[:2000]}
        print(f"section {name} failed: {report[name]['failed']}", flush=True)


def succeeded(report: dict) -> bool:
    """The exit status: no section failed."""
    return not any(isinstance(v, dict) and "failed" in v for v in report.values())


def run(args) -> dict | None:
    if args.table:
        report = json.loads(Path(args.table).read_text())
        print(markdown_summary(report))
        print()
        print(step_summary(report))
        print()
        print(precision_summary(report))
        return None

    import torch

    from lmserve.model.checkpoints.catalog import resolve_model
    from lmserve.model.loader import resolve_device_dtype

    from ..engine import EngineSettings

    if args.threads:
        torch.set_num_threads(args.threads)
    deadline = Deadline(args.time_limit)
    path = resolve_model(args.model, models_dir=args.models_dir)
    device, _ = resolve_device_dtype(args.device, None)
    report = {"model": str(path), "concurrency": args.concurrency, "device": str(device),
              "threads": torch.get_num_threads(), "parameter_bytes": None,
              "cuda_graphs": device.type == "cuda" and EngineSettings().cuda_graphs}
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    edges = tuple(e for e in ("grpc", "http") if e not in args.skip)
    if edges:  # first: a server of its own, with nothing loaded in this process yet
        served_report: dict = {}
        _section(served_report, "grpc", lambda: bench_grpc(args, device, edges, deadline.share(SHARES["served"])))
        got = served_report["grpc"]
        report.update(got if "failed" not in got else {e: got for e in edges})
    if "kernels" not in args.skip and device.type == "cpu" and path.suffix == ".gguf":
        from lmserve.model.checkpoints.gguf_reader import read_gguf

        from .bounds import kernel_bounds

        ck = read_gguf(path, keep_q41=True)
        report["kernel_bounds"] = kernel_bounds(ck.config, ck.tensors, ck.q41, rows=tuple(sorted(set(args.concurrency))))
        del ck
    if "quality" not in args.skip and path.suffix == ".gguf" and device.type == "cpu":
        report["quality"] = bench_quality(path)
    if "engine" not in args.skip:
        engine: dict = {}
        _section(engine, "engine", lambda: in_process(args, path, device, deadline.share(SHARES["engine"])))
        report.update(engine["engine"] if "failed" not in engine["engine"] else engine)
    if "hf" not in args.skip:
        import importlib.util

        if importlib.util.find_spec("transformers") is None:
            report["transformers"] = {"skipped": "transformers is not installed here"}
            print("transformers  skipped: it is not installed here (no generate baseline)", flush=True)
        else:
            hf_dtype = torch.float32 if device.type == "cpu" else torch.bfloat16  # the reference's precision
            _section(report, "transformers", lambda: bench_hf(path, args.concurrency, args.max_new_tokens, device,
                                                               hf_dtype, deadline))
    report.update(ratios(report))
    print(markdown_summary(report))
    print(step_summary(report))
    print(precision_summary(report))
    return report


def in_process(args, path: Path, device, deadline: Deadline | None = None) -> dict:
    """The engine's sections: load (timed), prefill, waves in the device's default loop and in the other
    one, the matmul-only bounds of the same waves, and the weight-stream bound of a batch-1 decode step
    (the served linears' rate and memory's read rate) with the share of it the c=1 wave's decode reached."""
    from lmserve.model.loader import load_model

    from ..engine import EngineSettings
    from .bounds import matmul_bounds, read_bound, read_gb_per_s

    deadline = deadline or Deadline(None)
    t0 = time.perf_counter()
    loaded = load_model(path, dtype=args.dtype, quantization=args.quantization, device=device, compile="auto")
    out: dict = {"load_seconds": time.perf_counter() - t0}
    out["served"] = {"mode": loaded.mode, "kernels": loaded.kernels,
                     "compiled": loaded.compiled.compiled if loaded.compiled else False,
                     "compile_reason": loaded.compiled.reason if loaded.compiled else "",
                     "choice": loaded.plan.how if loaded.plan else "default"}
    print(f"served mode {loaded.mode}, kernels {loaded.kernels} ({out['served']['choice']})", flush=True)
    out["parameter_bytes"] = parameter_bytes(loaded.num_parameters, loaded.dtype)
    # the bounds first: measured before the waves, whatever the time limit leaves of them
    out["matmul_bounds"] = bounds = matmul_bounds(
        loaded.model, {c: sum(map(len, engine_wave.chat_prompts(loaded.tokenizer, c))) for c in args.concurrency},
        args.max_new_tokens, EngineSettings().token_budget, loaded.dtype, loaded.device)
    read_rate = read_gb_per_s(loaded.device)
    print(f"matmul-only bounds: weights stream at {bounds['weight_stream_gb_per_s']:.1f} GB/s (batch 1), "
          f"memory reads at {read_rate:.1f} GB/s, prefill GEMMs at {bounds['prefill_gflop_per_s']:.0f} GFLOP/s",
          flush=True)
    for c, b in bounds["by_concurrency"].items():
        print(f"bound         c={int(c):3d}: {b['output_tokens_per_s_bound']:8.1f} tok/s", flush=True)
    if "prefill" not in args.skip:
        out["prefill"] = bench_prefill(loaded)
    out["engine"] = bench_engine(loaded, args.concurrency, args.max_new_tokens, args.max_model_len,
                                 deadline=deadline.share(0.7 if "other-loop" not in args.skip else 1.0))
    if "other-loop" not in args.skip:  # the loop this device does not default to, side by side
        other = device.type != "cuda"
        out["engine_other_loop"] = {"overlap_steps": other, "rows": bench_engine(
            loaded, args.concurrency, args.max_new_tokens, args.max_model_len, overlap_steps=other, deadline=deadline)}
    c1 = measured(out["engine"]).get(1, {})
    c1_decode = 1e3 / c1["itl_p50_ms"] if c1.get("itl_p50_ms") else None
    out["weight_stream"] = {
        "linears": {"gb_per_s": bounds["weight_stream_gb_per_s"],
                    **read_bound(bounds["weight_bytes"], bounds["weight_stream_gb_per_s"],
                                 c1.get("output_tokens_per_s"), c1_decode)},
        "memory": {"gb_per_s": read_rate,
                   **read_bound(bounds["weight_bytes"], read_rate, c1.get("output_tokens_per_s"), c1_decode)}}
    for name, b in out["weight_stream"].items():
        share = b.get("decode_c1_share_of_bound")
        print(f"weight stream ({name}): {b['step_mb']:.0f} MB a step at {b['gb_per_s']:.1f} GB/s: "
              f"{b['bound_tok_s_c1']:.1f} tok/s at c=1" + (f"; decode at c=1 (1 / ITL p50) reached {share:.0%}"
                                                           if share else ""), flush=True)
    return out


def ratios(report: dict) -> dict:
    """Each section's tokens/s over another's, per concurrency, where both ran."""
    out = {}
    eng, hf = measured(report.get("engine")), measured(report.get("transformers"))
    grpc = measured(report.get("grpc", {}).get("rows"))
    http = measured(report.get("http", {}).get("rows"))
    if eng and hf:
        out["ratio_engine_over_transformers"] = {
            str(c): eng[c]["output_tokens_per_s"] / h["output_tokens_per_s"] for c, h in hf.items() if c in eng}
        by_c = report.get("matmul_bounds", {}).get("by_concurrency", {})
        out["ratio_bound_over_transformers"] = {
            str(c): by_c[str(c)]["output_tokens_per_s_bound"] / h["output_tokens_per_s"]
            for c, h in hf.items() if str(c) in by_c}
    if grpc:
        kb = report.get("kernel_bounds", {}).get("bound_tokens_per_s", {})
        if kb:
            out["ratio_grpc_over_kernel_bound"] = {
                str(c): g["output_tokens_per_s"] / kb[str(c)] for c, g in grpc.items() if str(c) in kb}
            print("gRPC / matmul-only bound of the fastest kernel: " + ", ".join(
                f"c={c}: {r:.0%}" for c, r in out["ratio_grpc_over_kernel_bound"].items()), flush=True)
        if eng:
            out["ratio_grpc_over_engine"] = {
                str(c): g["output_tokens_per_s"] / eng[c]["output_tokens_per_s"] for c, g in grpc.items() if c in eng}
    if http and eng:
        out["ratio_http_over_engine"] = {
            str(c): h["output_tokens_per_s"] / eng[c]["output_tokens_per_s"] for c, h in http.items() if c in eng}
    return out
