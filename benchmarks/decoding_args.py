"""What every decoding benchmark takes: ``--model`` (loaded with its head, cast to ``--dtype``), ``--max-tokens``,
``--repeats`` and ``--out``. Usage errors exit 2 (argparse), a model without a usable head exits 1."""

import argparse
from pathlib import Path

from mtp_plugin.commands.bench import DTYPES, cast
from mtp_plugin.usage import int_in


def parser(doc: str, max_tokens: int = 128, repeats: int = 3) -> argparse.ArgumentParser:
    """A benchmark's parser, described by the first line of its ``doc``, with the shared options."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--dtype", default="bfloat16", choices=[*DTYPES, "none"])
    p.add_argument("--max-tokens", type=int_in("max_tokens"), default=max_tokens, metavar="M")
    p.add_argument("--repeats", type=int_in("repeats"), default=repeats, metavar="R")
    p.add_argument("--out", type=Path, help="directory for the dated result file")
    return p


def with_head(p: argparse.ArgumentParser, args: argparse.Namespace, loaded: tuple, why: str = "") -> tuple:
    """``loaded`` (model, tokenizer) with the model cast to ``args.dtype``; exit 1 when it has no usable head
    (``why``: what the benchmark needs it for)."""
    model, tokenizer = loaded
    if model.mtp_head is None:
        p.exit(1, f"{args.model}: no usable MTP head{why}\n")
    if args.dtype != "none":
        cast(model, DTYPES[args.dtype])
    return model, tokenizer
