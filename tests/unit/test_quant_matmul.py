"""The native weight-only kernel (quant_matmul.py) on SmolLM2's own Q4_1 and Q8_0 blocks, at the
model's real shapes: it computes the dequantized weights' product, each row is bitwise the same
alone or among any rows and on any thread count, the narrower AVX2 paths give the same bits, and
the GGUF block readers (Q4_0 as well) reproduce gguf's own dequantization.

Oracles: float64 matmuls of the dequantized weights with the activations quantized by the
kernel's documented recipe (tight), and with the float activations (loose: the int8 step), the
`gguf` package's dequantizer, and each row computed alone.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

from lmserve.model.linear import kernels as K
from lmserve.model.native import build as native
from lmserve.model.linear import quant_matmul as QM
from lmserve.model.checkpoints.gguf_reader import read_gguf
from lmserve.model.linear.formats import Q41Blocks, Q80Blocks, quantize_q41, quantize_q80


pytestmark = pytest.mark.usefixtures("quant_kernel")


@pytest.fixture(scope="module")
def gguf(smollm2_gguf_path):
    return read_gguf(smollm2_gguf_path, keep_q41=True)


def real_shapes(gguf):
    """(role, blocks) at every shape a decode step multiplies: hidden 576, intermediate 1536, vocab 49152."""
    L = "model.layers.7."
    q41 = gguf.q41
    return {
        "qkv": Q41Blocks.cat([q41[L + f"self_attn.{x}_proj.weight"] for x in "qkv"]),  # [960, 576]
        "o": q41[L + "self_attn.o_proj.weight"],  # [576, 576]
        "gate_up": Q41Blocks.cat([q41[L + "mlp.gate_proj.weight"], q41[L + "mlp.up_proj.weight"]]),  # [3072, 576]
        "down": q41[L + "mlp.down_proj.weight"],  # [576, 1536]
        "head": gguf.q80["model.embed_tokens.weight"],  # [49152, 576] Q8_0
    }


def int8_activations(x: torch.Tensor) -> torch.Tensor:
    """The kernel's one-code recipe (a8), in float32 like the kernel: per row and block of 32,
    e = max|x| / 127 and h = round(x * (127 / max|x|)); returns h * e in float64, [M, K]."""
    xf = x.float().reshape(x.shape[0], -1, 32)  # [M, K/32, 32]
    amax = xf.abs().amax(-1, keepdim=True)
    h = torch.where(amax > 0, xf * (127 / amax), torch.zeros_like(xf)).round().clamp(-127, 127)
    return (h.double() * (amax / 127).double()).reshape(x.shape)


def reference(blocks, x: torch.Tensor, precise: bool) -> torch.Tensor:
    """What the kernel computes, in float64: the float activations when precise (two codes: ~16
    bits), else their one-code quantization; int4's minimum term uses the float block sums of x, and
    with one code its codes are centred: w = d (q - 8) + (m + 8 d)."""
    xq = x.double() if precise else int8_activations(x)
    if isinstance(blocks, Q80Blocks):
        return xq @ blocks.dequantize().double().T
    d = blocks.d.double().repeat_interleave(32, 1)
    m = blocks.m.double().repeat_interleave(32, 1)
    shift = 0.0 if precise else 8.0
    return xq @ ((blocks.q.double() - shift) * d).T + x.double() @ (m + shift * d).T


def run(kernel, blocks, x, precise=True):
    packed = QM.pack_q4(blocks) if isinstance(blocks, Q41Blocks) else QM.pack_q8(blocks)
    return kernel(x, packed, 4 if isinstance(blocks, Q41Blocks) else 8, blocks.q.shape[0], precise)


def test_the_kernel_says_which_path_it_runs():
    k = QM.default_kernel()
    assert k.path in QM.PATHS.values()
    assert k.name == (f"{k.path}+amx" if k.amx else k.path)


@pytest.mark.parametrize("role", ["qkv", "o", "gate_up", "down", "head"])
def test_amx_tiles_give_the_vnni_bits_at_the_real_shapes(gguf, tile_kernel, role):
    """Calls of enough rows take AMX tiles where the OS grants them: the same exact integer sums and
    float steps, so every row is bitwise what the VNNI path gives, whichever path a call takes (on a
    CPU without tiles, the tile code runs over the software tile unit: conftest.tile_kernel)."""
    k = tile_kernel
    blocks = real_shapes(gguf)[role]
    g = torch.Generator().manual_seed(5)
    was = k.set_amx(QM.AMX_NEVER)
    try:
        for M in (1, 2, 5, 8, 9, 16, 23, 40):  # tiles of heights 2, 2, 6, 8, 10, 16, 12 x 2 (a padding row), 14 x 3
            x = torch.randn(M, blocks.q.shape[1], generator=g) * torch.linspace(0.1, 3, blocks.q.shape[1])
            x[0, 7::97] *= 40
            for dtype in (torch.bfloat16, torch.float32):
                for precise in (True, False):
                    k.set_amx(QM.AMX_NEVER)
                    want = run(k, blocks, x.to(dtype), precise)
                    k.set_amx(QM.AMX_ALWAYS)
                    got = run(k, blocks, x.to(dtype), precise)
                    assert torch.equal(got, want), (M, dtype, precise)
        k.set_amx(QM.AMX_ALWAYS)  # no rows: no tile of height 0
        assert run(k, blocks, torch.zeros(0, blocks.q.shape[1])).shape == (0, blocks.q.shape[0])
    finally:
        k.set_amx(was)


@pytest.mark.parametrize("precise", [True, False], ids=["two-codes", "a8"])
@pytest.mark.parametrize("role", ["qkv", "o", "gate_up", "down", "head"])
def test_computes_the_dequantized_weights_product_at_the_real_shapes(gguf, role, precise):
    blocks = real_shapes(gguf)[role]
    k = QM.default_kernel()
    g = torch.Generator().manual_seed(1)
    K_in = blocks.q.shape[1]
    x = torch.randn(5, K_in, generator=g) * torch.linspace(0.1, 3, K_in)  # [5, K]
    x[1, 7::97] *= 40  # outlier channels, as RMSNorm weights make them
    x[2, :64] = 0  # all-zero blocks: a zero step
    y = run(k, blocks, x, precise).double()  # float32 in and out
    want = reference(blocks, x, precise)
    scale = want.abs().amax(1, keepdim=True)
    # float32 sums of exact integer dot products. Two codes leave each value within ~2^-16 of its
    # block's largest (an outlier's block: ~1e-4 of the row here); rounding x to bfloat16 costs 2^-9
    assert ((y - want).abs() / scale).max() < (1e-3 if precise else 2e-5)
    if not precise:  # one int8 code: the float activations' product within the int8 step
        exact = reference(blocks, x, True)
        assert ((y - exact).abs() / scale).max() < 0.05
    yb = run(k, blocks, x.bfloat16(), precise).double()  # bfloat16 in and out: rounded output
    want_b = reference(blocks, x.bfloat16().float(), precise)
    assert ((yb - want_b).abs() / want_b.abs().amax(1, keepdim=True)).max() < 2 ** -8 + (1e-3 if precise else 2e-5)


@pytest.mark.parametrize("role", ["qkv", "o", "gate_up", "down", "head"])
def test_each_row_is_the_same_alone_or_batched_at_the_real_shapes(gguf, role):
    """rows_invariant: 64 rows alone, then 2..17, 31..33, 64, 100, 256 rows in one call."""
    blocks = real_shapes(gguf)[role]
    for precise in (True, False):
        layer = K.NativeQuantLinear(blocks, None, precise=precise)
        assert K.rows_invariant(layer, blocks.q.shape[1], torch.bfloat16, seed=3)
    assert K.rows_invariant(K.NativeQuantLinear(blocks, None), blocks.q.shape[1], torch.float32, seed=4)


def test_rows_do_not_depend_on_the_thread_count(gguf):
    blocks = real_shapes(gguf)["gate_up"]
    k = QM.default_kernel()
    x = torch.randn(19, blocks.q.shape[1]).bfloat16()
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(run(k, blocks, x))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("role", ["gate_up", "down", "head"])
def test_narrower_paths_give_the_same_bits(gguf, narrower_kernels, role):
    """Exact integer sums, then one fixed order of float steps: the AVX2 and AVX-VNNI builds agree
    bit for bit with the native one (and are invariant like it)."""
    blocks = real_shapes(gguf)[role]
    x = torch.randn(11, blocks.q.shape[1]).bfloat16()
    for precise in (True, False):
        want = run(QM.default_kernel(), blocks, x, precise)
        for path, k in narrower_kernels.items():
            assert k.path == path
            got = run(k, blocks, x, precise)
            assert torch.equal(got, want), (path, precise)
            alone = torch.cat([run(k, blocks, x[i: i + 1], precise) for i in range(x.shape[0])])
            assert torch.equal(alone, got), (path, precise)


def test_q40_and_q80_readers_match_gguf_dequantization():
    from gguf import GGMLQuantizationType as T, quants

    w = (torch.randn(32, 96) * 0.1).numpy()
    for qtype, read in ((T.Q4_0, Q41Blocks.from_raw_q40), (T.Q8_0, Q80Blocks.from_raw)):
        raw = quants.quantize(w, qtype)  # [32, K/32 * block bytes]
        want = quants.dequantize(raw, qtype)
        got = read(np.ascontiguousarray(raw)).dequantize().numpy()
        np.testing.assert_array_equal(got, want)


def test_float_weights_are_blocked_like_the_files():
    """A weight with no blocks (an HF checkpoint) goes through Q4_1's and Q8_0's recipes."""
    w = torch.randn(64, 576) * 0.05
    for blocks, step in ((quantize_q41(w).half_steps(), 15), (quantize_q80(w), 127 * 2)):
        err = (blocks.dequantize() - w).abs().reshape(64, -1, 32).amax(-1)  # [N, K/32]
        span = (w.reshape(64, -1, 32).amax(-1) - w.reshape(64, -1, 32).amin(-1))
        assert (err <= span / step * 0.51 + 1e-3).all()


def test_native_quantizers_and_packers_give_the_torch_recipes_bits():
    """Weights quantized at load (quantize_q80 / quantize_q41, pack_q8 / pack_q4) by the native library:
    bitwise the torch recipes, from float32 and bfloat16, with flat blocks, ties at .5 steps, tiny and
    huge values."""
    from lmserve.model.linear.formats import native_blocks, quantize_q41_torch, quantize_q80_torch

    assert native_blocks() is not None  # the fixture loaded the library: the quantizers take the native path
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 1024, generator=g) * torch.logspace(-6, 3, 96)[:, None]  # rows from 1e-6 to 1e3
    w[5, 64:96] = 0.0  # a block of zeros: step 0, codes 0
    w[6, 96:128] = -2.5  # a flat block: Q4_1's step 0
    w[7, :32] = torch.arange(32) - 15.5  # max 16.5: codes at exact .5 ties after the division
    for x in (w, w.bfloat16()):
        native, torch_ = quantize_q80(x), quantize_q80_torch(x)
        assert torch.equal(native.q, torch_.q) and torch.equal(native.d, torch_.d)
        assert torch.equal(QM.pack_q8(native), QM.pack_q8_torch(native))
        native, torch_ = quantize_q41(x), quantize_q41_torch(x)
        assert all(torch.equal(a, b) for a, b in ((native.q, torch_.q), (native.d, torch_.d), (native.m, torch_.m)))
        assert torch.equal(QM.pack_q4(native.half_steps()), QM.pack_q4_torch(native.half_steps()))


@pytest.mark.parametrize("march", ["sapphirerapids", "x86-64-v3 -mavxvnni", "x86-64-v3", "x86-64-v2"])
def test_every_path_of_the_native_sources_compiles(march):
    """Each build only compiles the paths its CPU defines (AMX tiles, AVX-512, AVX-VNNI, AVX2, none):
    compile the sources for each target whatever this CPU is, so that an edit breaking a path this
    machine does not build fails here, not at another machine's first start."""
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        pytest.skip(f"no C++ compiler ({cxx})")
    arch, *more = march.split()
    done = subprocess.run([cxx, f"-march={arch}", *more, "-fopenmp", "-std=c++17", "-fsyntax-only",
                           *map(str, native.SOURCES)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_candidates_share_a_packed_weight_and_give_each_kernels_own_rows(gguf):
    """measure_role's candidates: the one-code and two-code native kernels share one packed weight and
    compute what each built alone computes; the float kernels share one read of the weights."""
    blocks = real_shapes(gguf)["o"]
    src = K.WeightSource(blocks.dequantize(), None, q41=blocks)
    # oneDNN takes bfloat16 weights only where the CPU computes bfloat16 (AVX-512): a candidate there alone
    kernels = ["native-int4", "native-int4-a8", "dense", *(["onednn"] if K.onednn_supports(torch.bfloat16) else [])]
    sets = K._build_candidates(kernels, [src], torch.bfloat16)
    assert sets["native-int4"][0].packed is sets["native-int4-a8"][0].packed
    assert sets["dense"][0].weight.dtype == torch.bfloat16
    x = torch.randn(5, blocks.q.shape[1]).bfloat16()
    for kernel in kernels:
        alone = K.build(kernel, src, torch.bfloat16)
        assert sets[kernel][0].kernel == kernel
        assert torch.equal(sets[kernel][0](x), alone(x)), kernel
