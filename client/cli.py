"""The ``lmserve`` command.

Client subcommands (generate, tokenize, info, health, bench) live here and in
:mod:`lmserve.client.bench`. Subcommands of the model and server packages are registered
through their ``add_subcommands(subparsers)`` functions, which must not import torch
until their command runs; a client-only install simply lacks them.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any, Callable

from .cli_args import CliUsageError, add_connection_args, client_kwargs
from .errors import InvalidRequestError, LmserveError
from .types import ChatMessage, SamplingParams

# Packages that contribute subcommands; each exposes add_subcommands(subparsers).
EXTERNAL_SUBCOMMANDS = ("lmserve.model.checkpoints.cli", "lmserve.model.training.cli", "lmserve.server.cli")


def add_sampling_args(parser: argparse.ArgumentParser, *, max_new_tokens: int = 0) -> None:
    """Sampling flags, mapped onto :class:`SamplingParams` by :func:`sampling_from_args`."""
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                       help="most tokens to generate (0: server default)")
    group.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (default)")
    group.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    group.add_argument("--top-p", type=float, default=1.0, help="1.0 disables nucleus sampling")
    group.add_argument("--min-p", type=float, default=0.0, help="0 disables min-p")
    group.add_argument("--repetition-penalty", type=float, default=1.0, help="1.0 disables it")
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--seed", type=int, default=None, help="sampling seed")
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    spec = parser.add_argument_group("speculative decoding (docs/speculative-decoding.md)")
    spec.add_argument("--prediction", metavar="FILE",
                      help="text the answer is expected to repeat (e.g. the file an edit rewrites): the server "
                           "drafts from it; the answer is the same, sooner where it repeats it")
    spec.add_argument("--no-speculation", action="store_true", help="opt this request out of speculative decoding")
    shape = parser.add_argument_group("output constraint (at most one; docs/constrained-decoding.md)")
    one = shape.add_mutually_exclusive_group()
    one.add_argument("--json-schema", metavar="FILE", help="JSON valid under the schema in FILE")
    one.add_argument("--json-object", action="store_true", help="one JSON object")
    one.add_argument("--regex", metavar="PATTERN", help="text the regular expression matches whole")
    one.add_argument("--grammar", metavar="FILE", help="text derived from the Lark grammar in FILE")
    one.add_argument("--choice", action="append", metavar="TEXT", help="one of these strings (repeatable)")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        speculate=not args.no_speculation,
        prediction=_read_file(args.prediction, "--prediction") or "",
        json_schema=_read_file(args.json_schema, "--json-schema"),
        json_object=args.json_object,
        regex=args.regex,
        grammar=_read_file(args.grammar, "--grammar"),
        choice=tuple(args.choice) if args.choice else None,
    )


def _read_file(path: str | None, flag: str) -> str | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise CliUsageError(f"{flag}: cannot read {path}: {exc.strerror}") from None


def make_client(args: argparse.Namespace, **overrides: Any):
    from .sync import Client

    try:
        return Client(args.target, **{**client_kwargs(args), **overrides})
    except (ValueError, OSError) as e:  # bad TLS flags or unreadable certificate files
        raise CliUsageError(str(e)) from e


# ---------------------------------------------------------------- commands


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is None or args.prompt == "-":
        if sys.stdin.isatty():
            raise CliUsageError("give a prompt, or pipe one on stdin")
        return sys.stdin.read()
    return args.prompt


def cmd_generate(args: argparse.Namespace) -> int:
    text = _read_prompt(args)
    prompt: Any = text
    if args.chat or args.system is not None:
        prompt = ([ChatMessage("system", args.system)] if args.system is not None else []) + [
            ChatMessage("user", text)
        ]
    params = sampling_from_args(args)
    from ._convert import StreamAccumulator

    acc = StreamAccumulator()
    with make_client(args) as client:
        for chunk in client.stream(prompt, params, request_id=args.request_id):
            acc.add(chunk)
            if not args.json:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
    result = acc.result()
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
    if args.stats:
        u = result.usage
        timing = f", ttft {result.timing.time_to_first_token_seconds:.3f}s" if result.timing else ""
        drafts = f", drafts {u.accepted_draft_tokens}/{u.draft_tokens} accepted" if u.draft_tokens else ""
        print(f"[{result.finish_reason}] prompt {u.prompt_tokens} + completion {u.completion_tokens} tokens{timing}"
              f"{drafts}", file=sys.stderr)
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    text = _read_prompt(args)
    source: Any = [ChatMessage("user", text)] if args.chat else text
    with make_client(args) as client:
        result = client.tokenize(source)
    if args.json:
        print(json.dumps({"token_ids": result.token_ids, "tokens": result.tokens, "text": result.text},
                         ensure_ascii=False))
    else:
        print(" ".join(map(str, result.token_ids)))
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    with make_client(args) as client:
        info = client.model_info()
    if args.json:
        print(json.dumps(info.to_dict(), indent=2))
    else:
        for key, value in info.to_dict().items():
            print(f"{key}: {value}")
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    timeout = args.timeout if args.timeout is not None else 5.0
    with make_client(args, max_retries=0) as client:
        status = client.health(args.service, timeout=timeout)
    print(status)
    return 0 if status == "SERVING" else 1


# ---------------------------------------------------------------- parser


def _register_external(subparsers: argparse._SubParsersAction) -> None:
    for module_name in EXTERNAL_SUBCOMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            missing = e.name or ""
            absent = missing == module_name or module_name.startswith(missing + ".")
            third_party = not (missing == "lmserve" or missing.startswith("lmserve."))
            if absent or third_party:  # client-only install, or a server extra not installed
                continue
            raise  # a broken import inside lmserve itself
        module.add_subcommands(subparsers)


def build_parser() -> argparse.ArgumentParser:
    """The full ``lmserve`` parser, including subcommands contributed by other packages."""
    from . import bench
    from lmserve import __version__

    parser = argparse.ArgumentParser(prog="lmserve", description="lmserve text-generation service")
    parser.add_argument("--version", action="version", version=f"lmserve {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    gen = subparsers.add_parser("generate", help="stream a completion to stdout")
    gen.add_argument("prompt", nargs="?", help="prompt text ('-' or omitted: read stdin)")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    gen.add_argument("--system", help="system message (implies --chat)")
    gen.add_argument("--json", action="store_true", help="print the final result as JSON instead of text")
    gen.add_argument("--stats", action="store_true", help="print finish reason, usage and TTFT to stderr")
    gen.add_argument("--request-id", default="", help="request id to send")
    add_sampling_args(gen)
    add_connection_args(gen)
    gen.set_defaults(func=cmd_generate)

    tok = subparsers.add_parser("tokenize", help="print the token ids of a text")
    tok.add_argument("prompt", nargs="?", help="text ('-' or omitted: read stdin)")
    tok.add_argument("--chat", action="store_true", help="tokenize as a user chat message")
    tok.add_argument("--json", action="store_true", help="print ids, pieces and text as JSON")
    add_connection_args(tok)
    tok.set_defaults(func=cmd_tokenize)

    info = subparsers.add_parser("info", help="describe the served model")
    info.add_argument("--json", action="store_true", help="print as JSON")
    add_connection_args(info)
    info.set_defaults(func=cmd_info)

    hc = subparsers.add_parser("health", help="exit 0 if the server is SERVING, else 1")
    hc.add_argument("--service", default="", help="health service name (default: the whole server)")
    add_connection_args(hc)
    hc.set_defaults(func=cmd_health)

    bench.add_subcommand(subparsers)
    _register_external(subparsers)
    return parser


def _report(error: LmserveError) -> None:
    code = error.code.name if error.code is not None else "ERROR"
    # the server's message already lists the violations; print them once, one per line
    summary = "invalid request" if error.field_violations else error.message
    print(f"lmserve: {code}: {summary}", file=sys.stderr)
    for field, description in error.field_violations:
        print(f"  {field}: {description}", file=sys.stderr)


def run(func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Runs a command, turning SDK errors into one-line messages and exit codes."""
    try:
        return int(func(args) or 0)
    except InvalidRequestError as e:
        _report(e)
        return 2
    except LmserveError as e:
        _report(e)
        return 1
    except CliUsageError as e:
        print(f"lmserve: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        if (e.name or "lmserve").split(".")[0] == "lmserve":
            raise  # a module of lmserve itself is missing: a broken install, not a missing extra
        print(f"lmserve: error: this command needs the server extra, which is not installed here "
              f"(no module {e.name!r}): pip install 'lmserve[server]'", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `lmserve generate ... | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``lmserve`` console script."""
    args = build_parser().parse_args(argv)
    return run(args.func, args)


if __name__ == "__main__":
    sys.exit(main())
