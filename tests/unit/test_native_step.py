"""The native step (native/step.py) on SmolLM2 at its real shapes, against the eager layers it
replaces: bitwise the same logits and the same K/V written, for decode rows at different positions,
a verified draft (one slot on several consecutive rows), packed new prompts, a continued prompt
chunk, and a step mixing all of them, through both forward entry points; and each row is the same
alone or in the batch. Also with sliding windows on some layers (their prompt tokens then take the
decode kernel, eager and native alike). With a bfloat16 cache and with an int8 one (the native writes quantize as the
eager layers' torch writes do, codes and scales bit for bit). Oracle: the eager layers (themselves checked against transformers and the
explicit attention elsewhere), run from a copy of the same cache.

The same tests run on the other families' layers (the loop reads a layer description): random-weight
models at the layer shapes of Qwen3 0.6B (q/k norms), Gemma 3 270M (scaled embeddings, (1 + w) norms,
four norms a layer, GELU-tanh, q/k norms, sliding layers on their own RoPE base beside a global one)
and Phi-3 (head size 96, LongRoPE's tables, every layer sliding), a few layers each."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lmserve.model.native import build as native
from lmserve.model.native import step as native_step
from lmserve.model.linear import kernels as K
from lmserve.model.tuning import precision as P
from lmserve.model.linear import quant_matmul as QM
from lmserve.model.checkpoints.gguf_reader import read_gguf
from lmserve.model.config import LongRopeScaling, ModelConfig
from lmserve.model.kv_cache import KVCache
from lmserve.model.llama import LlamaForCausalLM, Segment
from lmserve.model.loader import build_model, native_parts

BF16 = torch.bfloat16
PROMPTS = [37, 5, 120, 64]  # prompt lengths of slots 0..3


@pytest.fixture(scope="module")
def kernel_dir(native_kernels_dir):
    d = native_kernels_dir
    QM.use_cache_dir(d)
    lib, why = native.build(d)
    if lib is None or QM.default_kernel() is None:
        pytest.skip(f"no native kernels here: {why}")
    yield d
    QM.use_cache_dir(None)


@pytest.fixture(scope="module")
def gguf(smollm2_gguf_path):
    return read_gguf(smollm2_gguf_path, keep_q41=True)


def served(gguf, kernel_dir, layers: str, head: str, windows: tuple[int, ...] = ()):
    cfg = dataclasses.replace(gguf.config, layer_windows=windows)
    return built(cfg, gguf.tensors, kernel_dir, layers, head, q41=gguf.q41, q80=gguf.q80)


def built(cfg, tensors, kernel_dir, layers: str, head: str, **blocks):
    """The model served in bfloat16 with its layers' linears on `layers`, the LM head on `head`; its backend."""
    quant = "int4" if layers.endswith("int4") else "int8"
    plan = P.Plan(P.Mode(BF16, quant), {r: head if r == "head" else layers for r in K.ROLES})
    parts = native_parts(torch.device("cpu"), kernel_dir, BF16, cfg, True)
    model = build_model(cfg, tensors, BF16, "cpu", plan=plan, fused_ops=parts.fused_ops, native_lib=parts.step_lib,
                        **blocks)
    return model.freeze_attributes(), parts.attention


SLIDING = tuple(16 if i % 3 else 0 for i in range(30))  # SmolLM2's 30 layers, two of three with a 16-key window
SHAPE = dict(vocab_size=4096, rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=1024)
FAMILY_LAYERS = {  # a few layers of each family at its real model's layer shapes
    "qwen3": ModelConfig(hidden_size=1024, num_layers=2, num_heads=16, num_kv_heads=8, head_dim=128,
                         intermediate_size=3072, rope_theta=1e6, model_type="qwen3", qk_norm=True, **SHAPE),
    "gemma3": ModelConfig(hidden_size=640, num_layers=3, num_heads=4, num_kv_heads=1, head_dim=256,
                          intermediate_size=2048, rope_theta=1e6, model_type="gemma3", norm_style="gemma",
                          sandwich_norms=True, hidden_act="gelu_tanh", qk_norm=True, embed_scale=640 ** 0.5,
                          query_scale=256 ** -0.5, layer_windows=(16, 0, 16), rope_local_theta=1e4, **SHAPE),
    "phi3": ModelConfig(hidden_size=768, num_layers=2, num_heads=8, num_kv_heads=8, head_dim=96, intermediate_size=2048,
                        model_type="phi3", layer_windows=(16, 16), **SHAPE,
                        rope_scaling=LongRopeScaling(tuple(1.0 + 0.05 * i for i in range(48)),
                                                     tuple(1.5 + 0.4 * i for i in range(48)), 48, 1.19)),
}


def family_weights(cfg: ModelConfig) -> dict:
    """Random weights by HF name: linears large enough that attention is not uniform, norms near identity."""
    g = torch.Generator().manual_seed(0)
    model = LlamaForCausalLM(cfg).init_weights(std=0.08, generator=g)
    return {n: w + 0.2 * torch.randn(w.shape, generator=g) if "norm" in n else w
            for n, w in model.state_dict().items() if n != "lm_head.weight"}


@pytest.fixture(scope="module", params=[("native-int8", "native-int8-a8", BF16, ()), ("native-int4", "int8", BF16, ()),
                                        ("native-int4", "int8", torch.int8, ()),
                                        ("native-int8", "native-int8-a8", BF16, SLIDING),
                                        ("native-int4", "int8", torch.int8, SLIDING),
                                        ("native-int8", "native-int8-a8", BF16, "qwen3"),
                                        ("native-int4", "int8", torch.int8, "gemma3"),
                                        ("native-int8", "int8", BF16, "phi3")],
                ids=["int8", "int4", "int4-kv-int8", "int8-sliding", "int4-kv-int8-sliding", "qwen3-int8",
                     "gemma3-int4-kv-int8", "phi3-int8"])
def loaded(request, kernel_dir):
    layers, head, kv_dtype, windows = request.param
    if isinstance(windows, str):  # another family's layers
        cfg = FAMILY_LAYERS[windows]
        model, backend = built(cfg, family_weights(cfg), kernel_dir, layers, head)
    else:
        model, backend = served(request.getfixturevalue("gguf"), kernel_dir, layers, head, windows)
    assert model.native_step is not None, native_step.why_not(model)
    g = torch.Generator().manual_seed(0)
    cache = KVCache(model.config, 6, 256, kv_dtype)
    with torch.inference_mode():
        meta, pos = backend.packed(torch.arange(len(PROMPTS)), torch.tensor(PROMPTS))
        ids = torch.randint(0, model.config.vocab_size, (1, sum(PROMPTS)), generator=g)
        model(ids, pos, meta, cache)
    return model, backend, cache


def both_ways(model, backend, cache, slots, starts, tokens, segments: bool = False):
    """(eager logits, native logits) of one decode step from the same cache state; the cache keeps
    the native step's writes, which must equal the eager step's."""
    meta, pos = backend.decode(slots, starts)
    ids = torch.tensor(tokens)[:, None]

    def forward():
        if segments:
            return model.forward_segments([Segment(ids, pos, meta)], cache, torch.arange(len(slots)))
        return model(ids, pos, meta, cache)[:, 0]

    return eager_and_native(model, cache, forward)


def eager_and_native(model, cache, forward):
    """forward() through the eager layers and then the native step, from the same cache state."""
    step = model.native_step
    held = [t for t in (cache.k, cache.v, cache.scales) if t is not None]  # an int8 cache's scales too
    before = [t.clone() for t in held]
    with torch.inference_mode():
        try:
            model.native_step = None
            eager = forward()
            after_eager = [t.clone() for t in held]
        finally:
            model.native_step = step
        for t, t0 in zip(held, before):
            t.copy_(t0)
        native_logits = forward()
    assert all(torch.equal(t, t1) for t, t1 in zip(held, after_eager)), "the native step wrote other K/V"
    return eager, native_logits


@pytest.mark.parametrize("segments", [False, True], ids=["forward", "forward_segments"])
def test_decode_rows_are_bitwise_the_eager_layers(loaded, segments):
    model, backend, cache = loaded
    tokens = [11, 2024, 7, 310]
    for step in range(3):
        starts = [n + step for n in PROMPTS]
        eager, got = both_ways(model, backend, cache, [0, 1, 2, 3], starts, tokens, segments)
        assert torch.equal(eager, got), (step, (eager.float() - got.float()).abs().max())
        tokens = got.argmax(-1).tolist()


def test_a_verified_draft_is_bitwise_the_eager_layers(loaded):
    """Slot 2 verifies a 4-token draft (4 rows at consecutive positions: every K/V written before any
    row attends) beside slot 0's decode row."""
    model, backend, cache = loaded
    p0, p2 = PROMPTS[0] + 8, PROMPTS[2] + 8
    eager, got = both_ways(model, backend, cache, [0, 2, 2, 2, 2], [p0, p2, p2 + 1, p2 + 2, p2 + 3],
                           [5, 9, 400, 17, 2])
    assert torch.equal(eager, got)


def test_each_row_is_the_same_alone_or_in_the_batch(loaded):
    model, backend, cache = loaded
    slots, starts, tokens = [0, 1, 2, 3], [n + 12 for n in PROMPTS], [3, 1000, 42, 9]
    with torch.inference_mode():
        meta, pos = backend.decode(slots, starts)
        batch = model(torch.tensor(tokens)[:, None], pos, meta, cache)[:, 0]
        for i in range(4):
            meta, pos = backend.decode(slots[i: i + 1], starts[i: i + 1])
            alone = model(torch.tensor(tokens[i: i + 1])[:, None], pos, meta, cache)[:, 0]
            assert torch.equal(alone[0], batch[i]), i


def test_packed_prompts_and_a_mixed_step_are_bitwise_the_eager_layers(loaded):
    """New prompts packed into one row (slots 4, 5), then one step mixing a continued chunk of slot
    4's prompt, a new prompt on slot 5 ... as the runner lays steps out: chunks, packed prompts, then
    decode rows (slots 0 and 2, the latter verifying a draft)."""
    model, backend, cache = loaded
    g = torch.Generator().manual_seed(1)
    V = model.config.vocab_size
    meta, pos = backend.packed(torch.tensor([4, 5]), torch.tensor([50, 17]))
    ids = torch.randint(0, V, (1, 67), generator=g)
    assert model.native_step.applies([Segment(ids, pos, meta)], cache)
    eager, got = eager_and_native(model, cache, lambda: model(ids, pos, meta, cache, logits_index=torch.tensor([49, 66])))
    assert torch.equal(eager, got)

    chunk_meta, chunk_pos = backend.chunk(torch.tensor([4]), torch.tensor([50]), 30)
    new_meta, new_pos = backend.packed(torch.tensor([5]), torch.tensor([40]))  # slot 5 starts over
    p0, p2 = PROMPTS[0] + 20, PROMPTS[2] + 20
    dec_meta, dec_pos = backend.decode([0, 2, 2, 2], [p0, p2, p2 + 1, p2 + 2])
    segments = [Segment(torch.randint(0, V, (1, 30), generator=g), chunk_pos, chunk_meta),
                Segment(torch.randint(0, V, (1, 40), generator=g), new_pos, new_meta),
                Segment(torch.tensor([[8], [77], [1000], [3]]), dec_pos, dec_meta)]
    index = torch.tensor([29, 69, 70, 71, 72, 73])  # each prompt's last token, every decode row
    assert model.native_step.applies(segments, cache)
    eager, got = eager_and_native(model, cache, lambda: model.forward_segments(segments, cache, index))
    assert torch.equal(eager, got), (eager.float() - got.float()).abs().max()


def test_a_row_outside_the_cache_is_refused(loaded):
    model, backend, cache = loaded
    meta, pos = backend.decode([0, 2, 2], [10, cache.max_len - 1, cache.max_len])  # shared slot: write first
    with torch.inference_mode(), pytest.raises(IndexError, match="outside the cache"):
        model(torch.tensor([[1], [2], [3]]), pos, meta, cache)


def test_it_is_built_only_where_every_layer_linear_is_native(gguf, kernel_dir):
    torch_layers, _ = served(gguf, kernel_dir, "int8", "int8")
    assert torch_layers.native_step is None
    assert "not the native quantized kernel" in native_step.why_not(torch_layers)
    plan = P.reference_plan()
    parts = native_parts(torch.device("cpu"), kernel_dir, torch.float32, gguf.config, True)
    f32 = build_model(gguf.config, gguf.tensors, torch.float32, "cpu", plan=plan, fused_ops=parts.fused_ops,
                      native_lib=parts.step_lib)
    assert f32.native_step is None and "not fused" in native_step.why_not(f32)


def test_a_whole_step_refuses_an_id_or_row_out_of_range(loaded):
    """head_input (embedding to final norm in one call) checks its inputs before writing anything."""
    model, backend, cache = loaded
    meta, pos = backend.decode([0], [PROMPTS[0] + 30])
    k0 = cache.k.clone()
    V = model.config.vocab_size
    with torch.inference_mode():
        for ids, rows in (([[V]], [0]), ([[-1]], [0]), ([[5]], [1])):
            with pytest.raises(IndexError, match="out of range"):
                model.forward_segments([Segment(torch.tensor(ids), pos, meta)], cache, torch.tensor(rows))
    assert torch.equal(cache.k, k0)


def test_a_chunk_that_needs_no_logits_writes_the_eager_kv(loaded):
    """A prompt chunk that does not finish its prompt asks for no logits rows: none come back, and the
    whole-step call writes the K/V the eager layers write."""
    model, backend, cache = loaded
    g = torch.Generator().manual_seed(7)
    meta, pos = backend.packed(torch.tensor([5]), torch.tensor([33]))
    segments = [Segment(torch.randint(0, model.config.vocab_size, (1, 33), generator=g), pos, meta)]
    eager, got = eager_and_native(model, cache, lambda: model.forward_segments(segments, cache,
                                                                               torch.tensor([], dtype=torch.long)))
    assert eager.shape == got.shape == (0, model.config.vocab_size)


def test_one_thread_and_two_give_the_same_bits(loaded):
    """The engine steps on one thread while other processes hold the cores (server/engine/threads.py):
    every kernel computes each output row on one thread, so a mixed step (packed prompts, then decode
    rows with a verified draft) is bitwise the same on one thread as on two, K/V writes included."""
    model, backend, cache = loaded
    g = torch.Generator().manual_seed(2)
    V = model.config.vocab_size
    new_meta, new_pos = backend.packed(torch.tensor([4, 5]), torch.tensor([50, 40]))
    p0, p2 = PROMPTS[0] + 40, PROMPTS[2] + 40
    dec_meta, dec_pos = backend.decode([0, 2, 2, 2], [p0, p2, p2 + 1, p2 + 2])
    segments = [Segment(torch.randint(0, V, (1, 90), generator=g), new_pos, new_meta),
                Segment(torch.tensor([[8], [77], [1000], [3]]), dec_pos, dec_meta)]
    index = torch.tensor([89, 90, 91, 92, 93])
    assert model.native_step.applies(segments, cache)
    held = [t for t in (cache.k, cache.v, cache.scales) if t is not None]
    before = [t.clone() for t in held]
    threads = torch.get_num_threads()
    out = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for t, t0 in zip(held, before):
                t.copy_(t0)
            with torch.inference_mode():
                out[n] = (model.forward_segments(segments, cache, index), [t.clone() for t in held])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out[1][0], out[2][0])
    assert all(torch.equal(a, b) for a, b in zip(out[1][1], out[2][1]))


def test_every_family_but_a_biased_one_may_take_the_loop(kernel_dir):
    """What the mode measurement reads (precision.time_mode): a family's layers may run in the loop, so
    its roles are served on the native kernel; q/k/v biases (Qwen2) have no place in the layer description."""
    cpu = torch.device("cpu")
    for name, cfg in FAMILY_LAYERS.items():
        assert native_step.possible(cfg, BF16, "int4", cpu), name
    biased = dataclasses.replace(FAMILY_LAYERS["qwen3"], model_type="qwen2", qk_norm=False, attention_bias=True)
    assert not native_step.possible(biased, BF16, "int4", cpu)
