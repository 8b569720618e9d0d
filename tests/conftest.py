"""Shared fixtures: the real SmolLM2 GGUF, pulled once into a cache that outlives test sessions."""

import os
from pathlib import Path

import pytest

from lmserve.model.catalog import pull

pytest_plugins = ["fixtures.trained_model"]


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF (pulled and sha256-verified on first use)."""
    models_dir = os.environ.get("LMSERVE_TEST_MODELS_DIR") or Path(__file__).resolve().parents[1] / ".cache" / "models"
    return pull("smollm2", models_dir, progress=False)
