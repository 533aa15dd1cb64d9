"""Find a checkpoint's MTP head from safetensors headers: trunk shards (index-listed or not) and sidecars, in every
naming form; tensor data is read on demand (``mx.load`` is lazy). Also the built-in plugin that reads safetensors
files and names the sidecars every family shares. Design: docs/checkpoints.md."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from ..confine import OutsideRoot, confined, relative_inside
from ..head.conventions import ZERO_CENTRED
from ..hookspecs import hookimpl
from ..plugins import hook
from .safetensors_header import HeaderError, read_local_header

SIDECAR_NAMES = ("mtp.safetensors", "mtp/weights.safetensors", "model-mtp.safetensors")
CONFIG_KEYS = ("mtp_sidecar", "mtp_file", "mtp_weights")  # config.json keys naming a head file
INDEX = "model.safetensors.index.json"
JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
              type(None): "null"}


class CheckpointError(ValueError):
    """A model directory or head file that cannot be used as it is; the message names the file and the fix."""


@dataclass(frozen=True)
class HeadTensor:
    """One stored head tensor: ``canonical`` head-relative (``fc.weight``), ``name`` as stored in ``file``;
    ``shape`` and ``dtype`` (safetensors code: ``BF16``, ``U32`` …) from the file header."""

    canonical: str
    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: str

    @property
    def naming(self) -> str:
        """``mtp.*``, ``language_model.mtp.*`` … or ``bare``; an extra decoder layer as ``model.layers.61.*``."""
        prefix = self.name[: len(self.name) - len(self.canonical)] if self.name.endswith(self.canonical) else None
        if prefix is None or any(p.isdigit() for p in prefix.split(".")):
            parts = self.name.split(".")
            index = next((i for i, p in enumerate(parts) if p.isdigit()), len(parts) - 2)
            return ".".join(parts[: index + 1]) + ".*"
        return f"{prefix}*" if prefix else "bare"


@dataclass
class HeadLocation:
    """Where a model directory's head lives. ``unusable``: head files present or named but unreadable (the head
    cannot load); ``warnings``: what the search skipped without harm (an unusable index); one line each."""

    model_dir: Path
    config: dict
    tensors: dict[str, HeadTensor] = field(default_factory=dict)
    trunk_files: list[Path] = field(default_factory=list)
    metadata: dict = field(default_factory=dict)
    metadata_files: dict[str, Path] = field(default_factory=dict)
    unusable: list[str] = field(default_factory=list)
    copies: list[HeadTensor] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def claimed(self) -> set[tuple[Path, str]]:
        """Every ``(file, stored name)`` the head owns, equal copies included: none may reach the runtime's loading."""
        return {(t.file, t.name) for t in [*self.tensors.values(), *self.copies]}

    def display(self, path: Path) -> str:
        """``path`` relative to the model directory when inside it, else as given."""
        try:
            return str(Path(path).relative_to(self.model_dir))
        except ValueError:
            return str(path)

    def source(self, key: str) -> str:
        """Where metadata ``key`` is read from: config.json (which wins) or the head file that carries it."""
        if key in self.config or key in (self.config.get("text_config") or {}):
            return str(self.model_dir / "config.json")
        return str(self.metadata_files.get(key, "head metadata"))

    @property
    def model_type(self) -> str:
        """config.json ``model_type``."""
        return self.config.get("model_type", "")

    @property
    def declared_layers(self) -> int:
        """MTP layers config.json declares (``declared_key``), else 0; CheckpointError (naming config.json and the
        key) for a value that is not a non-negative integer."""
        key = self.declared_key
        if key is None:
            return 0
        value = next(cfg[key] for cfg in (self.config, self.config.get("text_config") or {}) if cfg.get(key))
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CheckpointError(f"{self.model_dir / 'config.json'}: {key}={value!r} is not a number of "
                                  "layers; set it to an integer (1 for a one-layer MTP head)")
        return value

    @property
    def declared_key(self) -> str | None:
        """The config.json key (top level or ``text_config``) declaring a non-zero number of MTP layers:
        ``mtp_num_hidden_layers`` (Qwen3.5) or ``num_nextn_predict_layers`` (DeepSeek-V3); None when neither."""
        return next((key for cfg in (self.config, self.config.get("text_config") or {})
                     for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers") if cfg.get(key)), None)

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
    """config.json of ``model_dir`` as a dict; CheckpointError (naming the file and the fix) when it is missing,
    unreadable or not JSON, or it or its ``text_config`` (when present: null is refused) is not an object."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no config.json; point at a model directory.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot be read ({e}); fix its permissions or restore it.") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e}); restore the file from its source.") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: {JSON_KINDS.get(type(config), 'not an object')}, not a JSON object; "
                              "restore the file from its source.")
    text = config.get("text_config", {})
    if not isinstance(text, dict):
        raise CheckpointError(f"{path}: \"text_config\" is {JSON_KINDS.get(type(text), 'not an object')}, not a JSON "
                              "object; restore the file from its source.")
    return config


def check_weight_files(model_dir: Path) -> None:
    """Read every ``.safetensors`` header of ``model_dir`` (top level and ``mtp/``); CheckpointError, naming the fix,
    for the first file that cannot be read or is cut short."""
    model_dir = Path(model_dir)
    for path in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("mtp/*.safetensors")):
        if path.is_file():
            mtp_read_tensor_names(path)


def read_index(model_dir: Path) -> tuple[dict | None, str | None]:
    """``(data, problem)`` for ``model.safetensors.index.json`` of ``model_dir``; never raises. ``data``: the index
    when it is an object whose ``weight_map`` (if any) is an object, else None; ``problem``: what is wrong (an unusable
    index, or the first ``weight_map`` entry that is not a file name) without the file's name, else None."""
    path = Path(model_dir) / INDEX
    if not path.exists():
        return None, None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        return None, f"cannot be read ({e})"
    except json.JSONDecodeError as e:
        return None, f"not valid JSON ({e})"
    if not isinstance(data, dict):
        return None, f"{JSON_KINDS.get(type(data), 'not an object')}, not a JSON object"
    weight_map = data.get("weight_map", {})
    if not isinstance(weight_map, dict):
        return None, f"its weight_map is {JSON_KINDS.get(type(weight_map), 'not an object')}, not a JSON object"
    bad = next(((k, v) for k, v in weight_map.items() if not isinstance(v, str)), None)
    if bad is not None:
        return data, f"weight_map[{bad[0]!r}] is {json.dumps(bad[1])}, not a file name"
    return data, None


def _candidate_files(model_dir: Path, config: dict, loc: HeadLocation) -> tuple[list[Path], list[Path]]:
    """(shards, existing sidecars); unreadable head files go to ``loc.unusable``, an unusable index to warnings."""
    shards = set(model_dir.glob("*.safetensors"))
    index, index_problem = read_index(model_dir)
    for key, name in (index or {}).get("weight_map", {}).items():
        if isinstance(name, str):
            try:
                shards.add(confined(model_dir, name, f"{model_dir / INDEX}: weight_map[{key!r}]", links=True))
            except OutsideRoot as e:
                loc.unusable.append(f"{e}: the head is not read through this index; repair or delete it")
    if index_problem is not None:
        kept = "its other entries are used" if index is not None else "it is ignored"
        loc.warnings.append(f"{model_dir / INDEX}: {index_problem}; {kept}, and the head is looked for by file name "
                            "(mlx-lm never reads the index); repair the index or delete it")
    sidecars = []
    named = {model_dir / v for cfg in (config, config.get("text_config") or {}) for k, v in cfg.items()
             if k in CONFIG_KEYS and isinstance(v, str)}
    for paths in hook().mtp_sidecar_paths(model_dir=model_dir, config=config):
        for path in map(Path, paths):
            try:
                relative_inside(model_dir, path, f"{model_dir / 'config.json'}: {'/'.join(CONFIG_KEYS)}"
                                if path in named else "a head file a plugin's mtp_sidecar_paths names", links=True)
            except OutsideRoot as e:
                loc.unusable.append(f"{e}: name a file inside the model directory (link a head kept elsewhere "
                                    "into it)")
                continue
            problem = unreadable_file(path, named=path in named)
            if problem is None:
                sidecars.append(path)
            elif problem:
                loc.unusable.append(f"{path}: {problem}")
    shards = {p for p in shards if p.is_file()} - set(sidecars)
    return sorted(shards), sorted(set(sidecars))


def head_files(model_dir: Path) -> list[str]:
    """Names, relative to ``model_dir``, of files that may hold the head: the families' sidecar paths (existing or
    not) and the shards the index maps head tensors to, as named (``confine.confined`` them before use). Empty for an
    unhandled model type or unreadable config.json."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
        index = json.loads((model_dir / INDEX).read_text()) if (model_dir / INDEX).exists() else {}
        paths = [p for found in hook().mtp_sidecar_paths(model_dir=model_dir, config=config) for p in found]
        names = {os.path.relpath(p, model_dir) for p in paths}
        model_type = config.get("model_type", "")
        for name, file in (index.get("weight_map") or {}).items():
            if hook().mtp_head_name(name=name, model_type=model_type, sidecar=False, config=config) is not None:
                names.add(file)
    except (OSError, ValueError, AttributeError, TypeError):  # not a checkpoint the families can read
        return []
    return sorted(names)


def unreadable_file(path: Path, named: bool = False) -> str | None:
    """Why the head file ``path`` cannot be read; ``""`` when absent and not ``named`` by config.json; None when
    readable."""
    if path.is_file():
        if not os.access(path, os.R_OK):
            return "not readable (permission denied); fix its permissions (chmod a+r)"
        return None
    if path.is_dir():
        return "a directory, not a weights file; point at the head's .safetensors file"
    if path.is_symlink() and not path.exists():
        return (f"a dangling symbolic link to {os.readlink(path)}; the target is missing: restore it or "
                "point the link at the head file")
    if path.exists():
        return "not a regular file; point at the head's .safetensors file"
    return "named in config.json but absent; restore the head file or fix the name" if named else ""


def find_head(model_dir: Path, config: dict | None = None) -> HeadLocation:
    """Locate every head tensor of ``model_dir`` from file headers. Any file whose every tensor has a bare head name
    is a sidecar; a tensor stored twice is kept once when the copies are equal (only then is tensor data read).

    Raises:
        CheckpointError: bad config.json, an unreadable weights file, or two differing copies of a head tensor.
    """
    model_dir = Path(model_dir)
    config = read_config(model_dir) if config is None else config
    loc = HeadLocation(model_dir=model_dir, config=config)
    shards, sidecars = _candidate_files(model_dir, config, loc)
    for path in shards + sidecars:
        header = hook().mtp_read_tensor_names(path=path)
        if header is None:
            continue
        names, metadata = header
        found = head_tensors(path, names, config, sidecar=path in sidecars)
        if not found:
            loc.trunk_files.append(path)
            continue
        if len(found) < len(names):
            loc.trunk_files.append(path)
        for t in found:
            if t.canonical in loc.tensors:
                _check_same(loc.tensors[t.canonical], t)
                loc.copies.append(t)
                continue
            loc.tensors[t.canonical] = t
        loc.metadata.update(metadata or {})
        loc.metadata_files.update(dict.fromkeys(metadata or {}, path))
    return loc


def head_tensors(path: Path, names: dict, config: dict, sidecar: bool) -> list[HeadTensor]:
    """Head tensors among ``names`` (``{name: (shape, dtype)}``, the header of ``path``): a sidecar's under sidecar
    names; a shard's under trunk names, else under sidecar names when every tensor of the file is one."""
    found = _head_tensors(path, names, config, sidecar)
    if not found and not sidecar:
        found = _head_tensors(path, names, config, sidecar=True)
        if len(found) != len(names):
            found = []
    return found


def _head_tensors(path: Path, names: dict, config: dict, sidecar: bool) -> list[HeadTensor]:
    out = []
    for name, (shape, dtype) in names.items():
        canonical = hook().mtp_head_name(name=name, model_type=config.get("model_type"), sidecar=sidecar,
                                         config=config)
        if canonical is not None:
            out.append(HeadTensor(canonical, name, path, tuple(shape), dtype))
    return out


def _check_same(first: HeadTensor, second: HeadTensor) -> None:
    """Raise CheckpointError, naming both, unless a second copy of a head tensor equals the first."""
    same = first.shape == second.shape and first.dtype == second.dtype
    if same:
        a = hook().mtp_load_sidecar(path=first.file, names=[first.name])
        b = hook().mtp_load_sidecar(path=second.file, names=[second.name])
        same = a is not None and b is not None and mx.array_equal(a[first.name], b[second.name]).item()
    if not same:
        raise CheckpointError(
            f"head tensor {first.canonical!r} is stored twice with different values: {first.name} in "
            f"{first.file} and {second.name} in {second.file}; remove the copy you do not trust."
        )


def load_tensors(tensors: list[HeadTensor]) -> dict:
    """``{canonical: mx.array}`` of ``tensors`` in stored dtypes, read through the hooks; CheckpointError for a file
    no plugin reads or a tensor missing from its file."""
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
        head = {name for file, name in location.claimed() if file == path}
        out.update({(path, n): v for n, v in names.items() if n not in head})
    return out




def file_conventions(location: HeadLocation) -> dict[Path, tuple[str, str]]:
    """``{file: (convention, evidence)}`` each head file's own evidence gives its head norms: a file with trunk
    tensors shares its trunk's convention (negative trunk norms: zero-centred, else ``mtp_stored_norm_convention`` of
    the layout), a head-only PyTorch file (``format: pt``) the original's. Files without evidence are absent."""
    headers = trunk_headers(location)
    out = {}
    for path in location.files:
        if path in location.trunk_files:
            norms = [n for (f, n), (shape, _) in headers.items()
                     if f == path and len(shape) == 1 and n.endswith("norm.weight") and ".linear_attn." not in n]
            arrays = hook().mtp_load_sidecar(path=path, names=norms) if norms else {}
            negative = [n for n in norms if bool(mx.any(arrays[n] < 0).item())]
            if negative:
                out[path] = (ZERO_CENTRED, f"stored with the trunk, whose norms in {path.name} are zero-centred "
                                           f"(negative entries in {negative[0]})")
                continue
            shapes = {n: tuple(shape) for (f, n), (shape, _) in headers.items() if f == path}
            stored = hook().mtp_stored_norm_convention(config=location.config, shapes=shapes, pytorch=False)
            if stored is not None:
                out[path] = (stored[0], f"stored with the trunk in {path.name}, {stored[1]}: {stored[0]} like its "
                                        "trunk")
            continue
        _, metadata = hook().mtp_read_tensor_names(path=path) or ({}, {})
        if (metadata or {}).get("format") == "pt":
            stored = hook().mtp_stored_norm_convention(config=location.config, shapes={}, pytorch=True)
            if stored is not None:
                out[path] = (stored[0], f"{path.name} was written by PyTorch (format 'pt'), as {stored[1]} stores "
                                        f"it: {stored[0]}")
    return out


@hookimpl
def mtp_sidecar_paths(model_dir, config):
    """For a handled model type: the sidecars runtimes write (``SIDECAR_NAMES``, ``commands.graft.LAYOUTS``) and a
    file config.json (or its ``text_config``) names under ``CONFIG_KEYS``."""
    if config.get("model_type") not in sum(hook().mtp_model_types(), []):
        return []
    paths = [model_dir / n for n in SIDECAR_NAMES]
    for cfg in (config, config.get("text_config") or {}):
        paths += [model_dir / cfg[k] for k in CONFIG_KEYS if isinstance(cfg.get(k), str)]
    return paths


@hookimpl
def mtp_read_tensor_names(path):
    """Header of a ``.safetensors`` file as ``({name: (shape, dtype)}, metadata)``, checked by
    ``safetensors_header.read_header``; None for other formats."""
    path = Path(path)
    if path.suffix != ".safetensors":
        return None
    try:
        header = read_local_header(path)
    except PermissionError:
        raise CheckpointError(f"{path}: not readable (permission denied); fix its permissions (chmod a+r).") from None
    except (OSError, HeaderError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors header ({e}); re-download or re-export it.") from None
    return header.shapes(), dict(header.metadata or {})


@hookimpl
def mtp_load_sidecar(path, names):
    """Tensors ``names`` of a ``.safetensors`` file as ``{name: mx.array}``; None for other formats."""
    path = Path(path)
    if path.suffix != ".safetensors":
        return None
    try:
        arrays = mx.load(str(path))
    except (RuntimeError, ValueError) as e:  # mlx's own reader refused what the header check let through
        raise CheckpointError(f"{path}: mlx cannot read it ({e}); re-download or re-export it.") from None
    missing = [n for n in names if n not in arrays]
    if missing:
        raise CheckpointError(f"{path}: tensor {missing[0]!r} listed but absent; the file is truncated.")
    return {n: arrays[n] for n in names}
