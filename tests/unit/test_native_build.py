"""The native library's build (model/native/build.py): every source compiled (side by side) and linked into
one library that holds them all; a source that does not compile gives the compiler's own complaint and no
library."""

from __future__ import annotations

import shutil

import pytest

from lmserve.model.native import build as B

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")


def test_every_source_lands_in_one_library(tmp_path):
    sources = []
    for i in range(3):
        src = tmp_path / f"part{i}.cpp"
        src.write_text(f'extern "C" int lm_part{i}(int x) {{ return x * {i + 2}; }}\n')
        sources.append(src)
    lib, why = B.build(tmp_path / "cache", sources=sources)
    assert lib is not None, why
    assert [getattr(lib, f"lm_part{i}")(10) for i in range(3)] == [20, 30, 40]
    assert [p.name for p in (tmp_path / "cache" / "kernels").iterdir()] == [f"{lib._name.rsplit('/', 1)[-1]}"]


def test_a_source_that_does_not_compile_names_the_error_and_leaves_no_library(tmp_path):
    good, bad = tmp_path / "good.cpp", tmp_path / "bad.cpp"
    good.write_text('extern "C" int lm_good() { return 1; }\n')
    bad.write_text('extern "C" int lm_bad() { return undeclared_name; }\n')
    lib, why = B.build(tmp_path / "cache", sources=[good, bad])
    assert lib is None
    assert why.startswith("compiling the native kernels failed") and "undeclared_name" in why
    assert list((tmp_path / "cache" / "kernels").iterdir()) == []  # neither the library nor objects stay
