"""What ships, tested as it ships: the wheel built from this tree, and the image's install steps.

The rest of the suite imports the editable checkout, where a package left out of the wheel or a C++
source left out of its package data still works. Here nothing comes from the checkout:

- The wheel is built from the tree's files and installed alone into a venv that borrows the test
  venv's dependencies (a path entry, so the editable project's finder stays out). Every module imports
  there, and `lmserve serve` answers over gRPC and HTTP, its native kernels compiled from the wheel's
  own sources.
- The base wheel (no [server] extra), installed with its own dependencies, is a client: the SDK and
  `lmserve generate` work, and torch is not importable.
- The Dockerfile's builder stage is replayed, its instructions in order, into a scratch root. That
  runs the same pip commands and the build-time import check. The image's HEALTHCHECK command, run
  from that venv, answers.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.request
import zipfile
from pathlib import Path

import pytest
from _dockerfile import DOCKERFILE, DOCKERIGNORE, dockerignore_rules, excluded, package_roots, parse_dockerfile
from _repo import REPO_ROOT, server_harness

from lmserve.client import Client

pytestmark = pytest.mark.slow

PROMPT = "Explain in two sentences what a CPU does."
TOKENS = 12
# Files under the package folders' parents that are development tools, not part of any package.
NOT_SHIPPED = {"proto/generate.sh"}
# The CPU wheel index the Dockerfile defaults to is not reachable from every build machine; the
# Dockerfile's own TORCH_INDEX_URL argument points the replay at the package index, where pip finds
# the same CPU build the Makefile installs (torch==2.13.0, from the local wheel cache where present).
REPLAY_ARGS = {"TORCH_INDEX_URL": "https://pypi.org/simple"}


def run(args: list[str], timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    """Run a command; on failure, fail the test with its output (never a bare CalledProcessError)."""
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kw)
    if done.returncode != 0:
        pytest.fail(f"{shlex.join(map(str, args))} exited {done.returncode}\n{done.stdout[-4000:]}\n"
                    f"{done.stderr[-4000:]}", pytrace=False)
    return done


def tree_files() -> list[str]:
    """The files of this tree as a fresh clone plus uncommitted work would have them: tracked and
    untracked-but-not-ignored, minus deleted ones."""
    out = run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT).stdout
    return sorted(f for f in out.splitlines() if (REPO_ROOT / f).is_file())


def copy_files(files: list[str], dest: Path) -> None:
    for name in files:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / name, target)


def site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without the test venv on PATH or in PYTHONPATH, and no LMSERVE_* settings."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LMSERVE_", "PYTHON", "VIRTUAL_ENV"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not p.startswith(sys.prefix))
    env.update(extra)
    return env


# ---------------------------------------------------------------- the wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("source")
    copy_files(tree_files(), src)
    out = tmp_path_factory.mktemp("dist")
    # no build isolation: the test venv's setuptools builds it, so no download is needed
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)])
    (built,) = out.glob("lmserve-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel_names(wheel) -> set[str]:
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


@pytest.fixture(scope="module")
def wheel_venv(wheel, tmp_path_factory) -> Path:
    """The wheel alone, in a venv that sees the test venv's dependencies but not its project."""
    venv = tmp_path_factory.mktemp("wheel-venv")
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q", "--no-deps",
         str(wheel)])
    # after the install, so pip never sees the editable project's metadata; a plain path entry, so the
    # test venv's own .pth files (the editable finder among them) are not run
    (site_packages(venv) / "shared_test_dependencies.pth").write_text(f"{site_packages(Path(sys.prefix))}\n")
    return venv


def test_every_file_of_the_package_folders_is_in_the_wheel(wheel_names):
    """Each file under a package root ships at its import path: modules, stubs, the proto, the C++
    kernels and headers, the quality text, scripts. Files beside the roots are named dev tools."""
    roots = package_roots()
    files = [f for f in tree_files() if f.split("/")[0] in {r.split("/")[0] for r in roots.values()}]
    missing, unplaced = [], []
    for name in files:
        if "__pycache__" in name:
            continue
        root = next((r for r in sorted(roots.values(), key=len, reverse=True) if name.startswith(r + "/")), None)
        if root is None:
            unplaced.append(name)
            continue
        package = next(p for p, r in roots.items() if r == root)
        shipped = package.replace(".", "/") + name[len(root):]
        if shipped not in wheel_names:
            missing.append(f"{name} (as {shipped})")
    assert not missing, f"not in the wheel: {missing}"
    assert set(unplaced) == NOT_SHIPPED, f"files outside every package root: {sorted(set(unplaced) - NOT_SHIPPED)}"


def test_every_module_imports_from_the_installed_wheel(wheel_venv, wheel_names, tmp_path):
    modules = sorted(n[:-3].replace("/", ".").removesuffix(".__init__") for n in wheel_names
                     if n.endswith(".py") and n.startswith("lmserve/"))
    script = (
        "import importlib, json, sys\n"
        f"mods = {modules!r}\n"
        "failed = {}\n"
        "for m in mods:\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except Exception as exc:\n"
        "        failed[m] = f'{type(exc).__name__}: {exc}'\n"
        "import lmserve\n"
        "print(json.dumps({'failed': failed, 'from': lmserve.__file__}))\n")
    done = run([str(wheel_venv / "bin" / "python"), "-c", script], cwd=tmp_path, env=clean_env())
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(result["from"]).is_relative_to(wheel_venv), f"lmserve came from {result['from']}"
    assert result["failed"] == {}


@pytest.fixture(scope="module")
def wheel_server(wheel_venv, smollm2_gguf_path, tmp_path_factory):
    """`lmserve serve` from the wheel's venv, in a quantized bfloat16 mode so the native kernels are
    compiled from the wheel's own C++ sources into a fresh cache."""
    home = tmp_path_factory.mktemp("wheel-home")
    srv = server_harness.ServerProcess(smollm2_gguf_path, log_dir=home, cwd=home, command=[str(wheel_venv / "bin" / "lmserve")],
                                       env={"XDG_CACHE_HOME": str(home / "cache")}, startup_timeout=600)
    srv.start(dtype="bfloat16", quantization="int4", kv_cache_dtype="model", compile="false")
    yield srv
    srv.stop()


def http_completion(srv, prompt: str, max_tokens: int) -> str:
    with urllib.request.urlopen(f"{srv.http_url}/models", timeout=60) as response:
        model = json.loads(response.read())["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(f"{srv.http_url}/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())["choices"][0]["text"]


@pytest.fixture(scope="module")
def grpc_answer(wheel_server) -> str:
    with Client(wheel_server.target, timeout=120) as client:
        result = client.generate(PROMPT, max_new_tokens=TOKENS)
    assert result.usage.completion_tokens == TOKENS and result.text.strip()
    return result.text


def test_the_installed_wheel_serves_grpc_and_http(wheel_server, grpc_answer):
    log = wheel_server.log
    assert "native kernels: built for this CPU" in log, log[-3000:]
    built = list((Path(wheel_server.extra_env["XDG_CACHE_HOME"]) / "lmserve").rglob("*.so"))
    assert built, "no native library was compiled into the fresh cache"
    # the same greedy tokens through the other edge
    assert http_completion(wheel_server, PROMPT, TOKENS) == grpc_answer


# ---------------------------------------------------------------- the base wheel: a client without torch


@pytest.fixture(scope="module")
def client_venv(wheel, tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("client-venv")
    run([sys.executable, "-m", "venv", str(venv)])
    run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", str(wheel)], env=clean_env())
    return venv


def test_the_base_wheel_has_no_torch_and_its_client_and_load_generator_work(client_venv, wheel_server, grpc_answer,
                                                                            tmp_path):
    python = str(client_venv / "bin" / "python")
    script = (
        "import importlib.util, json, sys\n"
        "from lmserve.client import Client\n"
        f"with Client({wheel_server.target!r}, timeout=120) as c:\n"
        f"    text = c.generate({PROMPT!r}, max_new_tokens={TOKENS}).text\n"
        "print(json.dumps({'text': text, 'torch_findable': importlib.util.find_spec('torch') is not None,\n"
        "                  'torch_loaded': 'torch' in sys.modules}))\n")
    result = json.loads(run([python, "-c", script], cwd=tmp_path, env=clean_env()).stdout.strip().splitlines()[-1])
    assert result == {"text": grpc_answer, "torch_findable": False, "torch_loaded": False}
    cli = run([str(client_venv / "bin" / "lmserve"), "generate", "-t", wheel_server.target, PROMPT,
               "--max-new-tokens", str(TOKENS)], cwd=tmp_path, env=clean_env())
    assert cli.stdout.strip() == grpc_answer.strip()
    # serving needs the extra: one line that says which, not a traceback
    serve = subprocess.run([str(client_venv / "bin" / "lmserve"), "serve"], capture_output=True,
                           text=True, cwd=tmp_path, env=clean_env(), timeout=120)
    assert serve.returncode != 0 and "Traceback" not in serve.stderr and "lmserve[server]" in serve.stderr, serve.stderr
    # the client benchmarks run here; a benchmark of the server's own code says which extra it needs
    report = tmp_path / "load.json"
    run([str(client_venv / "bin" / "lmserve"), "bench", "load", "-t", wheel_server.target, "--requests", "2",
         "--max-new-tokens", str(TOKENS), "--no-progress", "--out", str(report)], cwd=tmp_path, env=clean_env())
    assert json.loads(report.read_text())["summary"]["completed"] == 2
    engine = subprocess.run([str(client_venv / "bin" / "lmserve"), "bench", "engine"], capture_output=True,
                            text=True, cwd=tmp_path, env=clean_env(), timeout=120)
    assert engine.returncode == 2 and "Traceback" not in engine.stderr and "lmserve[server]" in engine.stderr, \
        engine.stderr


# ---------------------------------------------------------------- the image's install steps, replayed


@pytest.fixture(scope="module")
def image_root(tmp_path_factory) -> Path:
    """The Dockerfile's builder stage replayed under a scratch root: ARG and ENV into the environment,
    WORKDIR and COPY into the root (the build context as .dockerignore leaves it), and every RUN
    through sh, so the same pip commands run in the same order, ending with the import check."""
    df = parse_dockerfile(DOCKERFILE.read_text())
    builder = df.stage("builder")
    root = tmp_path_factory.mktemp("image")
    rules = dockerignore_rules(DOCKERIGNORE.read_text())
    context = [f for f in tree_files() if not excluded(f, rules)]
    args = {**df.global_args, **REPLAY_ARGS}
    env = clean_env()

    def rooted(text: str) -> str:
        # the stage's absolute paths (its venv, its work dir) inside the scratch root
        for path in ("/opt/venv", "/src"):
            text = text.replace(path, f"{root}{path}")
        return text

    workdir = root
    for inst in builder.instructions:
        if inst.keyword == "ARG":
            key, _, default = inst.args.partition("=")
            args.setdefault(key.strip(), default.strip().strip('"'))
        elif inst.keyword == "ENV":
            for word in shlex.split(rooted(inst.args)):
                key, _, value = word.partition("=")
                env[key] = os.path.expandvars(value.replace("$PATH", env["PATH"]))
        elif inst.keyword == "WORKDIR":
            workdir = Path(rooted(inst.args.strip()))
            workdir.mkdir(parents=True, exist_ok=True)
        elif inst.keyword == "COPY":
            *sources, dest = inst.words()
            for source in sources:
                source = source.rstrip("/")
                chosen = [f for f in context if f == source or f.startswith(source + "/")]
                assert chosen, f"COPY {source}: nothing in the build context"
                copy_files(chosen, workdir)
        elif inst.keyword == "RUN":
            command = rooted(re.sub(r"^(\s*--\S+)+\s*", "", inst.args))  # the script after --mount etc.
            run(["sh", "-c", command], cwd=workdir, env={**env, **args}, timeout=1200)
        else:
            raise AssertionError(f"line {inst.line}: the replay does not know {inst.keyword}")
    return root


def test_the_images_install_steps_install_a_working_server(image_root, wheel_server):
    venv = image_root / "opt" / "venv"
    python = str(venv / "bin" / "python")
    where = run([python, "-c", "import lmserve.server.app, lmserve.model; print(lmserve.model.__file__)"],
                cwd=image_root, env=clean_env()).stdout.strip()
    assert Path(where).is_relative_to(venv)
    # the image's HEALTHCHECK command, from the image's venv, aimed at a serving server
    df = parse_dockerfile(DOCKERFILE.read_text())
    (check,) = df.final.all("HEALTHCHECK")
    command = check.exec_form()
    target_at = command.index("-t") + 1
    command[target_at] = wheel_server.target
    done = subprocess.run(command, capture_output=True, text=True, timeout=60,
                          env=clean_env(PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"))
    assert done.returncode == 0, done.stdout + done.stderr
