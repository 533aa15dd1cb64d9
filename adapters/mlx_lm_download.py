"""mlx-lm adapter, files from the Hugging Face Hub: the head's files are fetched with the trunk's.

mlx-lm's ``utils._download`` fetches a repository's files through an ``allow_patterns`` filter: by default
``model*.safetensors`` and the small files, so a sidecar head (``mtp.safetensors``, ``mtp/weights.safetensors``) never
arrives; and ``sharded_load`` (``mlx.launch``) gives a pipeline rank only the shards of its own layers, so a shard that
holds head tensors reaches only the rank whose layers it also holds. ``_download`` is wrapped: after a fetch from the
Hub, the files that may hold the head (``head_files``) and are not there yet are fetched with the same function, so
every rank holds the head whatever layers it runs. A local directory is never touched.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path

from mtp_plugin.loading.checkpoint import head_files

log = logging.getLogger("mtp_plugin")


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
                with _quiet_when_none_matches():  # sidecars the repository lacks are expected
                    download(path_or_hf_repo, revision=revision, allow_patterns=missing)
            except Exception as e:  # noqa: BLE001 - the trunk must still load; the loader reports a missing head
                log.debug("mtp_plugin: could not fetch %s of %s: %s", ", ".join(missing), path_or_hf_repo, e)
        return path

    return wrapper


@contextlib.contextmanager
def _quiet_when_none_matches():
    """Hide huggingface_hub's "No files matched allow_patterns" warning (its ``_snapshot_download`` logger) while
    the head's possible files are fetched."""
    logger = logging.getLogger("huggingface_hub._snapshot_download")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
