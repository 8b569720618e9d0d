"""LoRA adapters: read from PEFT's files, held in a pool of slots, added per row after the base linears.

An adapter is PEFT's pair of files, `adapter_config.json` and `adapter_model.safetensors`, trained on
the q/k/v/o attention projections and the gate/up/down MLP projections of a base this model is. Each
targeted projection p of a layer holds A [r, K] and B [out, r] and adds `(x A^T) B^T * scaling` to the
base's output, with scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora), r and alpha per
module from rank_pattern and alpha_pattern as PEFT matches them.

lmserve fuses q|k|v and gate|up into one GEMM each (serving.py); an adapter's q, k and v (gate, up)
products go to their slice of the fused output. Nothing is merged into the base weights: the base
linears run once over every row of a step, then each row that chose an adapter adds its own
adapter's product (`LoraStep`, `LoraSlots.add`).

Batch invariance: the rows of one adapter are gathered in chunks of exactly `CHUNK` rows (the last
chunk padded with copies of a row), and every chunk is one matrix of a batched matmul of fixed shape
[CHUNK, K] x [K, R]: a row's product is then the same whatever rows and adapters share its step
(checked in tests/unit/test_lora.py). Rows without an adapter are not touched: a base row's output is
bitwise the base model's.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

CHUNK = 16  # rows per matrix of the batched low-rank products (fixed: a row's rounding never depends on the batch)

# PEFT's module name -> (lmserve's fused role, index of its slice)
TARGETS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
           "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
ROLE_TARGETS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
                "down": ("down_proj",)}
PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served on this model; the message says what and where."""


def projection_shapes(cfg) -> dict[str, tuple[int, int]]:
    """PEFT module name -> (in_features, out_features) of the base model's projection."""
    D, I, Hd, Kd = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q_proj": (D, Hd), "k_proj": (D, Kd), "v_proj": (D, Kd), "o_proj": (Hd, D),
            "gate_proj": (D, I), "up_proj": (D, I), "down_proj": (I, D)}


def slices(cfg) -> dict[str, tuple[int, int]]:
    """PEFT module name -> [lo, hi) of its columns in lmserve's fused output (qkv, gate_up)."""
    D, I, Hd, Kd = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q_proj": (0, Hd), "k_proj": (Hd, Hd + Kd), "v_proj": (Hd + Kd, Hd + 2 * Kd), "o_proj": (0, D),
            "gate_proj": (0, I), "up_proj": (I, 2 * I), "down_proj": (0, D)}


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup (peft.utils.other.get_pattern_key): the first key that
    matches the end of the module's name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


@dataclass
class LoraAdapter:
    """One adapter read from its files, float32 on the host: (layer, module) -> A [r, K], B [out, r], scaling."""

    path: Path
    rank: int  # the largest rank of its modules
    modules: dict[tuple[int, str], tuple[Tensor, Tensor, float]] = field(default_factory=dict)

    @property
    def targets(self) -> list[str]:
        return sorted({m for _, m in self.modules})


def read_peft(path: str | Path, cfg, max_rank: int | None = None) -> LoraAdapter:
    """The PEFT adapter in directory `path`, checked against the base model's config `cfg`.

    Refused (AdapterError, naming what): a missing or unreadable file, another PEFT type, DoRA,
    modules_to_save, a bias other than "none", trainable LoRA biases, fan_in_fan_out, a module lmserve
    does not serve (embeddings, the LM head, ...), a layer the model lacks, a tensor whose shape is not
    the base projection's (module and both shapes named), a rank over `max_rank`."""
    from safetensors import safe_open

    path = Path(path)
    conf_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    for f in (conf_file, weights_file):
        if not f.is_file():
            raise AdapterError(f"adapter {path.name}: {f.name} not found (a PEFT adapter directory holds "
                               f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        conf = json.loads(conf_file.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"adapter {path.name}: {CONFIG_FILE} is not valid JSON ({exc})") from None
    if not isinstance(conf, dict):
        raise AdapterError(f"adapter {path.name}: {CONFIG_FILE} is not a JSON object")
    _refuse_unsupported(path.name, conf)
    r0, alpha0 = conf.get("r", 8), conf.get("lora_alpha", 8)
    rslora = bool(conf.get("use_rslora", False))
    ranks, alphas = conf.get("rank_pattern") or {}, conf.get("alpha_pattern") or {}
    shapes = projection_shapes(cfg)
    raw: dict[tuple[int, str], dict[str, Tensor]] = {}
    try:
        with safe_open(str(weights_file), framework="pt") as f:
            for key in f.keys():
                m = _KEY.search(key)
                if m is None:
                    raise AdapterError(f"adapter {path.name}: tensor {key} is not a LoRA weight of an attention or "
                                       f"MLP projection ({', '.join(TARGETS)}); lmserve serves only those")
                layer, parent, module, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
                if module not in TARGETS or PARENT[module] != parent:
                    raise AdapterError(f"adapter {path.name}: target module {parent}.{module} is not one the model "
                                       f"has (served: {', '.join(TARGETS)})")
                if layer >= cfg.num_layers:
                    raise AdapterError(f"adapter {path.name}: layers.{layer}.{parent}.{module} names layer {layer}; "
                                       f"the model has {cfg.num_layers} layers")
                raw.setdefault((layer, module), {})[ab] = f.get_tensor(key)
    except AdapterError:
        raise
    except Exception as exc:  # noqa: BLE001 - a corrupt or truncated file: said as such
        raise AdapterError(f"adapter {path.name}: {WEIGHTS_FILE} cannot be read ({type(exc).__name__})") from None
    if not raw:
        raise AdapterError(f"adapter {path.name}: {WEIGHTS_FILE} holds no LoRA weights")
    adapter = LoraAdapter(path, 0)
    for (layer, module), ab in sorted(raw.items()):
        name = f"layers.{layer}.{PARENT[module]}.{module}"
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"adapter {path.name}: {name} has lora_{'A' if 'B' in ab else 'B'} missing")
        A, B = ab["A"], ab["B"]
        k, out = shapes[module]
        r = A.shape[0]
        if A.dim() != 2 or B.dim() != 2 or A.shape[1] != k or B.shape[0] != out or B.shape[1] != r:
            raise AdapterError(f"adapter {path.name}: {name} does not fit the base model: lora_A is "
                               f"{list(A.shape)} and lora_B {list(B.shape)}, the base projection needs "
                               f"[r, {k}] and [{out}, r] (is the adapter for another base model?)")
        if max_rank is not None and r > max_rank:
            raise AdapterError(f"adapter {path.name}: {name} has rank {r}, over --max-lora-rank {max_rank}")
        full = f"model.{name}"
        alpha = _pattern_value(alphas, full, alpha0)
        pattern_r = _pattern_value(ranks, full, r0)
        if pattern_r != r:
            raise AdapterError(f"adapter {path.name}: {name} has rank {r} in {WEIGHTS_FILE} but {pattern_r} in "
                               f"{CONFIG_FILE}")
        scaling = alpha / math.sqrt(r) if rslora else alpha / r
        adapter.modules[(layer, module)] = (A.float(), B.float(), float(scaling))
        adapter.rank = max(adapter.rank, r)
    return adapter


def _refuse_unsupported(name: str, conf: dict) -> None:
    kind = conf.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise AdapterError(f"adapter {name}: peft_type {kind} is not served (LoRA only)")
    if conf.get("use_dora"):
        raise AdapterError(f"adapter {name}: DoRA (use_dora) is not served")
    if conf.get("modules_to_save"):
        raise AdapterError(f"adapter {name}: modules_to_save ({', '.join(map(str, conf['modules_to_save']))}) is not "
                           "served: it replaces whole modules of the base")
    if conf.get("bias", "none") != "none":
        raise AdapterError(f"adapter {name}: bias {conf['bias']!r} is not served (only \"none\")")
    if conf.get("lora_bias"):
        raise AdapterError(f"adapter {name}: lora_bias is not served")
    if conf.get("fan_in_fan_out"):
        raise AdapterError(f"adapter {name}: fan_in_fan_out is not served (a Llama-family base has none)")
    for key in ("trainable_token_indices", "target_parameters"):
        if conf.get(key):
            raise AdapterError(f"adapter {name}: {key} is not served")
    for key in ("r", "lora_alpha"):
        if key in conf and not isinstance(conf[key], (int, float)):
            raise AdapterError(f"adapter {name}: {key} must be a number")


@dataclass
class LoraStep:
    """A step's rows by adapter slot, laid out for the batched products: `gather` [G * CHUNK] row indices
    (chunks of one slot each, padded with a copy of a row), `slots` [G], and `valid` [n] (the positions in
    gather of real rows) with `rows` [n] their row indices. Built once per step, read by every layer."""

    gather: Tensor
    slots: Tensor
    valid: Tensor
    rows: Tensor
    used: frozenset[int]  # the slots in the step
    row_slots: Tensor  # [N] int64: each row's slot, -1 for the base (the native step reads this)

    @staticmethod
    def of(row_slots: list[int], device=None) -> "LoraStep | None":
        """From each row's slot (-1: the base alone); None when no row has an adapter."""
        by_slot: dict[int, list[int]] = {}
        for i, s in enumerate(row_slots):
            if s >= 0:
                by_slot.setdefault(s, []).append(i)
        if not by_slot:
            return None
        gather, slots, valid, rows = [], [], [], []
        for s, idx in sorted(by_slot.items()):
            for c in range(0, len(idx), CHUNK):
                part = idx[c: c + CHUNK]
                valid.extend(range(len(gather), len(gather) + len(part)))
                rows.extend(part)
                gather.extend(part + [part[0]] * (CHUNK - len(part)))
                slots.append(s)
        t = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
        return LoraStep(t(gather), t(slots), t(valid), t(rows), frozenset(by_slot), t(row_slots))


class LoraSlots:
    """`max_loras` adapters resident at once, in the activation dtype: per layer and fused role, A of its
    modules stacked along the rank [S, M * R, K] (zeros where a slot's adapter has a lower rank or does
    not target the module), each module's B transposed [S, R, out] (a rank's column of outputs contiguous:
    the native step adds 16 outputs at a time) and scaling [S]. `step` is the running step's
    LoraStep (set by LlamaForCausalLM.forward_segments for the length of one forward)."""

    def __init__(self, cfg, max_loras: int, max_rank: int, dtype: torch.dtype, device=None):
        self.cfg, self.max_loras, self.max_rank, self.dtype = cfg, max_loras, max_rank, dtype
        shapes, R = projection_shapes(cfg), max_rank
        self.slices = slices(cfg)
        self.A: dict[tuple[int, str], Tensor] = {}
        self.B: dict[tuple[int, str], Tensor] = {}
        self.scaling: dict[tuple[int, str], Tensor] = {}
        for layer in range(cfg.num_layers):
            for role, modules in ROLE_TARGETS.items():
                k = shapes[modules[0]][0]
                self.A[(layer, role)] = torch.zeros(max_loras, len(modules) * R, k, dtype=dtype, device=device)
                for m in modules:
                    self.B[(layer, m)] = torch.zeros(max_loras, R, shapes[m][1], dtype=dtype, device=device)
                    self.scaling[(layer, m)] = torch.zeros(max_loras, dtype=dtype, device=device)
        # (layer, module) -> slots whose adapter targets it: a step skips modules none of its slots targets
        self.present: dict[tuple[int, str], set[int]] = {}
        self.step: LoraStep | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.A, self.B, self.scaling) for t in d.values())

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Put `adapter` in `slot` (whatever was there is overwritten)."""
        self.clear(slot)
        R = self.max_rank
        for (layer, module), (A, B, scaling) in adapter.modules.items():
            role, j = TARGETS[module]
            r = A.shape[0]
            self.A[(layer, role)][slot, j * R: j * R + r] = A.to(self.dtype)
            self.B[(layer, module)][slot, :r] = B.T.to(self.dtype)
            self.scaling[(layer, module)][slot] = scaling
            self.present.setdefault((layer, module), set()).add(slot)

    def clear(self, slot: int) -> None:
        for t in (*self.A.values(), *self.B.values(), *self.scaling.values()):
            t[slot].zero_()
        for held in self.present.values():
            held.discard(slot)

    def add(self, layer: int, role: str, x: Tensor, y: Tensor) -> Tensor:
        """y (the base's output of `role` for inputs x [..., K]) plus each row's adapter product, in place
        on y's rows that have one."""
        step = self.step
        if step is None:
            return y
        modules = [m for m in ROLE_TARGETS[role] if not step.used.isdisjoint(self.present.get((layer, m), ()))]
        if not modules:
            return y
        R, G = self.max_rank, step.slots.shape[0]
        xs = x.reshape(-1, x.shape[-1])[step.gather].view(G, CHUNK, -1)  # [G, C, K]
        A = self.A[(layer, role)][step.slots]  # [G, M * R, K]
        t = torch.bmm(xs, A.transpose(1, 2))  # [G, C, M * R]
        flat = y.view(-1, y.shape[-1])
        for m in modules:
            j = TARGETS[m][1]
            B = self.B[(layer, m)][step.slots]  # [G, R, out]
            d = torch.bmm(t[:, :, j * R: (j + 1) * R], B)  # [G, C, out]
            d = d * self.scaling[(layer, m)][step.slots].view(G, 1, 1)
            lo, hi = self.slices[m]
            flat[step.rows, lo:hi] += d.view(G * CHUNK, -1)[step.valid]
        return y


__all__ = ["AdapterError", "CHUNK", "LoraAdapter", "LoraSlots", "LoraStep", "TARGETS", "read_peft",
           "projection_shapes"]
