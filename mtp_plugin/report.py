"""``mtp-plugin inspect``: can this directory run MTP, and if not, why — from headers and head tensors only.

No model is built and no trunk weights are read: file headers, the head's own tensors, and the
trunk's 1-D norm weights (for the per-tensor norm convention) are all that is touched.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .checkpoint import CheckpointError, HeadLocation, find_head, trunk_headers
from .compat import head_config, mismatches
from .conventions import describe_quantization
from .diagnostics import head_statistics, judge
from .plugins import hook
from .validation import validate


def trunk_quantization(location: HeadLocation, headers: dict) -> str:
    """``int4/g64`` from config.json's ``quantization``, else the dtype of the trunk's largest tensor."""
    q = location.config.get("quantization") or location.config.get("quantization_config")
    if q and "bits" in q:
        return describe_quantization({"bits": q["bits"], "group_size": q.get("group_size", 64)}, "")
    if not headers:
        return "unknown"
    shape, dtype = max(headers.values(), key=lambda sd: int(np.prod(sd[0])))
    return describe_quantization(None, dtype)


def inspect_dir(model_dir: Path) -> dict:
    """The inspect report of ``model_dir`` as a JSON-ready dict (keys listed in the README).

    Raises:
        CheckpointError: unreadable config.json or weights header.
    """
    location = find_head(Path(model_dir))
    config = location.config
    handled = location.model_type in sum(hook().mtp_model_types(), [])
    headers = trunk_headers(location)
    problems = []
    try:
        declared = location.declared_layers
    except CheckpointError:
        declared = None  # reported among the problems by the validation
    report = {
        "model_dir": str(location.model_dir),
        "model_type": location.model_type,
        "can_run": False,
        "mtp_tensors": len(location.tensors),
        "declared_mtp_layers": declared,
        "present_mtp_layers": location.present_layers,
        "naming": location.naming,
        "files": {location.display(f): sum(t.file == f for t in location.tensors.values())
                  for f in location.files},
        "norm_convention": {},
        "head_quantization": {},
        "trunk_quantization": trunk_quantization(location, headers),
        "head_trained": None,
        "problems": problems,
    }
    if not handled:
        problems.append(f"model type {location.model_type!r} has no MTP support in any installed plugin")
        return report
    validated, weights, decisions = validate(location)
    problems += validated
    if not location.tensors and not problems:
        if declared:
            problems.append(f"config.json declares {location.declared_key}={declared} but no head "
                            "tensor is present in any file: the converter dropped it; graft one with "
                            "`mtp-plugin graft`")
        else:
            problems.append("no MTP head in this checkpoint; graft one with `mtp-plugin graft`")
        return report
    shapes = {c: t.shape for c, t in location.tensors.items()}
    problems += [f"head does not fit this trunk: {m}" for m in mismatches(config, head_config(shapes))]
    if problems or weights is None:
        return report
    _describe_head(report, location, weights, decisions)
    if report["head_trained"] is False:
        problems.append(f"head looks like random initialisation ({report['head_trained_evidence']}); drafts would "
                        "almost never be accepted")
    report["can_run"] = not problems
    return report


def _describe_head(report: dict, location: HeadLocation, weights: dict, decisions: dict) -> None:
    in_features = hook().mtp_head_in_features(config=location.config) or {}
    for name, decision in decisions.items():
        report["norm_convention"][name] = {"convention": decision.convention, "evidence": decision.evidence}
    norms, projections, labels = head_statistics(weights, decisions, in_features)
    for module, q in labels.items():
        dtype = str(weights[f"{module}.weight"].dtype).split(".")[-1]
        report["head_quantization"][module] = describe_quantization(q, "" if q else dtype)
    unknown = [n[: -len(".weight")] for n in weights if n.endswith(".weight") and weights[n].ndim >= 2
               and n not in decisions and n[: -len(".weight")] not in labels]
    report["problems"] += [f"{m}: quantized, but its input width is unknown to the plugin" for m in unknown]
    verdict = judge(norms, projections)
    report["head_trained"] = verdict.trained
    report["head_trained_evidence"] = verdict.evidence
    report["norm_means"] = {k: round(v, 4) for k, v in verdict.norm_means.items()}
    report["projection_kurtosis"] = {k: round(v, 2) for k, v in verdict.projection_kurtosis.items()}
    report["projection_std"] = {k: round(v, 5) for k, v in verdict.projection_std.items()}
