"""`lmserve train`: train a small model and its tokenizer on text files. Imports torch only when run."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

PROG = "lmserve train"


class _InputError(ValueError):
    pass


def _read_inputs(paths: list[str]) -> list[str]:
    """Texts of the given .txt files and of the *.txt files under the given directories."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(path.rglob("*.txt"))
            if not found:
                raise _InputError(f"directory {path} holds no .txt files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise _InputError(f"no such file or directory: {path}")
    texts = []
    for f in files:
        try:
            texts.append(f.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            raise _InputError(f"cannot read {f} as UTF-8 text: {e}") from e
    if not any(t.strip() for t in texts):
        raise _InputError("the input text is empty")
    return texts


def _error(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    """Train and save; 0 on success, 2 on bad input, 1 if training diverged."""
    try:
        texts = _read_inputs(args.inputs)
    except _InputError as e:
        return _error(str(e))
    if not args.quiet:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        logging.getLogger("lmserve.model.training.train").setLevel(logging.INFO)

    from .train import TrainingDivergedError, train

    try:
        result = train(
            texts, args.out, vocab_size=args.vocab_size, hidden_size=args.hidden_size, layers=args.layers,
            heads=args.heads, kv_heads=args.kv_heads, intermediate_size=args.intermediate_size,
            context=args.context, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
            warmup=args.warmup, seed=args.seed, device=args.device, progress=not args.quiet,
        )
    except ValueError as e:
        return _error(str(e))
    except TrainingDivergedError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    print(f"saved {result.path} (corpus loss {result.final_loss:.4f} after {result.steps} steps)")
    return 0


def add_subcommands(subparsers) -> None:
    """Register `train` on an argparse subparsers object."""
    p = subparsers.add_parser(
        "train", help="train a small Llama-family model and tokenizer on text files",
        description="Train a BPE sentencepiece tokenizer (with byte fallback) and a small Llama-family model "
                    "(RMSNorm, RoPE, grouped-query attention, SwiGLU) on plain text, then save a Hugging Face "
                    "style directory that `lmserve` serves and transformers loads. Each paragraph (text "
                    "separated by a blank line) is one training document. Runs on CPU or GPU.",
    )
    p.add_argument("inputs", nargs="+", metavar="PATH", help="UTF-8 .txt files, or directories searched for *.txt")
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write the model to")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default: %(default)s)")
    p.add_argument("--vocab-size", type=int, default=1024,
                   help="tokenizer vocabulary size; smaller when the text is too short to fill it (default: %(default)s)")
    p.add_argument("--hidden-size", type=int, default=128, help="model width (default: %(default)s)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default: %(default)s)")
    p.add_argument("--heads", type=int, default=4, help="attention (query) heads (default: %(default)s)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads, dividing --heads (default: %(default)s)")
    p.add_argument("--intermediate-size", type=int, default=None, help="SwiGLU width (default: ~8/3 of --hidden-size)")
    p.add_argument("--context", type=int, default=256,
                   help="training window and maximum positions, in tokens (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3,
                   help="peak learning rate; AdamW with warm-up then cosine decay (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: a tenth of --steps)")
    p.add_argument("--seed", type=int, default=0, help="random seed; the same seed gives the same model (default: %(default)s)")
    p.add_argument("--device", default=None, help="torch device such as cpu or cuda (default: cuda when available)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no log lines")
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lmserve.model.training.cli")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
