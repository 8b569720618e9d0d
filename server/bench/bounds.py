"""Upper bounds on throughput from the model's matrix multiplies alone, measured on this machine.

A wave of `c` requests must at least run every linear layer over every prompt token (prefill,
in steps of `token_budget` rows) and then once per generated token (decode, `c` rows per step,
LM head included). Timing exactly those multiplies with the served model's own kernels, and
charging nothing for attention, sampling, scheduling or Python, gives the best tokens/s any
engine built on these kernels could reach here. The benchmark reports it next to the measured
numbers so a target can be checked against what the hardware allows.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import torch
from torch import nn

from lmserve.model.llama import LlamaForCausalLM


def _linears(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if hasattr(m, "in_features") and hasattr(m, "out_features")]


def layer_flops_per_token(model: LlamaForCausalLM) -> int:
    """Multiply-add FLOPs of the decoder layers' linears for one token (LM head excluded)."""
    return 2 * sum(m.in_features * m.out_features for m in _linears(model.model.layers))


@torch.inference_mode()
def time_linears(layers: list[nn.Module], rows: int, dtype: torch.dtype, device: torch.device,
                 repeats: int = 5) -> float:
    """Fastest of `repeats` passes of `rows` input rows through every layer in `layers`, in seconds.

    The minimum, not the median: a bound is what the kernels can do, and on a shared machine
    a slower pass measures the neighbours."""
    inputs = {n: torch.randn(rows, n, dtype=dtype, device=device) for n in {m.in_features for m in layers}}

    def one_pass() -> float:
        t0 = time.perf_counter()
        for m in layers:
            m(inputs[m.in_features])
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    one_pass()  # warm-up (prepacking caches, allocator)
    return min(one_pass() for _ in range(repeats))


def matmul_bounds(model: LlamaForCausalLM, prompt_tokens: dict[int, int], max_new: int, token_budget: int,
                  dtype: torch.dtype, device: torch.device) -> dict:
    """For each concurrency c (prompt_tokens[c] = total prompt tokens of its wave): the matmul-only
    time of the wave and the tokens/s bound it implies, plus the machine rates behind them."""
    body = _linears(model.model.layers)
    head = [model.lm_head]
    weight_bytes = sum(m.in_features * m.out_features for m in body + head) * torch.finfo(dtype).bits // 8
    chunk = token_budget
    prefill_per_token = time_linears(body, chunk, dtype, device) / chunk
    flops_per_token = layer_flops_per_token(model)
    single = time_linears(body + head, 1, dtype, device)
    out: dict = {"weight_bytes": weight_bytes, "weight_stream_gb_per_s": weight_bytes / single / 1e9,
                 "prefill_gflop_per_s": flops_per_token / prefill_per_token / 1e9, "by_concurrency": {}}
    for c, prompt in prompt_tokens.items():
        step = time_linears(body, c, dtype, device) + time_linears(head, c, dtype, device)
        seconds = prompt * prefill_per_token + (max_new - 1) * step
        out["by_concurrency"][str(c)] = {"prompt_tokens": prompt, "decode_step_matmul_seconds": step,
                                         "wave_matmul_seconds": seconds,
                                         "output_tokens_per_s_bound": c * max_new / seconds}
    return out


@torch.inference_mode()
def read_gb_per_s(device: torch.device, nbytes: int | None = None, repeats: int = 5) -> float:
    """The rate a reduction reads a buffer of `nbytes` (default: 2 GiB on an accelerator, many times its
    cache; 256 MiB on a CPU) on `device`, in GB/s: the fastest of `repeats` after a warm-up. What a step
    that streams the weights once can reach at most, measured beside the run it bounds."""
    nbytes = nbytes or (2 << 30 if device.type != "cpu" else 256 << 20)
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)

    def once() -> float:
        t0 = time.perf_counter()
        x.sum()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    once()
    best = min(once() for _ in range(repeats))
    del x
    if device.type == "cuda":
        torch.cuda.empty_cache()  # an engine started next sizes its KV memory from what is free
    return nbytes / best / 1e9


def _all_linears(model: LlamaForCausalLM) -> list[nn.Module]:
    return _linears(model.model.layers) + [model.lm_head]


@torch.inference_mode()
def kernel_bounds(cfg, tensors: dict, q41: dict, rows=(1, 32), prefill_rows: int = 512, repeats: int = 3) -> dict:
    """The matmul-only decode step (every decoder linear + LM head) of each (mode, kernel) this CPU
    offers, at each batch size in `rows`, and the per-token cost of a prefill chunk; one model at a
    time, built from the checkpoint's float32 tensors (and Q4_1 blocks). Quality is not a concern
    here: precision.py and the quality report say which of these modes may be served."""
    from lmserve.model.linear import kernels as K
    from lmserve.model.loader import build_model
    from lmserve.model.tuning.precision import Mode, Plan

    modes = [Mode(torch.float32), Mode(torch.bfloat16), Mode(torch.bfloat16, "int8"), Mode(torch.bfloat16, "int4")]
    out: dict = {}
    for mode in modes:
        kernels = K.candidates(mode.quantization, mode.dtype, "qkv", torch.device("cpu"))
        for kernel in kernels:
            plan = Plan(mode, {r: K.candidates(mode.quantization, mode.dtype, r, torch.device("cpu"))[0]
                               if r == "head" and mode.quantization != "none" else kernel for r in K.ROLES})
            model = build_model(cfg, tensors, mode.dtype, "cpu", plan=plan, q41=q41)
            layers = _all_linears(model)
            times = K.time_candidates({"m": layers}, (*rows, prefill_rows), mode.dtype, repeats)["m"]
            name = f"{mode.name}/{plan.describe()}"
            out[name] = {"decode_step_ms": {str(r): times[r] * 1e3 for r in rows},
                         "prefill_ms_per_token": times[prefill_rows] * 1e3 / prefill_rows}
            print(f"matmul-only {name:48s} " + "  ".join(f"M={r}: {times[r] * 1e3:7.2f} ms" for r in rows)
                  + f"  prefill {prefill_rows / times[prefill_rows]:7.0f} tok/s", flush=True)
            del model, layers
    best = {str(r): min(out, key=lambda k: out[k]["decode_step_ms"][str(r)]) for r in rows}
    return {"by_kernel": out, "fastest": best,
            "bound_tokens_per_s": {str(r): r / (out[best[str(r)]]["decode_step_ms"][str(r)] / 1e3) for r in rows}}


# ---------------------------------------------------------------- the read-bandwidth bound of a batch-1 step

EMBEDDINGS = {"token_embd.weight": "output.weight", "model.embed_tokens.weight": "lm_head.weight"}  # table: head


def tensor_bytes(path: Path) -> dict[str, int]:
    """Bytes of each tensor of a checkpoint as stored: a GGUF file's blocks, or the tensors of a safetensors
    file or of every one in a Hugging Face directory (read from their headers)."""
    path = Path(path)
    if path.suffix == ".gguf":
        import gguf

        return {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
    out = {}
    for file in sorted(path.glob("*.safetensors")) if path.is_dir() else [path]:
        with open(file, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        out |= {name: end - start for name, t in header.items() if name != "__metadata__"
                for start, end in [t["data_offsets"]]}
    return out


def step_read_bytes(tensors: dict[str, int]) -> int:
    """Bytes a batch-1 decode step reads of these tensors: all of them, but an embedding table only when it
    is also the LM head (tied); an untied table is only gathered from, a row a token."""
    return sum(n for name, n in tensors.items() if not (name in EMBEDDINGS and EMBEDDINGS[name] in tensors))


def read_bound(step_bytes: int, gb_s: float, c1_tok_s: float | None = None, c1_decode_tok_s: float | None = None) -> dict:
    """A batch-1 step reading `step_bytes` at `gb_s`: the least time a token takes and the most tokens a
    second, and the share of that bound a measured single stream reached: its chat rate `c1_tok_s` (the
    prompt's prefill counted in) and its decode rate `c1_decode_tok_s` (once the prompt is read: the steps
    the bound is about)."""
    bound = gb_s * 1e9 / step_bytes
    out = {"step_mb": round(step_bytes / 1e6, 1), "bound_ms_per_token": round(1e3 / bound, 3),
           "bound_tok_s_c1": round(bound, 1)}
    if c1_tok_s:
        out["chat_c1_share_of_bound"] = round(c1_tok_s / bound, 3)
    if c1_decode_tok_s:
        out["decode_c1_share_of_bound"] = round(c1_decode_tok_s / bound, 3)
    return out


# ---------------------------------------------------------------- the product bound of a wave

def distinct_prefix_tokens(prompts: list[list[int]]) -> int:
    """Prompt tokens an engine must run at the least: each distinct prefix once (the nodes of the prompts'
    token trie), as a prefix cache at its best would; the prompts' shared system text counts once."""
    seen: set[tuple[int, ...]] = set()
    for p in prompts:
        seen.update(tuple(p[:i]) for i in range(1, len(p) + 1))
    return len(seen)


def product_bound(prompts: list[list[int]], max_new: int, linears: list[tuple[int, int]], head: tuple[int, int],
                  products_g_per_s: float, measured_tok_s: dict[str, float | None] | None = None) -> dict:
    """The most output tokens a second any engine reaches on a wave of `prompts` (`max_new` tokens each)
    when every weight meets every token it serves in one int8 product at the machine's measured peak
    (`products_g_per_s`: vpdpbusd or its kin, independent chains, all threads), charging nothing else:
    the decoder's `linears` ((out, in) per layer, all layers) over each distinct prompt prefix once, the
    LM head once per request after its prompt, then `linears` and `head` for every later token. With
    `measured_tok_s` (name: output tokens/s of that wave), the share of the bound each reached."""
    layer, head_products = sum(n * k for n, k in linears), head[0] * head[1]
    out_tokens = len(prompts) * max_new
    prefill = distinct_prefix_tokens(prompts)
    products = prefill * layer + len(prompts) * (head_products + (max_new - 1) * (layer + head_products))
    seconds = products / (products_g_per_s * 1e9)
    out = {"requests": len(prompts), "prompt_tokens": sum(map(len, prompts)), "distinct_prefix_tokens": prefill,
           "output_tokens": out_tokens, "g_products": round(products / 1e9, 1), "products_g_per_s": products_g_per_s,
           "least_seconds": round(seconds, 2), "bound_tok_s": round(out_tokens / seconds, 1)}
    for name, rate in (measured_tok_s or {}).items():
        if rate:
            out[f"{name}_share_of_bound"] = round(rate * seconds / out_tokens, 3)
    return out
