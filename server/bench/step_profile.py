"""Where a batch-1 decode step's time goes: the linears, attention, and everything else.

    lmserve bench step-profile [--rounds 3] [--mixed-steps]

One request decodes alone through the real engine (speculation off) in the mode `auto` serves on
this machine, or the one asked for, two ways taking turns in every round when the mode has the
native decode loop (native_step.py): "native" (the loop) and "eager" (the layers from Python). The
engine's phase timer splits each step into schedule, inputs, model, sample, process and deliver.
Within the model, "timed" rounds time every linear and attention call: eager ones by wrapping each
linear (ServingLinear) and each step attention's `attend` (cache write included), at ~1 us a
wrapped call; in the native loop by its own per-phase clock (linears, attention, the rest), the LM
head by the wrapper. "outside" = step - linears - attention is what the issue calls the step's fixed
cost: norms, RoPE, embedding, residual adds, sampling, scheduling and dispatch (an upper bound: the
timers' own cost lands there). "plain" rounds time nothing but the step. Then, with the engine
stopped, torch.profiler lists every torch op of a batch-1 step with its calls and self time, each
way (op_profile): what Python dispatches beside the native kernels. With --mixed-steps, the cost of
a stall-free step: 8 decode rows alone, beside prompt chunks of 8-64 tokens late or early in a long
prompt, and each chunk alone (mixed_steps): the decode rows' marginal cost and the prompt's cost per
token beside them, the two numbers that bound the stall-free trade-off.
A benchmark, not a test: run it on a quiet machine.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter

from lmserve.client.bench.harness import MODEL

from . import engine_wave
from .machine import load_from_arguments, taking_turns

FLAGS = {**MODEL, "rounds": 3}


def add_arguments(p) -> None:
    p.add_argument("--tokens", type=int, default=96, help="decode steps per round")
    p.add_argument("--mixed-steps", action="store_true",
                   help="also time stall-free steps: 8 decode rows with prompt chunks of 8-64 tokens late or early "
                        "in a long prompt, and each chunk alone")


class _Timers:
    """Wall seconds spent in wrapped calls on the engine thread (CPU ops are synchronous)."""

    def __init__(self):
        self.seconds: Counter = Counter()
        self.calls: Counter = Counter()
        self.on = False

    def wrap(self, owner, name: str, kind: str):
        original = getattr(owner, name)
        timers = self

        def timed(*args, **kwargs):
            if not timers.on:
                return original(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                timers.seconds[kind] += time.perf_counter() - t0
                timers.calls[kind] += 1

        setattr(owner, name, timed)


def op_profile(engine, prompt_len: int, steps: int = 20) -> dict:
    """torch.profiler over `steps` batch-1 decode steps of ModelRunner.step, run on this thread once the
    engine has stopped (a sequence of `prompt_len` cached tokens on slot 0): each torch op's calls and
    self time per step. The native kernels are called through ctypes and do not appear; their time is
    the step's minus the ops'."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ..engine import Request, SamplingParams
    from ..engine.scheduler import ScheduledBatch
    from ..engine.sequence import SeqStatus, Sequence

    seq = Sequence(Request([1] * prompt_len, SamplingParams(max_new_tokens=steps + 8)))
    seq.slot, seq.status, seq.num_cached = 0, SeqStatus.RUNNING, prompt_len - 1
    batch = ScheduledBatch(decode=(seq,))
    with torch.inference_mode():
        for _ in range(3):
            engine.runner.step(batch)
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                engine.runner.step(batch)
        wall = (time.perf_counter() - t0) / steps
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    ops = [{"op": e.key, "calls_per_step": round(e.count / steps, 1),
            "self_ms_per_step": round(e.self_cpu_time_total / 1e3 / steps, 3)} for e in events]
    return {"steps": steps, "step_ms_profiled": round(1e3 * wall, 3),
            "torch_ops_self_ms_per_step": round(sum(o["self_ms_per_step"] for o in ops), 3),
            "torch_op_calls_per_step": round(sum(o["calls_per_step"] for o in ops), 1), "ops": ops[:30]}


def mixed_steps(loaded, rounds: int = 11, streams: int = 8, context: int = 600,
                chunks: tuple[int, ...] = (8, 16, 24, 32, 48, 64), starts: tuple[int, ...] = (2900, 1000)) -> dict:
    """What a stall-free step costs beside decoding streams: `streams` decode rows (each after `context`
    cached tokens) alone; each prompt chunk of n tokens (n in `chunks`) after s cached ones of a long
    prompt (s in `starts`: late, early), with the decode rows and alone; and a 512-token chunk alone
    (the idle prefill's rate). Each batch runs ModelRunner.step on this thread (a fresh engine,
    stopped: nothing else runs), median wall ms of `rounds` in which the batches take turns (the order
    reversed every other round), and the native loop's own phases (mean ms) where the mode has it. The
    cache holds whatever is there: attention's cost does not depend on the values.

    Derived per chunk: the decode rows' marginal cost (with them minus alone: what the streams add to
    a prefill step) and the prompt's cost per token beside the streams ((with them - decode only) / n),
    against the idle rate: together they bound the stall-free trade-off (docs/benchmarks.md)."""
    from ..engine import Engine, EngineSettings

    engine = Engine(loaded, EngineSettings(max_batch=streams + 1, max_model_len=4096, prefix_cache=False,
                                           speculation="off")).start()
    engine.shutdown()
    batches = _mixed_batches(streams, context, chunks, starts)
    step = loaded.model.native_step
    times, phases = _time_batches(engine, batches, step, rounds)
    out = {"streams": streams, "context": context, "rounds": rounds}
    for name in batches:
        row = {"step_ms": round(1e3 * statistics.median(times[name]), 3)}
        if step is not None:
            row["loop_ms"] = {k: round(1e3 * v / rounds, 3) for k, v in phases[name].items()}
        out[name] = row
    base = out["decode only"]["step_ms"]
    out["over_decode_only"] = {name: round(out[name]["step_ms"] / base, 3) for name in batches if name != "decode only"}
    out["idle_ms_per_prompt_token"] = round(out[_IDLE]["step_ms"] / 512, 4)
    out["chunks"] = [_chunk_costs(out, n, start) for start in starts for n in chunks]
    for row in out["chunks"]:
        print(json.dumps(row), flush=True)
    print(json.dumps({"decode_only_ms": base, "idle_ms_per_prompt_token": out["idle_ms_per_prompt_token"]}), flush=True)
    return out


_IDLE = "512 prompt tokens after 1500, alone"  # the idle prefill's rate


def _beside(n: int, start: int) -> str:
    return f"decode + {n} prompt tokens after {start}"


def _alone(n: int, start: int) -> str:
    return f"{n} prompt tokens after {start}, alone"


def _mixed_batches(streams: int, context: int, chunks: tuple[int, ...], starts: tuple[int, ...]) -> dict:
    """mixed_steps' batches by name, each a function that makes it afresh: `streams` decode rows on slots
    0.. (each after `context` cached tokens) alone; each chunk of a long prompt (on the next slot) with
    them and alone; and the 512-token chunk alone."""
    from ..engine import Request, SamplingParams
    from ..engine.scheduler import PrefillChunk, ScheduledBatch
    from ..engine.sequence import SeqStatus, Sequence

    decoding = []
    for i in range(streams):
        seq = Sequence(Request([5 + i] * context, SamplingParams(max_new_tokens=64)))
        seq.slot, seq.status, seq.num_cached = i, SeqStatus.RUNNING, context - 1
        decoding.append(seq)
    long = Sequence(Request([7] * (max(starts) + max(chunks) + 16), SamplingParams(max_new_tokens=4)))
    long.slot, long.status = streams, SeqStatus.RUNNING

    def chunk(n: int, start: int) -> PrefillChunk:
        long.num_cached = start
        return PrefillChunk(long, start, n)

    batches = {"decode only": lambda: ScheduledBatch(decode=tuple(decoding))}
    for start in starts:
        for n in chunks:
            batches[_beside(n, start)] = \
                lambda n=n, start=start: ScheduledBatch(decode=tuple(decoding), prefill=(chunk(n, start),))
            batches[_alone(n, start)] = lambda n=n, start=start: ScheduledBatch(prefill=(chunk(n, start),))
    batches[_IDLE] = lambda: ScheduledBatch(prefill=(chunk(512, 1500),))
    return batches


def _time_batches(engine, batches: dict, step, rounds: int) -> tuple[dict, dict]:
    """Each batch run through the stopped engine's ModelRunner.step twice unmeasured, then once a round
    for `rounds` rounds, taking turns: its wall seconds per round, and the native loop's (`step`'s)
    phase seconds summed over the rounds (empty without it)."""
    import torch

    times = {name: [] for name in batches}
    phases = {name: {} for name in batches}
    with torch.inference_mode():
        for make in batches.values():
            for _ in range(2):
                engine.runner.step(make())
        for rnd in range(rounds):
            for name, make in taking_turns(batches.items(), rnd):
                batch = make()
                if step is not None:
                    step.time_phases(True)
                t0 = time.perf_counter()
                engine.runner.step(batch)
                times[name].append(time.perf_counter() - t0)
                if step is not None:
                    for k, v in step.phase_seconds().items():
                        phases[name][k] = phases[name].get(k, 0.0) + v
                    step.time_phases(False)
    return times, phases


def _chunk_costs(out: dict, n: int, start: int) -> dict:
    """A chunk of n tokens after `start` beside the decode rows, from mixed_steps' medians: the step over
    decode only, the decode rows' marginal cost and the prompt's cost per token beside them."""
    base = out["decode only"]["step_ms"]
    with_decode, by_itself = out[_beside(n, start)]["step_ms"], out[_alone(n, start)]["step_ms"]
    return {"tokens": n, "after": start, "with_decode_over_decode_only": round(with_decode / base, 3),
            "decode_rows_marginal_ms": round(with_decode - by_itself, 3),
            "ms_per_prompt_token_beside_decode": round((with_decode - base) / n, 4)}


def run(args) -> dict:
    import torch

    from lmserve.model.text.chat_template import NoChatTemplateError

    loaded = load_from_arguments(args)
    try:
        prompt = loaded.tokenizer.encode_chat([{"role": "user", "content": "Tell me about the sea."}])[0]
    except NoChatTemplateError:  # a base model: the question as text
        prompt = loaded.tokenizer.encode("Tell me about the sea.", add_special_tokens=True)
    step = loaded.model.native_step  # the native decode loop, when this mode has it
    ways = {"native": step, "eager": None} if step is not None else {"eager": None}
    rows, ops = profile_rounds(loaded, prompt, ways, args.tokens, args.rounds)

    def med(rows, key):
        return round(statistics.median(r[key] for r in rows), 3)

    summary = {}
    for way in ways:
        plain, timed = rows[way, False], rows[way, True]
        summary[way] = {"step_ms_plain": med(plain, "step_ms"), "step_ms_timed": med(timed, "step_ms"),
                        "linears_ms": med(timed, "linears_ms"), "attention_ms": med(timed, "attention_ms"),
                        "outside_ms": med(timed, "outside_ms"),
                        "phases_ms_plain": {p: round(statistics.median(r["phases_ms"][p] for r in plain), 3)
                                            for p in plain[0]["phases_ms"]}}
    if step is not None:
        summary["eager_over_native_step"] = round(summary["eager"]["step_ms_plain"] / summary["native"]["step_ms_plain"], 3)
    report = {"threads": torch.get_num_threads(), "mode": loaded.mode, "kernels": loaded.kernels,
              # what a decode step streams from memory: every linear's weights (the head's included; the
              # embedding table is only gathered from)
              "linear_weight_bytes": loaded.step_weight_bytes,
              "prompt_tokens": len(prompt), "summary": summary,
              "rounds": {f"{way}_{'timed' if on else 'plain'}": r for (way, on), r in rows.items()},
              "op_profile": ops}
    if args.mixed_steps:
        report["mixed_steps"] = mixed_steps(loaded)
    print(json.dumps(summary, indent=2))
    return report


def profile_rounds(loaded, prompt: list[int], ways: dict, tokens: int, rounds: int) -> tuple[dict, dict]:
    """`rounds` rounds in which each way decodes `tokens` tokens plain and timed, taking turns; then each
    way's op profile. Returns the rows per (way, timed) and the op profiles per way."""
    from lmserve.model.attention import backend as AB
    from lmserve.model.linear import kernels as K
    from lmserve.model.attention.sdpa import AttentionMetadata

    from ..engine import Engine, EngineSettings

    timers = _Timers()
    for cls in {type(m) for m in loaded.model.modules() if isinstance(m, K.ServingLinear)}:
        timers.wrap(cls, "forward", "linears")
    for cls in (AB.KernelDecode, AB.KernelPrompt, AttentionMetadata):
        timers.wrap(cls, "attend", "attention")
    engine = Engine(loaded, EngineSettings(max_batch=1, max_model_len=len(prompt) + tokens + 16,
                                           prefix_cache=False, speculation="off")).start()
    step = loaded.model.native_step
    rows = {(way, on): [] for way in ways for on in (False, True)}
    ops = {}
    try:
        engine_wave.greedy(engine, [prompt], 8)  # warm-up
        for _ in range(rounds):
            for way, on in rows:
                loaded.model.native_step = ways[way]
                timers.on = on
                if step is not None:
                    step.time_phases(on and way == "native")
                before, seconds, calls = engine.phase_times.copy(), Counter(timers.seconds), Counter(timers.calls)
                engine_wave.greedy(engine, [prompt], tokens)
                phases = engine.phase_times.per_step_ms(before)
                steps = engine.phase_times.steps - before.steps
                row = {"step_ms": round(sum(phases.values()), 3),
                       "phases_ms": {k: round(v, 3) for k, v in phases.items()}}
                if on:
                    native = step.phase_seconds() if way == "native" else {}
                    for kind in ("linears", "attention"):
                        row[f"{kind}_ms"] = round(1e3 * (timers.seconds[kind] - seconds[kind] + native.get(kind, 0))
                                                  / steps, 3)
                        row[f"{kind}_python_calls_per_step"] = round((timers.calls[kind] - calls[kind]) / steps, 1)
                    row["outside_ms"] = round(row["step_ms"] - row["linears_ms"] - row["attention_ms"], 3)
                    if native:
                        row["native_other_ms"] = round(1e3 * native["other"] / steps, 3)
                rows[way, on].append(row)
                print(json.dumps({"way": way, "timed": on, **row}), flush=True)
    finally:
        engine.shutdown()
        if step is not None:
            step.time_phases(False)
    for way in ways:
        loaded.model.native_step = ways[way]
        ops[way] = op_profile(engine, len(prompt) + 8)
        print(json.dumps({"way": way, **{k: v for k, v in ops[way].items() if k != "ops"}}), flush=True)
    loaded.model.native_step = step
    return rows, ops
