"""``mtp-plugin inspect``: can this directory run MTP, and if not, why. Reads file headers, the head's tensors and
the trunk's 1-D norms only; ``can_run`` follows the loader's own ``loading.validation.validate``.
Usage: docs/commands.md#inspect.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..head.conventions import describe_quantization
from ..loading.card import graft_command
from ..loading.checkpoint import CheckpointError, HeadLocation, find_head, trunk_headers
from ..loading.diagnostics import head_statistics, judge
from ..loading.validation import Validation, validate
from ..plugins import hook, retried_without_answerers


def trunk_quantization(location: HeadLocation, headers: dict) -> str:
    """``int4/g64`` from config.json's ``quantization``, else the dtype of the trunk's largest tensor."""
    q = location.config.get("quantization") or location.config.get("quantization_config")
    if q and "bits" in q:
        return describe_quantization({"bits": q["bits"], "group_size": q.get("group_size", 64)}, "")
    if not headers:
        return "unknown"
    shape, dtype = max(headers.values(), key=lambda sd: int(np.prod(sd[0])))
    return describe_quantization(None, dtype)


def _validated(model_dir: Path) -> tuple[HeadLocation, Validation | None]:
    """``model_dir``'s head location and its validation (None for a model type no plugin handles)."""
    location = find_head(model_dir)
    handled = location.model_type in sum(hook().mtp_model_types(), [])
    return location, validate(location) if handled else None


def _problem(found: tuple[HeadLocation, Validation | None]) -> str | None:
    """The first thing that keeps a handled model type's head from running (``_validated``), or None."""
    location, validation = found
    if validation is None:
        return None
    return validation.problems[0] if validation.problems else None if location.tensors else "no head tensors"


def inspect_dir(model_dir: Path) -> dict:
    """The inspect report of ``model_dir`` as a JSON-ready dict (keys: docs/commands.md#inspect).

    Raises:
        CheckpointError: unreadable config.json or weights header.
    """
    location, validation = retried_without_answerers("the head's validation", lambda: _validated(Path(model_dir)),
                                                     _problem)
    handled = validation is not None
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
        "warnings": location.warnings,
    }
    if not handled:
        problems.append(f"model type {location.model_type!r} has no MTP support in any installed plugin")
        return report
    problems += validation.problems
    if not location.tensors and not problems:
        command = graft_command(location.model_dir, online=True)
        if declared:
            problems.append(f"config.json declares {location.declared_key}={declared} but no head "
                            f"tensor is present in any file: the converter dropped it; get one with `{command}`")
        else:
            problems.append(f"no MTP head in this checkpoint; graft one with `{command}`")
        return report
    if problems or validation.weights is None:
        return report
    _describe_head(report, validation)
    if report["head_trained"] is False:
        problems.append(f"head looks like random initialisation ({report['head_trained_evidence']}); drafts would "
                        "almost never be accepted")
    report["can_run"] = not problems
    return report


def _describe_head(report: dict, validation: Validation) -> None:
    for name, decision in validation.norms.items():
        report["norm_convention"][name] = {"convention": decision.convention, "evidence": decision.evidence}
    report["head_quantization"] = dict(validation.quantization)
    norms, projections, _ = head_statistics(validation.weights, validation.norms, validation.in_features)
    verdict = judge(norms, projections)
    report["head_trained"] = verdict.trained
    report["head_trained_evidence"] = verdict.evidence
    report["norm_means"] = {k: round(v, 4) for k, v in verdict.norm_means.items()}
    report["projection_kurtosis"] = {k: round(v, 2) for k, v in verdict.projection_kurtosis.items()}
    report["projection_std"] = {k: round(v, 5) for k, v in verdict.projection_std.items()}
