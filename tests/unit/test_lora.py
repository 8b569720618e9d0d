"""LoRA adapters against transformers + peft, batched, cached, pooled and refused.

Adapters are written by peft itself on the trained test model (an HF directory) with random A and B
(init_lora_weights=False, then B drawn again so that every adapter moves the logits); transformers +
peft running the adapter is the oracle for float32 greedy tokens.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from safetensors.torch import load_file, save_file  # noqa: E402

from lmserve.model.linear.lora import AdapterError, LoraStep, read_peft  # noqa: E402
from lmserve.model.loader import load_model  # noqa: E402
from lmserve.server.engine.adapters import AdapterNotFoundError  # noqa: E402
from lmserve.server.engine.request import Request, SamplingParams  # noqa: E402

from test_engine_helpers import (  # noqa: E402,F401 - fixtures are used by name
    collect, one_torch_thread, random_prompt, results_of, running, wrap_step)

STEPS = 64
# name -> LoraConfig fields: ranks, targets, alpha, rslora and the per-module patterns all differ
ADAPTERS = {
    "attn": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"], use_rslora=True),
    "all": dict(r=16, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj", "up_proj"],
                rank_pattern={"q_proj": 4, "down_proj": 2}, alpha_pattern={"o_proj": 32}),
}


def peft_model(base_dir: Path, name: str, seed: int):
    """transformers' model of `base_dir` with adapter `name` (ADAPTERS) of random weights, float32, eval."""
    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **ADAPTERS[name]))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "lora_" in pname:
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 / p.shape[-1] ** 0.5))
    return model.eval()


@pytest.fixture(scope="module")
def adapters(trained_model_dir, tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """name -> (its PEFT directory, the peft model serving it)."""
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for i, name in enumerate(ADAPTERS):
        model = peft_model(trained_model_dir, name, seed=10 + i)
        model.save_pretrained(root / name)
        out[name] = (root / name, model)
    return out


@pytest.fixture(scope="module")
def trained(trained_model_dir, native_kernels_dir):
    """The trained model in float32, this module's own (serving adapters attaches their slots to it)."""
    return load_model(trained_model_dir, dtype=torch.float32, device="cpu", cache_dir=native_kernels_dir)


def prompt(trained, i: int = 0) -> list[int]:
    return random_prompt(random.Random(i), 12, trained.config.vocab_size)


@torch.inference_mode()
def reference_tokens(model, ids: list[int], steps: int = STEPS) -> list[int]:
    """Greedy tokens of transformers (+ peft) by full recompute."""
    ids, out = list(ids), []
    for _ in range(steps):
        tok = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        out.append(tok)
        ids.append(tok)
    return out


def lora_settings(adapters, **kw) -> dict:
    return dict(lora_modules=tuple(f"{n}={p}" for n, (p, _) in adapters.items()), **kw)


def greedy_request(ids, adapter: str = "", steps: int = STEPS) -> Request:
    return Request(list(ids), SamplingParams(max_new_tokens=steps, ignore_eos=True, logprobs=0), adapter=adapter)


def test_each_adapter_changes_the_logits(adapters, trained):
    ids = torch.tensor([prompt(trained)])
    for name, (_, model) in adapters.items():
        with torch.inference_mode():
            on = model(ids).logits
            with model.disable_adapter():
                off = model(ids).logits
        assert (on - off).abs().max() > 0.5, name


async def test_float32_greedy_tokens_equal_transformers_and_peft(adapters, trained):
    ids = prompt(trained)
    with running(trained, **lora_settings(adapters)) as engine:
        base, _ = await collect(engine, greedy_request(ids))
        for name, (_, model) in adapters.items():
            got, _ = await collect(engine, greedy_request(ids, name))
            assert got.token_ids == reference_tokens(model, ids), name
            assert got.token_ids != base.token_ids, f"{name} decodes the base model's tokens"
    with torch.inference_mode(), adapters["attn"][1].disable_adapter():
        assert base.token_ids == reference_tokens(adapters["attn"][1], ids)


async def test_a_batch_mixing_three_adapters_and_the_base_equals_each_row_alone(adapters, trained):
    names = ["", *ADAPTERS, "attn", ""]
    requests = [greedy_request(prompt(trained, i), name, 24) for i, name in enumerate(names)]
    with running(trained, **lora_settings(adapters), prefix_cache=False) as engine:
        alone = [(await collect(engine, r))[0] for r in requests]
        requests = [greedy_request(prompt(trained, i), name, 24) for i, name in enumerate(names)]
        seen = wrap_step(engine)
        together = await results_of(engine, requests)
    assert max(map(len, seen)) == len(names)  # every row in one step
    for a, b, name in zip(alone, together, names):
        assert a.token_ids == b.token_ids, name
        assert [t.logprob for t in a.logprobs] == [t.logprob for t in b.logprobs], name  # bitwise


async def test_the_prefix_cache_never_shares_kv_between_adapters(adapters, trained):
    ids = prompt(trained, 3) * 3  # several cache pages
    with running(trained, **lora_settings(adapters)) as cold:
        want = (await collect(cold, greedy_request(ids, "mlp", 8)))[0].token_ids
    with running(trained, **lora_settings(adapters)) as engine:
        await collect(engine, greedy_request(ids, "attn", 8))
        await collect(engine, greedy_request(ids, "", 8))
        before = engine.stats().prefix_hit_tokens_total
        got = (await collect(engine, greedy_request(ids, "mlp", 8)))[0].token_ids
        assert engine.stats().prefix_hit_tokens_total == before  # neither attn's nor the base's entry served it
        again = (await collect(engine, greedy_request(ids, "mlp", 8)))[0].token_ids
        assert engine.stats().prefix_hit_tokens_total > before  # its own entry does
    assert got == want and again == want


async def test_more_adapters_than_slots_wait_evict_and_reload_losing_no_request(adapters, trained):
    ids = [prompt(trained, i) for i in range(6)]
    names = [*ADAPTERS, *ADAPTERS]
    with running(trained, **lora_settings(adapters)) as engine:
        want = [(await collect(engine, greedy_request(p, n, 12)))[0].token_ids for p, n in zip(ids, names)]
    with running(trained, **lora_settings(adapters, max_loras=1), prefix_cache=False) as engine:
        got = await results_of(engine, [greedy_request(p, n, 12) for p, n in zip(ids, names)])
        s = engine.stats()
    assert [r.token_ids for r in got] == want
    assert s.lora_resident == 1 and s.lora_evictions_total >= 2 and s.lora_loads_total == s.lora_evictions_total + 1


async def test_a_request_waiting_for_an_adapter_slot_lets_base_requests_behind_it_go_first(adapters, trained):
    """One slot, pinned by a long request of `attn`: a request of `mlp` waits for it, and a base-model
    request submitted after it is admitted meanwhile (it needs no slot) and finishes while `attn` runs;
    `mlp` is served once the slot is free. Ordering by steps, not time: `attn` has 100 tokens to go."""
    with running(trained, **lora_settings(adapters, max_loras=1), prefix_cache=False) as engine:
        done: list[str] = []

        async def tracked(name: str, request: Request):
            result = (await collect(engine, request))[0]
            done.append(name)
            return result

        results = await asyncio.gather(tracked("attn", greedy_request(prompt(trained, 0), "attn", 100)),
                                       tracked("mlp", greedy_request(prompt(trained, 1), "mlp", 4)),
                                       tracked("base", greedy_request(prompt(trained, 2), "", 4)))
    assert done == ["base", "attn", "mlp"]  # base ahead of mlp, which waited for attn's slot
    assert [len(r.token_ids) for r in results] == [100, 4, 4]


async def test_an_unknown_adapter_is_refused_naming_it(adapters, trained):
    with running(trained, **lora_settings(adapters)) as engine:
        with pytest.raises(AdapterNotFoundError, match="'nope'"):
            await collect(engine, greedy_request(prompt(trained), "nope", 4))


def test_the_step_layout_gathers_rows_by_adapter_in_fixed_chunks():
    step = LoraStep.of([-1, 2, 0, 2, -1, 0, 2])
    assert step.slots.tolist() == [0, 2] and step.used == {0, 2}
    assert step.gather.shape[0] == 32 and step.rows.tolist() == [2, 5, 1, 3, 6]
    assert step.gather[step.valid].tolist() == step.rows.tolist()
    assert LoraStep.of([-1, -1]) is None


# ---- refused at load ------------------------------------------------------------------------

def edited(src: Path, dst: Path, config=None, tensors=None) -> Path:
    """A copy of adapter `src` with its config updated by `config` and its tensors by `tensors(dict)`."""
    dst.mkdir()
    conf = json.loads((src / "adapter_config.json").read_text())
    conf.update(config or {})
    (dst / "adapter_config.json").write_text(json.dumps(conf))
    weights = load_file(src / "adapter_model.safetensors")
    save_file(tensors(weights) if tensors else weights, dst / "adapter_model.safetensors")
    return dst


@pytest.mark.parametrize("config, message", [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "lora_only"}, "bias 'lora_only'"),
    ({"peft_type": "IA3"}, "IA3"),
])
def test_unsupported_adapter_kinds_are_refused_by_name(adapters, trained, tmp_path, config, message):
    bad = edited(adapters["attn"][0], tmp_path / "bad", config)
    with pytest.raises(AdapterError, match=message):
        read_peft(bad, trained.config, 64)


def test_bad_adapter_files_are_refused_naming_what(adapters, trained, tmp_path):
    src = adapters["attn"][0]
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    with pytest.raises(AdapterError, match="adapter half: adapter_model.safetensors not found"):
        read_peft(tmp_path / "half", trained.config)
    with pytest.raises(AdapterError, match="rank 8, over --max-lora-rank 4"):
        read_peft(src, trained.config, 4)

    def wider(w):  # an adapter trained on a base with another hidden size
        return {k: (torch.zeros(v.shape[0], v.shape[1] * 2) if "q_proj.lora_A" in k else v) for k, v in w.items()}
    with pytest.raises(AdapterError, match=r"layers\.0\.self_attn\.q_proj does not fit the base model: lora_A is \[8, 256\]"):
        read_peft(edited(src, tmp_path / "wide", tensors=wider), trained.config)

    def embedding(w):
        return {**w, "base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(8, 10)}
    with pytest.raises(AdapterError, match="embed_tokens"):
        read_peft(edited(src, tmp_path / "emb", tensors=embedding), trained.config)

    def deeper(w):
        return {k.replace("layers.1.", "layers.7."): v for k, v in w.items()}
    with pytest.raises(AdapterError, match="layer 7; the model has 2 layers"):
        read_peft(edited(src, tmp_path / "deep", tensors=deeper), trained.config)


def test_a_bad_adapter_fails_the_engine_start_naming_it(adapters, trained, tmp_path):
    with pytest.raises(AdapterError, match="missing"):
        with running(trained, lora_modules=(f"x={tmp_path / 'missing'}",)):
            pass
