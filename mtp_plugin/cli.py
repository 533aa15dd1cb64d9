"""``mtp-plugin`` command line (also ``python -m mtp_plugin``). Exit codes: 0 ok, 1 MTP cannot run, 2 usage."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .checkpoint import CheckpointError


def _inspect(args) -> int:
    from .report import inspect_dir

    report = inspect_dir(args.model_dir)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(render(report))
    return 0 if report["can_run"] else 1


def render(report: dict) -> str:
    """The inspect report as one screen of text."""
    lines = [
        f"{report['model_dir']}  ({report['model_type']})",
        f"  can_run:            {'yes' if report['can_run'] else 'NO'}",
        f"  MTP tensors:        {report['mtp_tensors']} (declared layers {report['declared_mtp_layers']}, "
        f"present {report['present_mtp_layers']})",
        f"  naming:             {', '.join(report['naming']) or '-'}",
        f"  files:              {', '.join(f'{f} ({n})' for f, n in report['files'].items()) or '-'}",
        f"  trunk quantization: {report['trunk_quantization']}",
        f"  head quantization:  {', '.join(sorted(set(report['head_quantization'].values()))) or '-'}",
    ]
    conventions = [v["convention"] for v in report["norm_convention"].values()]
    if conventions:
        counts = {c: conventions.count(c) for c in sorted(set(conventions))}
        lines.append(f"  norm convention:    {', '.join(f'{n} {c}' for c, n in counts.items())} (stored)")
    if report["head_trained"] is not None:
        trained = "yes" if report["head_trained"] else "NO"
        lines.append(f"  head trained:       {trained} ({report['head_trained_evidence']})")
    lines += [f"  problem: {p}" for p in report["problems"]]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The argument parser with one sub-parser per command."""
    p = argparse.ArgumentParser(prog="mtp-plugin", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    inspect = sub.add_parser("inspect", help="can this model directory run MTP, and why not")
    inspect.add_argument("model_dir", type=Path)
    inspect.add_argument("--json", action="store_true", help="machine-readable report")
    inspect.set_defaults(run=_inspect)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    args = parser().parse_args(argv)
    if not args.model_dir.is_dir():
        print(f"mtp-plugin: {args.model_dir}: not a directory; pass a model directory.", file=sys.stderr)
        return 2
    try:
        return args.run(args)
    except CheckpointError as e:
        print(f"mtp-plugin: {e}", file=sys.stderr)
        return 1
