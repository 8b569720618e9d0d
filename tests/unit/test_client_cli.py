"""The lmserve command: parsing, output, exit codes, and no torch import."""

import json
import subprocess
import sys

import grpc
import pytest
from _client_fakes import Failure, LoopbackServer, Script, unused_port

from lmserve.client import cli


def test_generate_flags_map_to_sampling_params(monkeypatch):
    monkeypatch.setenv("LMSERVE_TARGET", "example:1234")
    monkeypatch.setenv("LMSERVE_TOKEN", "tok")
    args = cli.build_parser().parse_args([
        "generate", "hi", "--max-new-tokens", "9", "--temperature", "0.7", "--top-k", "40", "--top-p", "0.9",
        "--min-p", "0.05", "--seed", "3", "--stop", "\n", "--stop", "###", "--repetition-penalty", "1.1",
    ])
    params = cli.sampling_from_args(args)
    assert (params.max_new_tokens, params.temperature, params.top_k, params.top_p) == (9, 0.7, 40, 0.9)
    assert (params.min_p, params.seed, params.repetition_penalty) == (0.05, 3, 1.1)
    assert params.stop == ("\n", "###")
    assert args.target == "example:1234" and args.token == "tok"
    assert cli.build_parser().parse_args(["info", "-t", "h:1"]).target == "h:1"


def test_constraint_flags_map_to_sampling_params(tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object"}')
    parse = cli.build_parser().parse_args
    assert cli.sampling_from_args(parse(["generate", "hi", "--json-schema", str(schema)])).json_schema == schema.read_text()
    assert cli.sampling_from_args(parse(["generate", "hi", "--regex", "[0-9]+"])).regex == "[0-9]+"
    assert cli.sampling_from_args(parse(["generate", "hi", "--choice", "a", "--choice", "b"])).choice == ("a", "b")
    assert cli.sampling_from_args(parse(["generate", "hi", "--json-object"])).json_object is True
    with pytest.raises(SystemExit):  # argparse: not allowed with each other
        parse(["generate", "hi", "--regex", "a", "--json-object"])
    with pytest.raises(cli.CliUsageError):
        cli.sampling_from_args(parse(["generate", "hi", "--grammar", str(tmp_path / "missing.lark")]))


def test_no_torch_on_import_or_parser_build():
    code = (
        "import sys, lmserve.client, lmserve.client.cli, lmserve.client.bench\n"
        "assert 'torch' not in sys.modules, 'import pulled torch'\n"
        "lmserve.client.cli.build_parser()\n"
        "assert 'torch' not in sys.modules, 'building the parser pulled torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_generate_streams_text(capsys):
    with LoopbackServer() as srv:
        assert cli.main(["generate", "hello", "-t", srv.target]) == 0
        _, request = srv.servicer.requests[-1]
    assert capsys.readouterr().out == "Hello world\n"
    assert request.prompt == "hello"


def test_generate_chat_json(capsys):
    with LoopbackServer() as srv:
        assert cli.main(["generate", "hello", "--system", "be brief", "--json", "-t", srv.target]) == 0
        _, request = srv.servicer.requests[-1]
    result = json.loads(capsys.readouterr().out)
    assert result["text"] == "Hello world" and result["finish_reason"] == "stop"
    assert result["usage"]["completion_tokens"] == len(result["token_ids"])
    assert [(m.role, m.content) for m in request.messages.messages] == [("system", "be brief"), ("user", "hello")]


def test_invalid_request_exits_2_with_violations_and_no_traceback(capsys):
    failure = Failure(grpc.StatusCode.INVALID_ARGUMENT, "invalid request", violations=[("params.top_p", "> 1")])
    with LoopbackServer(Script(fail_first=[failure])) as srv:
        assert cli.main(["generate", "x", "--top-p", "2", "-t", srv.target]) == 2
    err = capsys.readouterr().err
    assert "INVALID_ARGUMENT: invalid request" in err and "params.top_p: > 1" in err
    assert "Traceback" not in err


def test_other_errors_exit_1(capsys):
    with unused_port() as port:
        assert cli.main(["info", "-t", f"127.0.0.1:{port}", "--timeout", "5"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("lmserve: UNAVAILABLE") or err.startswith("lmserve: DEADLINE_EXCEEDED")
    assert "Traceback" not in err


@pytest.mark.parametrize("status, code", [("SERVING", 0), ("NOT_SERVING", 1)])
def test_health_exit_code(status, code, capsys):
    with LoopbackServer(health_status=status) as srv:
        assert cli.main(["health", "-t", srv.target]) == code
    assert capsys.readouterr().out.strip() == status


def test_health_of_unreachable_server_is_1():
    with unused_port() as port:
        assert cli.main(["health", "-t", f"127.0.0.1:{port}"]) == 1


def test_info_and_tokenize(capsys):
    with LoopbackServer() as srv:
        assert cli.main(["info", "--json", "-t", srv.target]) == 0
        assert json.loads(capsys.readouterr().out)["model_name"] == "fake"
        assert cli.main(["tokenize", "ab", "-t", srv.target]) == 0
        assert capsys.readouterr().out.split() == [str(ord("a")), str(ord("b"))]


def test_bad_tls_flags_exit_2(capsys):
    assert cli.main(["info", "--client-cert", "c.pem", "-t", "localhost:1"]) == 2
    assert "client_key" in capsys.readouterr().err


def test_console_script_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "lmserve.client.cli", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for command in ("generate", "health", "info", "bench"):
        assert command in out
