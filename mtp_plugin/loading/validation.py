"""One validation of a head, for the loader (which refuses the head), ``inspect`` (which says why) and ``graft`` /
``extract`` (which refuse to write it): metadata, head files, and the head's tensors against the module the loader
builds. Each problem names the file and the tensor or key, and the fix. Design: docs/checkpoints.md#validation."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from ..head.conventions import (
    ABSOLUTE,
    CONTRACT_KEY,
    NORM_KEY,
    ZERO_CENTRED,
    Contract,
    describe_quantization,
    plays_role,
    quantization_of,
)
from ..plugins import hook
from .checkpoint import CheckpointError, HeadLocation, load_tensors, trunk_headers
from .headfile import normalised_head

FIX = "; re-extract the head from the original checkpoint (`mtp-plugin extract`) or graft one that fits this trunk"
LISTED = 4  # names quoted in one problem line before "…"


@dataclass
class Validation:
    """What ``validate`` found: ``problems``, one line each (empty: the head loads); ``weights``: the normalised head
    (``headfile.normalised_head``) or None when unread; ``norms``: decision per RMSNorm weight; ``quantization``: label
    per linear module as stored; ``in_features``: input width per quantizable module of the built head."""

    problems: list[str]
    weights: dict | None = None
    norms: dict = field(default_factory=dict)
    quantization: dict[str, str] = field(default_factory=dict)
    in_features: dict[str, int] = field(default_factory=dict)


def metadata_problems(location: HeadLocation) -> list[str]:
    """Problems of the head files and of the metadata the loader reads, one line each naming file and key."""
    problems = list(location.unusable)
    try:
        _ = location.declared_layers
    except CheckpointError as e:
        problems.append(str(e))
    merged = {**location.metadata, **location.config}
    try:
        Contract.from_metadata(merged)
    except (ValueError, TypeError) as e:  # JSONDecodeError is a ValueError
        problems.append(f"{location.source(CONTRACT_KEY)}: {CONTRACT_KEY}={merged[CONTRACT_KEY]!r} is not a wiring "
                        f"contract ({e}); remove the key or record it again with `mtp-plugin verify --write`")
    raw = merged.get(NORM_KEY)
    if raw is not None:
        problems += _norm_key_problems(location, raw)
    return problems


def _norm_key_problems(location: HeadLocation, raw) -> list[str]:
    where = f"{location.source(NORM_KEY)}: {NORM_KEY}={raw!r}"
    fix = f"; use {ZERO_CENTRED!r} or {ABSOLUTE!r} (or a JSON object of them per norm), or remove the key"
    try:
        value = json.loads(raw) if isinstance(raw, str) and raw.lstrip().startswith("{") else raw
    except ValueError as e:
        return [f"{where} is not valid JSON ({e}){fix}"]
    values = value.values() if isinstance(value, dict) else [value]
    bad = [v for v in values if v not in (ZERO_CENTRED, ABSOLUTE)]
    return [f"{where}: {bad[0]!r} is not a norm convention{fix}"] if bad else []


def expected_head(config: dict, config_file: Path) -> nn.Module:
    """The float, unloaded head module the loader builds for ``config``, from an unloaded model of the runtime's class
    (``mtp_build_model``: nothing allocated or read). CheckpointError naming ``config_file``: no installed runtime
    builds the model or its head, or it cannot build the model from ``config``."""
    model_type = config.get("model_type")
    try:
        model = hook().mtp_build_model(config=config)
    except (TypeError, KeyError, ValueError, AttributeError) as e:  # a dataclass missing fields, a bad value
        raise CheckpointError(f"{config_file}: the runtime cannot build a {model_type!r} model from it ({e!r}); "
                              "restore config.json from the model's source") from None
    head = None if model is None else hook().mtp_build_head(model=model, config=config)
    if head is None:
        raise CheckpointError(f"{config_file}: no installed runtime builds the MTP head of model type "
                              f"{model_type!r}; install mlx-lm")
    return head


def linear_in_features(head: nn.Module) -> dict[str, int]:
    """Input width of every quantizable (``to_quantized``) module of the float ``head``, by canonical path."""
    leaves = tree_flatten(head.leaf_modules(), is_leaf=nn.Module.is_module)
    return {path: module.weight.shape[-1] for path, module in leaves if hasattr(module, "to_quantized")}


def structure_problems(location: HeadLocation, head: nn.Module, weights: dict) -> tuple[list[str], dict[str, str]]:
    """Check ``weights`` (``{canonical: mx.array}`` after the family's sanitize) against the parameters of the float
    ``head``, quantizing ``head`` in place like the stored weights (bits, group size from packed shapes). Returns
    ``(problems, labels)``: a line per missing, unknown, misshapen or mis-stored tensor naming file and tensor, and a
    quantization label per linear module."""
    problems, labels, broken = [], {}, set()

    def where(name: str) -> str:
        t = location.tensors.get(name)
        return f"{t.file}: {t.name}" if t is not None else f"{', '.join(map(str, location.files))}: {name}"

    def quantize_like_stored(path: str, module: nn.Module) -> nn.Module:
        weight, scales = weights.get(f"{path}.weight"), weights.get(f"{path}.scales")
        if not hasattr(module, "to_quantized") or weight is None:
            return module
        dtype = str(weight.dtype).split(".")[-1]
        problem = None
        if scales is None:
            labels[path] = describe_quantization(None, dtype)
            if weight.dtype == mx.uint32:
                problem = "packed (uint32) quantized weight without its scales"
        elif weight.dtype != mx.uint32:
            problem = f"has scales but is stored as {dtype}, not packed uint32"
        else:
            try:
                q = quantization_of(weight.shape, scales.shape, module.weight.shape[-1])
                quantized = module.to_quantized(**q)
                labels[path] = describe_quantization(q, dtype)
                return quantized
            except ValueError as e:
                problem = str(e)
        if problem is not None:
            problems.append(f"{where(f'{path}.weight')}: {problem}{FIX}")
            broken.add(path)
        return module

    head.update_modules(tree_map_with_path(quantize_like_stored, head.leaf_modules(), is_leaf=nn.Module.is_module))
    parameters = dict(tree_flatten(head.parameters()))
    expected = {name: tuple(value.shape) for name, value in parameters.items()}
    reported = {n for n in expected if n.rpartition(".")[0] in broken}
    missing = sorted(n for n in expected if n not in weights and n not in reported)
    if missing:
        problems.append(f"{', '.join(map(str, location.files))}: head incomplete, {len(missing)} of the "
                        f"{len(expected)} parameters of the head module missing: {_listed(missing)}{FIX}")
    for name in sorted(n for n in expected if n in weights and n not in reported):
        shape = tuple(weights[name].shape)
        if shape != expected[name]:
            problems.append(f"{where(name)}: {_shape_problem(location, name, shape, expected[name])}{FIX}")
        elif mx.issubdtype(parameters[name].dtype, mx.floating) and not mx.issubdtype(weights[name].dtype, mx.floating):
            problems.append(f"{where(name)}: stored as {str(weights[name].dtype).split('.')[-1]}, not a floating-point "
                            f"type{FIX}")
    unknown = sorted(n for n in weights if n not in expected and n.rpartition(".")[0] not in broken)
    return problems + _unknown_problems(location, unknown, expected, where), labels


def _listed(names: list[str]) -> str:
    return ", ".join(names[:LISTED]) + (", …" if len(names) > LISTED else "")


def _shape_problem(location: HeadLocation, name: str, shape: tuple, expected: tuple) -> str:
    """What is wrong with one tensor's shape, in the module's terms (inputs, outputs) where it is a linear weight."""
    if name.endswith(".weight") and len(shape) == len(expected) >= 2:
        if shape[-1] != expected[-1]:
            return f"{shape[-1]} inputs, expected {expected[-1]} (shape {shape}, the head module needs {expected})"
        if shape[-2] != expected[-2]:
            return f"{shape[-2]} outputs, expected {expected[-2]} (shape {shape}, the head module needs {expected})"
    trunk = _trunk_norm_sizes(location).get(name) if len(expected) == len(shape) == 1 else None
    evidence = (f"; the trunk's norms of the same role have {trunk} entries: the head comes from another model"
                if trunk == expected[0] else "")
    return f"shape {shape}, but the head module built from config.json needs {expected}{evidence}"


def _unknown_problems(location: HeadLocation, unknown: list[str], expected: dict, where) -> list[str]:
    """Tensors the head module does not have: extra decoder layers in one line, any other tensor by name."""
    layers = {n.split(".")[1] for n in expected if n.startswith("layers.")}
    extra = {}
    for name in unknown:
        parts = name.split(".")
        if parts[0] == "layers" and len(parts) > 2 and parts[1] not in layers:
            extra.setdefault(parts[1], []).append(name)
    problems = []
    if extra:
        key = location.declared_key
        declared = f"; config.json declares {key}={location.declared_layers}" if key else ""
        problems.append(f"{', '.join(map(str, location.files))}: {len(extra)} decoder layer(s) beyond the "
                        f"{len(layers)} of the head module built for this trunk "
                        f"({', '.join(f'layers.{k}.*' for k in sorted(extra))}: {sum(map(len, extra.values()))} "
                        f"tensors{declared}); remove them from the file, or re-extract the head")
    others = [n for n in unknown if not any(n in names for names in extra.values())]
    problems += [f"{where(n)}: not a parameter of the head module built from config.json (a tensor from another "
                 f"model or a newer layout); remove it or re-extract the head" for n in others[:LISTED]]
    if len(others) > LISTED:
        problems.append(f"{len(others) - LISTED} more unknown tensors: {_listed(others[LISTED:])}")
    return problems


def stored_problems(location: HeadLocation) -> list[str]:
    """What makes the head's files unreadable as stored, one line each: ``location.unusable``, then every head tensor
    read (``checkpoint.load_tensors``) and its float values checked finite. Structure is ``validate``'s."""
    if location.unusable:
        return list(location.unusable)
    if not location.tensors:
        return [f"{location.model_dir}: no head tensors in any file"]
    try:
        return _nonfinite(load_tensors(list(location.tensors.values())), location)
    except (CheckpointError, ValueError, RuntimeError) as e:  # mlx raises ValueError/RuntimeError on a short file
        return [f"{', '.join(map(str, location.files))}: {e}"]


def _nonfinite(weights: dict, location: HeadLocation) -> list[str]:
    """A problem per float tensor holding NaN or Inf; one evaluation, entries checked only where a sum is not finite."""
    totals = {k: v.sum() for k, v in weights.items() if mx.issubdtype(v.dtype, mx.floating)}
    mx.eval(list(weights.values()), list(totals.values()))
    bad = sorted(k for k, total in totals.items() if not mx.isfinite(total).item()
                 and not mx.isfinite(weights[k]).all().item())
    files = ", ".join(map(str, location.files))
    return [(f"{location.tensors[k].file}: {location.tensors[k].name}" if k in location.tensors else f"{files}: {k}")
            + ": non-finite values (NaN or Inf); the file is corrupt: re-download or re-extract the head" for k in bad]


def _trunk_norm_sizes(location: HeadLocation) -> dict[str, int]:
    """Head norm (canonical) → entries of the trunk's norms of the same role, from trunk headers."""
    roles = hook().mtp_norm_roles(config=location.config) or {}
    sizes = {}
    for (_, name), (shape, _) in trunk_headers(location).items():
        if len(shape) != 1:
            continue
        for head_name, role in roles.items():
            if plays_role(name, role):
                sizes.setdefault(head_name, shape[0])
    return sizes


def validate(location: HeadLocation, head: nn.Module | None = None) -> Validation:
    """Validate the head of ``location`` (``checkpoint.find_head``) against ``head``, the float module the loader built
    for its trunk (quantized in place like the stored weights, ready for ``load_weights``; None: ``expected_head``),
    and read it when its metadata allows."""
    problems = metadata_problems(location)
    if problems or not location.tensors:
        return Validation(problems)
    try:
        weights, decisions = normalised_head(location)
    except CheckpointError as e:  # the family could not put the head in the built layout (a tensor is missing)
        return Validation([f"{', '.join(map(str, location.files))}: {e}"])
    try:
        head = head if head is not None else expected_head(location.config, location.model_dir / "config.json")
    except CheckpointError as e:
        return Validation([str(e)])
    in_features = linear_in_features(head)
    problems, labels = structure_problems(location, head, weights)
    return Validation(problems + _nonfinite(weights, location), weights, decisions, labels, in_features)
