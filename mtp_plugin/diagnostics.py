"""Is a head trained or random initialisation? Two tells that need no inference (seed 003):

* norm weights still at their initial constant (every entry equal: 0 zero-centred, 1 absolute);
* projections Gaussian (Pearson kurtosis ≈ 3) with the same std in every tensor — the initializer
  range (e.g. 0.02), as reported for a random-init Ornith-1.5 head.
Trained projections are heavy-tailed (kurtosis well above 3) and their stds differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GAUSSIAN_KURTOSIS = 3.0
KURTOSIS_TOLERANCE = 0.5  # sampling error of a small tensor; trained heads sit at 3.7-15
STD_SPREAD = 0.15  # (max-min)/mean std over tensors; trained heads differ by ~50%
SAMPLE = 1 << 20


@dataclass(frozen=True)
class Verdict:
    """``trained`` with the statistics behind it: norm means, projection stds and kurtoses."""

    trained: bool
    evidence: str
    norm_means: dict[str, float]
    projection_std: dict[str, float]
    projection_kurtosis: dict[str, float]


def kurtosis(values: np.ndarray) -> float:
    """Pearson kurtosis E[(x-μ)^4]/σ^4 (3.0 for a Gaussian) of up to 2^20 evenly spaced entries."""
    v = np.asarray(values, dtype=np.float64).ravel()
    v = v[:: max(1, v.size // SAMPLE)]
    centred = v - v.mean()
    var = float(np.mean(centred**2))
    return float(np.mean(centred**4) / var**2) if var > 0 else 0.0


def judge(norms: dict[str, np.ndarray], projections: dict[str, np.ndarray]) -> Verdict:
    """Judge a head from its RMSNorm weights and its (dequantized) projection matrices, float arrays."""
    means = {k: float(np.mean(v)) for k, v in norms.items()}
    stds = {k: float(np.std(v)) for k, v in projections.items()}
    kurt = {k: kurtosis(v) for k, v in projections.items()}
    if norms and all(float(np.ptp(v)) == 0.0 for v in norms.values()):
        return Verdict(False, "every norm weight is still a constant (its initial value)", means, stds, kurt)
    if projections:
        gaussian = all(abs(k - GAUSSIAN_KURTOSIS) < KURTOSIS_TOLERANCE for k in kurt.values())
        mean_std = float(np.mean(list(stds.values())))
        spread = (max(stds.values()) - min(stds.values())) / max(mean_std, 1e-12)
        if gaussian and spread < STD_SPREAD:
            return Verdict(False, f"projections Gaussian (kurtosis ~3) with one std ({mean_std:.4f}) in every "
                           "tensor: the initializer", means, stds, kurt)
    return Verdict(True, "norms moved from their initial value and projections are not initializer noise",
                   means, stds, kurt)
