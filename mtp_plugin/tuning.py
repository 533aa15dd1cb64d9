"""Tuned draft depths (0: plain decoding, MTP parked): a user cache, ``$XDG_CACHE_HOME/mtp_plugin/tuning.json``,
keyed by model, machine and versions, and optionally ``mtp_tuned_depth`` in the model's config.json (the cache
wins). See docs/commands.md (tune)."""

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
    import mlx.core as mx

    info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
    return {"platform": platform.platform(), "arch": platform.machine(),
            "device": str(mx.default_device()), "device_name": str(info.get("device_name", "?"))}


def versions() -> dict:
    return {name: _version(name) for name in ("mlx", "mlx-lm", "mtp-plugin")}


def fingerprint(model_dir: Path) -> str:
    """Hash of the model's weight files (names, sizes, mtimes) and config.json without ``mtp_tuned_depth`` (so
    ``--write`` keeps the key)."""
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
    """The cache file's records; {} when it is missing, unreadable or malformed (the next ``record`` replaces it)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    records = data.get("records") if isinstance(data, dict) else None
    return records if isinstance(records, dict) else {}


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2)))


def record(model_dir: Path, depth: int, results: dict, write_config: bool = False,
           draft_vocab: list[int] | None = None) -> Path:
    """Record the tuned ``depth`` (0..8, 0: plain) for ``model_dir`` in the user cache, with ``results``
    (JSON-serialisable) and ``draft_vocab`` (token ids of ``head.draft_vocab``'s tuned vocabulary; None: full); with
    ``write_config``, also in its config.json (atomic replace). Returns the cache file. Raises ``UsageError`` when
    ``write_config`` and config.json or its directory is read-only (nothing written), OSError on a failed write."""
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
    """The cache's record for ``model_dir`` here (``depth``, ``draft_vocab``, ``results``, …) or None; never raises."""
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
