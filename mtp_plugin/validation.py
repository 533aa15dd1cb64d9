"""One validation of a head, used by the loader (which refuses the head) and by ``inspect`` (which says why).

Checked from config.json, the head's metadata and its own tensors (no model is built): metadata that
parses (``mtp_contract``, ``mtp_norm_convention``, ``mtp_num_hidden_layers``); head files that exist and
can be read; every required tensor present; norm sizes equal to the trunk's norms of the same role;
every linear weight's input width (packed width for a quantized one, which must have scales and fit a
bit width) and the fc's output width; every float value finite. Each problem names the file and the
tensor or key, and the fix.
"""

from __future__ import annotations

import json

import mlx.core as mx

from .checkpoint import CheckpointError, HeadLocation, trunk_headers
from .compat import text_config
from .conventions import (
    ABSOLUTE,
    CONTRACT_KEY,
    NORM_KEY,
    ZERO_CENTRED,
    Contract,
    is_norm,
    plays_role,
    quantization_of,
)
from .headfile import normalised_head
from .plugins import hook


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


def tensor_problems(location: HeadLocation, weights: dict) -> list[str]:
    """Problems of the head's tensors (canonical names, as loaded; values are evaluated for finiteness).

    Args:
        location: where the tensors came from (names and files for the messages).
        weights: ``{canonical: mx.array}`` after the family's sanitize.
    """
    config = location.config
    problems = []
    missing = [n for n in hook().mtp_required_tensors(config=config) or [] if n not in location.tensors]
    if missing:
        problems.append(f"head incomplete: {len(missing)} tensors missing, first {missing[0]!r}; re-extract the "
                        "head from the original checkpoint")
    in_features = hook().mtp_head_in_features(config=config) or {}
    hidden = text_config(config).get("hidden_size")
    norm_sizes = _trunk_norm_sizes(location)

    def where(name: str) -> str:
        t = location.tensors.get(name)
        return f"{t.file}: {t.name}" if t is not None else f"{', '.join(map(str, location.files))}: {name}"

    for name, value in weights.items():
        if is_norm(name, value.shape):
            size = norm_sizes.get(name)
            if size is not None and value.shape != (size,):
                problems.append(f"{where(name)}: shape {value.shape}, but the trunk's norm of the same role has "
                                f"{size} entries; the head comes from another model: re-extract or graft the right one")
            continue
        if not name.endswith(".weight") or value.ndim < 2:
            continue
        module = name[: -len(".weight")]
        problems += _linear_problems(where(name), value, weights.get(f"{module}.scales"),
                                     weights.get(f"{module}.biases"), in_features.get(module),
                                     hidden if module == "fc" else None)
    return problems + _nonfinite(weights, where)


def _linear_problems(where: str, weight, scales, biases, in_features: int | None, out_features: int | None):
    fix = "; re-extract the head (`mtp-plugin extract`) or graft one that fits this trunk"
    if out_features is not None and weight.shape[-2] != out_features:
        return [f"{where}: {weight.shape[-2]} outputs, expected {out_features} (the trunk's hidden size){fix}"]
    if scales is None:
        if weight.dtype == mx.uint32:
            return [f"{where}: packed (uint32) quantized weight without its scales{fix}"]
        if in_features is not None and weight.shape[-1] != in_features:
            return [f"{where}: {weight.shape[-1]} inputs, expected {in_features}{fix}"]
        return []
    if in_features is None:
        return []
    if weight.dtype != mx.uint32:
        return [f"{where}: has scales but is stored as {weight.dtype}, not packed uint32{fix}"]
    try:
        quantization_of(weight.shape, scales.shape, in_features)
    except ValueError as e:
        return [f"{where}: {e}{fix}"]
    if scales.shape[:-1] != weight.shape[:-1] or (biases is not None and biases.shape != scales.shape):
        return [f"{where}: scales {scales.shape} / biases {None if biases is None else biases.shape} do not match "
                f"the weight {weight.shape}{fix}"]
    return []


def _nonfinite(weights: dict, where) -> list[str]:
    floats = {k: v for k, v in weights.items() if mx.issubdtype(v.dtype, mx.floating)}
    flags = {k: mx.isfinite(v).all() for k, v in floats.items()}
    mx.eval(list(flags.values()))
    bad = sorted(k for k, f in flags.items() if not f.item())
    return [f"{where(k)}: non-finite values (NaN or Inf); the file is corrupt: re-download or re-extract the head"
            for k in bad]


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


def validate(location: HeadLocation) -> tuple[list[str], dict | None, dict]:
    """Validate the head of ``location`` and, when its metadata allows, read it.

    Returns:
        ``(problems, weights, decisions)``: every problem found (empty: the head can load), and the
        normalised head with its norm decisions (``headfile.normalised_head``), or ``(problems, None, {})``
        when the head cannot even be read.
    """
    problems = metadata_problems(location)
    if problems or not location.tensors:
        return problems, None, {}
    try:
        weights, decisions = normalised_head(location)
    except CheckpointError as e:  # the family could not put the head in the built layout (a tensor is missing)
        return [f"{', '.join(map(str, location.files))}: {e}"], None, {}
    return tensor_problems(location, weights), weights, decisions
