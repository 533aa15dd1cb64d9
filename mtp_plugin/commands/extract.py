"""``mtp-plugin extract``: take the head out of an original Hugging Face checkpoint as one MLX head file."""

from __future__ import annotations

from pathlib import Path

from ..files import check_new_output
from ..head.conventions import Contract
from ..hub.fetch import head_checkpoint, is_repo_id
from ..loading.checkpoint import CheckpointError, find_head
from ..loading.headfile import head_metadata, quantization_labels, quantize_head, write_atomically
from ..loading.validation import validate
from ..usage import DEFAULT_BITS, DEFAULT_GROUP_SIZE, UsageError, check_quantization


def extract(hf_dir: Path | str, out: Path, bits: int = DEFAULT_BITS, group_size: int = DEFAULT_GROUP_SIZE,
            force: bool = False, revision: str | None = None) -> dict:
    """Write the head of ``hf_dir`` to ``out`` (safetensors, names ``mtp.*``, norms folded to absolute).

    Args:
        hf_dir: a checkpoint carrying a head (normally the original Hugging Face one), or its Hub repo id (only the
            head's bytes are fetched: ``hub.fetch.head_checkpoint``, at ``revision``).
        out: the head file to write (atomically, with the mode of a new user file); never inside ``hf_dir``.
        bits: 4 or 8 for affine quantization with ``mx.quantize``, 16 to keep bfloat16.
        group_size: quantization group size, one of ``usage.GROUP_SIZES``.
        force: replace ``out`` if it exists (a writable file outside ``hf_dir``).

    Returns:
        Summary: tensors written, bytes, per-module quantization labels, norms folded.

    Raises:
        UsageError: ``out`` exists (without ``force``), lies inside ``hf_dir``, or its directory is missing or
            read-only; bits or group size not supported.
        CheckpointError: no head in ``hf_dir``, or one that would not load (``validation.validate``: the loader's
            own check against the head module of ``hf_dir``'s config.json; each problem names file and tensor);
            ``HubError`` for a repository that cannot serve it.
        ValueError: a group size that does not divide the head's widths.
    """
    check_quantization(bits, group_size)
    hub = is_repo_id(hf_dir)
    if not hub and revision is not None:
        raise UsageError(f"--revision {revision}: applies to a Hub repo, and --hf {hf_dir} is a local path")
    check_new_output(Path(out), [] if hub else [Path(hf_dir)], force)
    if hub:
        hf_dir = head_checkpoint(str(hf_dir), revision)
        check_new_output(Path(out), [hf_dir], force)  # not inside the fetched head's cache either
    hf_dir = Path(hf_dir)
    location = find_head(Path(hf_dir))
    if not location.tensors:
        raise CheckpointError(f"{hf_dir}: no MTP head tensors in any file; extract from the original checkpoint")
    validation = validate(location)
    if validation.problems:
        raise CheckpointError(f"{hf_dir}: its head would not load, so it is not extracted:\n  "
                              + "\n  ".join(validation.problems))
    linear = validation.in_features
    weights = quantize_head(validation.weights, bits, group_size, linear)
    labels = quantization_labels(weights, linear)
    contract = Contract.from_metadata({**location.metadata, **location.config})
    write_atomically(Path(out), {f"mtp.{k}": v for k, v in weights.items()}, head_metadata(contract, labels))
    return {"out": str(out), "tensors": len(weights), "bytes": Path(out).stat().st_size, "quantization": labels,
            "norms_folded": sorted(k for k, d in validation.norms.items() if d.convention == "zero_centred")}
