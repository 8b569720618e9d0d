"""What the head's vocabulary costs the host per token: the engine around a zero-cost model at two
vocabularies, SmolLM2's (49,152) and Gemma 3's (262,144).

    lmserve bench vocab-head [--models smollm2 gemma3] [--concurrency 1 8] [--rounds 3]

Each model's tokenizer and config come from its GGUF (no weights are read); the model is
host_ceiling's stand-in (ready-made logits [N, V], views of a bank whose argmax walks through real
text), so a wave's time is the host path alone: scheduling, sampling over the whole vocabulary,
output processing (with the native kernels a CPU server loads: greedy's row max, the constraint masks). Per mode, the requests ask for: greedy tokens; sampled ones (temperature, top-k,
top-p); greedy with the top 5 logprobs; a JSON schema (the constraint's mask over the vocabulary
each step; its logits are copies of the stand-in's rows, since the mask is written into them, and the
copies' CPU time, the model's part, is taken out); n-gram speculation (drafts from the prompt, verified rows sampled). Reported: host ms per
output token (this process's CPU time, and wall time) for each model, mode and concurrency over
--rounds rounds, the models taking turns; the ratio of the large vocabulary to the small one as the
ratio of each model's fastest round and as the median of the rounds' ratios (a round's two waves ran
back to back, so what else ran on the machine weighs on both). A benchmark, not a test.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from . import engine_wave
from .constrained_bench import SCHEMA
from .host_ceiling import stand_in_loaded

FLAGS = {"models_dir": None, "concurrency": [1, 8], "max_new_tokens": 96, "threads": 1, "rounds": 3,
         "skip": ("greedy", "sampled", "logprobs", "constrained", "ngram")}


# the engine each mode's waves go to: n-gram's speculates; the constrained requests' masks are written into their
# logits, so theirs are copies (host_ceiling.StandInModel.with_fresh_logits); the others read the bank in place
ENGINE_OF = {"ngram": "ngram", "constrained": "masked"}


def add_arguments(p) -> None:
    p.add_argument("--models", nargs=2, default=["smollm2", "gemma3"], metavar=("SMALL", "LARGE"),
                   help="the two catalog models (or GGUF files) whose vocabularies are compared")


def params(mode: str, max_new: int, prompt: list[int]):
    from ..engine import SamplingParams
    from ..engine.constraints import Constraint

    if mode == "sampled":
        return SamplingParams(max_new_tokens=max_new, ignore_eos=True, temperature=0.8, top_k=50, top_p=0.9, seed=1)
    if mode == "logprobs":
        return SamplingParams(max_new_tokens=max_new, ignore_eos=True, logprobs=5)
    if mode == "constrained":
        return SamplingParams(max_new_tokens=max_new, constraint=Constraint.json_schema(SCHEMA))
    if mode == "ngram":  # the output is expected to repeat the prompt: drafts every step
        return SamplingParams(max_new_tokens=max_new, ignore_eos=True, prediction=tuple(prompt))
    return SamplingParams(max_new_tokens=max_new, ignore_eos=True)


def prompts(loaded, n: int, length: int = 48) -> list[list[int]]:
    """Slices of the held-out text, a different one per request."""
    from lmserve.model.tuning.quality import text_ids

    ids = text_ids(loaded.tokenizer)
    return [ids[(i * 131) % (len(ids) - length):][:length] for i in range(n)]


def host_ms_per_token(engine, loaded, mode: str, c: int, max_new: int) -> tuple[float, float]:
    """(wall ms, this process's CPU ms) per output token of one wave: the CPU time is what a machine busy
    with other work distorts least (the model costs nothing, so both are the host path)."""
    from ..engine import Request

    ps = prompts(loaded, c)
    model = engine.loaded.model
    copies = model.copy_seconds  # the stand-in's copies of the logits (the constrained mode's): the model's time
    cpu = time.process_time()
    w = engine_wave.wave(engine, [Request(p, params(mode, max_new, p)) for p in ps])
    cpu = time.process_time() - cpu - (model.copy_seconds - copies)
    tokens = max(1, w.tokens)
    return 1e3 * w.seconds / tokens, 1e3 * cpu / tokens


def run(args) -> dict | None:
    from lmserve.model.native import build as native

    from ..engine import Engine, EngineSettings

    torch.set_num_threads(args.threads)
    lib, why = native.load()  # as a CPU server has it: greedy's row max and the masks take the native kernels
    print(f"native kernels: {why}", flush=True)
    modes = [m for m in FLAGS["skip"] if m not in args.skip]
    top = max(args.concurrency)
    loaded, engines = {}, {}
    for name in args.models:
        t0 = time.perf_counter()
        loaded[name] = stand_in_loaded(name, args.models_dir, 8 * top)
        for spec in ("off", "ngram"):
            engines[name, spec] = Engine(loaded[name], EngineSettings(max_batch=top, max_model_len=1024,
                                                                      speculation=spec)).start()
        masked = dataclasses.replace(loaded[name], model=loaded[name].model.with_fresh_logits())
        engines[name, "masked"] = Engine(masked, EngineSettings(max_batch=top, max_model_len=1024)).start()
        print(f"{name}: vocabulary {loaded[name].config.vocab_size:,}, tokenizer and engines in "
              f"{time.perf_counter() - t0:.1f}s", flush=True)
    samples: dict[tuple, list[float]] = {}
    try:
        for name in args.models:  # warm-up: every mode once (a constraint's first compile, caches)
            for mode in modes:
                host_ms_per_token(engines[name, ENGINE_OF.get(mode, "off")], loaded[name], mode, top, 8)
        for _ in range(args.rounds):
            for mode in modes:
                for c in args.concurrency:
                    for name in args.models:  # the two vocabularies take turns
                        engine = engines[name, ENGINE_OF.get(mode, "off")]
                        wall, cpu = host_ms_per_token(engine, loaded[name], mode, c, args.max_new_tokens)
                        samples.setdefault((mode, c, name), []).append((wall, cpu))
    finally:
        for engine in engines.values():
            engine.shutdown()
    small, large = args.models
    rows = []
    for mode in modes:
        for c in args.concurrency:
            a, b = samples[mode, c, small], samples[mode, c, large]
            fastest = [min(u for _, u in x) for x in (a, b)]  # what other work on the machine added least to
            paired = statistics.median(cb / ca for (_, ca), (_, cb) in zip(a, b))  # the two ran back to back
            rows.append({"mode": mode, "concurrency": c, "cpu_ms_per_token_fastest": dict(zip((small, large), fastest)),
                         "ratio_fastest": fastest[1] / fastest[0], "ratio_paired_median": paired,
                         "rounds_wall_cpu_ms": {small: a, large: b}})
            print(f"{mode:<12} c={c:<3} CPU ms/token (fastest round) {small} {fastest[0]:.3f}, {large} {fastest[1]:.3f}: "
                  f"{fastest[1] / fastest[0]:.2f}x; median of the rounds' ratios {paired:.2f}x", flush=True)
    return {"vocabularies": {n: loaded[n].config.vocab_size for n in args.models}, "native_kernels": lib is not None,
            "rows": rows}
