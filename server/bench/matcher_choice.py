"""Which grammar matcher library constrained decoding uses, decided by measurement.

Both candidates are timed on the same vocabulary (SmolLM2's 49,152 tokens, as lmserve's tokenizer
gives their bytes) and the same constraints: building the vocabulary index, compiling a typical
JSON schema, a regex and a small grammar, and computing one allowed-token mask per step along the
same valid token sequence. The candidates alternate round by round in one process, so a busy
machine slows both alike.

    lmserve bench matcher-choice [--rounds 5]

xgrammar is not a dependency of lmserve: put it on PYTHONPATH to include it (it is skipped, and
the report says so, when it cannot be imported).
"""

from __future__ import annotations

import json
import statistics
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"]},
    },
    "required": ["name", "age", "tags"],
}
DOCUMENT = '{"name":"Ann Smith","age":42,"email":"ann@example.com","tags":["a","c"],"address":{"city":"Paris","zip":"75001"}}'
REGEX = r"[0-9]{3}-[0-9]{3}-[0-9]{4}"
REGEX_TEXT = "555-123-4567"
LARK = 'start: expr\nexpr: term (("+" | "-") term)*\nterm: NUMBER | "(" expr ")"\nNUMBER: /[0-9]+/\n'
EBNF = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]+ | "(" expr ")"\n'
GRAMMAR_TEXT = "(12+3)-45+(6-(7+8))"
FLAGS = {"model": "smollm2", "models_dir": None, "rounds": 5}


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer):
        import llguidance

        self.ll = llguidance
        self.tok = tokenizer
        self.v = tokenizer.vocab_size

    def build_vocab(self):
        from lmserve.server.engine.constraints.vocabulary import build_vocabulary

        self.vocab = build_vocabulary(self.tok)  # lmserve's bridge (token bytes -> LLTokenizer)

    def compile(self, kind, source):
        M = self.ll.LLMatcher
        grammar = {"json": lambda: M.grammar_from_json_schema(json.dumps(source)),
                   "regex": lambda: M.grammar_from_regex(source),
                   "grammar": lambda: M.grammar_from_lark(source)}[kind]()
        m = M(self.vocab.ll_tokenizer, grammar, log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def walk(self, matcher, tokens):
        from lmserve.server.engine.constraints.state import fill_bitmask, new_bitmask

        mask = new_bitmask(self.v)
        times = []
        for t in tokens:
            _, dt = _timed(lambda: fill_bitmask(matcher, mask))
            times.append(dt)
            assert (int(mask[0, t // 32]) >> (t % 32)) & 1, f"token {t} masked out"
            assert matcher.consume_token(t), matcher.get_error()
        fill_bitmask(matcher, mask)
        return times, matcher.is_accepting()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer):
        import xgrammar

        self.xg = xgrammar
        self.tok = tokenizer
        self.v = tokenizer.vocab_size

    def build_vocab(self):
        info = self.xg.TokenizerInfo(list(self.tok.token_bytes), self.xg.VocabType.RAW, vocab_size=self.v,
                                     stop_token_ids=list(self.tok.eos_ids))
        self.compiler = self.xg.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, kind, source):
        c = self.compiler
        compiled = {"json": lambda: c.compile_json_schema(json.dumps(source)),
                    "regex": lambda: c.compile_regex(source),
                    "grammar": lambda: c.compile_grammar(source)}[kind]()
        return self.xg.GrammarMatcher(compiled)

    def walk(self, matcher, tokens):
        mask = self.xg.allocate_token_bitmask(1, self.v)
        times = []
        for t in tokens:
            _, dt = _timed(lambda: matcher.fill_next_token_bitmask(mask, 0))
            times.append(dt)
            assert (int(mask[0, t // 32]) >> (t % 32)) & 1, f"token {t} masked out"
            assert matcher.accept_token(t)
        matcher.fill_next_token_bitmask(mask, 0)
        return times, matcher.is_terminated() or bool((int(mask[0, self.tok.eos_ids[0] // 32]) >> (self.tok.eos_ids[0] % 32)) & 1)


def compare(tokenizer, rounds: int) -> dict:
    libs = [LLGuidance(tokenizer)]
    skipped = {}
    try:
        libs.append(XGrammar(tokenizer))
    except ImportError as exc:
        skipped["xgrammar"] = f"not importable: {exc}"
    cases = {"json": (SCHEMA, DOCUMENT), "regex": (REGEX, REGEX_TEXT)}
    sources = {"llguidance": {"grammar": LARK}, "xgrammar": {"grammar": EBNF}}
    rows: dict = {lib.name: {"vocab_s": [], "compile_s": {}, "mask_us": {}, "accepting": {}} for lib in libs}
    for _ in range(rounds):
        for lib in libs:
            r = rows[lib.name]
            _, dt = _timed(lib.build_vocab)
            r["vocab_s"].append(dt)
            for kind in ("json", "regex", "grammar"):
                source, text = cases[kind] if kind in cases else (sources[lib.name]["grammar"], GRAMMAR_TEXT)
                matcher, dt = _timed(lambda: lib.compile(kind, source))
                r["compile_s"].setdefault(kind, []).append(dt)
                times, accepting = lib.walk(matcher, tokenizer.encode(text))
                r["mask_us"].setdefault(kind, []).extend(t * 1e6 for t in times)
                r["accepting"][kind] = accepting
    summary = {}
    for name, r in rows.items():
        summary[name] = {
            "vocab_build_ms_median": round(statistics.median(r["vocab_s"]) * 1e3, 1),
            "compile_ms_median": {k: round(statistics.median(v) * 1e3, 2) for k, v in r["compile_s"].items()},
            "mask_us_median": {k: round(statistics.median(v), 1) for k, v in r["mask_us"].items()},
            "mask_us_p95": {k: round(sorted(v)[int(0.95 * (len(v) - 1))], 1) for k, v in r["mask_us"].items()},
            "accepting_at_end": r["accepting"],
        }
    return {"summary": summary, "skipped": skipped, "rounds": rounds}


def run(args) -> dict:
    import gguf

    from lmserve.model.checkpoints.catalog import resolve_model
    from lmserve.model.text.tokenizer import Tokenizer

    reader = gguf.GGUFReader(str(resolve_model(args.model, models_dir=args.models_dir)))
    tok = Tokenizer.from_gguf_fields({k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")})
    torch.set_num_threads(1)
    result = compare(tok, args.rounds)
    result.update(vocab_size=tok.vocab_size, torch_threads=1)
    print(json.dumps(result["summary"], indent=1), result["skipped"])
    return result
