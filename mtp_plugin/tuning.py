"""Where tuned draft depths are kept: a user cache keyed by model, machine and versions; optionally config.json.

A record says which depth decoded fastest on this machine (0: plain decoding, i.e. MTP parked). The
user cache is ``$XDG_CACHE_HOME/mtp_plugin/tuning.json`` (default ``~/.cache/mtp_plugin/tuning.json``),
one record per key; the key hashes

* the model: its resolved directory and a fingerprint of its files (weights: name, size, mtime;
  config.json: its content without our own ``mtp_tuned_depth`` entry, so ``--write`` keeps the key);
* the machine: platform, architecture, MLX's default device and its name;
* the versions of mlx, mlx-lm and mtp-plugin.

``mtp-plugin tune --write`` also stores the depth as ``mtp_tuned_depth`` in the model's config.json,
which travels with the model; the user cache, when it has a record, takes precedence.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
from importlib import metadata
from pathlib import Path

from .files import atomic_write, check_replaceable

CONFIG_KEY = "mtp_tuned_depth"


def cache_file() -> Path:
    """The user cache file (it may not exist yet)."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "mtp_plugin" / "tuning.json"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def machine() -> dict:
    """Platform, architecture, MLX default device and device name."""
    import mlx.core as mx

    info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
    return {"platform": platform.platform(), "arch": platform.machine(),
            "device": str(mx.default_device()), "device_name": str(info.get("device_name", "?"))}


def versions() -> dict:
    """Installed versions of mlx, mlx-lm and mtp-plugin."""
    return {name: _version(name) for name in ("mlx", "mlx-lm", "mtp-plugin")}


def fingerprint(model_dir: Path) -> str:
    """Hash of the model's weight files (names, sizes, mtimes) and config.json (without ``mtp_tuned_depth``)."""
    digest = hashlib.sha256()
    for path in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.safetensors.index.json")):
        st = path.stat()
        digest.update(f"{path.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    config = json.loads((model_dir / "config.json").read_text())
    config.pop(CONFIG_KEY, None)
    digest.update(json.dumps(config, sort_keys=True).encode())
    return digest.hexdigest()[:16]


def key(model_dir: Path) -> tuple[str, dict]:
    """(record key, what it identifies) for ``model_dir`` on this machine with these versions."""
    model_dir = Path(model_dir).resolve()
    identity = {"model": str(model_dir), "fingerprint": fingerprint(model_dir), "machine": machine(),
                "versions": versions()}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24], identity


def _records(path: Path) -> dict:
    """The records of the user cache file ``path``: {} when it is missing, unreadable or not of the expected shape
    (a damaged cache is ignored, and replaced by the next ``record``)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    records = data.get("records") if isinstance(data, dict) else None
    return records if isinstance(records, dict) else {}


def _write_json(path: Path, data: dict) -> None:
    """Write atomically (``files.atomic_write``): readers never see a partial file; the mode is kept."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2)))


def record(model_dir: Path, depth: int, results: dict, write_config: bool = False,
           draft_vocab: list[int] | None = None) -> Path:
    """Record the tuned ``depth`` (0: plain) for ``model_dir`` in the user cache, and in its config.json if asked.

    Args:
        model_dir: the model directory.
        depth: the recommended draft depth, 0..8 (0: plain decoding).
        results: measurements to keep with the record (JSON-serialisable).
        write_config: also set ``mtp_tuned_depth`` in ``model_dir/config.json`` (atomic replace).
        draft_vocab: the token ids of the tuned draft vocabulary (``draft_vocab.py``), None for the full one.

    Returns:
        The user cache file written.

    Raises:
        UsageError: ``write_config`` and config.json or its directory is read-only (nothing written).
        OSError: a file cannot be written.
    """
    model_dir = Path(model_dir)
    if write_config:
        config_path = model_dir / "config.json"
        check_replaceable(config_path)
        config = json.loads(config_path.read_text())
        config[CONFIG_KEY] = depth
        _write_json(config_path, config)
    record_key, identity = key(model_dir)
    path = cache_file()
    records = _records(path)
    records[record_key] = {
        **identity, "depth": depth, "draft_vocab": draft_vocab, "results": results,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    _write_json(path, {"records": records})
    return path


def recorded(model_dir: Path) -> dict | None:
    """The user cache's record for ``model_dir`` on this machine with these versions (``depth``, ``draft_vocab``,
    ``results``, …), or None. Never raises."""
    try:
        found = _records(cache_file()).get(key(model_dir)[0])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return found if isinstance(found, dict) else None


def recorded_depth(model_dir: Path) -> int | None:
    """The tuned depth for ``model_dir`` (0: plain): the user cache's record for this model, machine and
    versions, else config.json's ``mtp_tuned_depth``, else None. Never raises."""
    try:
        found = recorded(model_dir)
        if found is not None:
            return int(found["depth"])
        value = json.loads((Path(model_dir) / "config.json").read_text()).get(CONFIG_KEY)
        return None if value is None else int(value)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def start_depth(model_dir: Path, default: int, max_depth: int) -> int:
    """The adaptive controller's starting depth: the recorded one if valid (0..max_depth), else ``default``."""
    depth = recorded_depth(model_dir)
    return depth if depth is not None and 0 <= depth <= max_depth else default
