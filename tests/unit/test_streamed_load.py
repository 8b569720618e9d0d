"""Loading at the checkpoint's own size: tensors read from the mapped file one at a time.

The oracle for every streamed path is the eager one it replaces: the same checkpoint read whole
(read_gguf / read_hf_dir) and built by the same kernels. Peak memory per model shape is measured by
the load benchmark (reports), not here.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from lmserve.model.assembly import CheckpointModes, build_model
from lmserve.model.checkpoints.gguf_reader import open_gguf, read_gguf
from lmserve.model.linear import kernels as K
from lmserve.model.tuning import precision as P
from lmserve.model.tuning import quality as Q


@pytest.fixture(scope="module")
def eager(smollm2_gguf_path):
    return read_gguf(smollm2_gguf_path, keep_q41=True)


@pytest.fixture
def opened(smollm2_gguf_path):
    ckpt = open_gguf(smollm2_gguf_path)
    yield ckpt
    ckpt.close()


def test_sources_read_what_the_whole_file_read_gives(eager, opened):
    for name in ("model.embed_tokens.weight", "model.layers.3.self_attn.q_proj.weight",
                 "model.layers.3.mlp.down_proj.weight", "model.norm.weight"):
        src = opened.sources[name]
        assert torch.equal(src.read(), eager.tensors[name]), name
        src.release()
        assert torch.equal(src.read(), eager.tensors[name]), f"{name} after its pages were handed back"
    embed = opened.sources["model.embed_tokens.weight"]
    for index in (torch.arange(100, 164), torch.tensor([7, 3, 49000, 3])):  # a slice, and scattered rows
        assert torch.equal(embed.rows(index), eager.tensors["model.embed_tokens.weight"][index])
    q = opened.sources["model.layers.0.self_attn.q_proj.weight"].blocks()  # unpermuted as the floats are
    assert torch.equal(q.dequantize(), eager.tensors["model.layers.0.self_attn.q_proj.weight"])


def _plan(quant: str, layers: str, head: str) -> P.Plan:
    return P.Plan(P.Mode(torch.bfloat16 if quant != "none" else torch.float32, quant),
                  {r: head if r == "head" else layers for r in K.ROLES})


@pytest.mark.parametrize("plan", [_plan("int4", "native-int4", "native-int8-a8"), _plan("int8", "int8", "int8"),
                                  _plan("none", "dense", "dense")], ids=["native-int4", "int8", "float32"])
def test_a_model_built_from_sources_equals_the_one_built_from_tensors(eager, opened, plan, native_kernels_dir):
    from lmserve.model.linear import quant_matmul as QM

    QM.use_cache_dir(native_kernels_dir)
    if plan.kernels["qkv"].startswith("native") and QM.default_kernel() is None:
        pytest.skip("no native quantized kernel here (no compiler or no AVX2)")
    ids = list(range(5, 70))
    dtype = plan.mode.dtype
    whole = build_model(eager.config, eager.tensors, dtype, "cpu", plan=plan, q41=eager.q41, q80=eager.q80)
    streamed = build_model(opened.config, opened.sources, dtype, "cpu", plan=plan)
    assert torch.equal(Q.logits_of(streamed, ids), Q.logits_of(whole, ids))
    # and a plan's logits computed a layer at a time, as the precision probe measures them
    layered = CheckpointModes(opened.config, opened.sources).logits(plan, ids)
    assert_close(layered, Q.logits_of(whole, ids), rtol=1e-5, atol=1e-5)
    assert torch.equal(layered.argmax(-1), Q.logits_of(whole, ids).argmax(-1))


def test_a_first_layers_model_is_the_whole_model_cut_short(opened):
    modes = CheckpointModes(opened.config, opened.sources)
    short = modes.model(P.reference_plan(), layers=2)
    assert len(short.model.layers) == 2 and short.config.num_layers == 2
    assert short.config.vocab_size == opened.config.vocab_size


def test_timing_sources_scale_the_sample_to_the_whole_model(opened):
    cfg = opened.config
    sources, scale = CheckpointModes(cfg, opened.sources).timing_sources(64 << 20)
    n = len(sources["qkv"])
    assert 2 <= n <= cfg.num_layers and scale["qkv"] == cfg.num_layers / n
    rows = sources["head"][0].shape[0]
    assert rows < cfg.vocab_size and scale["head"] == pytest.approx(cfg.vocab_size / rows)
    # 64 MiB of float32 rows of 576 is 29,127 rows: cut to a multiple of 16, so that the native kernels
    # (16 columns a group) are timed on the head too, not left out of its candidates
    assert rows % 16 == 0
    assert K.build("native-int8-a8", sources["head"][0], torch.bfloat16).out_features == rows
    assert sources["qkv"][0].shape == ((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.hidden_size)
    assert sources["qkv"][0].q41 is not None  # the file's Q4_1 blocks travel with the timed weights


def test_an_hf_directory_reads_the_same_tensors_as_sources(tmp_path):
    transformers = pytest.importorskip("transformers")
    from lmserve.model.checkpoints.hf_dir import open_hf_dir
    from lmserve.model.loader import read_hf_dir

    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")  # several shards and an index
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ckpt = open_hf_dir(tmp_path)
    try:
        want = {n: t for n, t in hf.state_dict().items() if n != "lm_head.weight" or not config.tie_word_embeddings}
        assert set(ckpt.sources) == set(want)
        for name, t in want.items():
            src = ckpt.sources[name]
            assert src.stored_as == "BF16" and torch.equal(src.read(torch.bfloat16), t), name
        embed = ckpt.sources["model.embed_tokens.weight"]
        assert torch.equal(embed.rows(torch.tensor([5, 1, 90])), want["model.embed_tokens.weight"][[5, 1, 90]].float())
    finally:
        ckpt.close()
    _, whole = read_hf_dir(tmp_path)
    assert all(torch.equal(whole[n], t) for n, t in want.items())


def test_roles_served_from_the_files_blocks_read_no_floats(opened, native_kernels_dir):
    """Building the layers on the native int4 kernel from a Q4_1 file takes each role's blocks as they
    are: no linear weight of a layer is ever dequantized to floats (what a loader holding the file's
    size needs), and the pages each role read are handed back once it is built."""
    from lmserve.model.checkpoints.sources import TensorSource
    from lmserve.model.linear import quant_matmul as QM

    QM.use_cache_dir(native_kernels_dir)
    if QM.default_kernel() is None:
        pytest.skip("no native quantized kernel here (no compiler or no AVX2)")
    released = set()

    def guarded(src: TensorSource) -> TensorSource:
        def refuse():
            raise AssertionError(f"{src.name} was read as floats")

        def release():
            released.add(src.name)
            src.release()
        return TensorSource(src.name, src.shape, src.stored_as, src.nbytes, refuse, _blocks=src.blocks, _release=release)

    layer_linears = {n for n, s in opened.sources.items() if n.startswith("model.layers.") and len(s.shape) == 2}
    sources = {n: guarded(s) if n in layer_linears else s for n, s in opened.sources.items()}
    plan = _plan("int4", "native-int4", "native-int8-a8")
    model = build_model(opened.config, sources, torch.bfloat16, "cpu", plan=plan)
    assert {m.kernel for m in model.modules() if isinstance(m, K.ServingLinear)} == {"native-int4", "native-int8-a8"}
    assert released == layer_linears
