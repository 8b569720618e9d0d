#!/bin/sh
# Installs the agent command-line clients the HTTP edge is tested against (tests/integration/
# test_agent_clients.py): Claude Code (Messages API) and Codex CLI (Responses API), pinned, from the npm
# registry, into $LMSERVE_AGENT_CLIENTS (default ~/.cache/lmserve/agent-clients). Idempotent: does
# nothing when those versions are there. Test tools only: the server never runs them.
set -eu
CLAUDE=2.1.197
CODEX=0.171.0
dir="${LMSERVE_AGENT_CLIENTS:-$HOME/.cache/lmserve/agent-clients}"
stamp="$dir/.installed-claude-$CLAUDE-codex-$CODEX"
[ -e "$stamp" ] && exit 0
if ! command -v npm >/dev/null 2>&1; then
    echo "install-agent-clients: npm not found; the agent-client tests will skip" >&2
    exit 0
fi
mkdir -p "$dir"
echo "install-agent-clients: Claude Code $CLAUDE and Codex CLI $CODEX into $dir" >&2
if (cd "$dir" && npm install --silent --no-audit --no-fund --no-save \
        "@anthropic-ai/claude-code@$CLAUDE" "@openai/codex@$CODEX" >/dev/null); then
    touch "$stamp"
else
    echo "install-agent-clients: npm install failed; the agent-client tests will skip" >&2
fi
