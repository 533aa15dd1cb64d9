"""Find a checkpoint's MTP head: trunk shards (index-listed or not) and sidecars, in every naming form.

Only safetensors headers are read here; tensor data is read on demand, one tensor at a time
(``mx.load`` is lazy: arrays that are never evaluated are never read from disk).
This module is also the built-in plugin for reading safetensors files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from .hookspecs import hookimpl
from .plugins import hook


class CheckpointError(ValueError):
    """A model directory or head file that cannot be used as it is; the message names the file and the fix."""


@dataclass(frozen=True)
class HeadTensor:
    """One stored head tensor.

    ``canonical`` is head-relative (``fc.weight``), ``name`` as stored in ``file``; ``shape`` and
    ``dtype`` (safetensors code: ``BF16``, ``F32``, ``U32`` …) come from the file header.
    """

    canonical: str
    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: str

    @property
    def naming(self) -> str:
        """The naming form: ``mtp.*``, ``language_model.mtp.*``, ``model.mtp.*`` … or ``bare``."""
        prefix = self.name[: len(self.name) - len(self.canonical)]
        return f"{prefix}*" if prefix else "bare"


@dataclass
class HeadLocation:
    """Where a model directory's head lives: its tensors by canonical name, files and declared size."""

    model_dir: Path
    config: dict
    tensors: dict[str, HeadTensor] = field(default_factory=dict)
    trunk_files: list[Path] = field(default_factory=list)
    metadata: dict = field(default_factory=dict)

    @property
    def model_type(self) -> str:
        """config.json ``model_type``."""
        return self.config.get("model_type", "")

    @property
    def declared_layers(self) -> int:
        """``mtp_num_hidden_layers`` as config.json declares it (top level or ``text_config``), else 0."""
        for cfg in (self.config, self.config.get("text_config") or {}):
            for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
                if cfg.get(key):
                    return int(cfg[key])
        return 0

    @property
    def files(self) -> list[Path]:
        """Files that hold head tensors, sorted."""
        return sorted({t.file for t in self.tensors.values()})

    @property
    def naming(self) -> list[str]:
        """Naming forms seen, sorted."""
        return sorted({t.naming for t in self.tensors.values()})

    @property
    def present_layers(self) -> int:
        """Number of distinct ``layers.N`` decoder layers present in the head."""
        return len({c.split(".")[1] for c in self.tensors if c.startswith("layers.")})


def read_config(model_dir: Path) -> dict:
    """config.json of ``model_dir`` as a dict.

    Raises:
        CheckpointError: if config.json is missing or not valid JSON.
    """
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no config.json; point at a model directory.") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e}); restore the file from its source.") from None


def _candidate_files(model_dir: Path, config: dict) -> tuple[list[Path], list[Path]]:
    """(files that may mix trunk and head tensors, named sidecar files that exist)."""
    shards = set(model_dir.glob("*.safetensors"))
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards |= {model_dir / f for f in json.loads(index.read_text()).get("weight_map", {}).values()}
    sidecars = []
    for paths in hook().mtp_sidecar_paths(model_dir=model_dir, config=config):
        sidecars += [Path(p) for p in paths if Path(p).is_file()]
    shards = {p for p in shards if p.is_file()} - set(sidecars)
    return sorted(shards), sorted(set(sidecars))


def find_head(model_dir: Path, config: dict | None = None) -> HeadLocation:
    """Locate every head tensor of ``model_dir`` from file headers alone.

    A file named by a sidecar hook may use bare names (``fc.weight``); any other file whose every
    tensor is a bare head name is taken as a sidecar too.

    Raises:
        CheckpointError: bad config.json, an unreadable weights file, or one head tensor stored twice.
    """
    model_dir = Path(model_dir)
    config = read_config(model_dir) if config is None else config
    loc = HeadLocation(model_dir=model_dir, config=config)
    shards, sidecars = _candidate_files(model_dir, config)
    model_type = loc.model_type
    for path in shards + sidecars:
        header = hook().mtp_read_tensor_names(path=path)
        if header is None:
            continue
        names, metadata = header
        found = _head_tensors(path, names, model_type, sidecar=path in sidecars)
        if not found and path not in sidecars:
            found = _head_tensors(path, names, model_type, sidecar=True)
            if len(found) != len(names):
                found = {}
        if not found:
            loc.trunk_files.append(path)
            continue
        if len(found) < len(names):
            loc.trunk_files.append(path)
        for t in found.values():
            if t.canonical in loc.tensors:
                other = loc.tensors[t.canonical]
                raise CheckpointError(
                    f"head tensor {t.canonical!r} is stored twice: {other.name} in {other.file} and "
                    f"{t.name} in {t.file}; remove one copy (keep the sidecar you trust)."
                )
            loc.tensors[t.canonical] = t
        loc.metadata.update(metadata or {})
    return loc


def _head_tensors(path: Path, names: dict, model_type: str, sidecar: bool) -> dict[str, HeadTensor]:
    out = {}
    for name, (shape, dtype) in names.items():
        canonical = hook().mtp_head_name(name=name, model_type=model_type, sidecar=sidecar)
        if canonical is not None:
            out[canonical] = HeadTensor(canonical, name, path, tuple(shape), dtype)
    return out


def load_tensors(tensors: list[HeadTensor]) -> dict:
    """The data of ``tensors`` as ``{canonical: mx.array}`` in their stored dtypes, read through the hooks.

    Raises:
        CheckpointError: a file no plugin can read, or a tensor missing from its file.
    """
    by_file: dict[Path, list[HeadTensor]] = {}
    for t in tensors:
        by_file.setdefault(t.file, []).append(t)
    out = {}
    for path, group in by_file.items():
        arrays = hook().mtp_load_sidecar(path=path, names=[t.name for t in group])
        if arrays is None:
            raise CheckpointError(f"{path}: no plugin reads this file format; convert it to safetensors.")
        for t in group:
            out[t.canonical] = arrays[t.name]
    return out


def trunk_headers(location: HeadLocation) -> dict[tuple[Path, str], tuple]:
    """Headers of the trunk tensors: ``{(file, name): (shape, dtype)}`` (head tensors excluded)."""
    out = {}
    for path in location.trunk_files:
        names, _ = hook().mtp_read_tensor_names(path=path) or ({}, {})
        head = {t.name for t in location.tensors.values() if t.file == path}
        out.update({(path, n): v for n, v in names.items() if n not in head})
    return out


def trunk_norms(location: HeadLocation, headers: dict) -> dict[str, np.ndarray]:
    """Trunk RMSNorm weights in the absolute convention (an unconverted HF trunk is zero-centred)."""
    hf_layout = any("conv1d.weight" in n and shape[-1] != 1 for (_, n), (shape, _) in headers.items())
    by_file: dict[Path, list[str]] = {}
    for (path, name), (shape, _) in headers.items():
        if len(shape) == 1 and name.endswith("norm.weight") and ".linear_attn." not in name:
            by_file.setdefault(path, []).append(name)
    out = {}
    for path, names in by_file.items():
        arrays = hook().mtp_load_sidecar(path=path, names=names)
        for name in names:
            out[name] = np.array(arrays[name].astype(mx.float32)) + (1.0 if hf_layout else 0.0)
    return out


@hookimpl
def mtp_read_tensor_names(path):
    """Header of a ``.safetensors`` file as ``({name: (shape, dtype)}, metadata)``; None for other formats."""
    from safetensors import safe_open

    path = Path(path)
    if path.suffix != ".safetensors":
        return None
    try:
        with safe_open(str(path), framework="numpy") as f:
            names = {}
            for name in f.keys():
                s = f.get_slice(name)
                names[name] = (tuple(s.get_shape()), s.get_dtype())
            return names, dict(f.metadata() or {})
    except Exception as e:  # safetensors raises its own SafetensorError and OSError
        raise CheckpointError(f"{path}: unreadable safetensors header ({e}); re-download or re-export it.") from e


@hookimpl
def mtp_load_sidecar(path, names):
    """Tensors ``names`` of a ``.safetensors`` file as ``{name: mx.array}``; None for other formats."""
    path = Path(path)
    if path.suffix != ".safetensors":
        return None
    arrays = mx.load(str(path))
    missing = [n for n in names if n not in arrays]
    if missing:
        raise CheckpointError(f"{path}: tensor {missing[0]!r} listed but absent; the file is truncated.")
    return {n: arrays[n] for n in names}
