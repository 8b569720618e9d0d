"""The project's native CPU kernels (model/native/csrc/*.cpp), compiled for this machine on first use.

One shared library holds them all (decode_attention.cpp, prompt_attention.cpp, fused_ops.cpp,
quant_matmul.cpp, logit_mask.cpp, row_max.cpp, native_step.cpp; native_common.h). It is compiled with the
system C++ compiler (`-O3 -march=native -fopenmp`, the sources side by side on the cores: ~9 s on 2),
cached under `<cache_dir>/kernels` per (sources, compiler, CPU), and loaded with ctypes: no torch
headers, so building is quick, and OpenMP resolves to the runtime torch has already loaded. Without
a compiler, or on a CPU the kernels do not know (no x86-64 AVX2 and FMA: ARM, older x86), the library
is not built and the callers keep the torch paths and log why.

$LMSERVE_NATIVE_MARCH names a narrower instruction set to build for than this CPU's own ("x86-64-v3":
AVX2, no AVX-512; "x86-64-v2": none the kernels know), so that one machine can serve, and be tested,
as a narrower one would; with ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA holding torch's own kernels
to the same set (tests/unit/test_narrower_cpu.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..cache_dir import default_cache_dir

CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cpp"))
HEADERS = sorted(CSRC.glob("*.h"))
_BUILD_SECONDS = 180
MARCH_ENV = "LMSERVE_NATIVE_MARCH"


def served_march() -> str:
    """What the served library is compiled for: "native" (this CPU's own instruction set), or the
    narrower one named in $LMSERVE_NATIVE_MARCH (read at each build, not at import)."""
    return os.environ.get(MARCH_ENV, "").strip() or "native"


def _target_defines(cxx: str, march: str) -> str:
    """The compiler's predefined macros for this target ("" when it cannot tell)."""
    arch, *more = march.split()
    try:
        return subprocess.run([cxx, f"-march={arch}", *more, "-dM", "-E", "-x", "c++", os.devnull],
                              capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def unknown_cpu(cxx: str, march: str) -> str | None:
    """Why the kernels have no path for this target (they need x86-64 with AVX2 and FMA), or None."""
    defines = _target_defines(cxx, march)
    if "__AVX2__" in defines and "__FMA__" in defines:
        return None
    what = "this CPU" if march == "native" else f"-march={march}"
    return f"{what} has no AVX2 and FMA, which the native kernels need: the torch paths serve"


def _identity(march: str = "native", sources=SOURCES) -> str:
    """What the built library depends on: the sources, the compiler and this CPU's instruction set."""
    cxx = os.environ.get("CXX", "g++")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "model name")):
                flags += line
                if line.startswith("flags"):
                    break
    except OSError:
        pass
    return hashlib.sha256(version.encode() + flags.encode() + march.encode()
                          + sources_digest(sources).encode()).hexdigest()[:20]


def sources_digest(sources=SOURCES) -> str:
    """A digest of the kernels' sources and headers alone (what a cached kernel choice was measured with)."""
    h = hashlib.sha256()
    for src in [*sources, *HEADERS]:
        h.update(src.name.encode() + src.read_bytes())
    return h.hexdigest()[:20]


def build(cache_dir: Path, march: str | None = None, sources=SOURCES) -> tuple[ctypes.CDLL | None, str]:
    """The library for this machine (compiled on first use, then cached), or None and why not.

    march: the instruction set compiled for, optionally followed by more -m flags; None: the served
    one (served_march: "native" unless narrowed), another (e.g. "x86-64-v3": AVX2, no AVX-512; "x86-64-v3 -mavxvnni") lets tests run a
    narrower path of the kernels on this machine, with `sources` a subset of SOURCES."""
    cxx = os.environ.get("CXX", "g++")
    march = march or served_march()
    if shutil.which(cxx) is None:
        return None, f"no C++ compiler ({cxx}) on PATH"
    target = Path(cache_dir) / "kernels" / f"lmserve-native-{_identity(march, sources)}.so"
    if not target.is_file():
        why = unknown_cpu(cxx, march)
        if why:
            return None, why
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                out = Path(tmp) / target.name
                arch, *more = march.split()
                failed = _compile(cxx, ["-O3", f"-march={arch}", *more, "-fopenmp", "-std=c++17", "-fPIC"],
                                  sources, out)
                if failed:
                    return None, f"compiling the native kernels failed: {failed[-300:]}"
                os.replace(out, target)  # atomic: a concurrent start sees the whole file or none
        except (OSError, subprocess.SubprocessError) as exc:
            return None, f"compiling the native kernels failed: {exc}"
    try:
        return ctypes.CDLL(str(target)), "built for this CPU" if march == "native" else f"built for -march={march}"
    except OSError as exc:
        return None, f"loading the native kernels failed: {exc}"


def usable_cores() -> set[int]:
    """The cores this process may run on (its affinity mask; every core where the OS has no masks)."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def _compile(cxx: str, flags: list[str], sources, out: Path) -> str:
    """Each source compiled to an object beside `out`, as many at once as this process has cores (one
    command for all of them took 15 s on 2 cores, one file after another), then linked into `out`.
    Returns the compiler's complaint, or "" when `out` was written."""
    sources = list(sources)

    def run(cmd: list[str]) -> str:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_BUILD_SECONDS)
        if done.returncode == 0:
            return ""
        return done.stderr.strip() or f"{cmd[0]} exited with {done.returncode}"

    objects = [out.with_name(f"{i}-{src.stem}.o") for i, src in enumerate(sources)]
    with ThreadPoolExecutor(max_workers=max(1, min(len(usable_cores()), len(sources)))) as pool:
        errors = list(pool.map(run, [[cxx, *flags, "-c", str(src), "-o", str(obj)] for src, obj in zip(sources, objects)]))
    failed = next((e for e in errors if e), "")
    return failed or run([cxx, *flags, "-shared", *map(str, objects), "-o", str(out)])


_LOADED: dict[str, tuple[ctypes.CDLL | None, str]] = {}


def load(cache_dir: Path | None = None) -> tuple[ctypes.CDLL | None, str]:
    """build(cache_dir) once per process (default: cache_dir.default_cache_dir())."""
    if cache_dir is None:
        cache_dir = default_cache_dir()
    key = str(Path(cache_dir).resolve())
    if key not in _LOADED:
        _LOADED[key] = build(Path(cache_dir))
    return _LOADED[key]


def loaded() -> ctypes.CDLL | None:
    """A library this process already built or loaded through load() (the model loader's on CPU), or
    None: for callers that use the kernels where they exist and must not build them (the sampler)."""
    return next((lib for lib, _ in _LOADED.values() if lib is not None), None)


_BOUND: dict = {}


def bound(wrapper):
    """wrapper(lib) for the library this process already loaded (loaded()), made once, or None while
    there is none (asked again next time: a model may load later in this process). For callers that
    use a kernel where the model loader built one and must not build it (the sampler)."""
    if wrapper not in _BOUND:
        lib = loaded()
        if lib is None:
            return None
        _BOUND[wrapper] = wrapper(lib)
    return _BOUND[wrapper]


def rows_packed(x):
    """x with its last two dimensions (heads, head_dim) packed, as the kernels read them; the rows
    before them may sit anywhere (their stride is passed). A copy only when they are not."""
    if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
        x = x.contiguous()
    return x


__all__ = ["build", "bound", "load", "loaded", "rows_packed", "sources_digest", "SOURCES"]
