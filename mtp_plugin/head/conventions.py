"""Per-tensor conventions of a head: RMSNorm convention (zero-centred ``1 + w`` or absolute ``w``, decided per tensor
from evidence), quantization read from packed shapes, and the wiring contract. Design: docs/checkpoints.md."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np

ZERO_CENTRED = "zero_centred"
ABSOLUTE = "absolute"
CONTRACT_KEY = "mtp_contract"
NORM_KEY = "mtp_norm_convention"


@dataclass(frozen=True)
class Contract:
    """How the head is wired to the trunk (a wrong choice collapses acceptance without any error): ``hidden``
    ``"post_norm"`` (after the trunk's final norm; Qwen's default) or ``"pre_norm"``; ``concat_order``
    ``"embedding_first"`` (Qwen's) or ``"hidden_first"``; ``positions`` ``"trunk"`` (RoPE position t for the pair
    (h[t], x[t+1]))."""

    hidden: str = "post_norm"
    concat_order: str = "embedding_first"
    positions: str = "trunk"

    @classmethod
    def from_metadata(cls, metadata: dict) -> Contract:
        """The contract under ``mtp_contract`` (JSON string or dict), defaults elsewhere. Raises TypeError for an
        unknown field, ValueError for an unknown value (or JSON that does not parse)."""
        raw = metadata.get(CONTRACT_KEY)
        if raw is None:
            return cls()
        fields = json.loads(raw) if isinstance(raw, str) else dict(raw)
        contract = cls(**fields)
        allowed = {"hidden": ("post_norm", "pre_norm"), "concat_order": ("embedding_first", "hidden_first"),
                   "positions": ("trunk",)}
        for key, values in allowed.items():
            if getattr(contract, key) not in values:
                raise ValueError(f"{CONTRACT_KEY}: {key}={getattr(contract, key)!r}; expected one of {values}")
        return contract

    def to_json(self) -> str:
        """JSON for safetensors metadata or config.json."""
        return json.dumps(asdict(self), sort_keys=True)


@dataclass(frozen=True)
class NormDecision:
    """The convention decided for one RMSNorm weight, and why."""

    convention: str
    evidence: str
    settled: bool = True


def is_norm(canonical: str, shape: tuple[int, ...]) -> bool:
    """True for a head RMSNorm weight: 1-D ``<module>.weight`` whose module name contains ``norm``."""
    parts = canonical.split(".")
    return len(shape) == 1 and parts[-1] == "weight" and len(parts) > 1 and "norm" in parts[-2]


def decide_norm(values: np.ndarray, declared: str | None = None,
                file_evidence: tuple[str, str] | None = None) -> NormDecision:
    """One RMSNorm weight's (H,) convention, never from a mean. Evidence, strongest first: ``declared`` in metadata;
    negative entries; all entries ≈ 0; ``file_evidence`` ``(convention, evidence)`` of its file
    (``loading.checkpoint.file_conventions``). Without any: absolute as stored, ``settled`` False, for
    ``head/norm_settling.py``."""
    if declared in (ZERO_CENTRED, ABSOLUTE):
        return NormDecision(declared, "declared in metadata")
    v = np.asarray(values, dtype=np.float32)
    negative = float(np.mean(v < 0))
    if negative > 0.01:
        return NormDecision(ZERO_CENTRED, f"{negative:.0%} negative entries; an absolute scale is never negative")
    if float(np.max(np.abs(v))) < 0.05:
        return NormDecision(ZERO_CENTRED, "all entries ~0; as absolute scales they would erase the signal")
    if file_evidence is not None:
        return NormDecision(*file_evidence)
    return NormDecision(ABSOLUTE, "all entries positive and no evidence in its file: read as stored until the "
                        "first prompt settles it by the head's own predictions", settled=False)


def quantization_of(weight_shape: tuple[int, ...], scales_shape: tuple[int, ...] | None,
                    in_features: int) -> dict | None:
    """``{"bits": b, "group_size": g}`` of a linear layer from MLX's packed shapes (weight (…, out, in·bits/32) uint32,
    scales (…, out, in/group_size)); None without scales. ValueError: shapes no bit width / group size explains."""
    if scales_shape is None:
        return None
    bits, rem = divmod(weight_shape[-1] * 32, in_features)
    group_size, grem = divmod(in_features, scales_shape[-1])
    if rem or grem or bits not in (2, 3, 4, 5, 6, 8):
        raise ValueError(f"weight {weight_shape} / scales {scales_shape} fit no quantization of {in_features} inputs")
    return {"bits": bits, "group_size": group_size}


def describe_quantization(q: dict | None, dtype: str) -> str:
    """Short label: ``int4/g64`` for quantized, else the float dtype (``bf16``, ``fp16``, ``fp32``)."""
    if q:
        return f"int{q['bits']}/g{q['group_size']}"
    return {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "bfloat16": "bf16", "float16": "fp16",
            "float32": "fp32"}.get(dtype, dtype.lower())


TRUNK_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")


def strip_trunk(name: str) -> str:
    """A trunk tensor name without its stack prefix (HF and MLX layouts alike): ``norm.weight``, ``layers.0.…``."""
    for prefix in TRUNK_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def plays_role(name: str, role: str) -> bool:
    """Whether trunk tensor ``name`` is a norm of ``role`` (``mtp_norm_roles``: ``norm.weight`` the final norm,
    ``input_layernorm.weight`` every layer's, ``layers.0.input_layernorm.weight`` the first layer's)."""
    stripped = strip_trunk(name)
    parts = stripped.split(".", 2)
    return stripped == role or (len(parts) == 3 and parts[0] == "layers" and parts[2] == role)


def declared_norms(metadata: dict) -> dict | str | None:
    """The norm convention recorded in metadata: one string for all norms or a per-name dict."""
    raw = metadata.get(NORM_KEY)
    if isinstance(raw, str) and raw.startswith("{"):
        return json.loads(raw)
    return raw
