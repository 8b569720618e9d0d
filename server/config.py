"""Server settings from CLI flags, each defaulting to an LMSERVE_* environment variable. No torch here.

`ServerSettings` holds the process's own settings (model, network, TLS, lifecycle) and an
`EngineSettings` for the engine; both dataclasses' fields become flags of `lmserve serve`.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields

from .engine.settings import EngineSettings


@dataclass(frozen=True)
class ServerSettings:
    model: str = "smollm2"
    models_dir: str | None = None
    dtype: str = "auto"  # auto: bfloat16 on CUDA; on CPU measured with --quantization (model/tuning/precision.py)
    quantization: str = "auto"  # auto, none, int8, int4 or kquant (weight-only; CPU)
    batch_invariant: bool = True  # only kernels whose output rows do not depend on the batch
    compile: str = "auto"  # compile the layers' work between attentions (CPU): auto = measured, cached
    cache_dir: str | None = None  # kernel choices (and compiled code) per machine; None = $XDG_CACHE_HOME/lmserve
    device: str | None = None  # None: cuda if available, else cpu
    host: str = "127.0.0.1"
    port: int = 50051  # 0: any free port, logged when bound
    http_port: int = 8000  # the OpenAI-compatible HTTP API, on --host; 0 disables it, -1 binds any free port (logged)
    http_max_connections: int = 1024  # open HTTP connections at once; beyond: 503 at once
    http_keep_alive_timeout: float = 30.0  # seconds an idle HTTP keep-alive connection is kept
    http_read_timeout: float = 30.0  # seconds a request's headers and then its body may take to arrive
    metrics_host: str | None = None  # None: same as host
    metrics_port: int = 9400  # 0 disables the metrics endpoint
    threads: int | None = None  # torch intra-op threads on CPU; None = torch's default
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None  # set: clients must present a certificate signed by it (mutual TLS)
    auth_tokens_file: str | None = None
    grace_period: float = 30.0  # seconds in-flight streams get to finish on SIGTERM
    max_receive_message_bytes: int = 4 * 2**20
    max_input_chars: int | None = None  # None: 32 characters per token of context
    input_workers: int = 2  # threads that tokenize, render and validate inputs off the event loop
    stream_idle_timeout: float = 60.0  # seconds a write to a stream may wait for its reader; 0 = no limit
    max_concurrent_rpcs: int = 1024  # calls in progress at once; beyond: RESOURCE_EXHAUSTED
    max_concurrent_streams: int = 256  # calls at once on one HTTP/2 connection
    max_connection_age: float = 1800.0  # seconds before a connection is asked to go (GOAWAY); 0 = never
    max_connection_age_grace: float = 600.0  # seconds its calls then get to finish
    max_connection_idle: float = 900.0  # seconds a connection without calls is kept; 0 = forever
    max_health_watchers: int = 64  # concurrent grpc.health.v1 Watch calls
    log_level: str = "INFO"
    served_model_name: str | None = None  # comma-separated names the HTTP API answers to; None: the --model name
    chat_template: str | None = None  # a Jinja2 chat template file served instead of the model's own
    strict_openai_fields: bool = False  # refuse (400) top-level fields the OpenAI edge does not know
    responses_store_max: int = 1000  # Responses API: responses kept for previous_response_id (0: none)
    responses_store_ttl: float = 3600.0  # Responses API: seconds a stored response is kept
    engine: EngineSettings = field(default_factory=EngineSettings)

    def __post_init__(self):
        if not (0 <= self.port < 65536) or not (0 <= self.metrics_port < 65536):
            raise ValueError("ports must be in 0..65535 (port 0: any free port; metrics_port 0 disables metrics)")
        if not (-1 <= self.http_port < 65536):
            raise ValueError("--http-port must be in 1..65535 (0 disables the HTTP API, -1 binds any free port)")
        if self.http_port > 0 and self.http_port == self.port:
            raise ValueError("--http-port and --port must differ")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        if self.grace_period < 0:
            raise ValueError("--grace-period must be >= 0")
        for name in ("http_keep_alive_timeout", "http_read_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 (seconds)")
        for name in ("stream_idle_timeout", "max_connection_age", "max_connection_age_grace", "max_connection_idle"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (seconds)")
        for name in ("input_workers", "http_max_connections", "max_concurrent_rpcs", "max_concurrent_streams", "max_health_watchers"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.responses_store_max < 0 or not self.responses_store_ttl > 0:
            raise ValueError("--responses-store-max must be >= 0 and --responses-store-ttl > 0 (seconds)")
        if self.max_input_chars is not None and self.max_input_chars < 1:
            raise ValueError("--max-input-chars must be >= 1")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.compile not in ("auto", "true", "false"):
            raise ValueError(f"--compile must be auto, true or false, got {self.compile!r}")
        if self.served_model_name is not None and not served_names(self.served_model_name):
            raise ValueError("--served-model-name needs at least one name (comma-separated)")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {self.quantization!r}")


def served_names(value: str) -> tuple[str, ...]:
    """The names of --served-model-name ("a,b"), in order, without blanks or repeats."""
    return tuple(dict.fromkeys(n.strip() for n in value.split(",") if n.strip()))


DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16")
QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4", "kquant")


HELP = {
    "model": "catalog name (see `lmserve models`), a .gguf file, or a Hugging Face model directory",
    "models_dir": "where pulled models live (default: $XDG_CACHE_HOME/lmserve/models)",
    "dtype": "auto, float32, bfloat16 or float16; auto: bfloat16 on CUDA, on CPU the fastest mode within the "
             "quality bounds, measured at first start and cached (float32 is the token-exact reference)",
    "quantization": "auto, none, int8, int4 or kquant: weight-only quantization on CPU (computes in bfloat16; "
                    "a GGUF file's Q4_0/Q4_1 weights are served as they are in int4, Q8_0 in int8, and its "
                    "Q4_K/Q5_K/Q6_K tensors each in its own type in kquant); auto measures, as for --dtype",
    "batch_invariant": "serve only kernels whose rows do not depend on the batch (a request's greedy tokens "
                       "are then the same alone or batched): true or false",
    "compile": "auto, true or false: compile the decoder layers' work between attentions on CPU (torch.compile, "
               "needs a C++ compiler); auto compiles at first start, keeps it only if measured faster, and caches both",
    "cache_dir": "where measured kernel choices, compiled code and the native CPU kernels built for this machine "
                 "are cached (default: $XDG_CACHE_HOME/lmserve)",
    "device": "cpu, cuda or cuda:N (default: cuda when available)",
    "host": "address the gRPC and HTTP servers bind (0.0.0.0 for all interfaces)",
    "port": "gRPC port (0: any free port, logged when bound)",
    "http_port": "port of the HTTP API (/v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, /v1/models; "
                 "probes /health and /ready), bound on --host with the same TLS and tokens as gRPC "
                 "(0 disables it; -1 binds any free port, which the startup log names)",
    "http_max_connections": "open HTTP connections at once; more are answered 503",
    "http_keep_alive_timeout": "seconds an idle HTTP keep-alive connection is kept open",
    "http_read_timeout": "seconds an HTTP request's headers, and then its body, may take to arrive "
                         "(a slow client cannot hold a connection open without sending)",
    "metrics_host": "address of the /metrics endpoint (default: --host)",
    "metrics_port": "Prometheus /metrics port (0 disables it)",
    "max_batch": "most requests admitted at once (the KV memory limits the tokens they hold)",
    "max_queue": "most requests waiting for admission; beyond it calls get RESOURCE_EXHAUSTED",
    "max_new_tokens_cap": "largest max_new_tokens a request may ask for",
    "default_max_new_tokens": "max_new_tokens when a request leaves it 0",
    "max_model_len": "tokens per request, prompt + generated (default: the model's, at most 4096)",
    "kv_cache_gb": "KV cache budget in GiB: the most K/V memory held, prefix cache included "
                   "(default: 20%% of RAM on CPU, 90%% of free memory after weights on CUDA)",
    "kv_cache_dtype": "what the KV cache holds: model (the model's dtype), int8 (codes with one scale per position "
                      "and head: nearly twice the tokens per GiB, half the bytes for decode attention; needs a "
                      "bfloat16 model on the native CPU attention kernels) or auto (int8 where it can serve and "
                      "its measured quality on the held-out text stays within bounds, else model)",
    "prefix_cache": "reuse cached K/V of earlier requests for prompts sharing a prefix: true or false",
    "stuck_after_seconds": "an engine step running longer than this marks the server NOT_SERVING",
    "token_budget": "most tokens per engine step (decode rows + prefill chunk); the largest prefill chunk",
    "max_step_ms": "target engine step time in ms while requests are decoding: a prompt's prefill is cut into "
                   "chunks that fit it, sized from measured step costs (default: 2.5x the measured decode-only "
                   "step; 0: off, every chunk is --token-budget)",
    "cuda_graphs": "on CUDA, replay decode steps from CUDA graphs captured at start-up: true or false",
    "overlap_steps": "launch each engine step before the previous one's tokens are read back, so the host's "
                     "scheduling and output work overlaps the device's compute: auto (on CUDA only), true or false",
    "speculation": "auto, ngram or off: draft tokens for greedy requests from earlier text of the same request "
                   "(prompt lookup) and verify them in the step, several tokens per step where text repeats; the "
                   "tokens are exactly those of decoding one at a time. auto: ngram with batch-invariant kernels "
                   "and the sequential loop (CPU), else off",
    "draft_tokens": "most tokens drafted per request and step (--speculation)",
    "draft_max_batch": "draft only while at most this many requests decode (a fuller step gains little)",
    "threads": "torch CPU threads (default: torch's choice)",
    "lora_modules": "LoRA adapters to serve, one or more NAME=PATH (a PEFT directory: adapter_config.json and "
                    "adapter_model.safetensors); a request chooses one by its model name (docs/lora.md)",
    "lora_dir": "allow loading and unloading LoRA adapters at runtime (POST /v1/load_lora_adapter, "
                "/v1/unload_lora_adapter, gRPC LoadLoraAdapter), from inside this directory only",
    "max_loras": "LoRA adapters resident at once; the least recently used one no running request holds is "
                 "evicted for another (and read again from its path when asked for)",
    "max_lora_rank": "the largest LoRA rank served (adapters with a higher rank are refused at load)",
    "adaptive_threads": "on CPU, run engine steps on one thread while other processes keep this machine's cores "
                        "busy (seen in the kernel's count of this process's preemptions), and on all --threads again "
                        "once the cores are free; the tokens are the same either way: true or false",
    "attention": "auto or paged: the attention and KV cache layout. auto: the device's (on CUDA the paged kernel "
                 "over a page pool where triton is installed, else SDPA over a dense cache; on CPU the native kernels); "
                 "paged: the paged cache and kernel on any device (on CPU run by Triton's interpreter: for tests, slow)",
    "tls_cert": "PEM certificate chain: serve TLS",
    "tls_key": "PEM private key for --tls-cert",
    "tls_client_ca": "PEM CA bundle: require client certificates signed by it (mutual TLS)",
    "auth_tokens_file": "file with one bearer token per line; every RPC but health, and every HTTP request but "
                        "/health and /ready, must carry one (Authorization: Bearer TOKEN)",
    "grace_period": "seconds in-flight requests get to finish after SIGTERM/SIGINT",
    "max_receive_message_bytes": "largest request message accepted (a gRPC message, an HTTP body)",
    "max_input_chars": "longest prompt, Tokenize text or message content in characters, and most characters of "
                       "all contents of one request (default: 32 per token of context)",
    "input_workers": "threads that parse, tokenize, render chat templates and validate inputs off the event loop "
                     "(both edges)",
    "stream_idle_timeout": "seconds a stream's next message may wait for its reader before the stream is cancelled "
                           "and its slot freed (0: no limit)",
    "max_concurrent_rpcs": "calls in progress at once on this server; more get RESOURCE_EXHAUSTED",
    "max_concurrent_streams": "calls at once on one HTTP/2 connection",
    "max_connection_age": "seconds after which a client connection is asked to reconnect (GOAWAY), so long-lived "
                          "channels reach replicas added later (0: never)",
    "max_connection_age_grace": "seconds the calls of a connection past its age get to finish",
    "max_connection_idle": "seconds a connection without calls is kept open (0: forever)",
    "max_health_watchers": "concurrent grpc.health.v1 Watch calls; more get RESOURCE_EXHAUSTED",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
    "served_model_name": "the model's name(s) in the HTTP API and GetModelInfo, comma-separated: requests may use "
                         "any of them, /v1/models lists each, the first is the one reported (default: --model)",
    "chat_template": "a Jinja2 chat template file to render chat requests with instead of the model's own "
                     "(sandboxed like the model's; e.g. one that renders tools)",
    "strict_openai_fields": "refuse HTTP requests carrying top-level fields this server does not know (400 naming "
                            "the field) instead of ignoring them and logging each name once: true or false",
    "responses_store_max": "responses the Responses API keeps in memory (with their conversations) for "
                           "previous_response_id and GET /v1/responses/{id}; the oldest go first (0: none kept)",
    "responses_store_ttl": "seconds a stored response is kept",
}


def _env_name(name: str) -> str:
    return "LMSERVE_" + name.upper()


def _flag_fields():
    """(owner, field) for every flag: the server's own settings, then the engine's."""
    own = [(ServerSettings, f) for f in fields(ServerSettings) if f.name != "engine"]
    return own + [(EngineSettings, f) for f in fields(EngineSettings)]


def environment_names() -> set[str]:
    """Every LMSERVE_* variable `lmserve serve` reads."""
    return {_env_name(f.name) for _, f in _flag_fields()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per setting; the default comes from LMSERVE_<NAME> at parse time, else the dataclass."""
    for _, f in _flag_fields():
        flag = "--" + f.name.replace("_", "-")
        many = {"nargs": "+"} if str(f.type).startswith("tuple") else {}  # one or more values after the flag
        parser.add_argument(flag, dest=f.name, default=None, metavar=f.name.split("_")[-1].upper(), **many,
                            help=f"{HELP[f.name]} [env {_env_name(f.name)}"
                                 + ("]" if f.default is None else f"; default {f.default}]"))


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _boolean(raw: str) -> bool:
    if str(raw).strip().lower() in _TRUE:
        return True
    if str(raw).strip().lower() in _FALSE:
        return False
    raise ValueError(f"expected one of {', '.join(_TRUE + _FALSE)}")


def settings_from_args(args: argparse.Namespace, environ=None) -> ServerSettings:
    """Flags win over LMSERVE_* variables, which win over defaults. Values are converted and validated."""
    environ = os.environ if environ is None else environ
    values: dict[type, dict] = {ServerSettings: {}, EngineSettings: {}}
    for owner, f in _flag_fields():
        raw = getattr(args, f.name, None)
        if raw is None:
            raw = environ.get(_env_name(f.name))
        if raw is None or raw == "":
            continue
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        try:
            if kind.startswith("tuple"):  # the flag's values, or the variable's, split at whitespace
                values[owner][f.name] = tuple(raw) if isinstance(raw, list) else tuple(str(raw).split())
                continue
            if kind == "bool | None" and str(raw).strip().lower() == "auto":
                continue  # None: the setting's automatic choice
            if kind.startswith("bool"):
                values[owner][f.name] = _boolean(raw)
            elif kind.startswith("int"):
                values[owner][f.name] = int(raw)
            elif kind.startswith("float"):
                values[owner][f.name] = float(raw)
            else:
                values[owner][f.name] = str(raw)
        except ValueError:
            hint = {"bool": " (true or false)", "bool | None": " (auto, true or false)"}.get(kind, "")
            raise ValueError(f"--{f.name.replace('_', '-')} / {_env_name(f.name)}: {raw!r} is not a valid {kind.split()[0]}{hint}")
    try:
        engine = EngineSettings(**values[EngineSettings])
    except ValueError as exc:  # name the flag, as for a value that does not parse
        name = str(exc).split()[0]
        raise ValueError(f"--{name.replace('_', '-')} / {_env_name(name)}: {exc}") from None
    return ServerSettings(**values[ServerSettings], engine=engine)
