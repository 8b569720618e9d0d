"""LoRA adapters in the default CPU mode at a real shape: SmolLM2-135M in bfloat16+int4, whose steps run in
one native call, adapter rows included (native_step.cpp's lora_add).

The oracle is the promise itself: every row's greedy tokens and logprobs are bitwise the same alone or
batched beside the base and other adapters, and a base row beside adapter rows is bitwise the base
model's. The adapter path in bfloat16 is held to float32 with the same adapter.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lmserve.model.linear.lora import projection_shapes
from lmserve.model.loader import load_model
from lmserve.server.engine.request import Request, SamplingParams

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
from test_engine_helpers import collect, results_of, running  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TEXTS = ("Name three colors of the rainbow and say where each one comes from in the sky.",
         "What is a prime number? Give two examples.",
         "Write a short note to a neighbour asking them to water the plants.",
         "List four animals that live in the ocean.")
NEW_TOKENS = 10
QUICK = dict(speculation="off", max_step_ms=0)  # no start-up measurements: the engines here are many and short


def write_adapter(path: Path, cfg, targets: list[str], r: int, alpha: float, seed: int) -> Path:
    """A PEFT LoRA adapter directory with random A and B for every layer's `targets` (as peft saves them)."""
    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    shapes, tensors = projection_shapes(cfg), {}
    for layer in range(cfg.num_layers):
        for m in targets:
            k, out = shapes[m]
            parent = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{parent}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, k, generator=g) / k ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, r, generator=g) * 0.5 / r ** 0.5
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": targets, "bias": "none"}))
    return path


@pytest.fixture(scope="module")
def smollm2_int4(smollm2_gguf_path, native_kernels_dir):
    return load_model(smollm2_gguf_path, dtype=torch.bfloat16, quantization="int4", device="cpu",
                      cache_dir=native_kernels_dir)


@pytest.fixture(scope="module")
def lora_modules(smollm2_int4, tmp_path_factory) -> tuple[str, ...]:
    root, cfg = tmp_path_factory.mktemp("smollm2-adapters"), smollm2_int4.config
    a = write_adapter(root / "a", cfg, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                      16, 32, seed=1)
    b = write_adapter(root / "b", cfg, ["q_proj", "v_proj", "down_proj"], 8, 8, seed=2)
    return f"a={a}", f"b={b}"


def _requests(loaded, adapters) -> list[Request]:
    return [Request(loaded.tokenizer.encode(t), SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0),
                    adapter=a) for t, a in zip(TEXTS, adapters)]


def _answers(results) -> list[tuple[list[int], list[float]]]:
    return [(list(r.token_ids), [lp.logprob for lp in r.logprobs]) for r in results]


async def test_adapter_rows_and_base_rows_are_bitwise_the_same_alone_and_mixed(smollm2_int4, lora_modules):
    loaded = smollm2_int4
    assert loaded.model.native_step is not None  # the default mode's steps are native
    native_rows = []
    head_input = loaded.model.native_step.head_input

    def counted(*args, lora=None):
        native_rows.append(lora is not None)
        return head_input(*args, lora=lora)
    mixed = ["a", "", "b", "a"]
    with running(loaded, prefix_cache=False, **QUICK) as engine:  # no adapters served: every step native
        base = _answers([(await collect(engine, r))[0] for r in _requests(loaded, [""] * 4)])
    loaded.model.native_step.head_input = counted
    try:
        with running(loaded, prefix_cache=False, lora_modules=lora_modules, **QUICK) as engine:
            alone = _answers([(await collect(engine, r))[0] for r in _requests(loaded, mixed)])
            together = _answers(await results_of(engine, _requests(loaded, mixed)))
    finally:
        del loaded.model.native_step.head_input
    assert any(native_rows)  # adapter rows went through the native step
    assert together == alone
    assert alone[1] == base[1]  # the base row: the same bits beside adapter rows as with none served
    for i in (0, 2, 3):  # every adapter changes what is generated
        assert alone[i] != base[i]


async def test_the_bfloat16_adapter_path_follows_float32_with_the_same_adapter(smollm2_gguf_path, smollm2_int4,
                                                                              lora_modules, native_kernels_dir):
    """The first token's logprob under each adapter, bfloat16+int4 against float32: within what the mode
    itself differs by on the base (twice its gap, plus 0.05 nats)."""
    f32 = load_model(smollm2_gguf_path, dtype=torch.float32, quantization="none", device="cpu",
                     cache_dir=native_kernels_dir)

    async def firsts(loaded) -> dict[str, tuple[int, float]]:
        with running(loaded, prefix_cache=False, lora_modules=lora_modules, **QUICK) as engine:
            out = {}
            for adapter in ("", "a", "b"):
                r = (await collect(engine, _requests(loaded, [adapter])[0]))[0]
                out[adapter] = (r.token_ids[0], r.logprobs[0].logprob)
            return out

    bf16, f32 = await firsts(smollm2_int4), await firsts(f32)
    base_gap = abs(bf16[""][1] - f32[""][1])
    for adapter in ("a", "b"):
        assert bf16[adapter][0] == f32[adapter][0], adapter
        assert abs(bf16[adapter][1] - f32[adapter][1]) <= 2 * base_gap + 0.05, adapter
