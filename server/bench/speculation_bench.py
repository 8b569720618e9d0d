"""Speculative decoding (prompt lookup) on and off, side by side in one process.

    lmserve bench speculation [--concurrency 1 32] [--rounds 2]

Workloads whose answers repeat their input (editing code, quoting a passage, answering from a
document by quoting it, restating a record as JSON under a json_object constraint) and ones that do
not (the chat prompts of `lmserve bench load`), greedy, at c=1 and at c=32. Each configuration runs
speculation off and on alternately (off, on, off, on) through the engine's async API; the report
has tokens/s for both, their ratio, drafted and accepted tokens, and whether the tokens were
identical (they must be); at c=1 also the decode rate, tokens after the first over the time after
the first (what speculation can change: the prompt's prefill is the same either way, and it is a
large share of a short answer's time). At c=1 a third configuration sends each request its own answer (from
the off round) as its prediction: every draft is right, so its gain is the most that verifying lets
any proposer reach on this machine. This is a benchmark, not a test: run it on a quiet machine.
"""

from __future__ import annotations

import json
import statistics

from lmserve.client.bench.harness import MODEL

from . import engine_wave
from .machine import load_from_arguments

FLAGS = {**MODEL, "max_new_tokens": 128, "rounds": 2, "concurrency": [1, 32]}


def add_arguments(p) -> None:
    p.add_argument("--draft-tokens", type=int, default=8, help="most tokens drafted per request and step")
    p.add_argument("--ignore-eos", action="store_true",
                   help="decode max-new-tokens every time (default: stop at the answer's end, as a user's request "
                        "does; the tokens are the same with speculation on and off either way)")

# a constrained workload: JSON (json_object) that restates a record given in the prompt
RECORD = ('{"name": "Ada Lovelace", "born": 1815, "city": "London", "field": "mathematics", '
          '"known_for": ["the first computer program", "notes on the Analytical Engine"]}')


def workloads(tok) -> dict[str, list[int]]:
    from lmserve.client.bench.prompts import REPEATING, synthetic_workload

    def chat(text):
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))

    out = {name: chat(text) for name, text in REPEATING.items()}
    out["json_copy"] = chat(f"Restate this record as JSON with the same keys and values:\n\n{RECORD}")
    chat_prompt = synthetic_workload()[0].prompt
    out["chat"] = tok.encode(tok.apply_chat_template([{"role": m.role, "content": m.content} for m in chat_prompt],
                                                     add_generation_prompt=True))
    return out


def constraint_of(workload: str):
    """The output constraint a workload's requests carry (None: free text)."""
    from ..engine.constraints import Constraint

    return Constraint.json_object() if workload == "json_copy" else None


def timed(engine, prompts: list[list[int]], max_new: int, ignore_eos: bool = True, prediction=(),
          constraint=None, speculate: bool = True):
    """Each stream's tokens, the wave's seconds, and its decode rate: tokens after each stream's first
    chunk over the time after the last first chunk (what speculation can change: the prompt's prefill is
    the same either way)."""
    w = engine_wave.greedy(engine, prompts, max_new, ignore_eos=ignore_eos and constraint is None,
                           prediction=prediction, constraint=constraint, speculate=speculate)
    return [s.token_ids for s in w.streams], w.seconds, w.decode_rate()


def compare(loaded, prompt: list[int], concurrency: int, max_new: int, rounds: int, max_model_len: int,
            draft_tokens: int = 8, ignore_eos: bool = False, constraint=None) -> dict:
    """tokens/s with speculation off and on (alternating rounds), acceptance and token identity; at c=1
    also on with the answer itself as the request's prediction ("predicted": every draft right, so
    the gain is what verifying costs allows, the bound of any proposer)."""
    from ..engine import Engine, EngineSettings

    rates = {"off": [], "ngram": [], **({"predicted": []} if concurrency == 1 else {})}
    decode_rates = {mode: [] for mode in rates}
    tokens, stats = {}, None
    for _ in range(rounds):
        for mode in rates:  # one engine thread at a time (each keeps its own OpenMP pool)
            engine = Engine(loaded, EngineSettings(max_batch=concurrency, max_model_len=max_model_len,
                                                   prefix_cache=False, speculation="ngram" if mode == "predicted"
                                                   else mode, draft_tokens=draft_tokens)).start()
            prediction = tuple(tokens["off"][0]) if mode == "predicted" else ()
            try:
                # warm-up: kernels primed, first-step costs paid, and every engine's step pacer fed the same
                # steps (no drafts): its first fit decides how much prefill rides with the decode rows at
                # c=32, and a warm-up with a verifying step had fitted cheaper rows, smaller chunks, ~10%
                # fewer tokens/s with not one draft in the measured wave
                timed(engine, [prompt], 8, speculate=False)
                before = engine.stats()
                out, seconds, decode_rate = timed(engine, [prompt] * concurrency, max_new, ignore_eos, prediction,
                                                  constraint)
                after = engine.stats()
            finally:
                engine.shutdown()
            rates[mode].append(sum(map(len, out)) / seconds)
            decode_rates[mode].append(decode_rate)
            tokens.setdefault(mode, out)
            if mode == "ngram":
                d = after.drafted_tokens_total - before.drafted_tokens_total
                a = after.accepted_tokens_total - before.accepted_tokens_total
                stats = (d + (stats or (0, 0))[0], a + (stats or (0, 0))[1])
    off, on = statistics.median(rates["off"]), statistics.median(rates["ngram"])
    d_off, d_on = statistics.median(decode_rates["off"]), statistics.median(decode_rates["ngram"])
    return {"concurrency": concurrency, "output_tokens": len(tokens["off"][0]),
            "tok_s_off": round(off, 1), "tok_s_on": round(on, 1),
            "speedup": round(on / off, 3),
            **({"decode_tok_s_off": round(d_off, 1), "decode_tok_s_on": round(d_on, 1),
                "decode_speedup": round(d_on / d_off, 3)} if concurrency == 1 else {}),
            "rounds_off": [round(r, 1) for r in rates["off"]],
            "rounds_on": [round(r, 1) for r in rates["ngram"]], "drafted": stats[0], "accepted": stats[1],
            "acceptance": round(stats[1] / max(1, stats[0]), 3),
            "identical_tokens": all(tokens[m] == tokens["off"] for m in tokens),
            **({"tok_s_predicted": round(statistics.median(rates["predicted"]), 1),
                "speedup_predicted": round(statistics.median(rates["predicted"]) / off, 3),
                "decode_speedup_predicted": round(statistics.median(decode_rates["predicted"]) / d_off, 3)}
               if "predicted" in rates else {})}


def run(args) -> dict:
    loaded = load_from_arguments(args)
    prompts = workloads(loaded.tokenizer)
    max_model_len = max(map(len, prompts.values())) + args.max_new_tokens + 8
    results = []
    for name, ids in prompts.items():
        for c in args.concurrency:
            r = {"workload": name, "prompt_tokens": len(ids), "draft_tokens": args.draft_tokens,
                 **compare(loaded, ids, c, args.max_new_tokens, args.rounds, max_model_len, args.draft_tokens,
                           args.ignore_eos, constraint_of(name))}
            print(json.dumps(r), flush=True)
            results.append(r)
    return {"mode": loaded.mode, "kernels": loaded.kernels, "results": results}
