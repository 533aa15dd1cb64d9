"""A head from the Hugging Face Hub without its trunk: ranged reads of the bytes its tensors hold, kept as a local
directory ``loading.checkpoint.find_head`` reads like the repository (config.json, index, each head file reduced to
its head tensors). Every request goes through huggingface_hub. Design: docs/commands.md#graft."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..confine import OutsideRoot, confined
from ..files import user_mode
from ..loading.checkpoint import INDEX, CheckpointError, find_head, head_files, head_tensors, read_config
from ..loading.safetensors_header import HeaderError, read_header
from ..loading.validation import stored_problems
from ..plugins import hook

log = logging.getLogger("mtp_plugin")

RETRIES = 5  # tries per byte range, each resuming where the last one stopped


class HubError(CheckpointError):
    """A repository that cannot serve a head; the message names the repository, the file and what to do."""


def is_repo_id(value: str | Path) -> bool:
    """True for ``OWNER/NAME`` (a valid Hub repo id) that cannot be meant as a path: it does not exist, does not
    start with ``.`` or ``~``, names no ``.safetensors`` file, and OWNER is no local directory."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    text = str(value)
    if (Path(text).exists() or text.count("/") != 1 or text.startswith((".", "~")) or text.endswith(".safetensors")
            or Path(text).parent.is_dir()):
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def heads_cache() -> Path:
    """Where fetched heads are kept: ``HF_HOME/mtp_plugin/heads`` (huggingface_hub's ``HF_HOME``)."""
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "mtp_plugin" / "heads"


@dataclass
class RemoteFile:
    """One repository file's head tensors: ``entries`` their header entries (``data_offsets`` relative to the data
    section), ordered by offset; ``data_start``: the data section's offset in the file (bytes)."""

    name: str
    entries: dict[str, dict]
    metadata: dict | None
    data_start: int

    @property
    def nbytes(self) -> int:
        return sum(e["data_offsets"][1] - e["data_offsets"][0] for e in self.entries.values())

    def runs(self) -> list[tuple[int, int]]:
        """The byte ranges ``[start, end)`` of the file that hold the head tensors, adjacent tensors merged."""
        runs: list[list[int]] = []
        for entry in self.entries.values():
            start, end = (self.data_start + o for o in entry["data_offsets"])
            if runs and runs[-1][1] == start:
                runs[-1][1] = end
            else:
                runs.append([start, end])
        return [(a, b) for a, b in runs]

    def local_header(self) -> bytes:
        """The reduced file's length prefix and JSON header (padded with spaces to 8 bytes, as safetensors writes)."""
        header, offset = {}, 0
        for name, entry in self.entries.items():
            size = entry["data_offsets"][1] - entry["data_offsets"][0]
            header[name] = {"dtype": entry["dtype"], "shape": entry["shape"], "data_offsets": [offset, offset + size]}
            offset += size
        if self.metadata is not None:
            header = {"__metadata__": self.metadata, **header}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        return struct.pack("<Q", len(text)) + text


def head_checkpoint(repo_id: str, revision: str | None = None, check_config=None) -> Path:
    """A local directory with the head of Hub repository ``repo_id`` at ``revision`` (default: main): config.json, the
    index and only the head tensors' bytes, kept under ``heads_cache()`` by repository and commit (a second call
    fetches nothing, offline too; a cut-off fetch resumes). Offline, a cached snapshot of the whole checkpoint serves.
    Everything the repository sends is hostile until checked: names stay in the cache (``confine``), headers are
    ``safetensors_header``'s, and a fetched head is published only once it reads (``validation.stored_problems``); a
    cached one that does not is discarded and fetched again, once, with one warning.
    ``check_config``: called with config.json (a dict) before any tensor byte is fetched; may raise. HubError: the
    repository, revision or a file cannot be fetched (offline and uncached included), no file holds head tensors, or
    what it sends breaks a rule above."""
    from filelock import FileLock
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.file_download import repo_folder_name
    from huggingface_hub.utils import validate_repo_id

    validate_repo_id(repo_id)  # HFValidationError (a ValueError): the cache folder is named after it
    if revision is not None:  # huggingface_hub keeps refs/REVISION in its cache
        confined(Path(constants.HF_HUB_CACHE), revision, "--revision")
    where = repo_id if revision is None else f"{repo_id} at revision {revision}"
    try:
        config_file = Path(hf_hub_download(repo_id, "config.json", revision=revision))
    except Exception as e:  # noqa: BLE001 - huggingface_hub raises many kinds; all mean the same here
        raise HubError(_unreachable(repo_id, revision, "config.json", e, first=True)) from e
    snapshot, commit = config_file.parent, config_file.parent.name
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        raise HubError(f"{where}: the Hub answered commit {commit!r}, not a commit hash; refused")
    config = read_config(snapshot)
    if check_config is not None:
        check_config(config)
    folder = heads_cache() / repo_folder_name(repo_id=repo_id, repo_type="model")
    if _cached(folder / commit, where):
        return folder / commit
    if constants.HF_HUB_OFFLINE:
        if find_head(snapshot, config).tensors:  # the whole checkpoint downloaded before
            return snapshot
        raise HubError(_unreachable(repo_id, revision, "the head's tensors",
                                    "HF_HUB_OFFLINE is set and they are not cached"))
    (folder / "incomplete").mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder / "incomplete" / f"{commit}.lock")):
        if _cached(folder / commit, where):  # another process fetched it meanwhile
            return folder / commit
        try:
            heads = _head_files(repo_id, commit, snapshot, config, where, folder / commit)
            parts = {r.name: _fetch(repo_id, commit, r, folder / "incomplete") for r in heads}
        except (HubError, OutsideRoot):
            raise
        except Exception as e:  # noqa: BLE001
            raise HubError(_unreachable(repo_id, revision, "the head", e)) from e
        return _publish(folder, commit, snapshot, parts, where)


def _cached(head: Path, where: str) -> bool:
    """Whether a fetched head is kept at ``head`` and reads; one that does not is removed, with one warning (a folder
    without config.json, the rest of a discard cut short, silently)."""
    if not (head / "config.json").is_file():
        shutil.rmtree(head, ignore_errors=True)
        return False
    try:
        problems = stored_problems(find_head(head))
    except CheckpointError as e:
        problems = [str(e)]
    if not problems:
        return True
    log.warning("mtp_plugin: %s: the cached head in %s does not read (%s); it is discarded and fetched again", where,
                head, problems[0])
    shutil.rmtree(head, ignore_errors=True)  # another process may be discarding it too
    return False


def _head_files(repo_id: str, commit: str, snapshot: Path, config: dict, where: str, root: Path
                ) -> list[RemoteFile]:
    """The repository's files holding head tensors, from their checked headers; HubError when none does, or a name
    (index, config, file list) would leave ``root``, where they are kept."""
    from huggingface_hub import HfApi, hf_hub_download

    sizes = {s.rfilename: s.size for s in HfApi().model_info(repo_id, revision=commit, files_metadata=True).siblings}
    listed = set()
    if INDEX in sizes:
        index = json.loads(Path(hf_hub_download(repo_id, INDEX, revision=commit)).read_text())
        listed = set((index.get("weight_map") or {}).values()) if isinstance(index, dict) else set()
    names = {f for f in head_files(snapshot) if f in sizes}
    names |= {f for f in sizes if f.endswith(".safetensors") and "/" not in f and f not in listed}
    for name in names:
        confined(root, name, f"{where}: a file its index, config or file list names")
    sidecars = {os.path.relpath(p, snapshot) for found in
                hook().mtp_sidecar_paths(model_dir=snapshot, config=config) for p in found}
    heads = [r for f in sorted(names) if (r := _remote_file(repo_id, commit, f, sizes[f], config, f in sidecars,
                                                            where)).entries]
    if not heads:
        read = ", ".join(sorted(names)) or "none: no safetensors file may hold them"
        raise HubError(f"{where}: no MTP head tensors in the files that may hold them ({read}); pick a donor that "
                       "carries the head (the original checkpoint, e.g. the model card's base_model)")
    return heads


def model_checkpoint(repo_id: str) -> Path:
    """Local directory of Hub model ``repo_id`` as the runtime downloads it (``mtp_download_model``); HubError when it
    cannot be downloaded (offline and uncached included) or no runtime is installed."""
    try:
        path = hook().mtp_download_model(repo_id=repo_id)
    except Exception as e:  # noqa: BLE001
        raise HubError(_unreachable(repo_id, None, "the model", e, first=True)) from e
    if path is None:
        raise HubError(f"{repo_id}: no installed runtime downloads models; install mlx-lm")
    return Path(path)


def _unreachable(repo_id: str, revision: str | None, what: str, reason, first: bool = False) -> str:
    """Why Hub repository ``repo_id`` cannot serve ``what``; ``first``: its first request, so the text (a mistyped
    relative path looks like ``OWNER/NAME``) was no local path either, which the message says first."""
    at = "" if revision is None else f" at revision {revision}"
    download = f"hf download {repo_id}" + ("" if revision is None else f" --revision {revision}")
    local = f"{repo_id}: no such directory ({Path(repo_id).absolute()}), and as a Hub repo id" if first else repo_id
    reason = " ".join(str(reason).split())  # one line: the Hub's messages span several
    return (f"{local}{at}: cannot fetch {what} ({reason}); check the {'path, or the ' * first}repo id, revision and "
            "network (or HF_TOKEN for a gated repo); offline, run once online or download the checkpoint "
            f"(`{download}`) and pass its directory")


def _remote_file(repo_id: str, commit: str, name: str, size: int | None, config: dict, sidecar: bool, where: str
                 ) -> RemoteFile:
    """The head tensors of ``name`` (``size`` bytes, as the file list says) from its header, read with two ranged
    requests and checked (``safetensors_header``); HubError naming the file when it breaks a rule."""
    if size is None:
        raise HubError(f"{where}: {name}: the Hub reports no size for it, so its header cannot be checked; download "
                       "the repository (`hf download`) and pass its directory")
    url = _url(repo_id, commit, name)
    try:
        header = read_header(lambda start, end: _read_range(url, start, end), size)
    except HeaderError as e:
        raise HubError(f"{where}: {name}: unreadable safetensors header ({e}); the repository's file is broken or "
                       "hostile: pick another donor") from None
    shapes = header.shapes()
    found = {t.name for t in head_tensors(Path(name), shapes, config, sidecar)}
    return RemoteFile(name, {n: e for n, e in header.entries.items() if n in found}, header.metadata,
                      header.data_start)


def _url(repo_id: str, commit: str, name: str) -> str:
    from huggingface_hub import hf_hub_url

    return hf_hub_url(repo_id, name, revision=commit)


def _read_range(url: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of ``url`` (``_stream``)."""
    data = bytearray()
    _stream(url, data.extend, start, end)
    return bytes(data)


def _fetch(repo_id: str, commit: str, remote: RemoteFile, incomplete: Path) -> Path:
    """Write ``remote``'s reduced file to ``incomplete/COMMIT--HASH.part`` (HASH: of its name, so that no two names
    share one), resuming; its path once complete."""
    from huggingface_hub.utils import tqdm

    incomplete.mkdir(parents=True, exist_ok=True)
    path = incomplete / f"{commit}--{hashlib.sha256(remote.name.encode()).hexdigest()[:32]}.part"
    header = remote.local_header()
    with open(path, "a+b") as f:
        f.seek(0)
        if f.read(len(header)) != header:
            f.truncate(0)
            f.write(header)
        f.seek(0, os.SEEK_END)
        done = f.tell() - len(header)
        url = _url(repo_id, commit, remote.name)
        with tqdm(total=remote.nbytes, initial=done, unit="B", unit_scale=True,
                  desc=f"{repo_id}: head in {remote.name}") as bar:
            for start, end in remote.runs():
                if done < end - start:
                    _stream(url, f.write, start + done, end, bar)
                done = max(done - (end - start), 0)
        got = f.tell() - len(header)
        if got != remote.nbytes:
            f.truncate(0)
            raise HubError(f"{repo_id}: fetched {got} bytes of the head in {remote.name}, expected {remote.nbytes}; "
                           "run the command again")
    return path


def _stream(url: str, write, start: int, end: int, bar=None) -> None:
    """Bytes ``[start, end)`` of ``url`` to ``write`` by ranged GETs, resumed on transport errors (``RETRIES`` tries).

    Raises:
        HubError: the server ignores the Range header, or the stream keeps breaking.
    """
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_stream_backoff

    for attempt in range(RETRIES):
        try:
            headers = {**build_hf_headers(), "Range": f"bytes={start}-{end - 1}"}
            with http_stream_backoff("GET", url, headers=headers, retry_on_exceptions=()) as response:
                hf_raise_for_status(response)
                if response.status_code != 206:
                    raise HubError(f"{url}: the server ignored a Range request (status {response.status_code}), "
                                   "so the head cannot be fetched alone from it; download the repository (`hf "
                                   "download OWNER/NAME`) and pass its directory")
                for chunk in response.iter_bytes():
                    write(chunk[: end - start])
                    start += len(chunk)
                    if bar is not None:
                        bar.update(len(chunk))
            if start >= end:
                return
        except Exception as e:
            if not _transient(e) or attempt == RETRIES - 1:
                raise
        time.sleep(min(2.0 ** attempt, 8.0))
    raise HubError(f"{url}: the stream ended {end - start} bytes early {RETRIES} times; run the command again to "
                   "resume")


def _transient(error: Exception) -> bool:
    """A network error to resume after: OSError, or the HTTP client's ``TransportError`` (matched by name, whichever
    client huggingface_hub uses); never an HTTP status."""
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(error, HfHubHTTPError):
        return False
    return isinstance(error, OSError) or any(c.__name__ == "TransportError" for c in type(error).__mro__)


def _publish(folder: Path, commit: str, snapshot: Path, parts: dict[str, Path], where: str) -> Path:
    """Move ``parts`` (name → ``.part``), config.json and the index into ``folder/commit`` (built, then renamed) once
    the head there reads (``validation.stored_problems``); else remove them and raise HubError."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{commit}.", dir=folder))
    try:
        for name in ("config.json", INDEX):
            if (snapshot / name).is_file():
                shutil.copyfile(snapshot / name, tmp / name)
        for name, part in parts.items():
            target = confined(tmp, name, f"{where}: a head file")
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(part, target)
        problems = stored_problems(find_head(tmp))
        if problems:
            raise HubError(f"{where}: the fetched head does not read ({problems[0].replace(f'{tmp}/', '')}); "
                           "nothing was kept: run the command again, or pick another donor if it fails the same way")
        os.chmod(tmp, user_mode(directory=True))
        os.rename(tmp, folder / commit)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (folder / commit / "config.json").is_file():  # else another process published it first
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for part in parts.values():
            part.unlink(missing_ok=True)
        raise
    return folder / commit
