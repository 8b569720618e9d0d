"""Turn a checkpoint (HF directory, GGUF file, catalog name) into a ready model + tokenizer."""

from __future__ import annotations

import ctypes
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import ModelConfig
from .errors import CheckpointNotFoundError
from .attention.backend import NativeCpuBackend, SdpaBackend, choose_backend
from .tuning.compile import CompileResult, compile_model
from .assembly import CheckpointModes, build_model, expected_shapes  # noqa: F401 - build_model, expected_shapes: public here too
from .checkpoints.hf_dir import open_hf_dir
from .linear import fused_ops
from .llama import LlamaForCausalLM
from .native import build as native
from .native import step as native_step
from .cache_dir import default_cache_dir
from .tuning.precision import Plan, parse_dtype, resolve_plan
from .text.tokenizer import Tokenizer

log = logging.getLogger("lmserve.model")


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    config: ModelConfig
    source: Path
    dtype: torch.dtype
    device: torch.device
    plan: Plan | None = None  # the precision mode and per-role kernels served (precision.py)
    compiled: CompileResult | None = None  # whether the layers' non-attention work is compiled (compile.py)
    attention: SdpaBackend | None = None  # the attention backend (attention/backend.py); None: SDPA
    batch_invariant: bool = True  # served only on kernels whose rows do not depend on the batch
    cache_dir: Path | None = None  # where measurements of this machine are cached (precision.py, kv_choice.py)
    # seconds of each start-up phase (read, precision plan, build, compile; the engine adds its own), logged once ready
    phases: dict[str, float] = field(default_factory=dict)
    # start-up measurements of this loaded model kept in memory (by name), where a busy machine kept them
    # off the disk cache: every engine built on it still makes the same choice
    measured: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.attention is None:
            self.attention = SdpaBackend(self.device)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights held in memory (prepacked copies included)."""
        return self.model.weight_bytes()

    @property
    def step_weight_bytes(self) -> int:
        """Bytes of weights a batch-1 decode step reads (the serving linears, the LM head included)."""
        from .linear.serving import step_bytes

        return step_bytes(self.model)

    @property
    def num_parameters(self) -> int:
        """The checkpoint's parameter count (a tied matrix once), however the weights are stored."""
        return sum(math.prod(s) for s in expected_shapes(self.config).values())

    @property
    def mode(self) -> str:
        """e.g. "float32", "bfloat16+int4"."""
        return self.plan.mode.name if self.plan else str(self.dtype).removeprefix("torch.")

    @property
    def choice(self) -> str:
        """How the mode and kernels were chosen and why, e.g. "measured in 40.1s: bfloat16+int4: speed score ..."."""
        if self.plan is None:
            return "default"
        return f"{self.plan.how}: {self.plan.reason}" if self.plan.reason else self.plan.how

    @property
    def kernels(self) -> str:
        """The linear kernels served, e.g. "onednn" or "int4 (qkv/o/gate_up/down), int8 (head)"."""
        text = self.plan.describe() if self.plan else "default"
        if "native-" in text:  # which build of the native quantized kernel runs: avx512-vnni+amx, avx2, ...
            from .linear import quant_matmul
            qm = quant_matmul.default_kernel()
            text += f" on {qm.name}" if qm is not None else ""
        text += ", compiled" if self.compiled is not None and self.compiled.compiled else ""
        text += f", attention: {self.attention.describe()}"
        text += ", fused elementwise" if self.model.uses_fused_ops else ""
        return text + (", steps in one native call" if self.model.native_step is not None else "")


def _glibc():
    """The C library when it is glibc (it has the malloc tuning calls used here), else None."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


def bound_native_caches() -> None:
    """Keep a long-running serving process's memory to its tensors. Call before the first oneDNN op.

    - oneDNN and ideep cache a compiled primitive per GEMM shape, up to 1024 each by default, at
      ~0.6 MB apiece; packed prefill meets a new shape at almost every step. 32 entries keep the
      decode shapes of the current batch size (five per size) hot; a new shape costs ~1 ms once.
      An operator's own setting of either variable wins.
    - glibc returns freed heap to the OS only above a trim threshold that grows with the largest
      block ever freed, and serves blocks above a (growing) mmap threshold with fresh mappings.
      Fixed values keep both bounded: blocks from 8 MB up are mapped and unmapped (a long
      prefill's activations do not stay resident), and at most 16 MB of free heap is kept. A
      lower mmap threshold maps and faults in every step's activations anew: with 128 KB (what
      fixing only the trim threshold leaves) a 512-token bf16 prefill step on the engine thread
      took 231 ms against 190 ms.
    """
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "32")
    os.environ.setdefault("LRU_CACHE_CAPACITY", "32")
    libc = _glibc()
    if libc is not None:
        libc.mallopt(-3, 8 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 16 << 20)  # M_TRIM_THRESHOLD


def release_freed_memory() -> None:
    """Hand memory freed while loading back to the OS (glibc keeps freed heap pages otherwise,
    and resident memory would carry the dequantized originals' footprint for the process's life)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def release_thread_pool() -> None:
    """Free the calling thread's OpenMP worker pool (OpenMP 5's omp_pause_resource_all).

    Every thread that runs a parallel torch op keeps its own pool of workers for the life of the
    thread. While more threads than cores are pooled, libgomp stops spinning between parallel
    regions and hands work over through the kernel instead: measured on a 2-core EPYC, a
    one-row bfloat16 oneDNN linear took 25 us on the only pooled thread and 75 us on a second
    one, and a batch-1 decode step 12.6 ms against 19 ms. The engine steps on its own thread, so
    the thread that loaded the model hands its pool back before the engine starts. A later
    parallel op on that thread builds a new pool (correct, only slower for the engine)."""
    omp = libgomp()
    pause = getattr(omp, "omp_pause_resource_all", None) if omp is not None else None
    if pause is not None:  # else another OpenMP runtime, or none: nothing to release
        pause(1)  # omp_pause_soft


def libgomp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (matched by soname), or None under another runtime or none."""
    try:
        return ctypes.CDLL("libgomp.so.1")
    except OSError:
        return None


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve_device_dtype(device: torch.device | str | None,
                         dtype: torch.dtype | str | None) -> tuple[torch.device, torch.dtype]:
    """The device and dtype a model is served with: the defaults fill what is not given."""
    device = torch.device(device) if device is not None else default_device()
    return device, parse_dtype(dtype) or default_dtype(device)


def read_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """config.json + safetensors (single file or sharded index), or a weights-only torch file, read
    whole into memory (the loader itself reads them as sources: checkpoints/hf_dir.py)."""
    ckpt = open_hf_dir(path)
    try:
        return ckpt.config, {n: src.read(_stored_dtype(src)) for n, src in ckpt.sources.items()}
    finally:
        ckpt.close()


def _stored_dtype(src) -> torch.dtype:
    return {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}.get(src.stored_as, torch.float32)


@dataclass(frozen=True)
class NativeParts:
    """What this device's native library gives a served model, chosen before it is built (native_parts)."""

    attention: SdpaBackend  # the attention backend
    fused_ops: object = None  # linear/fused_ops.FusedOps for bfloat16 norms, RoPE, activations; or None
    step_lib: object = None  # the library for steps in one native call (where the model can take them), or None
    why: str = ""  # how the library came to be, or why there is none

    def log(self, model: LlamaForCausalLM) -> None:
        """One INFO line: the library, the attention backend, the elementwise ops and the step path."""
        why_not = native_step.why_not(model) if self.step_lib is not None else "no native attention"
        if model.native_step is not None:
            steps = "in one native call"
        elif why_not is not None:
            steps = f"eager ({why_not})"
        else:
            steps = "through the compiled layers (--compile true)"
        log.info("native kernels: %s: attention %s, %s RMSNorm/RoPE/gated activation; steps %s", self.why,
                 self.attention.describe(), "fused" if self.fused_ops is not None else "torch", steps)


def native_parts(device: torch.device, cache_dir: Path, dtype: torch.dtype, cfg: ModelConfig,
                 batch_invariant: bool) -> NativeParts:
    """The attention backend for this device, and on CPU the fused elementwise ops (native/build.py's
    library) where they apply and the library for steps in one native call where attention is native."""
    if device.type != "cpu":
        return NativeParts(choose_backend(device, dtype, cfg, batch_invariant))
    lib, why = native.load(cache_dir)  # load(), not build(): the sampler's row max and mask find it there (loaded())
    backend = choose_backend(device, dtype, cfg, batch_invariant, lib)
    fused = (lib is not None and dtype == torch.bfloat16
             and fused_ops.supports(cfg.hidden_size, cfg.head_dim, cfg.intermediate_size))
    if not fused:
        return NativeParts(backend, why=why)
    return NativeParts(backend, fused_ops.FusedOps(lib), lib if isinstance(backend, NativeCpuBackend) else None, why)


@dataclass
class Checkpoint:
    """A checkpoint opened for loading: its config, tokenizer and tensors as sources (read from the
    mapped files on demand). Close it when the model is built."""

    config: ModelConfig
    sources: dict
    tokenizer: Tokenizer
    close: object  # () -> None

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_checkpoint(path: Path) -> Checkpoint:
    """A .gguf file or a Hugging Face directory, opened: nothing is read but its directory, metadata
    and tokenizer."""
    if path.is_file() and path.suffix == ".gguf":
        from .checkpoints.gguf_reader import open_gguf

        ckpt = open_gguf(path)
        try:
            tokenizer = Tokenizer.from_gguf_fields(ckpt.metadata)
        except BaseException:
            ckpt.close()
            raise
        return Checkpoint(ckpt.config, ckpt.sources, tokenizer, ckpt.close)
    if path.is_dir():
        ckpt = open_hf_dir(path)
        try:
            tokenizer = Tokenizer.from_dir(path)
        except BaseException:
            ckpt.close()
            raise
        return Checkpoint(ckpt.config, ckpt.sources, tokenizer, ckpt.close)
    raise CheckpointNotFoundError(f"{path} is neither a .gguf file nor a model directory")


def reference_logits(source: Path, ids: list[int], window: int) -> torch.Tensor:
    """quality.logits_of for the float32 reference of the checkpoint at `source` (streamed a layer at a
    time, as precision.choose measures every mode against it)."""
    from .tuning.precision import reference_plan

    with read_checkpoint(Path(source)) as ckpt:
        try:
            return CheckpointModes(ckpt.config, ckpt.sources).logits(reference_plan(), ids, window)
        finally:
            release_freed_memory()


def load_model(spec: str | Path, dtype: torch.dtype | str | None = None, device: torch.device | str | None = None,
               models_dir: str | Path | None = None, quantization: str | None = None, batch_invariant: bool = True,
               cache_dir: str | Path | None = None, compile: str = "false") -> LoadedModel:
    """Load a catalog name (pulled if missing), a .gguf file, or a Hugging Face directory.

    dtype / quantization: None or "auto" let precision.py measure this machine (cached under
    cache_dir, default $XDG_CACHE_HOME/lmserve); an impossible combination raises PrecisionError
    before anything is read. batch_invariant: only kernels whose rows do not depend on the batch.
    compile: "true", "false" or "auto" (measured, cached): compile the decoder layers' non-attention
    work (compile.py); the default here is eager, the server's default is auto.
    """
    from .checkpoints.catalog import resolve_model
    from .tuning.precision import candidate_modes

    bound_native_caches()
    device = torch.device(device) if device is not None else default_device()
    candidate_modes(device, dtype, quantization)  # refuse an impossible mode before reading anything
    if compile not in ("true", "false", "auto"):
        raise ValueError(f"compile must be true, false or auto, got {compile!r}")
    path = resolve_model(str(spec), models_dir=models_dir)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if device.type == "cpu":
        from .linear import quant_matmul

        quant_matmul.use_cache_dir(cache_dir)  # the native quantized kernel, when measured or planned
    phases, t = {}, time.perf_counter()

    def phase(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        phases[name] = phases.get(name, 0.0) + now - t
        t = now
    with read_checkpoint(path) as ckpt:
        cfg, tokenizer = ckpt.config, ckpt.tokenizer
        modes = CheckpointModes(cfg, ckpt.sources)
        phase("read")
        plan = resolve_plan(modes, tokenizer, path, device, dtype, quantization, batch_invariant, cache_dir)
        release_freed_memory()  # what measuring held
        phase("precision plan")
        parts = native_parts(device, cache_dir, plan.mode.dtype, cfg, batch_invariant)
        phase("native kernels")
        # --compile true: the compiled layers serve every step, not the native step
        model = build_model(cfg, ckpt.sources, plan.mode.dtype, device, plan=plan, fused_ops=parts.fused_ops,
                            native_lib=None if compile == "true" else parts.step_lib)
    if device.type == "cpu":
        parts.log(model)
    release_freed_memory()
    phase("build")
    key = json.dumps([str(path.resolve()), plan.mode.name, plan.kernels, torch.__version__, torch.get_num_threads()])
    model.freeze_attributes()  # the module tree is final now; before compiling, whose guards see the attributes
    compiled = compile_model(model, plan.mode.dtype, device, compile, cache_dir, key)
    phase("compile decision")
    if compiled.compiled or compiled.timings:
        log.info("decoder layers %s: %s (%.1fs)%s", "compiled" if compiled.compiled else "eager", compiled.reason,
                 compiled.seconds, f"; eager vs compiled ms per step's layers {compiled.timings}" if compiled.timings else "")
    return LoadedModel(model=model, tokenizer=tokenizer, config=cfg, source=path, dtype=plan.mode.dtype,
                       device=device, plan=plan, compiled=compiled, attention=parts.attention,
                       batch_invariant=batch_invariant, cache_dir=cache_dir, phases=phases)
