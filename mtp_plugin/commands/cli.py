"""``mtp-plugin`` command line (also ``python -m mtp_plugin``); ``DESCRIPTION`` is its ``--help`` text (plain text:
argparse prints it as written)."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

from ..files import Terminated, terminating_cleanly
from ..hub.fetch import is_repo_id
from ..loading.checkpoint import CheckpointError, check_weight_files, read_config
from ..usage import DEFAULT_BITS, DEFAULT_GROUP_SIZE, GROUP_SIZES, HEAD_BITS, UsageError, describe, int_in

DESCRIPTION = """Inspect, verify, graft, extract, tune and benchmark MTP heads (also: python -m mtp_plugin).

Exit codes: 0 ok; 1 a failure (MTP cannot run, the head is unusable, a checkpoint is unreadable); 2 a usage
error (a bad option value, a missing model directory, an output that would lose or touch user data): nothing
was written; 130 interrupted. SIGTERM/SIGHUP remove the command's temporary files before the process ends by
that signal. Each command's options: mtp-plugin COMMAND --help."""
HUB_ARGS = ("recipient", "hf")  # the model-directory arguments that take a Hub repo id too
SAMPLE_SOURCE = Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py"  # real text found on every machine


def _inspect(args) -> int:
    from .inspect import inspect_dir

    report = inspect_dir(args.model_dir)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(render(report))
    return 0 if report["can_run"] else 1


def _extract(args) -> int:
    from .extract import extract

    summary = extract(args.hf, args.out, args.bits, args.group_size, args.force, args.revision)
    labels = sorted(set(summary["quantization"].values()))
    print(f"wrote {summary['out']}: {summary['tensors']} tensors, {summary['bytes'] / 1e6:.2f} MB, "
          f"{', '.join(labels)}, {len(summary['norms_folded'])} norms folded to absolute")
    return 0


def _graft(args) -> int:
    from .graft import graft

    summary = graft(args.recipient, args.donor, args.out, args.layout, args.force, args.bits, args.group_size,
                    args.revision, args.verbose)
    for line in summary["overridden"]:
        print(f"--force overrode: {line}", file=sys.stderr)
    if summary["kept"]:
        print(f"mtp-plugin: the donor's head is already quantized ({', '.join(summary['kept'])}): kept as it is, not "
              f"--bits {args.bits} --group-size {args.group_size} (quantizing again cannot restore what it lost; for "
              "another quantization, graft from a float head: its original checkpoint or `mtp-plugin extract`)",
              file=sys.stderr)
    linked, copied = summary["linked"], summary["copied"]
    if not copied:
        recipient = "recipient files hard-linked"
    elif not linked:
        recipient = f"recipient files copied ({copied}: no hard link could be made, e.g. another filesystem)"
    else:
        recipient = f"recipient files hard-linked ({linked}) and copied ({copied}: no hard link could be made)"
    print(f"wrote {summary['out']} ({summary['layout']} layout): {summary['tensors']} head tensors in "
          f"{summary['head_file']}, {summary['head_bytes'] / 1e6:.2f} MB; {recipient}")
    return 0


def _verify(args) -> int:
    from .verify import verify

    try:
        text = (args.prompt_file or SAMPLE_SOURCE).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{args.prompt_file}: cannot be read as text ({e}); pass a UTF-8 text file") from None
    result = verify(args.model_dir, text, write=args.write)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"depth-1 greedy acceptance over {result['tokens'] - 1} drafts (2 trunk passes and "
              f"{len(result['candidates'])} head passes, no decoding loop):")
        for c in result["candidates"]:
            print(f"  {c['acceptance']:.3f}  norms={c['norms']:<16} hidden={c['hidden']:<9} "
                  f"concat={c['concat_order']}")
        print(write_advice(result))
    for problem in result["problems"]:
        print(f"mtp-plugin: verify: {problem}", file=sys.stderr)
    return 1 if result["problems"] else 0


def write_advice(result: dict) -> str:
    """verify's last line: current and best acceptance, and whether ``--write`` is worth it: only when the gain
    exceeds two binomial standard errors of the difference, 2 * sqrt((p_b (1 - p_b) + p_c (1 - p_c)) / n),
    n = tokens - 1 drafts (conservative: both rates come from the same drafts)."""
    best, current = result["best"], result["current"]
    line = f"current wiring {current['acceptance']:.3f}; best {best['acceptance']:.3f}"
    if result["written"]:
        return line + " (recorded in config.json)"
    if best == current:
        return line + " (the current wiring)"
    drafts = max(result["tokens"] - 1, 1)
    pb, pc = best["acceptance"], current["acceptance"]
    noise = 2 * math.sqrt((pb * (1 - pb) + pc * (1 - pc)) / drafts)
    gain = pb - pc
    if gain <= noise:
        return (line + f": +{gain:.3f} is within this measurement's noise (±{noise:.3f}, two standard errors over "
                f"{drafts} drafts); keep the current wiring (--write not needed)")
    return (line + f": +{gain:.3f} is beyond this measurement's noise (±{noise:.3f}, two standard errors over "
            f"{drafts} drafts); run with --write to record it")


def _tune(args) -> int:
    from ..head.draft_vocab import FILE_NAME
    from .tune import tune

    result = tune(args.model_dir, args.depths, args.max_tokens, args.repeats, args.write, args.vocab_text)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{'candidate':<16} {'tok/s':>8} {'speedup':>8} {'tok/cycle':>9}  acceptance by depth  "
          f"(median of {args.repeats} runs, {args.max_tokens} tokens per prompt)")
    vocabulary = result["vocabulary"]
    for r in result["candidates"]:
        _tune_row(r)
    if vocabulary["candidates"]:
        print(f"draft vocabulary at depth {vocabulary['depth']} (S=k: the k most frequent tokens; measured again "
              "beside plain and the full vocabulary):")
        for r in vocabulary["candidates"]:
            _tune_row(r)
    depth = result["depth"]
    choice = f"depth {depth}" if depth else "plain decoding (no depth beat it: MTP starts parked)"
    choice += f", draft vocabulary of {vocabulary['size']} tokens" if vocabulary["size"] else ", full draft vocabulary"
    where = result["cache"] + (f" and {args.model_dir / 'config.json'}, {args.model_dir / FILE_NAME}"
                               if result["written"] else "")
    print(f"recommended: {choice}; recorded in {where}")
    return 0


def _tune_row(r: dict) -> None:
    """One candidate's line of the tune table."""
    cycle = f"{r['tokens_per_cycle']:9.2f}" if r["tokens_per_cycle"] is not None else f"{'-':>9}"
    acceptance = " ".join(f"{p:.2f}" for p in r["acceptance_by_depth"] or []) or "-"
    print(f"{r['name']:<16} {r['tokens_per_second']:>8.1f} {r['speedup']:>8.3f} {cycle}  {acceptance}")


def _bench(args) -> int:
    from .bench import bench, few_tokens, render

    if few_tokens(args.max_tokens):
        print(f"mtp-plugin bench: {few_tokens(args.max_tokens)}", file=sys.stderr)
    if len(args.context) > 1:
        from . import sweep

        report = sweep.sweep(args.model_dir, args.context, args.depths, args.max_tokens, args.repeats, args.dtype,
                             args.prompts)
        print(json.dumps(report, indent=2) if args.json else sweep.render(report))
        return 0
    report = bench(args.model_dir, args.depths, args.max_tokens, args.repeats, args.dtype, args.context[0],
                   not args.no_references, args.prompts)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def _contexts(text: str) -> list[int]:
    """``--context``'s value: token counts separated by commas (0 alone: the suite's own prompts)."""
    try:
        counts = [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"token counts separated by commas, got {text!r}") from None
    if counts != [0] and any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError(f"token counts must be >= 1, got {text!r}")
    return counts


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
    lines += [f"  warning: {w}" for w in report["warnings"]]
    return "\n".join(lines)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` for options that have a default value (not for flags and required options)."""

    def _get_help_string(self, action):
        if action.default in (None, False, argparse.SUPPRESS):
            return action.help
        return super()._get_help_string(action)


def _command(sub, name: str, run, text: str, model_dir: str = "model_dir") -> argparse.ArgumentParser:
    command = sub.add_parser(name, help=text, description=text, formatter_class=_Help)
    command.set_defaults(run=run, model_dir_arg=model_dir)
    return command


def _quantization_options(command: argparse.ArgumentParser) -> None:
    command.add_argument("--bits", type=int, default=DEFAULT_BITS, choices=HEAD_BITS,
                         help="the head's weights: 4/8 quantize, 16 keeps bfloat16 (the default was measured: "
                         "docs/checkpoints.md#head-quantization)")
    command.add_argument("--group-size", type=int, default=DEFAULT_GROUP_SIZE, choices=GROUP_SIZES,
                         help="quantization group size")


def parser() -> argparse.ArgumentParser:
    """The argument parser with one sub-parser per command; every option's help gives its default and range."""
    p = argparse.ArgumentParser(prog="mtp-plugin", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {metadata.version('mtp-plugin')}")
    sub = p.add_subparsers(dest="command", required=True)
    inspect = _command(sub, "inspect", _inspect, "can this model directory run MTP, and why not (reads only "
                       "file headers and the head; writes nothing)")
    inspect.add_argument("model_dir", type=Path, help="model directory (with config.json)")
    inspect.add_argument("--json", action="store_true", help="machine-readable report")

    graft = _command(sub, "graft", _graft, "give a head-less checkpoint the head of another (inputs never "
                     "written; the output directory must be new)", "recipient")
    graft.add_argument("--recipient", type=str, required=True,
                       help="model directory without a head, or a Hub repo id (downloaded as mlx-lm downloads it)")
    graft.add_argument("--donor", type=str, required=True, help="checkpoint directory or head file with a head, or "
                       "a Hub repo id (only the head's bytes are fetched)")
    graft.add_argument("--revision", help="the Hub donor's branch, tag or commit (default: its main branch)")
    graft.add_argument("--out", type=Path, required=True,
                       help="new output directory: must not exist, nor lie inside the recipient or donor")
    graft.add_argument("--layout", default="mlx-lm", choices=["mlx-lm", "mtplx", "omlx", "mlx-serve"],
                       help="runtime layout of the head file")
    _quantization_options(graft)
    graft.add_argument("--force", action="store_true", help="graft despite config/quantization mismatches")
    graft.add_argument("--verbose", action="store_true", help="a refusal lists each head tensor that does not fit")

    extract = _command(sub, "extract", _extract, "take the head out of an original Hugging Face checkpoint "
                       "(writes only --out)", "hf")
    extract.add_argument("--hf", type=str, required=True, help="checkpoint directory carrying the head, or a Hub "
                         "repo id (only the head's bytes are fetched)")
    extract.add_argument("--revision", help="the Hub repo's branch, tag or commit (default: its main branch)")
    extract.add_argument("--out", type=Path, required=True,
                         help="head file to write (safetensors), outside the checkpoint; its directory must exist")
    _quantization_options(extract)
    extract.add_argument("--force", action="store_true", help="replace an existing --out file (never an input)")

    verify = _command(sub, "verify", _verify, "measure acceptance and sweep the head's wiring contract (writes "
                      "only with --write)")
    verify.add_argument("model_dir", type=Path, help="model directory with a head")
    verify.add_argument("--prompt-file", type=Path, help="UTF-8 text to measure on, at least 2 tokens "
                        "(default: the standard library's textwrap.py)")
    verify.add_argument("--write", action="store_true",
                        help="record the best wiring in config.json (atomically, mode kept; refused when read-only)")
    verify.add_argument("--json", action="store_true", help="machine-readable result")

    for name, run, text in (("tune", _tune, "measure plain decoding and depths 1..N, record the fastest in the "
                             "user cache"),
                            ("bench", _bench, "tokens/s, acceptance, cost ratios and efficiency of MTP decoding "
                             "(writes nothing)")):
        command = _command(sub, name, run, text)
        command.add_argument("model_dir", type=Path, help="model directory with a head")
        command.add_argument("--depths", type=int_in("depths"), default=3, metavar="N",
                             help=f"measure draft depths 1..N, N in {describe('depths')}")
        command.add_argument("--max-tokens", type=int_in("max_tokens"), default=128, metavar="M",
                             help=f"tokens generated per prompt, {describe('max_tokens')}")
        command.add_argument("--repeats", type=int_in("repeats"), default=3, metavar="R",
                             help=f"runs of the prompt suite (medians), {describe('repeats')}")
        command.add_argument("--json", action="store_true", help="machine-readable result")
    sub.choices["tune"].add_argument("--write", action="store_true", help="also record the depth in the model's "
                                     "config.json and the draft vocabulary in its mtp_draft_vocab.json (atomically, "
                                     "mode kept; refused when read-only)")
    sub.choices["tune"].add_argument("--vocab-text", type=Path, metavar="FILE",
                                     help="UTF-8 text whose tokens count towards the draft vocabulary's frequencies "
                                     "(beside the model's own output on the prompt suite)")
    sub.choices["bench"].add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                                      help="cast the floating weights after loading (e.g. an fp32/hf checkpoint)")
    sub.choices["bench"].add_argument("--context", type=_contexts, default=[0], metavar="N[,N...]",
                                      help="precede each prompt with earlier source up to N tokens (a long context; "
                                      "default 0: the suite's prompts of about 300 tokens); several lengths: the "
                                      "long-context sweep (plain, fixed depths and the default at each)")
    sub.choices["bench"].add_argument("--prompts", type=int, default=4, metavar="K",
                                      help="measure the suite's first K code prompts, 1-4 (default 4)")
    sub.choices["bench"].add_argument("--no-references", action="store_true",
                                      help="skip other runtimes' own MTP decoders (e.g. mlx-vlm's native drafter)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (argparse's own usage errors exit 2 through ``SystemExit``).

    On SIGTERM/SIGHUP the command's temporary files are removed, then the process ends by that signal.
    """
    args = parser().parse_args(argv)
    value = getattr(args, args.model_dir_arg)
    directory = Path(value)
    hub = args.model_dir_arg in HUB_ARGS
    local = not hub or not is_repo_id(value)  # a Hub repo is checked once fetched
    if local and not (directory / "config.json").is_file():
        what = ("no such directory" if not directory.exists() else "not a directory" if not directory.is_dir()
                else "no config.json")
        print(f"mtp-plugin: {value}: {what}; pass a model directory"
              f"{' or a Hub repo id (OWNER/NAME; --revision for a branch, tag or commit)' * hub}.", file=sys.stderr)
        return 2
    try:
        if local:  # an unreadable config.json or weights file is named here, before any runtime reads it
            read_config(directory)
            check_weight_files(directory)
        with terminating_cleanly():
            return args.run(args)
    except UsageError as e:
        print(f"mtp-plugin: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # stdout's reader left (``| head``): end quietly, stdout pointed where flushing works
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (CheckpointError, ValueError, OSError) as e:
        print(f"mtp-plugin: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # cleanups have run
        print("mtp-plugin: interrupted", file=sys.stderr)
        return 130
    except Terminated as e:  # cleanups have run: end as the signal asked
        signal.signal(e.signum, signal.SIG_DFL)
        os.kill(os.getpid(), e.signum)
        raise
