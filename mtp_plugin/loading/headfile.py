"""A head as a standalone artifact: normalised tensors (canonical names, absolute norms) and atomic writes. Our head
files carry safetensors metadata ``format`` (mlx), ``mtp_norm_convention`` (``absolute``), ``mtp_contract`` (JSON)
and ``mtp_quantization`` (JSON: module → ``int4/g64`` …)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..files import atomic_write
from ..head.conventions import (
    ABSOLUTE,
    CONTRACT_KEY,
    NORM_KEY,
    ZERO_CENTRED,
    Contract,
    NormDecision,
    decide_norm,
    declared_norms,
    describe_quantization,
    is_norm,
    quantization_of,
)
from ..plugins import hook
from .checkpoint import HeadLocation, file_conventions, load_tensors

QUANT_KEY = "mtp_quantization"
ROUTERS = ("mlp.gate.weight", "mlp.shared_expert_gate.weight")  # kept at 8 bits, as mlx-lm does for MoE


def normalised_head(location: HeadLocation) -> tuple[dict, dict[str, NormDecision]]:
    """``(weights, decisions)`` of ``location``'s head: ``{canonical: mx.array}`` in stored dtypes, experts stacked,
    every RMSNorm folded to absolute (in float32); and the ``NormDecision`` per norm tensor."""
    weights = load_tensors(list(location.tensors.values()))
    weights = hook().mtp_sanitize_head(weights=weights, config=location.config) or weights
    by_file = file_conventions(location)
    declared = declared_norms({**location.metadata, **location.config})
    decisions = {}
    for name, value in weights.items():
        if is_norm(name, value.shape):
            said = declared.get(name) if isinstance(declared, dict) else declared
            stored = location.tensors.get(name)
            evidence = by_file.get(stored.file) if stored is not None else None
            decisions[name] = decide_norm(np.array(value.astype(mx.float32)), said, evidence)
            if decisions[name].convention == ZERO_CENTRED:
                weights[name] = (value.astype(mx.float32) + 1.0).astype(value.dtype)
    return weights, decisions


def quantize_head(weights: dict, bits: int, group_size: int, linear: dict[str, int]) -> dict:
    """Affine-quantize (``mx.quantize``) every float weight of the ``linear`` modules (module → input width), router
    gates at 8 bits; ``bits=16`` casts to bfloat16. Other weights (norms, DeepSeek's router ``mlp.gate``) and quantized
    ones are kept. ValueError: an input width not divisible by ``group_size``."""
    out = {}
    for name, value in weights.items():
        module = name[: -len(".weight")]
        if not name.endswith(".weight") or module not in linear or f"{module}.scales" in weights:
            out[name] = value
            continue
        if bits == 16:
            out[name] = value.astype(mx.bfloat16)
            continue
        b = 8 if name.endswith(ROUTERS) else bits
        if value.shape[-1] % group_size:
            raise ValueError(f"{name}: {value.shape[-1]} inputs not divisible by group size {group_size}")
        out[name], out[f"{module}.scales"], out[f"{module}.biases"] = mx.quantize(value, group_size=group_size, bits=b)
    return out


def kept_quantization(labels: dict[str, str], bits: int, group_size: int) -> list[str]:
    """The quantizations (``int4/g64``) of a head's already-quantized modules (``labels``: module → label as stored)
    that ``quantize_head`` keeps although ``bits``/``group_size`` ask for another; sorted, empty when none."""
    kept = set()
    for module, label in labels.items():
        b = 8 if f"{module}.weight".endswith(ROUTERS) else bits
        if label.startswith("int") and label != ("bf16" if bits == 16 else f"int{b}/g{group_size}"):
            kept.add(label)
    return sorted(kept)


def quantization_labels(weights: dict, in_features: dict[str, int]) -> dict[str, str]:
    """Module → ``int4/g64`` / ``bf16`` label for every linear weight of a head (``in_features``' modules)."""
    labels = {}
    for name, value in weights.items():
        if not name.endswith(".weight") or name[: -len(".weight")] not in in_features:
            continue
        module = name[: -len(".weight")]
        scales = weights.get(f"{module}.scales")
        q = None if scales is None else quantization_of(value.shape, scales.shape, in_features[module])
        labels[module] = describe_quantization(q, str(value.dtype).split(".")[-1])
    return labels


def head_metadata(contract: Contract, labels: dict[str, str]) -> dict[str, str]:
    """Safetensors metadata our loader reads: format, folded norms, contract, per-module quantization."""
    return {"format": "mlx", NORM_KEY: ABSOLUTE, CONTRACT_KEY: contract.to_json(), QUANT_KEY: json.dumps(labels)}


def write_atomically(path: Path, tensors: dict, metadata: dict) -> None:
    """Write a safetensors file atomically (``files.atomic_write``), creating parent directories: a failure leaves no
    partial file, and replacing a hard link never writes into its other names."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: mx.save_safetensors(str(tmp), tensors, metadata=metadata), ".safetensors")
