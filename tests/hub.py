"""A Hugging Face Hub repository served from a local folder, for tests that have no network.

``snapshot_download`` stands in for ``huggingface_hub.snapshot_download`` where mlx-lm imported it
(``mlx_lm.utils.snapshot_download``): it copies the files of ``remote`` that ``allow_patterns`` selects, chosen by
huggingface_hub's own ``filter_repo_objects`` (the filter the real function applies), into one snapshot folder, and
returns that folder, as the real function returns the cached snapshot.
"""

from __future__ import annotations

import shutil
from pathlib import Path

REPO_ID = "mtp-plugin-tests/tiny"  # no local path has this name


def snapshot_download(remote: Path, snapshot: Path):
    """A ``snapshot_download(repo_id, revision=None, allow_patterns=None, **kwargs) -> str`` serving ``remote``
    (for ``REPO_ID`` only) into ``snapshot``; ``calls`` lists each call's patterns."""
    from huggingface_hub.utils import filter_repo_objects

    def download(repo_id, revision=None, allow_patterns=None, **kwargs):
        assert repo_id == REPO_ID, repo_id
        download.calls.append(allow_patterns)
        files = sorted(p.relative_to(remote).as_posix() for p in remote.rglob("*") if p.is_file())
        for name in filter_repo_objects(files, allow_patterns=allow_patterns):
            (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(remote / name, snapshot / name)
        return str(snapshot)

    download.calls = []
    snapshot.mkdir(parents=True, exist_ok=True)
    return download
