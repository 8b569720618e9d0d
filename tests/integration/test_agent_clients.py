"""The agent command-line clients against the HTTP edge, one scripted turn each: Claude Code through the
Messages API, Codex CLI through the Responses API (both installed by deploy/ci/install-agent-clients.sh,
pinned). Each sends its whole agent request: a system prompt and tool list of ~20k tokens, a
mid-conversation system message (Claude Code), namespace and hosted tools and developer messages (Codex),
tool schemas with keywords the grammar cannot enforce. SmolLM2's 4,096-token context cannot hold it, so
the turn ends with the server's 400 saying how long the prompt is, which each client shows its user:
every part of the request was read and translated before the length was known. (On a long-context model
the same turns are answered; docs/anthropic-api.md and docs/openai-api.md say how to point each client.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import httpx
import pytest

CLIENTS = Path(os.environ.get("LMSERVE_AGENT_CLIENTS", Path.home() / ".cache/lmserve/agent-clients"))
TOO_LONG = re.compile(r"has (\d+) tokens; the context holds 4096")


def client(name: str) -> Path:
    path = CLIENTS / "node_modules" / ".bin" / name
    if not path.exists():
        pytest.skip(f"{name} is not installed in {CLIENTS} (sh deploy/ci/install-agent-clients.sh)")
    return path


@pytest.fixture(scope="module")
def served(smollm2_http) -> tuple[str, str]:
    """(the server's root URL, its model name)."""
    name = httpx.get(f"{smollm2_http.http_url}/models", timeout=30).json()["data"][0]["id"]
    return smollm2_http.http_url.removesuffix("/v1"), name


def clean_env(tmp_path: Path) -> dict:
    home = tmp_path / "home"
    home.mkdir()
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TERM")}
    return {**keep, "HOME": str(home), "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
            "DISABLE_ERROR_REPORTING": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}


def test_claude_code_sends_its_whole_turn_and_shows_the_context_error(served, tmp_path):
    root, model = served
    env = {**clean_env(tmp_path), "ANTHROPIC_BASE_URL": root, "ANTHROPIC_API_KEY": "unused",
           "ANTHROPIC_MODEL": model, "ANTHROPIC_DEFAULT_HAIKU_MODEL": model, "ANTHROPIC_SMALL_FAST_MODEL": model,
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "256"}
    out = subprocess.run([str(client("claude")), "-p", "Reply with one word: hello", "--model", model,
                          "--output-format", "json", "--max-turns", "1"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["is_error"] and result["api_error_status"] == 400, result
    found = TOO_LONG.search(result["result"])
    assert found and int(found[1]) > 10_000, result["result"]  # the whole system prompt and tool list arrived


def test_claude_code_completes_a_turn_in_its_bare_mode(served, tmp_path):
    """Without its built-in tools and with a short system prompt (`--bare --tools "" --system-prompt`), the
    request fits SmolLM2's context: a streamed turn answered, as Claude Code reports it."""
    root, model = served
    env = {**clean_env(tmp_path), "ANTHROPIC_BASE_URL": root, "ANTHROPIC_API_KEY": "unused",
           "ANTHROPIC_MODEL": model, "ANTHROPIC_DEFAULT_HAIKU_MODEL": model, "ANTHROPIC_SMALL_FAST_MODEL": model,
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "64"}
    out = subprocess.run([str(client("claude")), "-p", "What is the capital of France?", "--model", model,
                          "--output-format", "json", "--max-turns", "1", "--bare", "--tools", "",
                          "--system-prompt", "Answer in one short sentence."],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # Claude Code samples at Anthropic's default temperature (1.0): the answer either ends within the limit,
    # or ends at it (stop_reason max_tokens), which Claude Code reports as its own error. Both are a streamed
    # turn read to its end; anything else (an API error, no answer) fails.
    if result["is_error"]:
        assert result["api_error_status"] is None and "exceeded the 64 output token maximum" in result["result"], result
    else:
        assert result["stop_reason"] == "end_turn" and result["result"].strip() and result["usage"]["output_tokens"], result


def test_codex_sends_its_whole_turn_and_shows_the_context_error(served, tmp_path):
    root, model = served
    home = tmp_path / "codex"
    home.mkdir()
    (home / "config.toml").write_text(
        f'model = "{model}"\nmodel_provider = "lmserve"\n\n[model_providers.lmserve]\nname = "lmserve"\n'
        f'base_url = "{root}/v1"\nwire_api = "responses"\nenv_key = "LMSERVE_KEY"\n')
    env = {**clean_env(tmp_path), "CODEX_HOME": str(home), "LMSERVE_KEY": "unused"}
    out = subprocess.run([str(client("codex")), "exec", "--skip-git-repo-check", "Reply with one word: hello"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    found = TOO_LONG.search(out.stdout + out.stderr)
    assert found and int(found[1]) > 4096, out.stdout[-2000:] + out.stderr[-2000:]
