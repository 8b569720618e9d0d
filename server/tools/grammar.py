"""The grammar (llguidance's Lark dialect) that holds the model's output to lmserve's call envelope, each
call's arguments to its function's JSON schema.

    required / a named function   calls only: the output starts with the envelope
    auto                          free text, or text up to the envelope's trigger and then calls
    auto with a response_format   the answer as that JSON, or calls

Under `auto` the text before a call is llguidance's lazy lexeme ending at the trigger: until the model
writes `<tool_call>` every token is allowed (a mask that costs microseconds: every token is allowed
there), and from the trigger's last byte on, whichever tokens spelled it, the call is held to a name
among the functions and arguments valid under its schema; after the calls only more calls (when
parallel, and no function is named) or the end may follow. Where one call is all that may follow, the
grammar admits nothing after it but the end, where the engine ends any constrained output. One matcher
and one mask path serve text, calls and constrained answers alike, drafts are verified against it as
for any constraint, and no engine change is needed.
"""

from __future__ import annotations

import json

from ..engine.constraints.compiler import JSON_OPTIONS
from .spec import ARGUMENTS_KEY, BETWEEN, HEAD, TAIL, TRIGGER, ToolUse

# keywords beside which an object's properties are not all in `properties` (or are combined from
# elsewhere): such an object is left as it is
_OPEN_ENDED = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf",
               "$ref", "if", "dependentSchemas", "dependentRequired", "dependencies", "propertyNames")


def _lit(text: str) -> str:
    return json.dumps(text)


def generation_schema(schema: dict, lenient: bool = False) -> dict:
    """The schema a call's arguments are generated under: the request's, written the way lmserve writes
    JSON (one line, ", " and ": "), with objects that declare their properties (none, for a function
    without arguments) and leave additionalProperties unset held to those properties. Every output is still valid under the schema as
    given; a small model no longer adds keys of its own until its token limit.

    `lenient` (tools offered under `auto`, where no call is promised): keywords the grammar cannot hold a
    call to (`propertyNames`, ...) are left out rather than refused, so an agent client's tool list serves
    whole; a call then follows the rest of its schema. Where calls are promised valid (`required`, a named
    function) such a schema is refused, naming the keyword."""
    return {**_closed(schema), "x-guidance": {**JSON_OPTIONS, "lenient": True} if lenient else JSON_OPTIONS}


def _closed(schema):
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    props = schema.get("properties")
    if (isinstance(props, dict) and not any(k in schema for k in _OPEN_ENDED)
            and isinstance(schema.get("required", []), list) and set(schema.get("required", [])) <= props.keys()):
        out["additionalProperties"] = False
    if isinstance(props, dict):
        out["properties"] = {k: _closed(v) for k, v in props.items()}
    for key in ("items", "additionalItems", "contains", "not"):
        if isinstance(schema.get(key), dict):
            out[key] = _closed(schema[key])
    for key in ("prefixItems", "anyOf", "oneOf"):  # alternatives each stand alone (allOf's do not)
        if isinstance(schema.get(key), list):
            out[key] = [_closed(s) for s in schema[key]]
    for key in ("$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            out[key] = {k: _closed(v) for k, v in schema[key].items()}
    return out


def tool_grammar(use: ToolUse, answer: dict | None = None) -> str:
    """The grammar of `use`'s output (its choice must allow calls). `answer`: a response_format's JSON
    schema, the alternative to calls under `auto`."""
    functions = use.callable()
    rules = []
    for i, tool in enumerate(functions):
        rules.append(f"fn_{i}: {_lit(json.dumps(tool.name) + ARGUMENTS_KEY)} args_{i}")
        rules.append(f"args_{i}: %json {json.dumps(generation_schema(tool.schema, use.choice == 'auto'))}")
    names = " | ".join(f"fn_{i}" for i in range(len(functions)))
    rules.append(f"call: {_lit(HEAD)} ({names}) {_lit(TAIL)}")
    rules.append("calls: call" if use.one_call else f"calls: call ({_lit(BETWEEN + TRIGGER)} call)*")
    if use.choice != "auto":
        start = [f"start: {_lit(TRIGGER)} calls"]
    elif answer is None:
        start = ["start: TEXT | head calls", f"head[lazy]: TEXT {_lit(TRIGGER)}", r"TEXT: /(.|\n)*/"]
    else:
        start = [f"start: answer | {_lit(TRIGGER)} calls", f"answer: %json {json.dumps({**answer, 'x-guidance': JSON_OPTIONS})}"]
    return "\n".join(start + rules) + "\n"

