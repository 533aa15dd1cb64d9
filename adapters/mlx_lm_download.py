"""mlx-lm adapter, files from the Hugging Face Hub: the head's files are fetched with the trunk's.

mlx-lm's ``utils._download`` fetches a repository's files through an ``allow_patterns`` filter: by default
``model*.safetensors`` and the small files, so a sidecar head (``mtp.safetensors``, ``mtp/weights.safetensors``) never
arrives; and ``sharded_load`` (``mlx.launch``) gives a pipeline rank only the shards of its own layers, so a shard that
holds head tensors reaches only the rank whose layers it also holds. ``_download`` is wrapped: after a fetch from the
Hub, the files that may hold the head (``head_files``) and are not there yet are fetched with the same function, so
every rank holds the head whatever layers it runs. A local directory is never touched.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

from mtp_plugin.plugins import hook

log = logging.getLogger("mtp_plugin")
INDEX = "model.safetensors.index.json"


def head_files(model_dir: Path) -> list[str]:
    """Names, relative to ``model_dir``, of the files that may hold the head of the checkpoint whose config.json (and
    index, if any) are in ``model_dir``: the sidecar paths the families name (``mtp_sidecar_paths``), whether they
    exist or not, and the shards the index maps head tensors to (``mtp_head_name``). Empty for a model type no family
    handles, or when config.json is missing or unreadable."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
        index = json.loads((model_dir / INDEX).read_text()) if (model_dir / INDEX).exists() else {}
        paths = [p for found in hook().mtp_sidecar_paths(model_dir=model_dir, config=config) for p in found]
        names = {p.relative_to(model_dir).as_posix() for p in paths if p.is_relative_to(model_dir)}
        model_type = config.get("model_type", "")
        for name, file in (index.get("weight_map") or {}).items():
            if hook().mtp_head_name(name=name, model_type=model_type, sidecar=False, config=config) is not None:
                names.add(file)
    except (OSError, ValueError, AttributeError, TypeError):  # not a checkpoint the families can read
        return []
    return sorted(names)


def offline() -> bool:
    """Whether huggingface_hub is told not to reach the Hub (``HF_HUB_OFFLINE``): only cached files then."""
    try:
        from huggingface_hub import constants
    except ImportError:
        return True
    return bool(constants.HF_HUB_OFFLINE)


def fetch_head_files(download):
    """Wrap mlx-lm's ``_download(path_or_hf_repo, revision=None, allow_patterns=None) -> Path``: after a fetch from
    the Hub, fetch the head's missing files (``head_files``) too; nothing more when huggingface_hub is offline.
    Sidecar names that the repository does not have match nothing (one more listing of the repository); a failure to
    fetch is logged at debug level only, and the loader then says what it found."""

    @functools.wraps(download)
    def wrapper(path_or_hf_repo, revision=None, allow_patterns=None):
        path = download(path_or_hf_repo, revision=revision, allow_patterns=allow_patterns)
        if Path(path_or_hf_repo).exists() or offline():
            return path
        missing = [name for name in head_files(Path(path)) if not (Path(path) / name).exists()]
        if missing:
            try:
                download(path_or_hf_repo, revision=revision, allow_patterns=missing)
            except Exception as e:  # noqa: BLE001 - the trunk must still load; the loader reports a missing head
                log.debug("mtp_plugin: could not fetch %s of %s: %s", ", ".join(missing), path_or_hf_repo, e)
        return path

    return wrapper
