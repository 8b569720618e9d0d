"""Tool calling, edge-neutral: what a request offers the model (spec.py), how the tools and earlier calls
reach the prompt (prompt.py), the grammar that holds a call to its function's schema (grammar.py), and
the reading of calls back out of the generated text, whole or as it streams (parser.py).

The model calls a function by writing lmserve's call envelope, the one Qwen2.5 and Hermes templates
teach:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from .spec import MAX_TOOLS, Tool, ToolCall, ToolUse

__all__ = ["MAX_TOOLS", "Tool", "ToolCall", "ToolUse"]
