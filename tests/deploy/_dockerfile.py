"""The Dockerfile and .dockerignore read as Docker reads them, without a Docker engine: a small
parser (stages, instructions, exec forms, flags), Docker's .dockerignore matching, and what the build
context holds. Shared by the structure tests and the replay of the image's install steps."""

from __future__ import annotations

import ast
import json
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from _repo import REPO_ROOT

DOCKERFILE = REPO_ROOT / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / ".dockerignore"

# ---------------------------------------------------------------- a small Dockerfile parser


@dataclass
class Instruction:
    keyword: str  # upper case
    args: str  # the rest of the logical line, continuations joined
    line: int

    def exec_form(self) -> list[str] | None:
        """The JSON array of an exec-form CMD/ENTRYPOINT/HEALTHCHECK CMD, else None."""
        text = self.args.split("CMD", 1)[1].strip() if self.keyword == "HEALTHCHECK" else self.args.strip()
        if not text.startswith("["):
            return None
        return json.loads(text)

    def flags(self) -> dict[str, str]:
        """Leading --name=value flags (COPY --from, HEALTHCHECK --interval, RUN --mount...)."""
        out = {}
        for word in shlex.split(self.args):
            if not word.startswith("--"):
                break
            name, _, value = word[2:].partition("=")
            out.setdefault(name, value)
        return out

    def words(self) -> list[str]:
        """Arguments after the leading flags (shell words)."""
        words = shlex.split(self.args)
        while words and words[0].startswith("--"):
            words.pop(0)
        return words


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)


def logical_lines(text: str) -> list[tuple[int, str]]:
    """Join backslash continuations; drop comments and blank lines (comments inside a continued
    instruction are dropped too, as Docker does)."""
    out, buf, start = [], [], 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not buf):
            continue
        if not buf:
            start = number
        if stripped.endswith("\\"):
            buf.append(stripped[:-1])
            continue
        buf.append(stripped)
        out.append((start, " ".join(part for part in buf if part)))
        buf = []
    assert not buf, "the Dockerfile ends inside a continued line"
    return out


def parse_dockerfile(text: str) -> Dockerfile:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line, content in logical_lines(text):
        keyword, _, args = content.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            words = [w for w in args.split() if not w.startswith("--platform")]
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
        elif not stages:
            assert keyword == "ARG", f"line {line}: only ARG may come before the first FROM, got {keyword}"
            key, _, default = args.partition("=")
            global_args[key.strip()] = default.strip().strip('"')
        else:
            stages[-1].instructions.append(Instruction(keyword, args, line))
    return Dockerfile(global_args, stages)


def substitute(text: str, values: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: values[m.group(1) or m.group(2)], text)


def env_of(stage: Stage) -> dict[str, str]:
    env = {}
    for inst in stage.all("ENV"):
        for word in shlex.split(inst.args):
            key, _, value = word.partition("=")
            env[key] = value
    return env


# ---------------------------------------------------------------- .dockerignore (Docker's rules)


def _pattern_regex(pattern: str) -> re.Pattern:
    """Go filepath.Match syntax plus `**` (any number of path segments), as Docker reads .dockerignore."""
    out, i = "", 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):
                i += 1
                out += "(?:.*/)?"
            else:
                out += ".*"
            continue
        if c == "*":
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[":
            end = pattern.index("]", i)
            body = pattern[i + 1:end]
            out += "[" + ("^" + body[1:] if body.startswith("^") else body) + "]"
            i = end
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out += re.escape(pattern[i])
        else:
            out += re.escape(c)
        i += 1
    return re.compile(out + r"\Z")


def dockerignore_rules(text: str) -> list[tuple[bool, re.Pattern]]:
    rules = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line[1:].strip() if negate else line
        pattern = str(Path("/" + pattern).resolve(strict=False)).lstrip("/") if ".." in pattern else pattern.strip("/")
        rules.append((negate, _pattern_regex(pattern)))
    return rules


def excluded(path: str, rules) -> bool:
    """Whether Docker leaves `path` (relative to the context) out: the last rule matching the path or
    one of its parent directories decides."""
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    result = False
    for negate, regex in rules:
        if any(regex.match(c) for c in candidates):
            result = not negate
    return result


def tracked_files(under: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", "--", under], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    return [line for line in out.stdout.splitlines() if line]


def context_copies(df: Dockerfile) -> list[str]:
    sources = []
    for stage in df.stages:
        for inst in stage.all("COPY") + stage.all("ADD"):
            if "from" not in inst.flags():
                sources += inst.words()[:-1]
    return sources


def package_roots() -> dict[str, str]:
    """setup.py's ROOTS (import package -> folder), read without running setup()."""
    tree = ast.parse((REPO_ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["ROOTS"]:
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py defines no ROOTS")
