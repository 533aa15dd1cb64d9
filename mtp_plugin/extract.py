"""``mtp-plugin extract``: take the head out of an original Hugging Face checkpoint as one MLX head file."""

from __future__ import annotations

from pathlib import Path

from .checkpoint import CheckpointError, find_head
from .conventions import Contract
from .headfile import head_metadata, normalised_head, quantization_labels, quantize_head, write_atomically
from .plugins import hook


def extract(hf_dir: Path, out: Path, bits: int = 8, group_size: int = 64) -> dict:
    """Write the head of ``hf_dir`` to ``out`` (safetensors, names ``mtp.*``, norms folded to absolute).

    Args:
        hf_dir: a checkpoint carrying a head (normally the original Hugging Face one).
        out: the head file to write (atomically; parent directories are created).
        bits: 4 or 8 for affine quantization with ``mx.quantize``, 16 to keep bfloat16.
        group_size: quantization group size.

    Returns:
        Summary: tensors written, bytes, per-module quantization labels, norms folded.

    Raises:
        CheckpointError: no head in ``hf_dir`` or a model type no plugin handles.
        ValueError: bits/group size that do not fit the head's widths.
    """
    location = find_head(Path(hf_dir))
    if not location.tensors:
        raise CheckpointError(f"{hf_dir}: no MTP head tensors in any file; extract from the original checkpoint")
    weights, decisions = normalised_head(location)
    weights = quantize_head(weights, bits, group_size)
    labels = quantization_labels(weights, hook().mtp_head_in_features(config=location.config) or {})
    contract = Contract.from_metadata({**location.metadata, **location.config})
    write_atomically(Path(out), {f"mtp.{k}": v for k, v in weights.items()}, head_metadata(contract, labels))
    return {"out": str(out), "tensors": len(weights), "bytes": Path(out).stat().st_size, "quantization": labels,
            "norms_folded": sorted(k for k, d in decisions.items() if d.convention == "zero_centred")}
