"""Turn a checkpoint (HF directory, GGUF file, catalog name) into a ready model + tokenizer."""

from __future__ import annotations

import ctypes
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ModelConfig
from .errors import CheckpointNotFoundError, ModelLoadError, ShapeMismatchError
from .attention.backend import SdpaBackend, choose_backend
from .tuning.compile import CompileResult, compile_model
from .linear.serving import fuse_linears, planned_linears
from .checkpoints.layout import checkpoint_shapes, expected_shapes, split_fused
from .llama import LlamaForCausalLM
from .cache_dir import default_cache_dir
from .tuning.precision import DTYPES, Plan, parse_dtype, resolve_plan
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
    kv_int8_measured: object = None  # an int8 KV cache's (quality, decode speed-up), measured once (server/engine/kv_choice.py)
    cache_dir: Path | None = None  # where measurements of this machine are cached (precision.py, kv_choice.py)

    def __post_init__(self):
        if self.attention is None:
            self.attention = SdpaBackend(self.device)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights held in memory (prepacked copies included)."""
        return self.model.weight_bytes()

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
        if "native-int" in text:  # which build of the native quantized kernel runs: avx512-vnni+amx, avx2, ...
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
    try:
        omp = ctypes.CDLL("libgomp.so.1")  # the runtime torch loaded (matched by soname)
        omp.omp_pause_resource_all(1)  # omp_pause_soft
    except (OSError, AttributeError):  # another OpenMP runtime, or none: nothing to release
        pass


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve_device_dtype(device: torch.device | str | None,
                         dtype: torch.dtype | str | None) -> tuple[torch.device, torch.dtype]:
    """The device and dtype a model is served with: the defaults fill what is not given."""
    device = torch.device(device) if device is not None else default_device()
    return device, parse_dtype(dtype) or default_dtype(device)


def build_model(cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device | str, prepare: bool = True, plan: Plan | None = None,
                q41: dict | None = None, q80: dict | None = None) -> LlamaForCausalLM:
    """Check names and shapes against the config, then materialize the model (no random init).

    prepare: fuse the linear layers and build them for serving (LlamaForCausalLM.prepare_for_inference):
    with a plan, each role on its planned kernel, built from the float32 weights (and q41 / q80,
    GGUF Q4_0-Q4_1 / Q8_0 blocks by tensor name); without, the default kernel for dtype.
    """
    shapes = expected_shapes(cfg)
    tensors = split_fused(cfg, dict(tensors))  # Phi-3's q|k|v and gate|up: the decoder fuses its own again
    missing = [n for n in shapes if n not in tensors]
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensor(s), first: {missing[0]!r}")
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise ShapeMismatchError(name, shape, tuple(tensors[name].shape))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    # assign: the checkpoint's tensors become the parameters (no second copy of the weights)
    planned = prepare and plan is not None
    state = {n: tensors[n].to(device=device, dtype=torch.float32 if planned else dtype) for n in shapes}
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for attr, blocks_by_name in (("q41", q41), ("q80", q80)):
        for name, blocks in (blocks_by_name or {}).items():
            setattr(model.get_submodule(name.removesuffix(".weight")), attr, blocks)
            if cfg.tie_word_embeddings and name == "model.embed_tokens.weight":
                setattr(model.lm_head, attr, blocks)  # the tied head serves the file's own blocks too
    model = model.eval().requires_grad_(False)
    if prepare:
        model.prepare_for_inference(planned_linears(plan.kernels, dtype) if planned else fuse_linears)
    if planned:
        model.to(dtype)  # what is not a linear (embedding, norms) computes in the mode's dtype
    model.model.rotary.build(device, dtype)
    return model


def read_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """config.json + safetensors (single file or sharded index), or a weights-only torch file."""
    from safetensors.torch import load_file

    if not (path / "config.json").is_file():
        raise CheckpointNotFoundError(f"{path} has no config.json")
    cfg = ModelConfig.from_hf(path / "config.json", name=path.name)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / s for s in shards]
    else:
        files = sorted(path.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    if files:
        for f in files:
            if not f.is_file():
                raise CheckpointNotFoundError(f"shard {f.name} named in {index.name} is missing from {path}")
            tensors.update(load_file(f))
    elif (path / "pytorch_model.bin").is_file():
        tensors = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise CheckpointNotFoundError(f"{path} has no *.safetensors weights")
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    for name, shape in checkpoint_shapes(cfg).items():  # named before a fused tensor is split
        if name in tensors and tuple(tensors[name].shape) != shape:
            raise ShapeMismatchError(name, shape, tuple(tensors[name].shape))
    return cfg, tensors


def attention_and_fused_ops(model: LlamaForCausalLM, device: torch.device, cache_dir: Path, dtype: torch.dtype,
                            cfg: ModelConfig, batch_invariant: bool) -> SdpaBackend:
    """The attention backend for this device, and on CPU the fused elementwise ops (native/build.py) where
    they apply; what was chosen is logged."""
    if device.type != "cpu":
        return choose_backend(device, dtype, cfg, batch_invariant)
    from .linear import fused_ops
    from .native import build as native
    from .native import step as native_step
    from .attention.backend import NativeCpuBackend

    lib, why = native.build(cache_dir)
    backend = choose_backend(device, dtype, cfg, batch_invariant, lib)
    fused = (lib is not None and dtype == torch.bfloat16
             and fused_ops.supports(cfg.hidden_size, cfg.head_dim, cfg.intermediate_size))
    if fused:
        model.use_fused_ops(fused_ops.FusedOps(lib))
    step_why = native_step.why_not(model) if fused and isinstance(backend, NativeCpuBackend) else "no native attention"
    if step_why is None:
        model.native_step = native_step.NativeStep(lib, model)
    log.info("native kernels: %s: attention %s, %s RMSNorm/RoPE/SwiGLU; steps %s", why, backend.describe(),
             "fused" if fused else "torch", "in one native call" if step_why is None else f"eager ({step_why})")
    return backend


def read_checkpoint(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], dict, dict, Tokenizer]:
    """(config, float32 tensors, Q4_0/Q4_1 blocks, Q8_0 blocks, tokenizer) of a .gguf file or a Hugging
    Face directory (no blocks for the latter)."""
    if path.is_file() and path.suffix == ".gguf":
        from .checkpoints.gguf_reader import read_gguf

        ckpt = read_gguf(path, keep_q41=True)
        return ckpt.config, ckpt.tensors, ckpt.q41, ckpt.q80, Tokenizer.from_gguf_fields(ckpt.metadata)
    if path.is_dir():
        cfg, tensors = read_hf_dir(path)
        return cfg, tensors, {}, {}, Tokenizer.from_dir(path)
    raise CheckpointNotFoundError(f"{path} is neither a .gguf file nor a model directory")


def reference_logits(source: Path, ids: list[int], window: int) -> torch.Tensor:
    """quality.logits_of for the float32 reference of the checkpoint at `source` (read again, dense float32
    on the CPU, dropped after): what every lossy path is measured against, as precision.choose does."""
    from .tuning.precision import reference_plan
    from .tuning.quality import logits_of

    cfg, tensors, q41, q80, _ = read_checkpoint(Path(source))
    model = build_model(cfg, tensors, torch.float32, "cpu", plan=reference_plan(), q41=q41, q80=q80)
    del tensors, q41, q80
    try:
        return logits_of(model, ids, window)
    finally:
        del model
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
    cfg, tensors, q41, q80, tokenizer = read_checkpoint(path)

    def build(plan: Plan) -> LlamaForCausalLM:
        return build_model(cfg, tensors, plan.mode.dtype, device, plan=plan, q41=q41, q80=q80)

    probe = build_model(cfg, tensors, torch.float32, "cpu", prepare=False, q41=q41, q80=q80)  # shares the tensors
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if device.type == "cpu":
        from .linear import quant_matmul

        quant_matmul.use_cache_dir(cache_dir)  # the native quantized kernel, when measured or planned
    plan = resolve_plan(probe, tokenizer, path, device, dtype, quantization, batch_invariant, cache_dir, build)
    del probe
    model = build(plan)
    attention = attention_and_fused_ops(model, device, cache_dir, plan.mode.dtype, cfg, batch_invariant)
    del tensors, q41, q80
    release_freed_memory()
    key = json.dumps([str(path.resolve()), plan.mode.name, plan.kernels, torch.__version__, torch.get_num_threads()])
    model.freeze_attributes()  # the module tree is final now; before compiling, whose guards see the attributes
    compiled = compile_model(model, plan.mode.dtype, device, compile, cache_dir, key)
    if compiled.compiled:
        model.native_step = None  # compiled layers serve every step
    if compiled.compiled or compiled.timings:
        log.info("decoder layers %s: %s (%.1fs)%s", "compiled" if compiled.compiled else "eager", compiled.reason,
                 compiled.seconds, f"; eager vs compiled ms per step's layers {compiled.timings}" if compiled.timings else "")
    return LoadedModel(model=model, tokenizer=tokenizer, config=cfg, source=path, dtype=plan.mode.dtype,
                       device=device, plan=plan, compiled=compiled, attention=attention,
                       batch_invariant=batch_invariant, cache_dir=cache_dir)
