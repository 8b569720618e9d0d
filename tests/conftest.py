"""Shared fixtures: the real SmolLM2 GGUF, pulled once into a cache that outlives test sessions."""

import os
from pathlib import Path

import pytest

from lmserve.model.checkpoints.catalog import pull

pytest_plugins = ["fixtures.trained_model"]


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF (pulled and sha256-verified on first use)."""
    models_dir = os.environ.get("LMSERVE_TEST_MODELS_DIR") or Path(__file__).resolve().parents[1] / ".cache" / "models"
    return pull("smollm2", models_dir, progress=False)


@pytest.fixture(scope="session")
def native_kernels_dir(tmp_path_factory) -> Path:
    """One kernels cache for the session's kernel tests: the native library compiles once (~16 s on
    2 cores) instead of once per test module."""
    return tmp_path_factory.mktemp("native-kernels")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf_path):
    """SmolLM2's byte-level BPE tokenizer, read from the GGUF's metadata (no weights loaded)."""
    import gguf

    from lmserve.model.text.tokenizer import Tokenizer

    reader = gguf.GGUFReader(str(smollm2_gguf_path))
    return Tokenizer.from_gguf_fields({k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")})
