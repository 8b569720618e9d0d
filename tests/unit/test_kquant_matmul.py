"""The native K-quant kernel (kquant_matmul.cpp, packed by quant_matmul.pack_kquant) on Q4_K, Q5_K and Q6_K blocks at
Llama-3.2-1B's linear shapes (K = 2048 and 8192).

Oracles:
- gguf's own dequantizer, for the codes and scales read from the bytes;
- the kernel's arithmetic redone in numpy: the activations quantized by the documented recipe
  (the same int8 codes, bit for bit), exact integer dot products with the codes, then the float steps
  in float64. The kernel may differ from it only by its float32 roundings, bounded from the steps it
  takes (derived in `rounding_bound`);
- float64 matmul of the gguf-dequantized weights with the float activations, within the bound the
  int8 activation step allows (`activation_bound`);
- each row computed alone (batch invariance), on other thread counts, and by the AVX2 build.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T, quants

from lmserve.model.linear import kernels as Kn
from lmserve.model.linear import quant_matmul as QM
from lmserve.model.linear.formats import KQUANT_BLOCK_BYTES, KQuantBlocks, kquant_codes
from lmserve.model.linear.quant_matmul import KQUANT_BITS, pack_kquant

Q4K, Q5K, Q6K = 12, 13, 14
EPS = 2.0 ** -24  # float32's unit roundoff


pytestmark = pytest.mark.usefixtures("quant_kernel")


def random_blocks(qtype: int, N: int, K: int, seed: int) -> KQuantBlocks:
    """Valid blocks: random codes and scales, float16 steps like a trained model's (~1e-3)."""
    rng = np.random.default_rng(seed)
    S = K // 256
    raw = rng.integers(0, 256, size=(N, S, KQUANT_BLOCK_BYTES[qtype]), dtype=np.uint8)

    def f16(lo, hi):
        return rng.uniform(lo, hi, size=(N, S)).astype(np.float16).view(np.uint8).reshape(N, S, 2)
    if qtype == Q6K:
        raw[..., 208:210] = f16(2e-4, 2e-3)
    else:
        raw[..., 0:2] = f16(2e-4, 2e-3)
        raw[..., 2:4] = f16(0, 1e-3)
    return KQuantBlocks.from_raw(raw.reshape(N, -1), qtype)


def decompose(b: KQuantBlocks):
    """(q, step, minus, centre) [N, K] float64 from the bytes, by the GGML spec read independently of
    the packing code: w = step (q - centre) - minus. Q4_K/Q5_K: step = d sc_j, minus = dmin m_j, per 32;
    Q6_K: step = d sc_i per 16, minus 0, centre 32."""
    N, K = b.shape
    raw = b.raw.numpy().reshape(N, K // 256, -1)
    q = kquant_codes(b).numpy().astype(np.float64)
    if b.qtype == Q6K:
        d = raw[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float64)  # [N, S]
        sc = raw[..., 192:208].view(np.int8).astype(np.float64)  # [N, S, 16]
        return q, np.repeat((d[..., None] * sc).reshape(N, -1), 16, axis=1), np.zeros_like(q), 32.0
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    dmin = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    s = raw[..., 4:16].astype(np.int64)  # [N, S, 12]
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    step = np.repeat((d[..., None] * sc).reshape(N, -1), 32, axis=1)
    minus = np.repeat((dmin[..., None] * mn).reshape(N, -1), 32, axis=1)
    return q, step, minus, 0.0


def quantized_activations(x: torch.Tensor, precise: bool):
    """The kernel's recipe (quant_matmul.cpp quantize_row), in float32 as it computes it: per row and
    block of 32, e = max|x| / 127, h = round(x * (127 / max|x|)); precise: l = round((x - e h) * (127 /
    max|x|) * 256), the remainder with one rounding. Returns (c, u) float64: codes c = 256 h + l (or h)
    [M, K] and the unit u = e / 256 (or e) [M, K/32]."""
    xf = x.float().numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(xf).max(-1, keepdims=True)
    e = amax / np.float32(127)
    ie = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), np.float32(0)).astype(np.float32)
    h = np.clip(np.rint(xf * ie), -127, 127)
    if not precise:
        return h.reshape(x.shape).astype(np.float64), e[..., 0].astype(np.float64)
    rem = (xf.astype(np.float64) - e.astype(np.float64) * h).astype(np.float32)  # exact, then rounded once: a fma
    lo = np.clip(np.rint(rem * ie * np.float32(256)), -127, 127)
    return (256 * h + lo).reshape(x.shape).astype(np.float64), e[..., 0].astype(np.float64) / 256


def kernel_terms(b: KQuantBlocks, x: torch.Tensor, precise: bool):
    """The kernel's per-block terms in float64 [M, N, blocks]: exact integer sums times their steps,
    and the minimum terms with the float block sums (Q4_K/Q5_K; one code centres the codes at 8 / 16)."""
    q, step, minus, centre = decompose(b)
    if b.qtype != Q6K and not precise:
        centre = 8.0 if b.qtype == Q4K else 16.0
    c, u = quantized_activations(x, precise)
    M, K = c.shape
    wq = step * (q - centre)  # [N, K]: what meets the quantized activations
    sub = 16 if b.qtype == Q6K else 32
    # exact integers: codes times (q - centre) summed per sub-block, then times the sub-block's step
    ints = np.einsum("msk,nsk->mns", c.reshape(M, -1, sub), (q - centre).reshape(q.shape[0], -1, sub))
    steps = step[:, ::sub]  # [N, K/sub]
    units = np.repeat(u, 32 // sub, axis=1)  # [M, K/sub]
    terms = ints * steps[None] * units[:, None]  # [M, N, K/sub]
    xs = x.double().numpy().reshape(M, -1, 32)
    # [N, K/32]: Q6_K's w = step (q - 32) has no minimum term
    mterm = np.zeros_like(step[:, ::32]) if b.qtype == Q6K else (centre * step - minus)[:, ::32]
    mins = xs.sum(-1)[:, None] * mterm[None]  # [M, N, K/32]
    mins_abs = np.abs(xs).sum(-1)[:, None] * np.abs(mterm)[None]
    return terms, mins, mins_abs, wq


def rounding_bound(terms, mins_abs, blocks: int) -> np.ndarray:
    """The kernel's float32 roundings, bounded: per block, (d sc) u and the integer's conversion round
    (2 eps of the term), the minimum's step C d sc - dmin m once and the block's float sum of x in 31
    adds (32 eps of sum|x| |mterm|); every one of the 2 x blocks fused multiply-adds rounds the partial
    sum (at most the sum of |terms|). First order, with 1% for the products of eps."""
    A = np.abs(terms).sum(-1) + mins_abs.sum(-1)  # [M, N]
    return 1.01 * EPS * (2 * np.abs(terms).sum(-1) + 32 * mins_abs.sum(-1) + 2 * blocks * A)


def run(kernel, b, x, precise=True):
    return kernel(x, pack_kquant([b]), KQUANT_BITS, b.shape[0], precise)


def activations(M: int, K: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.linspace(0.1, 3, K)
    x[0, 7::97] *= 40  # outlier channels, as RMSNorm weights make them
    if M > 2:
        x[2, :64] = 0  # all-zero blocks: a zero step
    return x


FORMATS = [Q4K, Q5K, Q6K]
SHAPES = [(3072, 2048), (512, 8192)]  # qkv of Llama-3.2-1B (2048 + 512 + 512 rows); down's K (a slice of its rows)


@pytest.mark.parametrize("qtype", FORMATS, ids=["Q4_K", "Q5_K", "Q6_K"])
def test_codes_and_scales_read_from_the_bytes_give_ggufs_dequantization(qtype):
    b = random_blocks(qtype, 48, 512, seed=qtype)
    q, step, minus, centre = decompose(b)
    want = quants.dequantize(b.raw.numpy(), T(qtype))
    np.testing.assert_array_equal((step * (q - centre) - minus).astype(np.float32), want)
    np.testing.assert_array_equal(b.dequantize().numpy(), want)


@pytest.mark.parametrize("precise", [True, False], ids=["two-codes", "a8"])
@pytest.mark.parametrize("shape", SHAPES, ids=["K2048", "K8192"])
@pytest.mark.parametrize("qtype", FORMATS, ids=["Q4_K", "Q5_K", "Q6_K"])
def test_integer_sums_and_float_steps_match_the_oracle(qtype, shape, precise):
    N, K = shape
    b = random_blocks(qtype, N, K, seed=1)
    x = activations(5, K, seed=2)
    y = run(QM.default_kernel(), b, x, precise).double().numpy()
    terms, mins, mins_abs, wq = kernel_terms(b, x, precise)
    want = terms.sum(-1) + mins.sum(-1)
    err = np.abs(y - want)
    bound = rounding_bound(terms, mins_abs, K // 32)
    assert (err <= bound).all(), float((err / bound).max())
    # against the float activations: the activation step's error, |x - c u| <= u / 2 per value (one code)
    # or u (two codes: the remainder's code may clamp at 127), times |the weight it meets|
    c, u = quantized_activations(x, precise)
    exact = x.double().numpy() @ b.dequantize().double().numpy().T
    act = (np.repeat(u, 32, axis=1) * (0.5 if not precise else 1.0)) @ np.abs(wq).T
    assert (np.abs(y - exact) <= act + bound).all()


@pytest.mark.parametrize("qtype", FORMATS, ids=["Q4_K", "Q5_K", "Q6_K"])
def test_bfloat16_in_and_out_is_the_float32_result_rounded(qtype):
    """bfloat16 activations quantize to the same codes as their float32 values; the output is the
    float32 sum rounded to bfloat16 (nearest even)."""
    b = random_blocks(qtype, 256, 2048, seed=3)
    x = activations(7, 2048, seed=4).bfloat16()
    k = QM.default_kernel()
    for precise in (True, False):
        assert torch.equal(run(k, b, x, precise), run(k, b, x.float(), precise).bfloat16())


def test_a_fused_weight_of_mixed_types_is_its_parts_side_by_side():
    """q|k|v of a Q4_K_M file: Q4_K, Q4_K, Q6_K rows in one packed weight and one call."""
    parts = [random_blocks(Q4K, 256, 2048, 5), random_blocks(Q4K, 64, 2048, 6), random_blocks(Q6K, 64, 2048, 7),
             random_blocks(Q5K, 32, 2048, 8)]
    x = activations(9, 2048, seed=9).bfloat16()
    k = QM.default_kernel()
    for precise in (True, False):
        fused = k(x, pack_kquant(parts), KQUANT_BITS, 416, precise)
        assert torch.equal(fused, torch.cat([run(k, p, x, precise) for p in parts], dim=1))


@pytest.mark.parametrize("qtype", FORMATS, ids=["Q4_K", "Q5_K", "Q6_K"])
def test_each_row_is_the_same_alone_or_batched(qtype):
    """rows_invariant: 64 rows alone, then 2..17, 31..33, 64, 100 and 256 rows in one call."""
    b = random_blocks(qtype, 512, 2048, seed=10)
    packed, k = pack_kquant([b]), QM.default_kernel()
    for precise in (True, False):
        layer = lambda x: k(x, packed, KQUANT_BITS, 512, precise)  # noqa: E731
        assert Kn.rows_invariant(layer, 2048, torch.bfloat16, seed=11)


def test_rows_do_not_depend_on_the_thread_count():
    b = random_blocks(Q4K, 512, 2048, seed=12)
    x = activations(19, 2048, seed=13).bfloat16()
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(run(QM.default_kernel(), b, x))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.fixture(scope="module")
def avx2_kernel(narrower_kernels):
    if "avx2" not in narrower_kernels:
        pytest.skip("this CPU has no AVX2")
    return narrower_kernels["avx2"]


@pytest.mark.parametrize("qtype", FORMATS, ids=["Q4_K", "Q5_K", "Q6_K"])
def test_the_avx2_build_gives_the_same_bits(avx2_kernel, qtype):
    assert avx2_kernel.path == "avx2"
    b = random_blocks(qtype, 256, 2048, seed=14)
    x = activations(11, 2048, seed=15).bfloat16()
    for precise in (True, False):
        want = run(QM.default_kernel(), b, x, precise)
        assert torch.equal(run(avx2_kernel, b, x, precise), want), precise
        alone = torch.cat([run(avx2_kernel, b, x[i: i + 1], precise) for i in range(x.shape[0])])
        assert torch.equal(alone, want), precise


@pytest.mark.parametrize("qtype", FORMATS, ids=["Q4_K", "Q5_K", "Q6_K"])
def test_amx_tiles_give_the_vnni_bits(tile_kernel, qtype):
    """Calls of 12 rows or more take the AMX tiles where the OS grants them (on a CPU without them, the
    same code over the software tile unit: conftest.tile_kernel). Exact integer sums, then
    group_rows' float steps in its order: every row bitwise what the VNNI path gives, at every tile
    height (a padding row included) and in a weight whose segments mix the three types."""
    k = tile_kernel
    single = random_blocks(qtype, 64, 2048, seed=20 + qtype)
    mixed = [single, random_blocks(Q4K, 32, 2048, 21), random_blocks(Q6K, 16, 2048, 22),
             random_blocks(Q5K, 16, 2048, 23)]
    was = k.set_amx(QM.AMX_NEVER)
    try:
        for M in (1, 5, 12, 13, 16, 23, 40):  # tiles of heights 2, 6, 12, 14 (a padding row), 16, 12 x 2, 14 x 3
            x = activations(M, 2048, seed=M)
            for packed, n in ((pack_kquant([single]), 64), (pack_kquant(mixed), 128)):
                for dtype in (torch.bfloat16, torch.float32):
                    for precise in (True, False):
                        k.set_amx(QM.AMX_NEVER)
                        want = k(x.to(dtype), packed, KQUANT_BITS, n, precise)
                        k.set_amx(QM.AMX_ALWAYS)
                        got = k(x.to(dtype), packed, KQUANT_BITS, n, precise)
                        assert torch.equal(got, want), (M, n, dtype, precise)
        k.set_amx(QM.AMX_ALWAYS)  # no rows: no tile of height 0
        assert run(k, single, torch.zeros(0, 2048)).shape == (0, 64)
    finally:
        k.set_amx(was)
    # and the VNNI path of the tile build is the served kernel's
    x = activations(13, 2048, seed=24).bfloat16()
    assert torch.equal(run(k, single, x), run(QM.default_kernel(), single, x))


def test_shapes_the_kernel_does_not_take_are_refused():
    b = random_blocks(Q4K, 32, 512, seed=16)
    k = QM.default_kernel()
    packed = pack_kquant([b])
    with pytest.raises(ValueError, match="does not take"):
        k(torch.randn(2, 256), packed, KQUANT_BITS, 32)  # K disagrees with the packed weight's
    with pytest.raises(ValueError, match="does not take"):
        k(torch.randn(2, 512), packed, KQUANT_BITS, 48)  # N too
    assert k(torch.zeros(0, 512), packed, KQUANT_BITS, 32).shape == (0, 32)
    with pytest.raises(ValueError, match="N % 16"):
        pack_kquant([random_blocks(Q4K, 24, 512, seed=17)])
