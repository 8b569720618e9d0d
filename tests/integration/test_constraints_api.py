"""Constraints through the real edges: the gRPC API (INVALID_ARGUMENT naming the field, before any
message), the SDK (sync and asyncio) and the CLI, against the shared trained server (sentencepiece
vocabulary with byte fallback). Outputs are checked by re.fullmatch and membership."""

from __future__ import annotations

import json
import re

import grpc
import pytest
from _server import field_violations
from test_cli import error_lines, lmserve

from lmserve.client import AsyncClient, Client, InvalidRequestError
from lmserve.v1 import lmserve_pb2 as pb

INTERNALS = re.compile(r"Traceback|File \"|\.py\b|lmserve\.server|0x[0-9a-f]{6,}|Error\(|<state>")
PROMPT = "The lighthouse keeper"


def P(**kw) -> pb.SamplingParams:
    return pb.SamplingParams(max_new_tokens=40, **kw)


def deep_schema(depth: int) -> str:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return json.dumps(schema)


BOMB = json.dumps({"allOf": [{"anyOf": [{"type": "object", "properties": {f"k{j}{i}": {"type": "integer"}}}
                                        for i in range(6)]} for j in range(8)]})

BAD = {
    "invalid schema": (P(json_schema='{"type": "strin"}'), "params.json_schema", "invalid JSON schema"),
    "schema not JSON": (P(json_schema="{type: object"), "params.json_schema", "invalid JSON schema"),
    "unsupported keyword": (P(json_schema='{"type": "array", "uniqueItems": true}'), "params.json_schema",
                            "uniqueItems"),
    "schema too deep": (P(json_schema=deep_schema(40)), "params.json_schema", "levels deep"),
    "schema bomb": (P(json_schema=BOMB), "params.json_schema", "too complex"),
    "bad regex": (P(regex="[a-z"), "params.regex", "invalid regular expression"),
    "regex too long": (P(regex="a" * 5000), "params.regex", "at most"),
    "empty language": (P(regex="[^\\s\\S]"), "params.regex", "vocabulary"),
    "grammar syntax": (P(grammar="start: (\"a\""), "params.grammar", "invalid grammar"),
    "grammar undefined rule": (P(grammar="start: value"), "params.grammar", "invalid grammar"),
    "empty choice": (P(choice=pb.Choice()), "params.choice.options", "at least one"),
    "ignore_eos with a constraint": (P(regex="a+", ignore_eos=True), "params.ignore_eos", "cannot be combined"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_constraints_are_invalid_argument_before_any_message(stub, case):
    params, field, words = BAD[case]
    received = []
    with pytest.raises(grpc.RpcError) as info:
        for msg in stub.GenerateStream(pb.GenerateRequest(prompt=PROMPT, params=params), timeout=60):
            received.append(msg)
    err = info.value
    assert received == []
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    violations = dict(field_violations(err))
    assert field in violations and words in violations[field], violations
    for text in [err.details(), *violations.values()]:
        assert not INTERNALS.search(text), f"internals leak into the message: {text!r}"


def test_constrained_generation_over_grpc(stub):
    for pattern in (r"(a+)+b", r"[A-Z][a-z]{2,8}( [a-z]{1,8}){0,3}\."):  # a ReDoS classic, and a sentence
        res = stub.Generate(pb.GenerateRequest(prompt=PROMPT, params=P(regex=pattern)), timeout=60)
        if res.finish_reason == pb.FINISH_REASON_EOS:
            assert re.fullmatch(pattern, res.text), res.text
        else:
            assert res.finish_reason == pb.FINISH_REASON_LENGTH
    pick = stub.Generate(pb.GenerateRequest(prompt=PROMPT, params=P(choice=pb.Choice(options=["sea", "lamp 🌍"]))),
                         timeout=60)
    assert pick.finish_reason == pb.FINISH_REASON_EOS and pick.text in ("sea", "lamp 🌍")
    obj = stub.Generate(pb.GenerateRequest(prompt=PROMPT, params=P(json_schema=json.dumps(
        {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["n"], "additionalProperties": False}))), timeout=60)
    assert obj.finish_reason == pb.FINISH_REASON_EOS and 0 <= json.loads(obj.text)["n"] <= 9


def test_sdk_sync_and_asyncio(server):
    options = ["north", "south", "east", "west"]
    with Client(server.target) as client:
        got = client.generate(PROMPT, choice=options, max_new_tokens=20)
        assert got.text in options and got.finish_reason == "eos"
        streamed = "".join(c.text for c in client.stream(PROMPT, regex=r"[0-9]{2}-[0-9]{2}", max_new_tokens=20))
        assert re.fullmatch(r"[0-9]{2}-[0-9]{2}", streamed)
        with pytest.raises(InvalidRequestError) as e:
            client.generate(PROMPT, json_schema={"type": "array", "uniqueItems": True})
        assert [f for f, _ in e.value.field_violations] == ["params.json_schema"]
        with pytest.raises(ValueError):
            client.generate(PROMPT, regex="a", choice=["b"])

    async def use_async():
        async with AsyncClient(server.target) as client:
            return await client.generate(PROMPT, json_schema={"enum": ["yes", "no"]}, max_new_tokens=20)

    import asyncio

    res = asyncio.run(use_async())
    assert json.loads(res.text) in ("yes", "no")


def test_cli_constraints(server, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                  "additionalProperties": False}))
    proc = lmserve("generate", PROMPT, "--json-schema", schema, "--max-new-tokens", 30, "-t", server.target)
    assert proc.returncode == 0, proc.stderr
    assert isinstance(json.loads(proc.stdout)["ok"], bool)
    proc = lmserve("generate", PROMPT, "--regex", "[a-z]{3}", "--max-new-tokens", 10, "-t", server.target)
    assert proc.returncode == 0 and re.fullmatch("[a-z]{3}", proc.stdout.rstrip("\n")), proc
    proc = lmserve("generate", PROMPT, "--regex", "(", "-t", server.target)
    assert proc.returncode == 2
    lines = error_lines(proc)
    assert lines[0] == "lmserve: INVALID_ARGUMENT: invalid request" and lines[1].startswith("  params.regex: invalid")
