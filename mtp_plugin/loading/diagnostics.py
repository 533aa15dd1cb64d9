"""Is a head trained or random initialisation, without inference: norm weights still constant, or every projection
distributed as an initializer draws it (Pearson kurtosis ≈ 3: Gaussian; ≈ 1.8: uniform), mean initializer noise;
trained projections are heavy-tailed. Design: docs/commands.md#inspect."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..head.conventions import quantization_of

INITIALIZERS = {"Gaussian": (3.0, 0.5), "uniform": (1.8, 0.3)}  # kurtosis and tolerance (small-tensor noise)
SAMPLE = 1 << 18  # entries per tensor (sampling error of a Gaussian kurtosis: about 0.01)


@dataclass(frozen=True)
class Verdict:
    """``trained`` with the statistics behind it: norm means, projection stds and kurtoses."""

    trained: bool
    evidence: str
    norm_means: dict[str, float]
    projection_std: dict[str, float]
    projection_kurtosis: dict[str, float]


def kurtosis(values: np.ndarray) -> float:
    """Pearson kurtosis E[(x-μ)^4]/σ^4 (3.0 for a Gaussian) of up to ``SAMPLE`` evenly spaced entries."""
    v = np.asarray(values, dtype=np.float64).ravel()
    v = v[:: max(1, v.size // SAMPLE)]
    centred = v - v.mean()
    squares = centred * centred  # products: faster than numpy's ``**4``
    var = float(squares.mean())
    return float((squares * squares).mean() / var**2) if var > 0 else 0.0


def judge(norms: dict[str, np.ndarray], projections: dict[str, np.ndarray]) -> Verdict:
    """Judge a head from its RMSNorm weights and its (dequantized) projection matrices, float arrays."""
    means = {k: float(np.mean(v)) for k, v in norms.items()}
    stds = {k: float(np.std(v)) for k, v in projections.items()}
    kurt = {k: kurtosis(v) for k, v in projections.items()}
    if norms and all(float(np.ptp(v)) == 0.0 for v in norms.values()):
        return Verdict(False, "every norm weight is still a constant (its initial value)", means, stds, kurt)
    for name, (value, tolerance) in INITIALIZERS.items():
        if projections and all(abs(k - value) < tolerance for k in kurt.values()):
            return Verdict(False, f"every projection is {name} (kurtosis ~{value}) as an initializer draws it",
                           means, stds, kurt)
    return Verdict(True, "norms moved from their initial value and projections are not initializer noise",
                   means, stds, kurt)


def head_statistics(weights: dict, norm_names, in_features: dict[str, int]) -> tuple[dict, dict, dict]:
    """``(norms, projections, labels)`` for ``judge`` from a validated head's ``weights`` (quantized linears as
    weight/scales/biases): float32 numpy norms and dequantized projections (up to ``SAMPLE`` evenly spaced entries),
    and each linear module's ``quantization_of`` (None: float). ``in_features``: ``validation.linear_in_features``."""
    norms = {n: np.array(weights[n].astype(mx.float32)) for n in norm_names}
    projections, labels = {}, {}
    for name, value in weights.items():
        if name in norms or not name.endswith(".weight") or value.ndim < 2:
            continue
        module = name[: -len(".weight")]
        scales = weights.get(f"{module}.scales")
        if scales is not None and module not in in_features:
            continue
        q = None if scales is None else quantization_of(value.shape, scales.shape, in_features[module])
        labels[module] = q
        projections[module] = _sampled_rows(value, scales, weights.get(f"{module}.biases"), q)
    return norms, projections, labels


def _sampled_rows(weight: mx.array, scales, biases, q: dict | None) -> np.ndarray:
    """About ``SAMPLE`` evenly spaced entries (whole rows, only those dequantized) of a weight, flat float32."""
    rows = weight.reshape(-1, weight.shape[-1])
    width = rows.shape[-1] * (32 // q["bits"] if q and 32 % q["bits"] == 0 else 1)
    step = max(1, rows.shape[0] * width // SAMPLE)
    rows = rows[::step]
    if q is not None:
        pick = [a.reshape(-1, a.shape[-1])[::step] for a in (scales, biases) if a is not None]
        rows = mx.dequantize(rows, pick[0], pick[1] if biases is not None else None, **q)
    return np.array(rows.astype(mx.float32)).ravel()
