"""What constrained decoding costs: inter-token latency with and without a JSON schema, side by side.

    lmserve bench constrained [--concurrency 1 32] [--rounds 5]

In one process, on one engine, rounds alternate an unconstrained and a constrained run of the same
chat prompts at each concurrency, so a busy machine slows both alike; the report gives each
round's ratio and their median. The constrained run goes twice a round: as served (greedy rows mask
only where the constraint refuses their argmax: sampler.py's lazy masks) and with every row's mask
computed and applied every step (`full_masks`), the candidates taking turns. Also: compiling a typical schema cold and from the cache, the
vocabulary index, and the share of constrained outputs the jsonschema library validates.
"""

from __future__ import annotations

import json
import statistics
import time

from lmserve.client.bench.harness import MODEL

from . import engine_wave
from .machine import load_from_arguments, taking_turns

FLAGS = {**MODEL, "concurrency": [1, 32], "rounds": 5, "max_new_tokens": 96}

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 60},
        "city": {"type": "string", "maxLength": 40},
        "interests": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "interests", "employed"],
    "additionalProperties": False,
}
QUESTIONS = ["Invent a person and describe them as JSON.", "Describe a fictional customer as JSON.",
             "Give a made-up user profile as JSON.", "Create a character for a novel, as JSON."]


def _chat_ids(tok, i: int) -> list[int]:
    return tok.encode_chat([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" (#{i})"}])[0]


def _wave(engine, tok, c: int, n: int, constrained: bool, lazy_masks: bool = True) -> dict:
    from ..engine.constraints import Constraint
    from ..engine.request import FinishReason, Request, SamplingParams

    # a constrained answer runs to its end (the schema bounds it: ~100 tokens at most); the
    # unconstrained one decodes n tokens, EOS ignored; ITL is compared per token
    p = (SamplingParams(max_new_tokens=4 * n, constraint=Constraint.json_schema(SCHEMA)) if constrained
         else SamplingParams(max_new_tokens=n, ignore_eos=True))
    engine.runner.sampler.lazy_masks = lazy_masks  # read by the engine thread; set while it is idle
    before = engine.phase_times.copy()
    masks = engine.constraints.worker
    computed, mask_s = masks.computed, masks.seconds
    w = engine_wave.wave(engine, [Request(_chat_ids(tok, i), p) for i in range(c)])
    phases = engine.phase_times.per_step_ms(before)  # the mask is applied in "sample", advanced in "process"
    gaps = [g for s in w.streams for g in s.gaps()]
    # constrained answers the token limit ended before the object closed
    cut = sum(s.finish_reason is FinishReason.LENGTH for s in w.streams) if constrained else 0
    # masks computed per token generated (greedy rows compute one only where the model's choice is not
    # allowed: constraints/state.py), and their time, wherever it was spent (ahead, on the mask thread)
    mask_counts = {"masks_per_token": (masks.computed - computed) / max(1, w.tokens),
                   "mask_ms_per_token": (masks.seconds - mask_s) * 1e3 / max(1, w.tokens)} if constrained else {}
    return {"itl_ms_median": statistics.median(gaps) * 1e3, "tokens": w.tokens, "tok_per_s": w.tokens / w.seconds,
            "length_cut": cut, "model_ms_per_step": phases["model"], "sample_ms_per_step": phases["sample"],
            "process_ms_per_step": phases["process"], **mask_counts, "texts": [s.text for s in w.streams]}


def _valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def _compile_times(loaded) -> dict:
    """On a compiler of its own: the vocabulary index's build, the schema's cold compile and the median
    of 20 compiles served from its cache."""
    from ..engine.constraints import Constraint
    from ..engine.constraints.compiler import ConstraintCompiler

    fresh = ConstraintCompiler(loaded.tokenizer, loaded.config.vocab_size)
    t = time.perf_counter()
    _ = fresh.vocabulary
    vocab_s = time.perf_counter() - t
    t = time.perf_counter()
    fresh.compile(Constraint.json_schema(SCHEMA))
    cold_ms = (time.perf_counter() - t) * 1e3
    hits = []
    for _ in range(20):
        t = time.perf_counter()
        fresh.compile(Constraint.json_schema(SCHEMA))
        hits.append((time.perf_counter() - t) * 1e6)
    fresh.close()
    return {"vocabulary_index_s": round(vocab_s, 3), "schema_cold_ms": round(cold_ms, 2),
            "schema_cache_hit_us_median": round(statistics.median(hits), 1)}


def _itl_at(engine, tok, c: int, rounds: int, n: int, outputs: dict[str, int]) -> dict:
    """`rounds` rounds at concurrency c in which the unconstrained, constrained and full-mask runs take
    turns: the ITL ratios, the masks computed and the host time the constraint adds. `outputs` counts
    the constrained outputs ("total"), those that validate ("valid") and those the same with full masks
    ("same")."""
    ratios, full_ratios, pairs = [], [], []
    for r in range(rounds):
        got = {}
        for name in taking_turns(("unconstrained", "constrained", "full_masks"), r):
            got[name] = _wave(engine, tok, c, n, name != "unconstrained", lazy_masks=name != "full_masks")
        free, held, full = got["unconstrained"], got["constrained"], got["full_masks"]
        ratios.append(held["itl_ms_median"] / free["itl_ms_median"])
        full_ratios.append(full["itl_ms_median"] / free["itl_ms_median"])
        pairs.append({k: {m: round(v, 3) for m, v in w.items() if m != "texts"} for k, w in got.items()})
        outputs["same"] += sum(a == b for a, b in zip(held["texts"], full["texts"]))  # greedy: the same outputs
        outputs["valid"] += sum(_valid(x) for x in held["texts"])
        outputs["total"] += len(held["texts"])
    # the host time the constraint adds to a step (mask applied in sample, matcher advanced in
    # process), beside the model's: steadier than the ITL ratio on a machine shared with others
    host = ("sample_ms_per_step", "process_ms_per_step")
    added = [sum(p["constrained"][k] - p["unconstrained"][k] for k in host) for p in pairs]
    model = statistics.median(p["unconstrained"]["model_ms_per_step"] for p in pairs)
    masks = {f"{k}{suffix}": round(statistics.median(p[run][k] for p in pairs), 4)
             for run, suffix in (("constrained", ""), ("full_masks", "_full_masks"))
             for k in ("masks_per_token", "mask_ms_per_token")}
    return {"concurrency": c, "itl_ratio_median": round(statistics.median(ratios), 3),
            "full_masks_itl_ratio_median": round(statistics.median(full_ratios), 3), **masks,
            "itl_ratios": [round(x, 3) for x in ratios],
            "full_masks_itl_ratios": [round(x, 3) for x in full_ratios],
            "added_host_ms_per_step": round(statistics.median(added), 3),
            "model_ms_per_step": round(model, 2), "rounds": pairs}


def measure(loaded, concurrencies: list[int], rounds: int, n: int) -> dict:
    from ..engine import Engine, EngineSettings

    compile_times = _compile_times(loaded)
    # no speculation: greedy unconstrained rows would draft and constrained ones do not, which would
    # compare two different step shapes rather than what the mask costs
    engine = Engine(loaded, EngineSettings(max_batch=max(concurrencies), prefix_cache=False,
                                           speculation="off")).start()
    outputs = {"valid": 0, "total": 0, "same": 0}
    try:
        _wave(engine, loaded.tokenizer, 1, 8, True)  # warm: the vocabulary index and the first compile
        rows = [_itl_at(engine, loaded.tokenizer, c, rounds, n, outputs) for c in concurrencies]
        stats = engine.constraints.stats
        cache = {"hits": stats.hits, "misses": stats.misses}
    finally:
        engine.shutdown()
    return {"itl": rows, "compile": compile_times, "engine_compile_cache": cache,
            "valid_outputs": f"{outputs['valid']}/{outputs['total']}",
            "lazy_outputs_as_full_masks": f"{outputs['same']}/{outputs['total']}",
            "note": "constrained answers may take 4x --max-new-tokens to close their object; one cut by that "
                    "limit would count as invalid (each round's length_cut)"}


def run(args) -> dict:
    loaded = load_from_arguments(args)
    report = {"mode": loaded.mode, **measure(loaded, args.concurrency, args.rounds, args.max_new_tokens)}
    for row in report["itl"]:
        print(f"c={row['concurrency']}: constrained/unconstrained ITL {row['itl_ratio_median']} ({row['itl_ratios']}), "
              f"with full masks {row['full_masks_itl_ratio_median']} ({row['full_masks_itl_ratios']}); "
              f"the constraint adds {row['added_host_ms_per_step']} ms of host time to a {row['model_ms_per_step']} ms step; "
              f"{row['masks_per_token']} masks ({row['mask_ms_per_token']} ms) per constrained token, "
              f"{row['masks_per_token_full_masks']} with full masks")
    print("compile:", report["compile"], "valid:", report["valid_outputs"], "lazy outputs as with full masks:",
          report["lazy_outputs_as_full_masks"])
    return report
