"""Per-tensor conventions of a head: RMSNorm convention, quantization, and the wiring contract.

Norm conventions: Hugging Face Qwen3.5 stores zero-centred RMSNorm weights (effective scale ``1 + w``),
MLX conversions store the absolute scale ``w``. A head may mix both (tensors copied from different
sources), so the convention is decided per tensor from evidence, never from the mere presence of
``mtp.*`` keys and never from a mean (a converted ``pre_fc_norm_embedding`` can have mean ≈ 0.27, a
zero-centred norm can be positive everywhere).
"""

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
    """How the head is wired to the trunk; a wrong choice collapses acceptance without any error.

    Attributes:
        hidden: ``"post_norm"`` (trunk hidden after its final norm, Qwen's default) or ``"pre_norm"``.
        concat_order: ``"embedding_first"`` (Qwen's default) or ``"hidden_first"``.
        positions: ``"trunk"``: the head's RoPE position for pair (h[t], x[t+1]) is t.
    """

    hidden: str = "post_norm"
    concat_order: str = "embedding_first"
    positions: str = "trunk"

    @classmethod
    def from_metadata(cls, metadata: dict) -> Contract:
        """The contract recorded under ``mtp_contract`` (JSON string or dict), defaults elsewhere.

        Raises:
            ValueError: an unknown field or value.
        """
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
    """True for a head RMSNorm weight: 1-D ``<module>.weight`` whose module name contains ``norm``
    (``norm``, ``q_norm``, ``input_layernorm``, ``pre_fc_norm_embedding`` …)."""
    parts = canonical.split(".")
    return len(shape) == 1 and parts[-1] == "weight" and len(parts) > 1 and "norm" in parts[-2]


def decide_norm(values: np.ndarray, declared: str | None = None,
                file_evidence: tuple[str, str] | None = None) -> NormDecision:
    """Decide one RMSNorm weight's convention from the evidence its file carries, never from a mean.

    Evidence, strongest first: a convention declared in metadata; negative entries (an absolute
    scale is never negative in a trained model); all entries ≈ 0 (an absolute scale of 0 would erase
    the signal); the file it is stored in (``checkpoint.file_conventions``). Without any of these the
    decision is provisional (absolute, as stored, ``settled`` False): the first prompt with enough evidence settles
    it by the head's own predictions of the prompt's tokens, per tensor (``settle.py``).

    Args:
        values: the stored weight, any float dtype, shape (H,).
        declared: ``"zero_centred"`` / ``"absolute"`` from metadata, or None.
        file_evidence: ``(convention, evidence)`` from the file the tensor sits in, or None.
    """
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
    """Affine quantization parameters of a linear layer inferred from stored shapes.

    MLX packs ``bits``-bit values into uint32: weight (…, out, in·bits/32), scales (…, out, in/group_size).

    Returns:
        ``{"bits": b, "group_size": g}`` or None for an unquantized weight.

    Raises:
        ValueError: shapes that no bit width / group size explains.
    """
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
    """A trunk tensor name without its stack prefix, the same for HF and MLX layouts:
    ``model.language_model.norm.weight`` and ``language_model.model.norm.weight`` are both ``norm.weight``."""
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
