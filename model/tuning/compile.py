"""A compiled decode step on CPU: torch.compile (inductor, C++ codegen) of the work between attentions.

Each decoder layer runs `enter` (RMSNorm, q|k|v projection, RoPE) and `exit` (o_proj, residual,
RMSNorm, SwiGLU MLP, residual) around its attention (llama.DecoderLayer). Those two functions
are compiled; the KV-cache write and SDPA stay eager. Compiling the whole step, cache write
included, was measured on the AMX Xeon to copy the whole stacked [layers, ...] cache at every
layer (the write goes through a view of one big buffer), so the cache never enters a graph.

The weight-only int8/int4 multiplies reach the compiler as opaque custom ops (kernels.py), so
they run as measured at load; oneDNN's prepacked weights are opaque tensors the compiler cannot
take, so a plan using them stays eager. Compiled code is cached on disk under
`<cache_dir>/inductor` (inductor's FX graph and AOT caches): the first start pays the compile,
a restart reuses it. `auto` times the compiled layers against eager ones, taking turns, and keeps
the faster; that decision is cached per (machine, model, mode, kernels) like the kernel choice.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ModelLoadError
from ..llama import DecoderLayer, LlamaForCausalLM
from ..cache_dir import write_cached


@dataclass
class CompileResult:
    compiled: bool
    reason: str  # why it is (or is not) compiled
    seconds: float = 0.0  # compile + warm-up time at this start
    timings: dict | None = None  # eager vs compiled ms of the layers' non-attention work, when measured


class CompileRefused(ModelLoadError):
    pass


def blocked_by(model: LlamaForCausalLM, device: torch.device) -> str | None:
    """Why this model cannot be compiled here, or None."""
    if device.type != "cpu":
        return "the compiled step is built for CPU (CUDA replays graphs: --cuda-graphs)"
    kinds = {getattr(m, "kernel", None) for m in model.modules()}
    if any(k and k.startswith("onednn") for k in kinds):
        return "oneDNN's prepacked weights are opaque to the compiler"
    return None


def _install(model: LlamaForCausalLM, enter, exit_) -> None:
    for layer in model.model.layers:
        layer.enter = functools.partial(enter, layer)
        layer.exit = functools.partial(exit_, layer)


def uninstall(model: LlamaForCausalLM) -> None:
    for layer in model.model.layers:
        layer.__dict__.pop("enter", None)
        layer.__dict__.pop("exit", None)


@torch.inference_mode()
def _warm(model: LlamaForCausalLM, dtype: torch.dtype) -> None:
    """Trigger compilation for the shapes serving meets: one decode row, many, and a prompt row
    (dynamo specializes sizes 0 and 1, so each gets its own graph)."""
    D = model.config.hidden_size
    rot = model.model.rotary
    layer = model.model.layers[0]
    for B, L in ((1, 1), (3, 1), (1, 7), (2, 5)):
        x = torch.randn(B, L, D).to(dtype)
        cos, sin = rot.tables(torch.arange(L).expand(B, L))
        q, _, _ = layer.enter(x, cos, sin)
        layer.exit(x, q.reshape(B, L, -1))


@torch.inference_mode()
def _time_layers(model: LlamaForCausalLM, dtype: torch.dtype, variants: dict, rows=(1, 32), repeats: int = 5) -> dict:
    """ms per pass of every layer's enter + exit (attention excluded), variants taking turns; fastest pass kept."""
    D = model.config.hidden_size
    rot = model.model.rotary
    layers = list(model.model.layers)
    best = {name: {b: float("inf") for b in rows} for name in variants}
    inputs = {}
    for b in rows:
        x = torch.randn(b, 1, D).to(dtype)
        inputs[b] = (x, *rot.tables(torch.full((b, 1), 17)))
    for _ in range(repeats):
        for name, (enter, exit_) in variants.items():
            for b in rows:
                x, cos, sin = inputs[b]
                t0 = time.perf_counter()
                for layer in layers:
                    q, _, _ = enter(layer, x, cos, sin)
                    x2 = exit_(layer, x, q.reshape(b, 1, -1))
                best[name][b] = min(best[name][b], time.perf_counter() - t0)
                del x2
    return {name: {b: round(t * 1e3, 3) for b, t in v.items()} for name, v in best.items()}


def compile_model(model: LlamaForCausalLM, dtype: torch.dtype, device: torch.device, mode: str,
                  cache_dir: Path | None, key: str) -> CompileResult:
    """mode: "true", "false" or "auto". Installs the compiled functions on the layers when chosen."""
    if mode == "false":
        return CompileResult(False, "--compile false")
    if mode == "auto" and model.native_step is not None:
        return CompileResult(False, "steps run in one native call (native/step.py)")
    reason = blocked_by(model, device)
    if reason is not None:
        if mode == "true":
            raise CompileRefused(f"--compile true: {reason}; pick other kernels or --compile false")
        return CompileResult(False, reason)
    decision_file = None
    if cache_dir is not None:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(cache_dir) / "inductor"))
        decision_file = Path(cache_dir) / "compile" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"
        if mode == "auto" and decision_file.is_file():
            try:
                saved = json.loads(decision_file.read_text())
            except ValueError:
                saved = {"compiled": True}  # unreadable: compile, and measure again below
            if not saved.get("compiled", True):
                return CompileResult(False, "measured slower than eager here (cached)", 0.0, saved.get("timings"))
    enter = torch.compile(DecoderLayer.enter, dynamic=True)
    exit_ = torch.compile(DecoderLayer.exit, dynamic=True)
    t0 = time.perf_counter()
    _install(model, enter, exit_)
    try:
        _warm(model, dtype)
    except Exception as exc:  # noqa: BLE001 - the compiler failed (no C++ compiler, unsupported op)
        uninstall(model)
        if mode == "true":
            raise CompileRefused(f"--compile true: compiling the decoder layers failed: {exc}") from exc
        return CompileResult(False, f"compile failed: {type(exc).__name__}: {str(exc)[:200]}")
    seconds = time.perf_counter() - t0
    if mode == "true" or (decision_file is not None and decision_file.is_file()):
        return CompileResult(True, "--compile true" if mode == "true" else "measured faster than eager here (cached)",
                             seconds)
    timings = _time_layers(model, dtype, {"eager": (DecoderLayer.enter, DecoderLayer.exit),
                                          "compiled": (enter, exit_)})
    faster = sum(timings["compiled"][b] / timings["eager"][b] for b in timings["eager"]) < len(timings["eager"])
    if not faster:
        uninstall(model)
    if decision_file is not None:
        write_cached(decision_file, {"compiled": faster, "timings": timings}, "compile decision")
    return CompileResult(faster, f"measured {'faster' if faster else 'slower'} than eager here", seconds, timings)


__all__ = ["CompileResult", "CompileRefused", "compile_model", "blocked_by", "uninstall"]
