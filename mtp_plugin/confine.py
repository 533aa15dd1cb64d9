"""Names read from files (index entries, config keys, a Hub repository's listing) that become paths: each stays inside
its root or is refused. Rules and why links are allowed where they are: docs/checkpoints.md#names-that-become-paths."""

from __future__ import annotations

from pathlib import Path, PurePosixPath, PureWindowsPath


class OutsideRoot(ValueError):
    """A name that would leave its root; the message names where the name came from, the name and why."""


def confined(root: Path, name: str, entry: str, links: bool = False) -> Path:
    """``root / name`` for a relative ``name`` that stays inside ``root``: no absolute path or drive, no ``..`` part,
    no backslash or NUL, and no directory on the way resolving outside ``root``. ``links``: the file itself may be a
    symbolic link to anywhere (huggingface_hub's snapshots link each file to a blob; users link shards); else it must
    resolve inside ``root`` too. ``entry``: where ``name`` was read, for the message.

    Raises:
        OutsideRoot: the name leaves ``root`` (or is no non-empty string).
    """
    why = _lexical_problem(name)
    if why is None:
        path = Path(root) / name
        where = path.parent if links else path
        if not where.resolve().is_relative_to(Path(root).resolve()):
            why = "a symbolic link on the way leads out"
    if why is not None:
        raise OutsideRoot(f"{entry} = {name!r} names a path outside {root} ({why}); refused")
    return Path(root) / name


def relative_inside(root: Path, path: Path, entry: str, links: bool = False) -> Path:
    """``confined`` for a path already joined to ``root`` (as ``mtp_sidecar_paths`` returns them): the name is what
    follows ``root``, or the whole path when it does not start with ``root``."""
    text, prefix = str(path), str(root).rstrip("/") + "/"
    return confined(root, text[len(prefix):] if text.startswith(prefix) else text, entry, links)


def _lexical_problem(name) -> str | None:
    if not isinstance(name, str) or not PurePosixPath(name).parts or PurePosixPath(name).parts == (".",):
        return "not a file name"
    if "\0" in name or "\\" in name:
        return "a NUL or backslash in it"
    if PurePosixPath(name).is_absolute() or PureWindowsPath(name).anchor:
        return "an absolute path"
    if ".." in PurePosixPath(name).parts:
        return "a '..' part"
    return None
