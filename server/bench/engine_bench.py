"""Throughput benchmark: the offline engine, Hugging Face `generate`, and the gRPC server, side by side.

    lmserve bench engine [--concurrency 1 8 32 64] [--device cuda]

Every section decodes the same chat prompts for the same number of tokens (EOS ignored), so
output tokens/s compare directly. A table is printed; `--table REPORT` prints an old report's. This
is a benchmark, not a test: run it on a quiet machine.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from lmserve.client.bench.harness import MODEL

from . import engine_wave, served

FLAGS = {**MODEL, "threads": None, "concurrency": [1, 8, 32, 64], "max_new_tokens": 128,
         "skip": ("engine", "other-loop", "hf", "grpc", "kernels", "quality", "prefill")}


def add_arguments(p) -> None:
    p.add_argument("--max-model-len", type=int, default=1024, help="context per request (sizes the KV cache)")
    p.add_argument("--table", metavar="REPORT", help="print the markdown summary of an existing report and exit")


def chat_messages(n: int) -> list[list[dict]]:
    from lmserve.client.bench.prompts import synthetic_workload

    items = synthetic_workload()
    return [[{"role": m.role, "content": m.content} for m in items[i % len(items)].prompt] for i in range(n)]


def bench_engine(loaded, concurrencies, max_new, max_model_len, overlap_steps: bool | None = None) -> list[dict]:
    """Waves of c requests through the engine's async API; `overlap_steps` None: the device's default loop."""
    from ..engine import Engine, EngineSettings

    tok = loaded.tokenizer
    # no prefix cache: every wave sends the same prompts, and transformers gets no such reuse either
    engine = Engine(loaded, EngineSettings(max_batch=max(concurrencies), max_model_len=max_model_len,
                                           prefix_cache=False, overlap_steps=overlap_steps)).start()
    label = "engine" if overlap_steps is None else ("overlapped" if overlap_steps else "sequential")

    def wave(c: int, n_tokens: int) -> float:
        w = engine_wave.greedy(engine, engine_wave.chat_prompts(tok, c), n_tokens)
        assert all(len(s.token_ids) == n_tokens for s in w.streams), [len(s.token_ids) for s in w.streams]
        return w.seconds

    rows = []
    try:
        wave(2, 8)  # warm-up
        for c in concurrencies:
            dt = wave(c, max_new)
            rows.append({"concurrency": c, "seconds": dt, "output_tokens_per_s": c * max_new / dt})
            print(f"{label:13s} c={c:3d}: {c * max_new / dt:8.1f} tok/s ({dt:.1f} s)", flush=True)
    finally:
        engine.shutdown()
    return rows


def bench_hf(gguf_path: Path, concurrencies, max_new, device, dtype) -> list[dict]:
    """transformers `generate` on the same prompts: a batch of c, left-padded, SDPA attention."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    d, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=dtype, attn_implementation="sdpa")
    model = model.to(device).eval()
    rows = []
    for c in concurrencies:
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


def bench_grpc(args, device) -> dict:
    """Start `lmserve serve`, time it to SERVING, drive each concurrency through gRPC, read memory.
    Runs before anything is loaded in this process, whose threads and memory would otherwise share
    the machine with the server."""
    from lmserve.client import Client
    from lmserve.client.bench.load import wave

    flags = ["--model", args.model, "--max-batch", str(max(args.concurrency)), "--max-model-len",
             str(args.max_model_len), "--prefix-cache", "false", "--device", str(device), "--dtype", args.dtype,
             "--quantization", args.quantization, *(["--models-dir", args.models_dir] if args.models_dir else []),
             *(["--threads", str(args.threads)] if args.threads else [])]
    result: dict = {"rows": []}
    with served.lmserve(flags, http=False, metrics=True) as server:
        with Client(server.grpc_target) as client:
            info = client.model_info()
        result["start_to_ready_seconds"] = server.ready_seconds
        result["served"] = {"dtype": info.dtype, "quantization": info.quantization, "kernels": info.kernels}
        param_bytes = parameter_bytes(info.num_parameters, info.dtype)
        print(f"server ready in {result['start_to_ready_seconds']:.1f} s", flush=True)
        wave(server.grpc_target, 2, 2, 8)  # warm-up
        for c in args.concurrency:
            run, agg = wave(server.grpc_target, c, c, args.max_new_tokens)
            row = {"concurrency": c, "seconds": run.duration, "output_tokens_per_s": agg.output_token_throughput,
                   "failed": agg.failed,
                   "ttft_p50_ms": agg.ttft.p50 * 1e3, "ttft_p99_ms": agg.ttft.p99 * 1e3,
                   "itl_p50_ms": agg.itl.p50 * 1e3, "itl_p99_ms": agg.itl.p99 * 1e3}
            result["rows"].append(row)
            print(f"grpc          c={c:3d}: {row['output_tokens_per_s']:8.1f} tok/s  ttft p50 {row['ttft_p50_ms']:.0f} ms"
                  f"  itl p50 {row['itl_p50_ms']:.0f} ms", flush=True)
        result["memory"] = memory_report(server.metrics(), param_bytes)
    return result


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
    eng = {r["concurrency"]: r for r in report.get("engine", [])}
    hf = {r["concurrency"]: r for r in report.get("transformers", [])}
    grpc = {r["concurrency"]: r for r in report.get("grpc", {}).get("rows", [])}
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
                          f"{r['output_tokens_per_s']:.1f}" for r in other["rows"] if r["concurrency"] in eng)
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


def run(args) -> dict | None:
    if args.table:
        report = json.loads(Path(args.table).read_text())
        print(markdown_summary(report))
        print()
        print(precision_summary(report))
        return None

    import torch

    from lmserve.model.checkpoints.catalog import resolve_model
    from lmserve.model.loader import resolve_device_dtype

    from ..engine import EngineSettings

    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model(args.model, models_dir=args.models_dir)
    device, _ = resolve_device_dtype(args.device, None)
    report = {"model": str(path), "concurrency": args.concurrency, "device": str(device),
              "threads": torch.get_num_threads(), "parameter_bytes": None,
              "cuda_graphs": device.type == "cuda" and EngineSettings().cuda_graphs}
    if "grpc" not in args.skip:  # first: a server of its own, with nothing loaded in this process yet
        report["grpc"] = bench_grpc(args, device)
    if "kernels" not in args.skip and device.type == "cpu" and path.suffix == ".gguf":
        from lmserve.model.checkpoints.gguf_reader import read_gguf

        from .bounds import kernel_bounds

        ck = read_gguf(path, keep_q41=True)
        report["kernel_bounds"] = kernel_bounds(ck.config, ck.tensors, ck.q41, rows=tuple(sorted(set(args.concurrency))))
        del ck
    if "quality" not in args.skip and path.suffix == ".gguf" and device.type == "cpu":
        report["quality"] = bench_quality(path)
    if "engine" not in args.skip:
        report.update(in_process(args, path, device))
    if "hf" not in args.skip and path.suffix == ".gguf":
        hf_dtype = torch.float32 if device.type == "cpu" else torch.bfloat16  # the reference's precision
        report["transformers"] = bench_hf(path, args.concurrency, args.max_new_tokens, device, hf_dtype)
    report.update(ratios(report))
    print(markdown_summary(report))
    print(precision_summary(report))
    return report


def in_process(args, path: Path, device) -> dict:
    """The engine's sections: load (timed), prefill, waves in the device's default loop and in the other
    one, and the matmul-only bounds of the same waves."""
    from lmserve.model.loader import load_model

    from ..engine import EngineSettings
    from .bounds import matmul_bounds

    t0 = time.perf_counter()
    loaded = load_model(path, dtype=args.dtype, quantization=args.quantization, device=device, compile="auto")
    out: dict = {"load_seconds": time.perf_counter() - t0}
    out["served"] = {"mode": loaded.mode, "kernels": loaded.kernels,
                     "compiled": loaded.compiled.compiled if loaded.compiled else False,
                     "compile_reason": loaded.compiled.reason if loaded.compiled else "",
                     "choice": loaded.plan.how if loaded.plan else "default"}
    print(f"served mode {loaded.mode}, kernels {loaded.kernels} ({out['served']['choice']})", flush=True)
    out["parameter_bytes"] = parameter_bytes(loaded.num_parameters, loaded.dtype)
    if "prefill" not in args.skip:
        out["prefill"] = bench_prefill(loaded)
    out["engine"] = bench_engine(loaded, args.concurrency, args.max_new_tokens, args.max_model_len)
    if "other-loop" not in args.skip:  # the loop this device does not default to, side by side
        other = device.type != "cuda"
        out["engine_other_loop"] = {"overlap_steps": other, "rows": bench_engine(
            loaded, args.concurrency, args.max_new_tokens, args.max_model_len, overlap_steps=other)}
    out["matmul_bounds"] = bounds = matmul_bounds(
        loaded.model, {c: sum(map(len, engine_wave.chat_prompts(loaded.tokenizer, c))) for c in args.concurrency},
        args.max_new_tokens, EngineSettings().token_budget, loaded.dtype, loaded.device)
    print(f"matmul-only bounds: weights stream at {bounds['weight_stream_gb_per_s']:.1f} GB/s (batch 1), "
          f"prefill GEMMs at {bounds['prefill_gflop_per_s']:.0f} GFLOP/s", flush=True)
    for c, b in bounds["by_concurrency"].items():
        print(f"bound         c={int(c):3d}: {b['output_tokens_per_s_bound']:8.1f} tok/s", flush=True)
    return out


def ratios(report: dict) -> dict:
    """Each section's tokens/s over another's, per concurrency, where both ran."""
    out = {}
    if "engine" in report and "transformers" in report:
        out["ratio_engine_over_transformers"] = {
            str(e["concurrency"]): e["output_tokens_per_s"] / h["output_tokens_per_s"]
            for e, h in zip(report["engine"], report["transformers"])}
        out["ratio_bound_over_transformers"] = {
            str(h["concurrency"]): report["matmul_bounds"]["by_concurrency"][str(h["concurrency"])][
                "output_tokens_per_s_bound"] / h["output_tokens_per_s"] for h in report["transformers"]}
    if "grpc" in report:
        kb = report.get("kernel_bounds", {}).get("bound_tokens_per_s", {})
        if kb:
            out["ratio_grpc_over_kernel_bound"] = {
                str(g["concurrency"]): g["output_tokens_per_s"] / kb[str(g["concurrency"])]
                for g in report["grpc"]["rows"] if str(g["concurrency"]) in kb}
            print("gRPC / matmul-only bound of the fastest kernel: " + ", ".join(
                f"c={c}: {r:.0%}" for c, r in out["ratio_grpc_over_kernel_bound"].items()), flush=True)
        if "engine" in report:
            out["ratio_grpc_over_engine"] = {
                str(e["concurrency"]): g["output_tokens_per_s"] / e["output_tokens_per_s"]
                for e, g in zip(report["engine"], report["grpc"]["rows"])}
    return out
