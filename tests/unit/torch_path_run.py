"""Run by test_narrower_cpu.py in a process whose native build is held to a CPU the kernels do not know
($LMSERVE_NATIVE_MARCH=x86-64-v2): the library is not built, and the memorizing model serves on the torch
paths in every mode that can, cold and after a prefix hit. Prints one JSON line of what it saw.

argv: the trained model's directory, a kernels cache directory, then (prefix, continuation) pairs as JSON.
"""

from __future__ import annotations

import asyncio
import json
import sys

from lmserve.model.loader import load_model
from lmserve.model.native import build as native
from lmserve.server.engine.engine import Engine
from lmserve.server.engine.request import Request, SamplingParams
from lmserve.server.engine.settings import EngineSettings

MODES = (("float32", "none"), ("bfloat16", "none"), ("bfloat16", "int8"))


async def _greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    tokens = []
    async for chunk in engine.generate(Request(prompt, SamplingParams(temperature=0.0, max_new_tokens=n))):
        tokens.extend(chunk.token_ids)
    return tokens


def main(model_dir: str, cache_dir: str, pairs: str) -> None:
    lib, why = native.build(cache_dir)
    seen = {"library": lib is not None, "why": why, "modes": {}}
    for dtype, quantization in MODES:
        loaded = load_model(model_dir, dtype=dtype, quantization=quantization, device="cpu", cache_dir=cache_dir)
        tok = loaded.tokenizer
        kernels = sorted({getattr(m, "kernel", "") for m in loaded.model.modules() if hasattr(m, "kernel")})
        engine = Engine(loaded, EngineSettings()).start()
        try:
            texts = []
            for prefix, continuation in json.loads(pairs):
                prompt = tok.encode(prefix, add_special_tokens=True)
                n = len(tok.encode(continuation)) + 4  # room for a boundary token and eos; eos ends it
                cold = asyncio.run(_greedy(engine, prompt, n))
                again = asyncio.run(_greedy(engine, prompt, n))  # after a prefix hit
                texts.append({"want": prefix + continuation, "ends": [cold[-1:], again[-1:], list(tok.eos_ids)],
                              "cold": tok.decode(prompt[1:] + cold[:-1]), "again": tok.decode(prompt[1:] + again[:-1])})
        finally:
            engine.shutdown()
        seen["modes"][f"{dtype}+{quantization}"] = {"attention": loaded.attention.name, "kernels": kernels,
                                                    "texts": texts}
    print(json.dumps(seen))


if __name__ == "__main__":
    main(*sys.argv[1:4])
