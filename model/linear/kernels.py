"""Linear-layer kernels for serving, and the measurement that picks one per layer role on this machine.

A *mode* (precision.py) fixes what the weights are (float32, bfloat16, int8, int4); a *kernel* is
how one multiply with those weights is carried out. Kernels of one mode give the same product up
to float rounding, so choosing among them is a matter of speed and of batch invariance, and both
are measured here, on the model's real shapes, at load:

- dense:  F.linear on a plain weight (torch's BLAS path)
- onednn: the weight reordered once into oneDNN's blocked layout (float32, bfloat16; float16
          only where the CPU has native float16 arithmetic); onednn-m2 runs a lone row as two,
          onednn-c16 also splits calls into chunks of 16 rows, for builds whose one-row or
          large-M paths round differently from the rest
- int8:   torch's weight-only int8 kernel, one scale per output row, bfloat16/float16 activations
- int4:   torch's weight-only int4 kernel, groups of 32 along K with a scale and a zero each
          (GGUF Q4_1 maps onto it as it is; see linear/formats.py), bfloat16 activations
- native-int8 / native-int4: the project's kernel (quant_matmul.py) on GGUF Q8_0 / Q4_0-Q4_1
          blocks, activations quantized per row and block of 32 to two int8 codes (~16 bits),
          integer dot products; its cost grows slowly with the rows (weights are unpacked once
          for up to 12 rows; calls of 12 rows or more take AMX tiles where the CPU and OS offer
          them and the measured rule in quant_matmul.cpp says they gain, with the same bits). native-int8-a8 takes one int8 code per activation (half the dot
          products), for the LM head, whose output the int8 step barely moves. Q8_0 blocks (a step
          per 32 weights) are finer than torch int8's step per row: the mode's quality check
          (precision.py) covers the kernels chosen.
- native-kquant / native-kquant-a8: a GGUF file's own blocks, whatever their type, with two
          activation codes or one: Q4_K, Q5_K and Q6_K on the kernel's K-quant path (kquant_matmul.cpp),
          a fused weight's parts each in its own type; the Q8_0 and Q5_0 (as 8-bit codes, exactly) or
          Q4_0/Q4_1 tensors that llama.cpp's K-quant mixes hold where a row is not a multiple of 256 on
          the int8 / int4 paths above.

Invariance: a kernel is batch-invariant when every output row is bitwise the same whatever other
rows share the call (1 row, a decode batch, a packed prompt). Some GEMMs change their blocking or
reduction order with M at real K (576, 1536) and not at toy sizes, so it is checked on the
model's own weights.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import quant_matmul as QM
from .formats import GROUP, QK_K, KQuantBlocks, Q41Blocks, Q80Blocks, int4_pack, int8_per_channel, quantize_q41, quantize_q80

ROLES = ("qkv", "o", "gate_up", "down", "head")
DECODE_BUCKETS = (1, 8, 32)  # batch sizes the choice is timed at
INVARIANCE_ROWS = (*range(2, 18), 31, 32, 33, 64, 100, 256)  # calls whose rows must equal each row alone
INVARIANCE_ALONE = 64  # rows computed alone for the comparison (rounding differences are data-dependent: many rows)


class ServingLinear(nn.Module):
    """Base of the kernels holding weights in their own layout (buffers, not parameters)."""

    kernel = "?"

    def __init__(self, out_features: int, in_features: int, bias: Tensor | None):
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)

    @property
    def nbytes(self) -> int:
        """Bytes of the weight layout held (buffers + opaque packed tensors)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"


class DenseLinear(ServingLinear):
    kernel = "dense"

    def __init__(self, weight: Tensor, bias: Tensor | None):
        super().__init__(*weight.shape, bias)
        self.register_buffer("weight", weight.detach().contiguous(), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


class OneDNNLinear(ServingLinear):
    kernel = "onednn"

    def __init__(self, weight: Tensor, bias: Tensor | None):
        super().__init__(*weight.shape, bias)
        # opaque oneDNN tensor: a plain attribute (no storage that state_dict or .to() could use)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
        self._bytes = weight.numel() * weight.element_size()

    @property
    def nbytes(self) -> int:
        return self._bytes + super().nbytes

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def sharing(self, variant: type["OneDNNLinear"]) -> "OneDNNLinear":
        """The same packed weight run as another oneDNN variant (OneDNNLinearM2, OneDNNLinearChunked):
        nothing reordered again."""
        twin = copy.copy(self)  # a shallow copy: the same packed tensor and buffers
        twin._buffers = dict(self._buffers)
        twin.__class__ = variant
        return twin


class OneDNNLinearM2(OneDNNLinear):
    """oneDNN with a lone row computed as the first of two: some oneDNN builds take a different
    (GEMV) path for one row, whose rounding differs from every M >= 2 (measured: float32 at K=1536
    on an AVX-512 EPYC and on an AMX Xeon). Padding costs one extra row at batch 1 only."""

    kernel = "onednn-m2"
    chunk = 0  # > 0: rows go through in chunks of at most this many (OneDNNLinearChunked)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.numel() // x.shape[-1]
        if rows == 1:
            x2 = x.reshape(1, -1).expand(2, -1)  # [2, K]
            return super().forward(x2)[:1].reshape(*x.shape[:-1], self.out_features)
        if not self.chunk or rows <= self.chunk:
            return super().forward(x)
        flat = x.reshape(rows, -1)
        parts = [super(OneDNNLinearM2, self).forward(flat[i: i + self.chunk]) for i in range(0, rows, self.chunk)]
        if parts[-1].shape[0] == 1:  # a lone last row: the two-row path too
            parts[-1] = self.forward(flat[-1:])
        return torch.cat(parts).reshape(*x.shape[:-1], self.out_features)


class OneDNNLinearChunked(OneDNNLinearM2):
    """oneDNN over chunks of at most 16 rows (a lone row run as two): for builds that switch to a
    differently rounding blocking at larger M (measured: bfloat16 at K=1536 from M=31 on an
    AVX-512 EPYC). Costs prefill speed on the layers that need it; decode batches are small."""

    kernel = "onednn-c16"
    chunk = 16


# The weight-only kernels as opaque custom ops: a compiled step (compile.py) then calls them as they
# are instead of letting the compiler decompose them into a dequantize + matmul.
@torch.library.custom_op("lmserve::int8_mm", mutates_args=())
def int8_mm(x: Tensor, qweight: Tensor, scale: Tensor) -> Tensor:
    return int8_mm_eager(x, qweight, scale)


@int8_mm.register_fake
def _(x, qweight, scale):
    return x.new_empty(x.shape[0], qweight.shape[0])


@torch.library.custom_op("lmserve::int4_mm", mutates_args=())
def int4_mm(x: Tensor, packed: Tensor, scale_zero: Tensor) -> Tensor:
    return int4_mm_eager(x, packed, scale_zero)


@int4_mm.register_fake
def _(x, packed, scale_zero):
    return x.new_empty(x.shape[0], scale_zero.shape[1])


# The eager calls go to torch's C bindings directly: through torch.ops' Python op objects, or the
# custom ops above, a call costs ~1 / ~5 us more, at 121 linears a decode step.
def int8_mm_eager(x: Tensor, qweight: Tensor, scale: Tensor) -> Tensor:
    return torch._weight_int8pack_mm(x.contiguous(), qweight, scale)


def int4_mm_eager(x: Tensor, packed: Tensor, scale_zero: Tensor) -> Tensor:
    return torch._weight_int4pack_mm_for_cpu(x.contiguous(), packed, GROUP, scale_zero)


def weight_only(linear: ServingLinear, x: Tensor, op, eager, *weights: Tensor) -> Tensor:
    """x [..., K] through a weight-only kernel: `op` (the custom op) inside a compiled graph, `eager`
    (torch's C binding) otherwise; bias added."""
    flat = x.reshape(-1, linear.in_features)
    y = (op if torch.compiler.is_compiling() else eager)(flat, *weights)  # [M, N]
    y = y.view(*x.shape[:-1], linear.out_features)
    return y if linear.bias is None else y + linear.bias


class Int8Linear(ServingLinear):
    kernel = "int8"

    def __init__(self, rows: tuple[Tensor, Tensor], bias: Tensor | None):
        q, scale = rows  # int8_per_channel's codes and scales
        super().__init__(*q.shape, bias)
        self.register_buffer("qweight", q, persistent=False)  # [N, K] int8
        self.register_buffer("scale", scale, persistent=False)  # [N]

    def forward(self, x: Tensor) -> Tensor:
        return weight_only(self, x, int8_mm, int8_mm_eager, self.qweight, self.scale)


class Int4Linear(ServingLinear):
    kernel = "int4"

    def __init__(self, blocks: Q41Blocks, bias: Tensor | None, dtype: torch.dtype):
        super().__init__(*blocks.q.shape, bias)
        packed, scale_zero = int4_pack(blocks, dtype)
        self.register_buffer("packed", packed, persistent=False)  # [N, K/2] uint8
        self.register_buffer("scale_zero", scale_zero, persistent=False)  # [K/32, N, 2]

    def forward(self, x: Tensor) -> Tensor:
        return weight_only(self, x, int4_mm, int4_mm_eager, self.packed, self.scale_zero)


@torch.library.custom_op("lmserve::native_qmm", mutates_args=())
def native_qmm(x: Tensor, packed: Tensor, bits: int, n: int, precise: bool) -> Tensor:
    return native_qmm_eager(x, packed, bits, n, precise)


@native_qmm.register_fake
def _(x, packed, bits, n, precise):
    return x.new_empty(x.shape[0], n)


def native_qmm_eager(x: Tensor, packed: Tensor, bits: int, n: int, precise: bool) -> Tensor:
    return QM.default_kernel()(x, packed, bits, n, precise)


class NativeQuantLinear(ServingLinear):
    """GGUF-style blocks on the native kernel (quant_matmul.py): Q4_0/Q4_1 (bits 4), Q8_0 (bits 8), or
    K-quant tensors fused along N, each in its own type (Q4_K/Q5_K/Q6_K: bits KQUANT_BITS); precise:
    activations as two int8 codes (~16 bits), else one."""

    def __init__(self, blocks: Q41Blocks | Q80Blocks | list[KQuantBlocks], bias: Tensor | None, precise: bool = True):
        kquant = isinstance(blocks, list)
        n, k = (sum(b.shape[0] for b in blocks), blocks[0].shape[1]) if kquant else tuple(blocks.q.shape)
        super().__init__(n, k, bias)
        QM.kernel_or_raise()
        if not QM.QuantMatmul.supports(n, k) or (kquant and k % QK_K):
            raise ValueError(f"the native quantized kernel needs N % {QM.GROUP_COLS} and K % {QK_K if kquant else GROUP} "
                             f"to be 0, got N={n}, K={k}")
        self.bits = QM.KQUANT_BITS if kquant else 4 if isinstance(blocks, Q41Blocks) else 8
        self.precise = precise
        self.kernel = ("native-kquant" if kquant else f"native-int{self.bits}") + ("" if precise else "-a8")
        packed = QM.pack_kquant(blocks) if kquant else QM.pack_q4(blocks) if self.bits == 4 else QM.pack_q8(blocks)
        self.register_buffer("packed", packed, persistent=False)  # uint8, the kernel's layout

    def forward(self, x: Tensor) -> Tensor:
        return weight_only(self, x, native_qmm, native_qmm_eager, self.packed, self.bits, self.out_features,
                           self.precise)

    def with_codes(self, precise: bool) -> "NativeQuantLinear":
        """The same packed weight with activations as two int8 codes (precise) or one: the sibling kernel,
        sharing this one's buffers (nothing quantized or packed again)."""
        twin = copy.copy(self)  # a shallow copy: the same buffer tensors
        twin._buffers = dict(self._buffers)
        twin.precise = precise
        twin.kernel = self.kernel.removesuffix("-a8") + ("" if precise else "-a8")
        return twin


@dataclass
class WeightSource:
    """What a serving linear is built from: the weight [N, K] and, for GGUF Q4_0/Q4_1, Q8_0 or K-quant
    tensors, their blocks (K-quants: one per part of a fused weight, each in its own type). The weight is either held (float32) or read from its checkpoint when a kernel needs
    floats (`parts`: a reader per row block, e.g. q, k and v of a fused projection), so that building a
    kernel from a file's own blocks reads no floats at all, and quantizing a role holds one part's floats
    at a time."""

    weight: Tensor | None  # [N, K] float32 held, or None: read from `parts` when needed
    bias: Tensor | None = None
    q41: Q41Blocks | None = None
    q80: Q80Blocks | None = None
    kq: list[KQuantBlocks] | None = None
    parts: tuple = ()  # readers () -> float32 [n_i, K] of the row blocks, when the weight is not held
    shape: tuple[int, int] | None = None

    def __post_init__(self):
        if self.weight is not None:
            self.shape = tuple(self.weight.shape)
            held = self.weight  # not `self`: a reader holding its own source would free neither until a gc pass
            self.parts = (lambda: held,)

    @staticmethod
    def of(weight: Tensor | None, bias: Tensor | None, blocks, **kw) -> "WeightSource":
        """A source whose file blocks (a TensorSource's blocks(): Q41Blocks, Q80Blocks, KQuantBlocks or
        None) go to the field of their format."""
        fields = {Q41Blocks: "q41", Q80Blocks: "q80", KQuantBlocks: "kq"}
        held = {} if blocks is None else {fields[type(blocks)]: [blocks] if isinstance(blocks, KQuantBlocks) else blocks}
        return WeightSource(weight, bias, **held, **kw)

    def file_blocks(self):
        """The file's own blocks of every part (K-quant, Q8_0-coded or Q4_1-coded), or None."""
        return next((b for b in (self.kq, self.q80, self.q41) if b is not None), None)

    def floats(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weight [N, K] in `dtype` (each part read and converted in turn)."""
        if len(self.parts) == 1:
            return self.parts[0]().to(dtype)
        return torch.cat([part().to(dtype) for part in self.parts])

    def quantized(self, quantize):
        """`quantize` (a per-row recipe: rows never mix) applied part by part and the blocks joined:
        the same blocks as quantizing the whole weight, holding one part's floats at a time."""
        if len(self.parts) == 1:
            return quantize(self.parts[0]())
        blocks = [quantize(part()) for part in self.parts]
        if isinstance(blocks[0], tuple):  # tensors by row, e.g. int8_per_channel's (codes, scales)
            return tuple(torch.cat(rows) for rows in zip(*blocks))
        return type(blocks[0]).cat(blocks)

    @staticmethod
    def cat(parts: list["WeightSource"]) -> "WeightSource":
        if len(parts) == 1:
            return parts[0]
        bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
        q41 = Q41Blocks.cat([p.q41 for p in parts]) if all(p.q41 is not None for p in parts) else None
        q80 = Q80Blocks.cat([p.q80 for p in parts]) if all(p.q80 is not None for p in parts) else None
        kq = [b for p in parts for b in p.kq] if all(p.kq is not None for p in parts) else None
        shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
        return WeightSource(None, bias, q41, q80, kq, parts=tuple(r for p in parts for r in p.parts), shape=shape)


def build(kernel: str, src: WeightSource, dtype: torch.dtype) -> nn.Module:
    """A serving linear of `kernel` computing in `dtype` from `src`."""
    bias = None if src.bias is None else src.bias.to(dtype)
    if kernel == "dense":
        return DenseLinear(src.floats(dtype), bias)
    if kernel == "onednn":
        return OneDNNLinear(src.floats(dtype), bias)
    if kernel == "onednn-m2":
        return OneDNNLinearM2(src.floats(dtype), bias)
    if kernel == "onednn-c16":
        return OneDNNLinearChunked(src.floats(dtype), bias)
    if kernel == "int8":
        return Int8Linear(src.quantized(lambda w: int8_per_channel(w, dtype)), bias)
    if kernel.startswith(("int4", "native-int")) and src.shape[1] % GROUP:
        raise ValueError(f"{kernel} needs the input size to be a multiple of {GROUP}, got {src.shape[1]}")
    if kernel == "int4":
        return Int4Linear(src.q41 if src.q41 is not None else src.quantized(quantize_q41), bias, dtype)
    if kernel in ("native-int4", "native-int4-a8"):
        blocks = src.q41 if src.q41 is not None else src.quantized(lambda w: quantize_q41(w).half_steps())
        return NativeQuantLinear(blocks, bias, precise=kernel == "native-int4")
    if kernel in ("native-kquant", "native-kquant-a8"):
        if src.file_blocks() is None:
            raise ValueError("native-kquant serves a GGUF file's own blocks; this weight has none of one format")
        return NativeQuantLinear(src.file_blocks(), bias, precise=kernel == "native-kquant")
    if kernel in ("native-int8", "native-int8-a8"):
        return NativeQuantLinear(src.q80 if src.q80 is not None else src.quantized(quantize_q80), bias,
                                 precise=kernel == "native-int8")
    raise ValueError(f"unknown kernel {kernel!r}")


def onednn_supports(dtype: torch.dtype) -> bool:
    """Whether oneDNN takes weights of this dtype here (float16 needs native float16 arithmetic)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 32, dtype=dtype))
        torch.ops.mkldnn._linear_pointwise(torch.zeros(2, 32, dtype=dtype), w, None, "none", [], "")
        return True
    except RuntimeError:
        return False


def candidates(quantization: str, dtype: torch.dtype, role: str, device: torch.device) -> list[str]:
    """Kernels that compute `role` in this mode: the same product up to rounding, but for the native
    ones' GGUF blocks and int8-coded activations (see above; quality is checked per plan)."""
    native = device.type == "cpu" and QM.default_kernel() is not None
    if quantization == "kquant":  # the file's own K-quant blocks, one activation code or two; the head may be int8
        if role != "head":
            return ["native-kquant", "native-kquant-a8"] if native else []
        return [*(["native-kquant-a8"] if native else []), "int8", *(["native-int8-a8"] if native else [])]
    if role == "head" and quantization in ("int8", "int4"):  # the LM head stays int8 in int4 mode (GGUF: Q8_0)
        return ["int8", *(["native-int8-a8"] if native else [])]
    if quantization == "int8":
        return ["int8", *(["native-int8"] if native else [])]
    if quantization == "int4":  # one centred activation code or two: the faster within the quality bounds
        return ["int4", *(["native-int4", "native-int4-a8"] if native else [])]
    if device.type != "cpu":
        return ["dense"]
    return ["dense", "onednn", "onednn-m2", "onednn-c16"] if onednn_supports(dtype) else ["dense"]


# ---- measurement ------------------------------------------------------------------------------
def rows_invariant(layer: nn.Module, in_features: int, dtype: torch.dtype, seed: int = 0) -> bool:
    """True when each output row is bitwise the same computed alone and among 2..256 rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(max(INVARIANCE_ROWS), in_features, generator=g).to(dtype)
    with torch.inference_mode():
        alone = torch.cat([layer(x[i: i + 1]) for i in range(INVARIANCE_ALONE)])  # [64, N]
        return all(torch.equal(layer(x[:m])[:INVARIANCE_ALONE], alone[:m]) for m in INVARIANCE_ROWS)


def time_layers(layers: list[nn.Module], rows: int, dtype: torch.dtype, repeats: int = 3) -> float:
    """Fastest of `repeats` passes of `rows` rows through every layer, in seconds."""
    return time_candidates({"x": layers}, (rows,), dtype, repeats)["x"][rows]


CLEAR_LEAD = 1.25  # a ranking is settled early when the fastest candidate leads by this factor beyond the noise
TIMING_COUNTS = {"passes": 0, "early_stops": 0}  # passes timed through a candidate's layers (start-up reports)


def _warm_up_layers(layers: list[nn.Module]) -> list[nn.Module]:
    """One layer of each weight shape and kernel class: the first call of a shape creates its primitive
    and scratch and first-touches its output; the other layers' weights were written when built."""
    seen: dict[tuple, nn.Module] = {}
    for m in layers:
        seen.setdefault((type(m), m.in_features, getattr(m, "out_features", None)), m)
    return list(seen.values())


def ranking_settled(samples: dict[str, dict[int, list[float]]], lead: float = CLEAR_LEAD) -> bool:
    """Whether more repeats could not change which candidate is fastest (pick's speed score): the
    noise is the largest spread (slowest / fastest pass) any candidate showed at any bucket, and the
    fastest by its best passes must lead every other by `lead` times that noise. A neighbour can only
    slow a pass down, so a candidate's best pass bounds its time from above: a lead wider than every
    spread seen is not one that another pass could close."""
    if len(samples) < 2:
        return False
    noise = max(max(s) / max(min(s), 1e-12) for per in samples.values() for s in per.values())
    best = {k: {b: min(s) for b, s in per.items()} for k, per in samples.items()}
    at = {b: min(t[b] for t in best.values()) for b in next(iter(best.values()))}
    scores = sorted(speed_score(t, at) for t in best.values())
    return scores[1] > scores[0] * noise * lead


def time_candidates(sets: dict[str, list[nn.Module]], buckets, dtype: torch.dtype,
                    repeats: int = 5, min_repeats: int | None = None) -> dict[str, dict[int, float]]:
    """Seconds per pass of each bucket's rows through every layer of each candidate set.

    The candidates take turns within every repeat and each keeps its fastest pass: on a shared
    machine a slow pass measures the neighbours, and taking turns exposes every candidate to the
    same neighbours. min_repeats (< repeats): after that many repeats, stop once the fastest
    candidate's lead is beyond the noise (ranking_settled); the times are then kept for ranking
    kernels of one role, not for comparing modes (a single candidate always takes every repeat)."""
    ins = {n: torch.randn(max(buckets), n).to(dtype) for ls in sets.values() for n in {m.in_features for m in ls}}
    samples = {k: {b: [] for b in buckets} for k in sets}
    with torch.inference_mode():
        for layers in sets.values():
            for b in buckets:
                for m in _warm_up_layers(layers):
                    m(ins[m.in_features][:b])  # warm-up: primitive creation, first-touch of the output
        for r in range(repeats):
            for name, layers in sets.items():
                for b in buckets:
                    t0 = time.perf_counter()
                    for m in layers:
                        m(ins[m.in_features][:b])
                    samples[name][b].append(time.perf_counter() - t0)
                    TIMING_COUNTS["passes"] += 1
            if min_repeats is not None and r + 1 >= min_repeats and r + 1 < repeats and ranking_settled(samples):
                TIMING_COUNTS["early_stops"] += 1
                break
    return {k: {b: min(s) for b, s in per.items()} for k, per in samples.items()}


@dataclass
class RoleMeasurement:
    kernel: str
    seconds: dict[int, float]  # per decode bucket, summed over the timed layers of this role
    invariant: bool | None  # None: not checked (a faster kernel was chosen first)


FLOAT_KERNELS = frozenset({"dense", "onednn", "onednn-m2", "onednn-c16"})


ONEDNN_VARIANTS = {"onednn": OneDNNLinear, "onednn-m2": OneDNNLinearM2, "onednn-c16": OneDNNLinearChunked}


def _build_candidates(kernels: list[str], sources: list[WeightSource], dtype: torch.dtype) -> dict[str, list[nn.Module]]:
    """kernel -> its linears on these weights, for the kernels that take them here. The float kernels
    share one read of the weights in dtype, and the oneDNN variants one reordered weight (sharing); a
    native kernel's one-code and two-code variants share one packed weight (with_codes)."""
    if FLOAT_KERNELS.intersection(kernels):
        floats = [WeightSource(s.floats(dtype), s.bias) for s in sources]
    sets = {}
    for kernel in kernels:
        sibling = kernel.removesuffix("-a8") if kernel.endswith("-a8") else f"{kernel}-a8"
        if kernel.startswith("native") and sibling in sets:
            sets[kernel] = [m.with_codes(precise=not kernel.endswith("-a8")) for m in sets[sibling]]
            continue
        packed = next((k for k in ONEDNN_VARIANTS if k in sets), None) if kernel in ONEDNN_VARIANTS else None
        if packed is not None:
            sets[kernel] = [m.sharing(ONEDNN_VARIANTS[kernel]) for m in sets[packed]]
            continue
        try:
            sets[kernel] = [build(kernel, s, dtype) for s in (floats if kernel in FLOAT_KERNELS else sources)]
        except (RuntimeError, ValueError):  # the kernel does not take this shape or dtype here
            continue
    return sets


def measure_role(kernels: list[str], sources: list[WeightSource], dtype: torch.dtype, batch_invariant: bool = True,
                 buckets=DECODE_BUCKETS, verify: bool = True) -> tuple[list[RoleMeasurement], RoleMeasurement | None]:
    """Time each candidate kernel on these weights (one per layer) at every bucket, then take the
    fastest (pick) whose rows are batch-invariant when that is required; invariance is checked in
    that order only as far as needed (verify_role). Returns (all measurements, the choice or None).
    verify=False: the fastest is returned unchecked (invariant None), for verify_role to check later
    if its mode can win at all; the linears built for timing are dropped on return."""
    sets = _build_candidates(kernels, sources, dtype)
    times = time_candidates(sets, buckets, dtype, repeats=2 if len(sets) == 1 else 3, min_repeats=2)
    measured = [RoleMeasurement(k, times[k], None) for k in sets]
    if not batch_invariant or not verify:
        return measured, pick(measured, batch_invariant=False)
    return measured, verify_role(measured, lambda kernel: sets[kernel][0], dtype)


def verify_role(measured: list[RoleMeasurement], first, dtype: torch.dtype) -> RoleMeasurement | None:
    """The fastest of a role's timed kernels (pick) whose rows are batch-invariant (rows_invariant on
    `first(kernel)`, its linear on the role's first timed weight), checking kernels in that order only
    as far as needed and recording each verdict in its measurement; None when none is invariant."""
    while True:
        best = pick([m for m in measured if m.invariant is not False], batch_invariant=False)
        if best is None or best.invariant:
            return best
        layer = first(best.kernel)
        best.invariant = rows_invariant(layer, layer.in_features, dtype)


BUCKET_WEIGHTS = {1: 2.0}  # batch 1 weighs as much as the other buckets together; the rest 1 each


def speed_score(seconds: dict[int, float], best: dict[int, float]) -> float:
    """Mean over the buckets of time relative to the best at that bucket, batch 1 weighted by
    BUCKET_WEIGHTS: 1.0 is fastest everywhere. A lone user (batch 1) is the first thing anyone
    tries, so a kernel or mode slow at batch 1 cannot win on large batches alone (with equal
    weights, bfloat16 beat int4 on a 2-core EPYC while serving one stream at half int4's rate)."""
    w = {b: BUCKET_WEIGHTS.get(b, 1.0) for b in best}
    return sum(w[b] * seconds[b] / (best[b] or 1e-9) for b in best) / sum(w.values())


def pick(measured: list[RoleMeasurement], batch_invariant: bool) -> RoleMeasurement | None:
    """The fastest allowed kernel by speed_score (time relative to the best at each bucket, batch 1
    weighted)."""
    allowed = [m for m in measured if m.invariant or not batch_invariant]
    if not allowed:
        return None
    best = {b: min(m.seconds[b] for m in allowed) for b in allowed[0].seconds}
    return min(allowed, key=lambda m: speed_score(m.seconds, best))


__all__ = ["ROLES", "DECODE_BUCKETS", "ServingLinear", "DenseLinear", "OneDNNLinear", "OneDNNLinearM2", "OneDNNLinearChunked", "Int8Linear", "Int4Linear",
           "NativeQuantLinear",
           "WeightSource", "build", "candidates", "onednn_supports", "rows_invariant", "time_layers", "time_candidates",
           "measure_role", "verify_role", "ranking_settled", "TIMING_COUNTS", "pick", "speed_score", "BUCKET_WEIGHTS", "RoleMeasurement", "native_qmm"]
