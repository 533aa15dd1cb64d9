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
    """Write the head of ``hf_dir`` (a checkpoint or Hub repo id: only the head's bytes are fetched, at ``revision``)
    to ``out`` atomically (safetensors, names ``mtp.*``, norms folded to absolute); ``bits`` 16 keeps bfloat16.
    Returns a summary: tensors written, bytes, per-module quantization labels, norms folded.

    Raises:
        UsageError: ``out`` exists (without ``force``), lies inside ``hf_dir`` or its directory is missing or
            read-only; unsupported bits or group size; ``revision`` with a local path.
        CheckpointError: no head, or one that would not load (``loading.validation.validate``); ``HubError``.
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
