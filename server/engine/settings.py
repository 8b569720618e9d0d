"""Engine settings: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

KV_CACHE_DTYPES = ("auto", "model", "int8")  # --kv-cache-dtype (kv_choice.py)
ATTENTIONS = ("auto", "paged")  # --attention


@dataclass(frozen=True)
class EngineSettings:
    max_batch: int = 256  # requests admitted at once; the KV memory limits the tokens they hold
    max_queue: int = 256  # requests waiting for admission; more are rejected
    max_model_len: int | None = None  # tokens per request (prompt + generated); None = min(model's, 4096)
    kv_cache_gb: float | None = None  # KV memory in GiB; None = a share of RAM on CPU, of free GPU memory on CUDA
    kv_cache_dtype: str = "auto"  # model, int8 (codes + scales, native CPU kernels), auto (kv_choice.py)
    prefix_cache: bool = True  # keep finished requests' K/V and reuse them for prompts that share a prefix
    token_budget: int = 512  # tokens per engine step (decodes + prefill chunk): the upper bound
    max_step_ms: float | None = None  # target step time while requests decode (step_cost.py); None = auto, 0 = off
    max_new_tokens_cap: int = 4096  # largest max_new_tokens a request may ask for
    default_max_new_tokens: int = 256
    stuck_after_seconds: float = 120.0  # a step running longer than this marks the engine stuck
    cuda_graphs: bool = True  # on CUDA, replay decode steps from graphs captured at start (cuda_graphs.py)
    overlap_steps: bool | None = None  # launch step k+1 before step k's tokens are read back; None = on CUDA only
    speculation: str = "auto"  # ngram: verify prompt-lookup drafts (ngram.py); off; auto: ngram where exact
    draft_tokens: int = 8  # most tokens drafted per sequence and step
    draft_max_batch: int = 4  # draft only while at most this many sequences decode
    adaptive_threads: bool = True  # CPU: steps on one thread while other processes keep the cores busy (threads.py)
    # auto: the device's backend (model/attention/backend.choose_backend: paged on CUDA where triton is
    # installed); paged: the paged cache and kernel on any device (on CPU through Triton's interpreter: tests)
    attention: str = "auto"
    lora_modules: tuple[str, ...] = ()  # LoRA adapters served from the start, each NAME=PATH (a PEFT directory)
    lora_dir: str | None = None  # adapters may be loaded and unloaded at runtime from inside this directory
    max_loras: int = 4  # adapters resident at once (each in a slot of max_lora_rank)
    max_lora_rank: int = 16  # the largest rank an adapter's module may have

    @property
    def serves_adapters(self) -> bool:
        return bool(self.lora_modules or self.lora_dir)

    def lora_pairs(self) -> list[tuple[str, str]]:
        """--lora-modules as (name, path) pairs."""
        return [(n.strip(), p.strip()) for n, _, p in (spec.partition("=") for spec in self.lora_modules)]

    @property
    def kv_cache_bytes(self) -> int | None:
        return None if self.kv_cache_gb is None else int(self.kv_cache_gb * 2**30)

    def __post_init__(self):
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTIONS)}, got {self.attention!r}")
        if self.speculation not in ("auto", "ngram", "off"):
            raise ValueError(f"speculation must be auto, ngram or off, got {self.speculation!r}")
        for name in ("max_batch", "token_budget", "max_new_tokens_cap", "default_max_new_tokens", "draft_tokens",
                     "draft_max_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_gb is not None and not self.kv_cache_gb > 0:
            raise ValueError(f"kv_cache_gb must be positive, got {self.kv_cache_gb}")
        if self.max_step_ms is not None and not (self.max_step_ms >= 0 and self.max_step_ms < float("inf")):
            raise ValueError(f"max_step_ms must be >= 0 (0: off), got {self.max_step_ms}")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1")
        if not isinstance(self.lora_modules, tuple):
            object.__setattr__(self, "lora_modules", tuple(self.lora_modules))
        for spec in self.lora_modules:
            name, sep, path = spec.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"lora_modules takes NAME=PATH pairs, got {spec!r}")
        if self.stuck_after_seconds <= 0:
            raise ValueError("stuck_after_seconds must be positive")
