"""Precision modes and the per-machine choice of mode and kernels, measured at load and cached on disk.

A mode is (compute dtype, weight quantization): float32, bfloat16, float16, bfloat16+int8,
bfloat16+int4, and on a GGUF file of K-quants bfloat16+kquant (its own blocks served as they are, each
tensor in its own type: Q4_K/Q5_K/Q6_K, and the Q8_0/Q5_0/Q4_0/Q4_1 of rows that are not a multiple of
256; their Q5_1 rounded to Q8_0). `--dtype auto` / `--quantization auto` leave it to measurement: every candidate
mode's linear layers are timed on the model's real weights at the decode batch buckets, each
kernel is checked for batch invariance (kernels.py), and the fastest mode whose quality on the
held-out text stays within quality.py's bounds (against this checkpoint in float32) wins.
The decision is written to `<cache_dir>/kernels/<key>.json`, keyed by the CPU (model name and
flags), torch version and thread count, the checkpoint file, and the request; a restart reads it.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from typing import Any, Protocol
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from ..native import step as native_step
from ..linear import kernels as K
from ..cache_dir import write_cached
from ..errors import ModelLoadError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
QUANTIZATIONS = ("none", "int8", "int4", "kquant")  # kquant: a GGUF file's own blocks, each tensor in its type
KQUANT_STORED = ("Q4_K", "Q5_K", "Q6_K")  # K-quants: a file with one of them offers bfloat16+kquant
# The types bfloat16+kquant serves, by the kernel path that takes them (Q5_0 as 8-bit codes): llama.cpp's
# K-quant mixes store a row that is not a multiple of 256 (Gemma 3 270M's 640, SmolLM2's 576) in
# Q5_0/Q5_1/Q8_0 instead. Every type is served as stored but Q5_1 (Q5_K's fallback), whose minimum 8-bit
# codes cannot hold: its weights are rounded to Q8_0 (gguf_reader._quant_blocks).
FILE_PATHS = {"Q4_K": "K-quant", "Q5_K": "K-quant", "Q6_K": "K-quant", "Q8_0": "8-bit", "Q5_0": "8-bit",
              "Q5_1": "8-bit", "Q4_0": "4-bit", "Q4_1": "4-bit"}
_FUSED_PARTS = {"attn_q": "attn_qkv", "attn_k": "attn_qkv", "attn_v": "attn_qkv", "ffn_gate": "ffn_gate_up",
                "ffn_up": "ffn_gate_up"}  # GGUF names of the parts that load as one fused weight
TIMED_BYTES = 256 << 20  # float32 weight bytes of the layers timed: far beyond any last-level cache, so the
# timing streams weights from memory as serving does (4 SmolLM2 layers fit a 32 MB L3 in bfloat16 and
# made bfloat16 look faster than int4 on a machine where it is 3x slower)


class PrecisionError(ModelLoadError):
    """A requested precision mode that this device cannot serve (raised before anything is built)."""


@dataclass(frozen=True)
class Mode:
    dtype: torch.dtype
    quantization: str = "none"

    @property
    def name(self) -> str:
        d = str(self.dtype).removeprefix("torch.")
        return d if self.quantization == "none" else f"{d}+{self.quantization}"


@dataclass
class Plan:
    """The served mode and the kernel of each linear role, with how they were chosen."""

    mode: Mode
    kernels: dict[str, str]  # role -> kernel
    how: str = "default"  # "default", "measured in N s", "cached"
    measurements: dict = field(default_factory=dict)
    reason: str = ""  # why this mode won (choice_reason), when it was measured
    # (ids, window, float32 reference logits [T, V]) the quality probe computed, when it measured: the
    # engine's int8 KV check scores the same text against it and drops it (never written to disk)
    reference: tuple | None = field(default=None, repr=False, compare=False)

    def describe(self) -> str:
        """Short text for the startup line, GetModelInfo and `lmserve info`."""
        kinds = {}
        for role in K.ROLES:
            if role in self.kernels:
                kinds.setdefault(self.kernels[role], []).append(role)
        if len(kinds) == 1:
            return next(iter(kinds))
        return ", ".join(f"{k} ({'/'.join(r)})" for k, r in kinds.items())


def reference_plan() -> Plan:
    """float32 with every role dense: what each lossy plan's quality is measured against."""
    return Plan(Mode(torch.float32), {r: "dense" for r in K.ROLES})


def parse_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    if dtype not in DTYPES:
        raise PrecisionError(f"--dtype {dtype!r}: expected auto, {', '.join(sorted(set(DTYPES)))}")
    return DTYPES[dtype]


def candidate_modes(device: torch.device, dtype, quantization: str | None,
                    stored: dict[str, str] | None = None) -> list[Mode]:
    """The modes a request allows on this device, or PrecisionError saying why none is possible.
    stored: each layer weight's type in the checkpoint (ModeBuilder.stored_types), which decides
    whether bfloat16+kquant can serve it; None before the checkpoint is read, to check a request alone."""
    dt = parse_dtype(dtype)
    q = quantization or "auto"
    if q not in (*QUANTIZATIONS, "auto"):
        raise PrecisionError(f"--quantization {q!r}: expected auto, none, int8, int4 or kquant")
    if device.type != "cpu":
        if q in ("int8", "int4", "kquant"):
            raise PrecisionError(f"--quantization {q} is served on CPU only (weight-only CPU kernels); "
                                 f"on {device.type} use --quantization none with bfloat16 or float16")
        return [Mode(dt or torch.bfloat16)]
    not_kquant = kquant_refusal(stored or {})
    file_modes = ([Mode(torch.bfloat16, "kquant")]
                  if stored and not not_kquant and any(t in KQUANT_STORED for t in stored.values()) else [])
    if q in ("int8", "int4", "kquant"):
        if dt not in (None, torch.bfloat16):
            raise PrecisionError(f"--quantization {q} computes in bfloat16 on CPU (its kernels have no fast "
                                 f"path for {str(dt).removeprefix('torch.')} activations); use --dtype bfloat16 or auto")
        if q == "kquant" and not_kquant:
            raise PrecisionError(f"--quantization kquant serves a GGUF file's own {', '.join(FILE_PATHS)} tensors "
                                 f"as they are; {not_kquant} (use auto, int8 or int4)")
        return [Mode(torch.bfloat16, q)]
    if q == "none":
        return [Mode(dt)] if dt is not None else [Mode(torch.float32), Mode(torch.bfloat16)]
    if dt is None:  # both auto
        modes = [Mode(torch.float32), Mode(torch.bfloat16), Mode(torch.bfloat16, "int8"), Mode(torch.bfloat16, "int4"),
                 *file_modes]
        if K.onednn_supports(torch.float16):  # native float16 arithmetic on this CPU
            modes.append(Mode(torch.float16))
        return modes
    if dt == torch.bfloat16:
        return [Mode(dt), Mode(dt, "int8"), Mode(dt, "int4"), *file_modes]
    return [Mode(dt)]


def kquant_refusal(stored: dict[str, str]) -> str | None:
    """Why bfloat16+kquant cannot serve these layer weights (name -> stored type) as the file holds
    them, naming the tensor, or None: a type outside FILE_PATHS, or the parts of one fused weight
    (q|k|v, gate|up) on different kernel paths."""
    seen: dict[tuple, tuple[str, str]] = {}
    for name, t in stored.items():
        if t not in FILE_PATHS:
            return f"this checkpoint stores {name} ({t})"
        parts = name.split(".")
        fused = (parts[1], _FUSED_PARTS.get(parts[2], parts[2])) if parts[0] == "blk" and len(parts) == 4 else (name,)
        first = seen.setdefault(fused, (name, t))
        if FILE_PATHS[first[1]] != FILE_PATHS[t]:
            return f"{first[0]} ({first[1]}) and {name} ({t}) are parts of one fused weight on different kernel paths"
    return None


# ---- the machine and the cache key ----------------------------------------------------------------
def cpu_identity() -> dict:
    """CPU model name and feature flags (from /proc/cpuinfo where present), torch build and threads."""
    name, flags = platform.processor() or platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name in ("", platform.machine(), platform.processor()):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].strip()
    except OSError:
        pass
    from ..native.build import served_march

    return {"cpu": name, "flags": flags, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "capability": torch.backends.cpu.get_cpu_capability(), "native_march": served_march()}


# Bumped when how kernels are timed or chosen changes, so that a cached choice made by older code is
# measured again (2: native linears were timed with ~70 us of lookup overhead a call; 3: a tie goes to
# the quantized mode that serves the file's own blocks before int8; 4: int4 may take one centred
# activation code, native-int4-a8, within the quality bounds; 5: the head timed on a slice of its rows,
# candidates checked for invariance over their first layers and their quality streamed a layer at a time;
# 6: bfloat16+kquant on K-quant files; 7: kquant also serves a mix's Q8_0/Q5_0/Q4_0/Q4_1 tensors, int8 a
# file's Q5_0 as its own codes; 8: kernels checked for batch invariance only for the modes that contend,
# ranked fastest first, and modes clearly behind timed in part; 9: the head's timed rows a multiple of 16,
# so the native kernels take them: a 262k vocabulary's slice of 104,857 rows had left them out).
CHOICE_VERSION = 9


def cache_key(source: Path, request: dict) -> str:
    """The cached choice's name: this machine, the model file, the request, the choosing code's
    version and the native kernels' sources (a faster kernel must be able to win)."""
    from ..native.build import sources_digest

    st = source.stat() if source.exists() else None
    ident = {"machine": cpu_identity(), "model": [str(source.resolve()), st.st_size if st else 0,
                                                  int(st.st_mtime) if st else 0], "request": request,
             "choice": [CHOICE_VERSION, sources_digest()]}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]


def measurement_path(loaded, prefix: str, what: dict) -> Path | None:
    """Where a measurement of a loaded model (`what` names it and its settings) is cached beside the
    plan (kernels/<prefix>-<key>.json): keyed like the plan by this CPU, torch and threads and the
    checkpoint file, and by everything a step's cost follows (mode, kernels, attention, compiled
    layers); None without a cache directory."""
    if getattr(loaded, "cache_dir", None) is None:
        return None
    plan = loaded.plan
    request = {**what, "mode": loaded.mode, "kernels": plan.kernels if plan is not None else None,
               "attention": loaded.attention.describe(),
               "compiled": bool(loaded.compiled is not None and loaded.compiled.compiled)}
    return Path(loaded.cache_dir) / "kernels" / f"{prefix}-{cache_key(Path(loaded.source), request)}.json"


def _plan_to_json(plan: Plan) -> dict:
    return {"dtype": str(plan.mode.dtype).removeprefix("torch."), "quantization": plan.mode.quantization,
            "kernels": plan.kernels, "measurements": plan.measurements, "reason": plan.reason}


def _plan_from_json(d: dict) -> Plan:
    return Plan(Mode(DTYPES[d["dtype"]], d["quantization"]), dict(d["kernels"]), "cached", d.get("measurements", {}),
                d.get("reason", ""))


# ---- measuring -----------------------------------------------------------------------------------
class ModeBuilder(Protocol):
    """A checkpoint as the probe measures it (model/assembly.py's CheckpointModes): no whole model in
    any mode is held, only a few layers' weights, a plan's first layers, or one layer at a time."""

    config: Any

    def stored_types(self) -> dict[str, str]:
        """Each decoder layer's linear weight by its name in the file, with its stored type ("Q4_K", "F32", ...)."""

    def stored_size(self) -> tuple[int, int]:
        """(the checkpoint's tensor bytes as stored, their weights)."""

    def timing_sources(self, max_bytes: int) -> tuple[dict[str, list[K.WeightSource]], dict[str, float]]:
        """Each role's weights for the first layers (and rows of the head), and the factor to the whole model."""

    def model(self, plan: "Plan", layers: int | None = None):
        """The plan's model, with only its first `layers` decoder layers when given."""

    def logits(self, plan: "Plan", ids: list[int], window: int = 512) -> torch.Tensor:
        """quality.logits_of of the plan's model on `ids` [T, V], computed a layer at a time."""


INVARIANCE_LAYERS = 2  # decoder layers of a candidate checked end to end for batch invariance


# kernels that take one int8 code per activation where a precise sibling takes two: a plan whose layers
# fail the quality bounds with them is measured again without them (_acceptable). The LM head keeps one
# code in every mode (its output barely moves with it), so these rules leave it alone.
ONE_CODE_KERNELS = frozenset({"native-int4-a8", "native-kquant-a8"})


def uses_one_code(kernels: dict[str, str]) -> bool:
    """Whether a plan's layer kernels (role -> kernel) include one that takes one int8 code per activation."""
    return not ONE_CODE_KERNELS.isdisjoint(k for role, k in kernels.items() if role != "head")


# roles in the order a mode's kernels are timed: the largest share of a step first, so that a mode
# timed in part (time_mode's `behind`) is known to be out of the running after as few roles as possible
TIMING_ORDER = ("gate_up", "down", "head", "qkv", "o")


def time_mode(config, mode: Mode, batch_invariant: bool, device: torch.device, timed: tuple[dict, dict],
              exclude: frozenset = frozenset(), verify: bool = True, roles: dict | None = None,
              behind=None) -> tuple[dict, dict[str, list[K.RoleMeasurement]]]:
    """Each role's candidate kernels timed on the timed weights: (the summary measure_mode returns, each
    role's measurements). verify=False: each role's fastest kernel is taken unchecked for batch
    invariance (settle_mode checks it once the mode is a contender), so that a mode that cannot win
    costs no invariance checks. roles: measurements of a mode timed in part before, kept (verify=False).
    behind: a test of step times per bucket (ms) at least as long as the mode's (lower_bound): once it
    holds, the rest of the roles are left untimed and the summary says "kernels" None and "at_least_ms"."""
    sources, scale = timed
    roles, chosen = dict(roles or {}), {}
    in_loop = native_step.possible(config, mode.dtype, mode.quantization, device)
    for role in TIMING_ORDER:
        if role in roles:  # timed before (verify=False): its fastest again
            chosen[role] = K.pick(roles[role], batch_invariant=False)
        else:
            kernels = [k for k in K.candidates(mode.quantization, mode.dtype, role, device)
                       if role == "head" or k not in exclude]
            if mode.quantization == "kquant" and role == "head" and any(s.kq is None for s in sources[role]):
                kernels = [k for k in kernels if not k.startswith("native-kquant")]  # int8 (a Q8_0 head: its own codes)
            if in_loop and role in native_step.LAYER_ROLES:  # the native step needs them
                kernels = [k for k in kernels if k.startswith("native")] or kernels
            roles[role], chosen[role] = K.measure_role(kernels, sources[role], mode.dtype, batch_invariant,
                                                       verify=verify)
        if chosen[role] is None:
            break
        if behind is not None and len(roles) < len(K.ROLES) and behind(lower_bound(roles, scale)):
            return {**_summary(roles, chosen, scale), "at_least_ms": lower_bound(roles, scale)}, roles
    return _summary(roles, chosen, scale), roles


def lower_bound(roles: dict[str, list[K.RoleMeasurement]], scale: dict[str, float]) -> dict[int, float]:
    """Step ms per bucket that a mode timed on these roles takes at least, whichever kernels serve it:
    each timed role's fastest kernel at that bucket (invariant or not), the untimed roles counted as 0."""
    return {b: round(sum(min(m.seconds[b] for m in ms) * scale[role] for role, ms in roles.items()) * 1e3, 3)
            for b in K.DECODE_BUCKETS}


def clearly_behind(at_least_ms: dict[int, float], step_ms: dict[int, float]) -> bool:
    """Whether step times of at least `at_least_ms` are more than TIE slower than `step_ms` at every
    bucket: such a mode scores more than (1 + TIE) times the other whatever the best at each bucket is
    (a score is a positive mix of the buckets' times), so it ranks behind it and is not tied with the
    fastest, and being the best at no bucket it moves no other mode's score."""
    return all(at_least_ms[b] > (1 + TIE) * step_ms[b] for b in step_ms)


def _summary(roles: dict[str, list[K.RoleMeasurement]], chosen: dict, scale: dict[str, float]) -> dict:
    """measure_mode's dict from each role's measurements and chosen kernel (None: the mode has none)."""
    detail = {role: {m.kernel: {"ms": {b: round(s * 1e3, 3) for b, s in m.seconds.items()},
                                "batch_invariant": m.invariant} for m in ms} for role, ms in roles.items()}
    if any(chosen.get(role) is None for role in K.ROLES):
        return {"kernels": None, "detail": detail}
    step = {b: sum(chosen[role].seconds[b] * scale[role] for role in K.ROLES) for b in K.DECODE_BUCKETS}
    return {"kernels": {role: chosen[role].kernel for role in K.ROLES},
            "step_ms": {b: round(s * 1e3, 3) for b, s in step.items()}, "detail": detail}


def measure_mode(config, mode: Mode, batch_invariant: bool, device: torch.device,
                 timed: tuple[dict, dict], exclude: frozenset = frozenset()) -> dict | None:
    """Per-role kernel choice and the mode's decode-step matmul time per bucket (the whole model, from
    the timed weights scaled by `timed`'s factors), or None when some role has no allowed kernel
    (none is batch-invariant and invariance is required). exclude: kernels not to consider."""
    return time_mode(config, mode, batch_invariant, device, timed, exclude)[0]


def settle_mode(mode: Mode, roles: dict[str, list[K.RoleMeasurement]], timed: tuple[dict, dict]) -> dict:
    """A mode timed with verify=False, its kernels now checked for batch invariance (kernels.verify_role:
    each role's fastest kernel on the role's first timed weight, the next fastest where it fails):
    measure_mode's dict for the kernels that pass ("kernels" None where some role has none)."""
    sources, scale = timed
    chosen = {}
    for role in K.ROLES:
        chosen[role] = K.verify_role(roles[role], lambda kernel: K.build(kernel, sources[role][0], mode.dtype),
                                     mode.dtype)
        if chosen[role] is None:
            break
    return _summary(roles, chosen, scale)


@torch.inference_mode()
def model_batch_invariant(model, ids: list[int], device: torch.device | str = "cpu") -> bool:
    """End to end at the model's real shapes: prompts prefilled alone and packed together, then one
    decode step alone and as a batch, give bitwise the same logits (every kernel, norm and RoPE).

    Decode uses prompts of one length so that every sequence attends over the same number of keys
    alone and batched: how attention calls group sequences of different lengths is the attention
    plan's business (its own tests), not the precision mode's."""
    from ..attention.sdpa import AttentionMetadata
    from ..kv_cache import KVCache

    dtype = model.model.norm.weight.dtype
    room = min(model.config.max_position_embeddings - 2, 62)  # a small model's context may be short
    ids = (list(ids) or [0]) * (300 // max(1, len(ids)) + 1)  # enough tokens for every prompt below

    def prefill(cache, prompts, slots):
        q_lens = torch.tensor([len(p) for p in prompts])
        meta, pos = AttentionMetadata.packed(torch.tensor(slots), q_lens)
        flat = torch.tensor([t for p in prompts for t in p])[None]
        return model(flat.to(device), pos.to(device), meta, cache, logits_index=torch.cumsum(q_lens, 0) - 1)

    def decode(cache, prompts, slots, tokens):
        starts = torch.tensor([len(p) for p in prompts])
        meta = AttentionMetadata.for_cache(torch.tensor(slots), starts, torch.ones_like(starts), 1)
        return model(tokens[:, None].to(device), starts[:, None].to(device), meta, cache)[:, 0]

    for lengths, steps in (((7, 29, 45), False), ((29, 29, 29, 29, 29), True)):
        prompts = [ids[i * 50: i * 50 + min(n, room)] for i, n in enumerate(lengths)]
        n = len(prompts)
        alone_p, alone_d = [], []
        for i in range(n):
            cache = KVCache(model.config, n, 64, dtype, device)
            alone_p.append(prefill(cache, prompts[i: i + 1], [i]))
            if steps:
                alone_d.append(decode(cache, prompts[i: i + 1], [i], alone_p[-1].argmax(-1)))
        cache = KVCache(model.config, n, 64, dtype, device)
        together = prefill(cache, prompts, list(range(n)))
        if not torch.equal(torch.cat(alone_p), together):
            return False
        if steps and not torch.equal(torch.cat(alone_d), decode(cache, prompts, list(range(n)), together.argmax(-1))):
            return False
    return True


TIE = 0.10  # modes whose speed scores are this close count as equally fast
_BITS = {"none": 0, "int8": 1, "int4": 2, "kquant": 2}


def file_exact_modes(sources: dict[str, list[K.WeightSource]], modes) -> frozenset:
    """The quantized modes that serve every layer's own blocks from the file (int4: Q4_0/Q4_1,
    int8: Q8_0/Q5_0, kquant: any of FILE_PATHS) instead of quantizing its dequantized weights again. On a Q4_1 GGUF int4 is the
    file itself and int8 adds a rounding (SmolLM2: mean KL 0.0017 in int4 against 0.0032 in int8)."""
    layer_roles = [r for r in K.ROLES if r != "head"]

    def own(blocks) -> bool:  # a Q5_1 tensor's Q8_0 codes are rounded from its weights
        return blocks is not None and getattr(blocks, "exact", True)

    def exact(md) -> bool:
        if md.quantization == "kquant":
            return all(own(s.file_blocks()) for r in layer_roles for s in sources[r])
        field = {"int4": "q41", "int8": "q80"}.get(md.quantization)
        return field is not None and all(own(getattr(s, field)) for r in layer_roles for s in sources[r])
    return frozenset(md for md in modes if exact(md))


def _precision_rank(md, exact: frozenset) -> int:
    """Among tied modes: unquantized first, then a quantized mode serving the file's own blocks,
    then the others by bits (int8 before int4)."""
    if md.quantization == "none":
        return 0
    return 1 if md in exact else 1 + _BITS.get(md.quantization, 2)


def mode_scores(step_ms: dict[Mode, dict[int, float]]) -> dict[Mode, float]:
    """Each mode's speed score (kernels.speed_score: 1.0 = fastest at every bucket, batch 1 weighted)."""
    buckets = next(iter(step_ms.values())).keys()
    best_at = {b: min(ms[b] for ms in step_ms.values()) or 1e-9 for b in buckets}
    return {md: K.speed_score(ms, best_at) for md, ms in step_ms.items()}


def rank_modes(step_ms: dict[Mode, dict[int, float]], tie: float = TIE, exact: frozenset = frozenset()) -> list[Mode]:
    """Modes fastest first by the speed score of their matmul-only step times (relative to the best
    at each batch bucket, batch 1 weighted: kernels.BUCKET_WEIGHTS); modes within `tie` of the
    fastest score come first among themselves in order of precision (unquantized first, then a
    quantized mode in `exact`, which serves the file's own blocks, then int8 before int4; wider
    dtype first), so that a near tie, which timing noise could tip either way, does not make two
    first starts on one machine serve different modes (it did: bfloat16 and bfloat16+int4 scored
    within 5% on the 2-core EPYC)."""
    score = mode_scores(step_ms)
    fastest = min(score.values())

    def key(md: Mode):
        tied = score[md] <= fastest * (1 + tie)
        return (not tied, _precision_rank(md, exact) if tied else 0, -md.dtype.itemsize if tied else 0, score[md])
    return sorted(step_ms, key=key)


def choice_reason(step_ms: dict[Mode, dict[int, float]], chosen: Mode, skipped: dict[str, str],
                  exact: frozenset = frozenset(), in_part: dict[str, dict[int, float]] | None = None) -> str:
    """One line saying why `chosen` won: every mode's score and its step ms per bucket, a near tie
    that precision broke, what ruled out the modes ranked before it, and the modes timed in part
    (name -> the step ms they take at least)."""
    score = mode_scores(step_ms)
    weights = "/".join(f"{K.BUCKET_WEIGHTS.get(b, 1.0):g}" for b in next(iter(step_ms.values())))
    parts = [f"{md.name} {score[md]:.2f} ({'/'.join(f'{v:.1f}' for v in step_ms[md].values())} ms)"
             for md in sorted(step_ms, key=score.get)]
    text = (f"{chosen.name}: speed score (1 = fastest at every batch; batch {'/'.join(map(str, next(iter(step_ms.values()))))}"
            f" weighted {weights}) " + ", ".join(parts))
    fastest = min(score, key=score.get)
    if fastest != chosen and fastest.name not in skipped and score[chosen] <= score[fastest] * (1 + TIE):
        why = "serves the file's own blocks" if chosen in exact else "more precise"
        text += f"; {chosen.name} within {TIE:.0%} of {fastest.name} and {why}"
    if skipped:
        text += "; passed over: " + ", ".join(f"{n} ({why})" for n, why in skipped.items())
    if in_part:
        text += (f"; timed in part, more than {TIE:.0%} slower than {chosen.name} at every batch on their first roles: "
                 + ", ".join(f"{n} (at least {'/'.join(f'{v:.1f}' for v in ms.values())} ms)" for n, ms in in_part.items()))
    return text


def _measure_all(builder: ModeBuilder, modes: list[Mode], batch_invariant: bool, device: torch.device,
                 timed) -> tuple[dict[Mode, dict], dict[Mode, dict], dict[Mode, dict]]:
    """Every mode's kernels and step times, its fastest kernels not yet checked for batch invariance
    (settle_mode does it for the modes that contend), and each mode's role measurements; and apart, the
    modes timed in part: those whose first roles already made them clearly_behind a mode timed whole
    (the fewest bytes first: quantized modes, then 2-byte, then float32). choose times them whole when
    the mode it would serve is not clearly ahead of them after all."""
    measured, roles, partial = {}, {}, {}
    order = sorted(modes, key=lambda m: (m.quantization == "none", m.dtype.itemsize, -_BITS.get(m.quantization, 0)))
    for mode in order:
        if device.type != "cpu":
            measured[mode] = {"kernels": {r: "dense" for r in K.ROLES}, "step_ms": {b: 0.0 for b in K.DECODE_BUCKETS}}
            continue
        ahead = [m["step_ms"] for m in measured.values()]
        entry, roles[mode] = time_mode(builder.config, mode, batch_invariant, device, timed, verify=False,
                                       behind=lambda lb: any(clearly_behind(lb, s) for s in ahead))
        if "at_least_ms" in entry:
            partial[mode] = entry
        elif entry["kernels"] is None:  # a role with no kernel at all on this machine
            del roles[mode]
        else:
            measured[mode] = entry
    return {m: measured[m] for m in modes if m in measured}, roles, partial


def _no_invariant_kernel() -> PrecisionError:
    return PrecisionError("no kernel of the requested mode is batch-invariant on this machine; "
                          "pass --batch-invariant false to serve it anyway")


class _Probe:
    """The quality probe of one choice: each candidate's logits on the held-out text against the float32
    reference's (computed once per sample, when first needed). The text is two samples of FIRST_TOKENS,
    each scored as its own window: the second only where the first's verdict is not settled (near a
    bound), the verdict then both together."""

    def __init__(self, builder: ModeBuilder, tokenizer, batch_invariant: bool):
        from . import quality as Qm

        self.builder, self.batch_invariant, self.Qm = builder, batch_invariant, Qm
        self.ids = Qm.text_ids(tokenizer, Qm.PROBE_TOKENS)
        self.samples = [self.ids[:Qm.FIRST_TOKENS], self.ids[Qm.FIRST_TOKENS:]]
        self.window = min(512, builder.config.max_position_embeddings)  # a small model's context may be shorter
        self.refs: dict[int, torch.Tensor] = {}  # sample -> the float32 reference's logits

    def invariant(self, plan: Plan) -> bool:
        """The plan's kernels give bitwise the same rows alone and batched, end to end over its first layers."""
        return model_batch_invariant(self.builder.model(plan, layers=INVARIANCE_LAYERS), self.ids)

    def _score(self, plan: Plan, sample: int):
        ids = self.samples[sample]
        if sample not in self.refs:
            self.refs[sample] = self.builder.logits(reference_plan(), ids, self.window)
        return self.Qm.compare(self.refs[sample], self.builder.logits(plan, ids, self.window), ids, self.window)

    def quality(self, plan: Plan):
        q = self._score(plan, 0)
        return q if q.settled() or len(self.samples[1]) < 2 else q.merged(self._score(plan, 1))

    def reference(self) -> tuple | None:
        """(ids, window, logits) of the first sample's float32 reference, when it was computed."""
        ref = self.refs.get(0)
        return None if ref is None else (self.samples[0], self.window, ref)


def choose(builder: ModeBuilder, tokenizer, modes: list[Mode], batch_invariant: bool, device: torch.device) -> Plan:
    """Time every mode, then walk them fastest first and keep the first whose kernels are batch-invariant
    (where required: checked when the mode comes first, the mode's times taken again from the kernels
    that pass and the modes ranked again when one fails), that is batch-invariant end to end, and that
    is within the quality bounds. A mode that quantizes the file's blocks again and comes first ahead of
    the mode serving them is timed again beside it (side_by_side) before its quality is checked. A
    mode ranked behind the one served is never checked (its unchecked kernels say batch_invariant
    None in the report)."""
    t0, counts = time.perf_counter(), dict(K.TIMING_COUNTS)
    timed = builder.timing_sources(TIMED_BYTES)
    measured, roles, partial = _measure_all(builder, modes, batch_invariant, device, timed)
    if not measured:
        raise _no_invariant_kernel()
    exact = file_exact_modes(timed[0], [*measured, *partial])
    report = {"modes": {}}
    probe = _Probe(builder, tokenizer, batch_invariant)
    skipped: dict[str, str] = {}
    confirmed: set[Mode] = set()  # modes whose lead over the file's own blocks was timed side by side

    def time_whole(p: Mode) -> bool:
        """A mode timed in part, timed whole: whether it has kernels (it is then in `measured`)."""
        entry, roles[p] = time_mode(builder.config, p, batch_invariant, device, timed, verify=False, roles=roles[p])
        del partial[p]
        if entry["kernels"] is not None:
            measured[p] = entry
        return entry["kernels"] is not None

    def settle(m: Mode) -> dict | None:
        """m's kernels checked for batch invariance (settle_mode): its final entry, or None when some role
        has no batch-invariant kernel (m is then out)."""
        settled = settle_mode(m, roles.pop(m), timed)
        if settled["kernels"] is None:
            del measured[m]
            return None
        return settled

    chosen = None
    while chosen is None:
        ranked = rank_modes({md: m["step_ms"] for md, m in measured.items()}, exact=exact)
        report["modes"] = {md.name: measured[md] for md in ranked}
        md = next((m for m in ranked if m.name not in skipped), None)
        if md is None and partial:  # every mode timed whole was passed over: time the rest whole
            rivals = list(partial)
        elif md is None:
            break
        else:
            rivals = []
        if batch_invariant and md in roles:  # checked once: its kernels and times are then final
            settled = settle(md)
            if settled is None:
                if not measured:
                    raise _no_invariant_kernel()
                continue
            changed = settled["kernels"] != measured[md]["kernels"]
            measured[md] = report["modes"][md.name] = settled
            if changed:  # slower now: rank again
                continue
        rivals = rivals or [p for p, e in partial.items() if not clearly_behind(e["at_least_ms"], measured[md]["step_ms"])]
        if rivals:  # modes timed in part that could rank with md: timed whole, then ranked again
            for p in rivals:
                time_whole(p)
            continue
        own = own_blocks_rival(md, [*ranked, *partial], exact, skipped) if md not in confirmed else None
        if own is not None:  # md's lead over the file's own blocks, confirmed side by side before its quality check
            confirmed.add(md)
            if own in partial and not time_whole(own):  # timed in part: the rest of its roles first
                continue
            if batch_invariant and own in roles:
                settled = settle(own)
                if settled is None:
                    continue
                measured[own] = settled
            for m, ms in side_by_side([md, own], measured, timed).items():
                measured[m] = {**measured[m], "step_ms": ms, "step_ms_timed_alone": measured[m]["step_ms"]}
            continue
        if _acceptable(md, [*ranked, *partial], measured, report, probe, skipped, builder, device, timed):
            chosen = md
    if chosen is None:
        raise PrecisionError("no requested mode is batch-invariant end to end on this machine "
                             f"({', '.join(m.name for m in ranked)}); pass --batch-invariant false to serve it anyway")
    dt = time.perf_counter() - t0
    report["seconds"] = round(dt, 2)
    # the work the choice took: timing passes through a role's timed layers (kernels.time_candidates), role
    # timings that stopped early on a settled ranking, modes timed whole and in part
    report["work"] = {**{k: K.TIMING_COUNTS[k] - counts[k] for k in counts}, "modes_timed_whole": len(measured),
                      "modes_timed_in_part": len(partial)}
    if partial:
        report["timed_in_part"] = {p.name: e for p, e in partial.items()}
    reason = choice_reason({md: measured[md]["step_ms"] for md in ranked}, chosen, skipped, exact,
                           {p.name: e["at_least_ms"] for p, e in partial.items()})
    if "quality" in report["modes"][chosen.name]:
        q = report["modes"][chosen.name]["quality"]
        reason += f"; {chosen.name} within the quality bounds (mean KL {q['mean_kl']:.4f}, perplexity x{q['ppl_ratio']:.3f})"
    again = [md.name for md in ranked if "step_ms_timed_alone" in measured[md]]
    if again:
        reason += f"; {' and '.join(again)} timed again side by side"
    report["reason"] = reason
    return Plan(chosen, measured[chosen]["kernels"], f"measured in {dt:.1f}s", report, reason, probe.reference())


def own_blocks_rival(md: Mode, behind: list[Mode], exact: frozenset, skipped: dict) -> Mode | None:
    """The mode serving the file's own blocks among the modes `behind` md (ranked, or timed in part),
    when md quantizes them again (int4 or int8 over a K-quant file, int8 over a Q4_1 one): the modes
    were timed one after the other, so on a shared machine a neighbour busy during one of them can
    put md ahead, and md's quality check is what the walk would pay for it (~30 s on a 3B K-quant
    file, where int4 then failed)."""
    if md in exact or md.quantization == "none":
        return None
    return next((m for m in behind if m in exact and m.name not in skipped and m.dtype == md.dtype), None)


def side_by_side(modes: list[Mode], measured: dict, timed: tuple[dict, dict]) -> dict[Mode, dict[int, float]]:
    """The step ms per bucket of `modes` (one dtype) on their measured kernels, timed again role by role
    with the modes' linears taking turns in every repeat (kernels.time_candidates), so that both meet
    the same neighbours; each role's linears are dropped before the next role's are built."""
    sources, scale = timed
    step = {m: dict.fromkeys(K.DECODE_BUCKETS, 0.0) for m in modes}
    for role in K.ROLES:
        sets = {m.name: [K.build(measured[m]["kernels"][role], s, m.dtype) for s in sources[role]] for m in modes}
        times = K.time_candidates(sets, K.DECODE_BUCKETS, modes[0].dtype)
        del sets
        for m in modes:
            for b in K.DECODE_BUCKETS:
                step[m][b] += times[m.name][b] * scale[role]
    return {m: {b: round(t * 1e3, 3) for b, t in step[m].items()} for m in modes}


def _acceptable(md: Mode, ranked: list[Mode], measured: dict, report: dict, probe: _Probe, skipped: dict,
                builder: ModeBuilder, device: torch.device, timed) -> bool:
    """Whether mode `md` (on its measured kernels, which this may change to the precise siblings of
    one-code kernels) is served: batch-invariant end to end where required, and within the quality
    bounds unless it is the reference or the only mode asked for. Records why not in `skipped`."""
    reference = md.dtype == torch.float32 and md.quantization == "none"
    # a mode asked for alone is served without a quality probe, but for one activation code, a
    # kernel choice the user did not make
    alone = len(ranked) == 1 and not uses_one_code(measured[md]["kernels"])
    if alone and not probe.batch_invariant:
        return True

    def invariant() -> bool:
        if not probe.batch_invariant:
            return True
        ok = probe.invariant(Plan(md, measured[md]["kernels"]))
        report["modes"][md.name]["model_batch_invariant"] = ok
        if not ok:
            skipped[md.name] = "not batch-invariant end to end"
        return ok

    if not invariant():
        return False
    if reference or alone:
        return True
    q = probe.quality(Plan(md, measured[md]["kernels"]))
    report["modes"][md.name]["quality"] = q.as_dict()
    if not q.within_bounds() and uses_one_code(measured[md]["kernels"]):
        # one activation code lost too much here: the same mode with two codes (its rank kept)
        precise = measure_mode(builder.config, md, probe.batch_invariant, device, timed, exclude=ONE_CODE_KERNELS)
        if precise["kernels"] is not None:
            measured[md] = report["modes"][md.name] = {**precise, "one_code_quality": q.as_dict()}
            if not invariant():
                return False
            q = probe.quality(Plan(md, measured[md]["kernels"]))
            report["modes"][md.name]["quality"] = q.as_dict()
    if q.within_bounds() or len(ranked) == 1:
        return True
    skipped[md.name] = f"quality: mean KL {q.mean_kl:.4f}, perplexity x{q.ppl_ratio:.3f}"
    return False


# `auto` keeps a checkpoint near its own size: a mode whose weights would take more than this many times
# the file's tensor bytes, plus MEMORY_SLACK, is no candidate (a Q4_K_M 8B file is 4.5 GB; served in
# bfloat16 it would be 16). A mode asked for by name is served whatever its size.
MEMORY_FACTOR, MEMORY_SLACK = 1.3, 1 << 29
_BYTES_PER_WEIGHT = {"int8": 34 / 32, "int4": 20 / 32}  # the packed layouts: codes, scales (and mins)


def served_bytes(mode: Mode, stored: tuple[int, int]) -> float:
    """About the bytes of a checkpoint's weights served in `mode`; stored: (bytes in the file, weights)."""
    nbytes, weights = stored
    if mode.quantization == "kquant":
        return nbytes
    if mode.quantization == "none":
        return weights * mode.dtype.itemsize
    return weights * _BYTES_PER_WEIGHT[mode.quantization]


def memory_candidates(modes: list[Mode], stored: tuple[int, int]) -> tuple[list[Mode], str]:
    """The modes `auto` may serve at this checkpoint's size, and a note naming those left out (empty
    when none is): never all of them (the smallest stays)."""
    limit = MEMORY_FACTOR * stored[0] + MEMORY_SLACK
    kept = [m for m in modes if served_bytes(m, stored) <= limit] or [min(modes, key=lambda m: served_bytes(m, stored))]
    out = [m for m in modes if m not in kept]
    if not out:
        return modes, ""
    gb = 1e9
    return kept, (f"not candidates at this size (weights over {MEMORY_FACTOR:g}x the file's {stored[0] / gb:.2f} GB "
                  f"+ {MEMORY_SLACK / 2**30:g} GiB): "
                  + ", ".join(f"{m.name} ({served_bytes(m, stored) / gb:.2f} GB)" for m in out))


def resolve_plan(builder: ModeBuilder, tokenizer, source: Path, device: torch.device, dtype, quantization: str | None,
                 batch_invariant: bool, cache_dir: Path | None) -> Plan:
    """The plan to serve: from the disk cache when this machine already measured this request."""
    modes = candidate_modes(device, dtype, quantization, builder.stored_types())
    if device.type != "cpu":
        return Plan(modes[0], {r: "dense" for r in K.ROLES})
    left_out = ""
    if len(modes) > 1:
        modes, left_out = memory_candidates(modes, builder.stored_size())
    request = {"dtype": str(dtype), "quantization": quantization or "auto", "batch_invariant": batch_invariant,
               "device": str(device), "version": 4}
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / "kernels" / f"{cache_key(source, request)}.json"
        if path.is_file():
            try:
                plan = _plan_from_json(json.loads(path.read_text()))
                if plan.mode in modes:
                    return plan
            except (ValueError, KeyError, TypeError):
                pass  # unreadable: measure again
    plan = choose(builder, tokenizer, modes, batch_invariant, device)
    if left_out:
        plan = replace(plan, reason=f"{plan.reason}; {left_out}")
    if path is not None:
        write_cached(path, {**_plan_to_json(plan), "machine": cpu_identity()["cpu"]}, "kernel choice")
    return plan


__all__ = ["measurement_path", "memory_candidates", "served_bytes", "MEMORY_FACTOR", "MEMORY_SLACK", "FILE_PATHS", "KQUANT_STORED", "kquant_refusal", "ONE_CODE_KERNELS", "Mode", "Plan", "PrecisionError", "candidate_modes", "resolve_plan", "choose", "measure_mode", "time_mode", "settle_mode", "rank_modes",
           "reference_plan", "uses_one_code", "ModeBuilder", "INVARIANCE_LAYERS",
           "mode_scores", "choice_reason", "file_exact_modes",
           "cpu_identity", "parse_dtype", "asdict"]
