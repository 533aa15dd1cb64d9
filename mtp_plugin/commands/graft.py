"""``mtp-plugin graft``: give a head-less checkpoint (the recipient) the head of another (the donor), as a new
directory of hard links plus the head file. Usage and guarantees: docs/commands.md#graft.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from ..files import check_new_output, user_mode
from ..head.conventions import Contract
from ..hub.fetch import head_checkpoint, is_repo_id, model_checkpoint
from ..loading.checkpoint import INDEX, CheckpointError, HeadLocation, HeadTensor, find_head, read_config, read_index
from ..loading.fit import FIELDS, head_config, mismatches
from ..loading.headfile import (
    head_metadata,
    kept_quantization,
    quantization_labels,
    quantize_head,
    write_atomically,
)
from ..loading.validation import expected_head, validate
from ..plugins import hook
from ..usage import DEFAULT_BITS, DEFAULT_GROUP_SIZE, UsageError, check_quantization

LAYOUTS = {  # layout: (head file, tensor-name prefix) each runtime documents
    "mlx-lm": ("mtp.safetensors", "mtp."),  # ours: a sidecar stock mlx-lm never reads
    "mtplx": ("mtp.safetensors", "mtp."),
    "omlx": ("model-mtp.safetensors", "language_model.mtp."),
    "mlx-serve": ("mtp/weights.safetensors", "mtp."),
}


class GraftRefused(CheckpointError):
    """The donor's head does not fit the recipient; the message lists why and how to override."""


def check_donor(donor: Path) -> None:
    """Raise ``UsageError`` unless ``donor`` is a file or a directory with config.json."""
    if not donor.exists():
        raise UsageError(f"--donor {donor}: no such file or directory; pass a checkpoint directory, a head "
                         ".safetensors file or a Hub repo id (OWNER/NAME; --revision for a branch, tag or commit)")
    if donor.is_dir() and not (donor / "config.json").is_file():
        raise UsageError(f"--donor {donor}: a directory without config.json; pass a model directory or a head "
                         ".safetensors file")


def donor_location(donor: Path, model_type: str) -> HeadLocation:
    """The head of ``donor``, a checkpoint directory or head-only weights file; ``CheckpointError`` if it has none."""
    if donor.is_dir():
        location = find_head(donor)
    else:
        header = hook().mtp_read_tensor_names(path=donor)
        if header is None:
            raise CheckpointError(f"{donor}: not a weights file any plugin reads; pass a safetensors head file")
        names, metadata = header
        location = HeadLocation(model_dir=donor.parent, config={"model_type": model_type}, metadata=metadata)
        for name, (shape, dtype) in names.items():
            canonical = hook().mtp_head_name(name=name, model_type=model_type, sidecar=True, config=location.config)
            if canonical is not None:
                location.tensors[canonical] = HeadTensor(canonical, name, donor, tuple(shape), dtype)
    if not location.tensors:
        raise CheckpointError(f"{donor}: no MTP head tensors; pick a donor that carries the head")
    return location


def graft(recipient: Path | str, donor: Path | str, out: Path, layout: str = "mlx-lm", force: bool = False,
          bits: int = DEFAULT_BITS, group_size: int = DEFAULT_GROUP_SIZE, revision: str | None = None,
          verbose: bool = False) -> dict:
    """Build new directory ``out``: ``recipient``'s files (hard links, else copies) plus ``donor``'s head in
    ``layout``, atomically (a temporary ``.NAME.*`` directory, renamed; removed on failure, and on SIGTERM/SIGHUP
    under ``files.terminating_cleanly``).

    Args:
        recipient: a model directory or Hub repo id.
        donor: a checkpoint directory, head file or Hub repo id (only the head's bytes are fetched, at ``revision``).
        bits, group_size: the head's quantization (``loading.headfile.quantize_head``; 16 keeps bfloat16); a donor
            head already quantized otherwise keeps its own (``kept``).
        verbose: a refusal for a head of another model size lists every tensor that does not fit.

    Returns:
        Summary: layout, head file, tensors, head bytes, overridden mismatches, files linked and copied, and ``kept``:
        the donor's quantizations (``int4/g64``) kept instead of ``bits``/``group_size``.

    Raises:
        UsageError: unknown layout, bits or group size; ``out`` exists, lies inside an input or its parent is
            missing or read-only; a missing donor or a donor directory without config.json.
        GraftRefused: config or base-quantization mismatches (unless ``force``), a recipient of an unsupported model
            type or with a head, a donor head that would not load into it (even with ``force``), or an unreadable
            index to extend.
        CheckpointError: unreadable inputs; ``HubError`` for a repository that cannot serve them.
    """
    if layout not in LAYOUTS:
        raise UsageError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    check_quantization(bits, group_size)
    hub_donor, hub_recipient = is_repo_id(donor), is_repo_id(recipient)
    if not hub_donor:
        check_donor(Path(donor))
        if revision is not None:
            raise UsageError(f"--revision {revision}: applies to a Hub donor, and --donor {donor} is a local path")
    out = Path(out)
    check_new_output(out, [Path(p) for p, hub in ((recipient, hub_recipient), (donor, hub_donor)) if not hub],
                     kind="directory")
    recipient = model_checkpoint(str(recipient)) if hub_recipient else Path(recipient)
    config = read_config(recipient)
    if config.get("model_type") not in sum(hook().mtp_model_types(), []):
        raise GraftRefused(f"{recipient}: model type {config.get('model_type')!r} has no MTP support")
    existing = find_head(recipient, config)
    if existing.tensors:
        raise GraftRefused(f"{recipient}: already carries a head in {existing.files[0].name}; graft onto a "
                           "head-less checkpoint")
    if hub_donor:
        donor = head_checkpoint(str(donor), revision, lambda c: _refuse_mismatches(mismatches(config, c), force))
    donor = Path(donor)
    check_new_output(out, [recipient, donor], kind="directory")  # a Hub input's files are in a cache: not there either
    source = donor_location(donor, config["model_type"])
    donor_config = source.config if donor.is_dir() else head_config({c: t.shape for c, t in source.tensors.items()})
    problems = mismatches(config, donor_config)
    validation = validate(source, expected_head(config, recipient / "config.json"))
    if validation.problems:
        declared = problems if donor.is_dir() else []  # a head file's sizes are read off the tensors listed
        raise GraftRefused(_would_not_load(recipient, donor, validation.problems, declared, verbose))
    _refuse_mismatches(problems, force)
    weights = quantize_head(validation.weights, bits, group_size, validation.in_features)
    kept = kept_quantization(validation.quantization, bits, group_size)
    contract = Contract.from_metadata({**source.metadata, **source.config})
    head_file, prefix = LAYOUTS[layout]
    index = _index_to_extend(recipient, head_file, layout)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        linked, copied = _link_tree(recipient, tmp)
        write_atomically(tmp / head_file, {prefix + k: v for k, v in weights.items()},
                         head_metadata(contract, quantization_labels(weights, validation.in_features)))
        if index is not None:
            index["weight_map"].update({prefix + k: head_file for k in weights})
            (tmp / INDEX).unlink()  # a hard link to the recipient's index: never write through it
            (tmp / INDEX).write_text(json.dumps(index, indent=2))
        os.chmod(tmp, user_mode(directory=True))
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": str(out), "layout": layout, "head_file": head_file, "tensors": len(weights),
            "head_bytes": (out / head_file).stat().st_size, "overridden": problems if force else [],
            "linked": linked, "copied": copied, "kept": kept}


def _would_not_load(recipient: Path, donor: Path, tensors: list[str], configs: list[str], verbose: bool) -> str:
    """The refusal of ``donor``'s head whose ``tensors`` (``validate``'s problems) do not fit ``recipient``: led by
    the size differences of the two configs (``loading.fit.mismatches``) when there are any, the tensors listed then
    only if ``verbose``."""
    sizes = [p for p in configs if p.split(":")[0] in FIELDS]
    if not sizes:
        return (f"the donor's head would not load into {recipient} (--force cannot override this):\n  "
                + "\n  ".join(tensors + [f"donor vs recipient: {p}" for p in configs]))
    line = (f"the donor's head ({donor}) is for a model of another size ({'; '.join(sizes)}): it cannot load into "
            f"{recipient}, even with --force; graft the head of a checkpoint of the recipient's own model")
    if verbose:
        return line + "\n  " + "\n  ".join(tensors)
    return line + f" (--verbose lists the {len(tensors)} tensors that do not fit)"


def _refuse_mismatches(problems: list[str], force: bool) -> None:
    """Raise ``GraftRefused`` listing ``problems`` (``loading.fit.mismatches``), unless ``force``."""
    if problems and not force:
        raise GraftRefused(f"the donor's head does not fit the recipient ({'; '.join(problems)}); --force overrides "
                           "(acceptance will tell whether the head still works)")


def _index_to_extend(recipient: Path, head_file: str, layout: str) -> dict | None:
    """The recipient's index when ``layout``'s head file (a ``model*`` file) must be listed in it, else None;
    ``GraftRefused`` when it cannot be read."""
    if not head_file.startswith("model") or not (recipient / INDEX).exists():
        return None
    data, problem = read_index(recipient)
    if data is None:
        raise GraftRefused(f"{recipient / INDEX}: {problem}; the {layout} layout lists its head file there: repair "
                           "or delete the index, or choose --layout mlx-lm")
    data.setdefault("weight_map", {})
    return data


def _link_tree(src: Path, dst: Path) -> tuple[int, int]:
    """Hard-link every file of ``src`` (a symlink's target) into ``dst``, else copy it; ``(linked, copied)``."""
    linked = copied = 0
    for path in sorted(src.rglob("*")):
        target = dst / path.relative_to(src)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path.resolve(), target)  # a snapshot of huggingface_hub's cache holds symbolic links to blobs
            linked += 1
        except OSError:  # another filesystem, or links not supported
            shutil.copy2(path, target)
            copied += 1
    return linked, copied
