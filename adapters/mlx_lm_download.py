"""mlx-lm adapter, Hub downloads: ``utils._download`` wrapped so the head's files (``head_files``) come with the trunk's
on every rank (mlx-lm's ``allow_patterns`` skip sidecars; ``sharded_load`` gives a rank only its own layers' shards).
A local directory is never touched. Design: docs/distributed.md."""

from __future__ import annotations

import contextlib
import functools
import glob
import logging
from pathlib import Path

from mtp_plugin.confine import OutsideRoot, confined
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
    the Hub (not offline), fetch the head's missing files too; a failure is logged at debug level only (the loader
    then says what it found)."""

    @functools.wraps(download)
    def wrapper(path_or_hf_repo, revision=None, allow_patterns=None):
        path = download(path_or_hf_repo, revision=revision, allow_patterns=allow_patterns)
        if Path(path_or_hf_repo).exists() or offline():
            return path
        missing = [name for name in head_files(Path(path)) if _absent_inside(Path(path), name)]
        if missing:
            try:
                with _quiet_when_none_matches():  # sidecars the repository lacks are expected
                    download(path_or_hf_repo, revision=revision, allow_patterns=[glob.escape(n) for n in missing])
            except Exception as e:  # noqa: BLE001 - the trunk must still load; the loader reports a missing head
                log.debug("mtp_plugin: could not fetch %s of %s: %s", ", ".join(missing), path_or_hf_repo, e)
        return path

    return wrapper


def _absent_inside(snapshot: Path, name: str) -> bool:
    """Whether head file ``name`` is missing from ``snapshot``; False for a name outside it (``confine``: never
    fetched or looked at; the loader names it)."""
    try:
        return not confined(snapshot, name, "a head file", links=True).exists()
    except OutsideRoot:
        return False


@contextlib.contextmanager
def _quiet_when_none_matches():
    """Hide huggingface_hub's "No files matched allow_patterns" warning (``_snapshot_download`` logger)."""
    logger = logging.getLogger("huggingface_hub._snapshot_download")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
