"""The commands' file handling: atomic writes with user modes, refusals (``UsageError``) of outputs that would touch
user data, and cleanup on SIGTERM/SIGHUP. Promises: docs/commands.md#what-the-commands-do-to-your-files.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from .usage import UsageError

TERMINATING = (signal.SIGTERM, signal.SIGHUP)


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived; ``signum`` says which. Raised through the work so that cleanups run."""

    def __init__(self, signum: int):
        super().__init__(f"terminated by {signal.Signals(signum).name}")
        self.signum = signum


def user_mode(directory: bool = False) -> int:
    """The mode a file (0666) or directory (0777) the user creates gets under the current umask."""
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if directory else 0o666) & ~umask


def atomic_write(path: Path, write: Callable[[Path], None], suffix: str = ".tmp") -> None:
    """Create or replace ``path`` atomically: ``write(tmp)`` fills a temporary ``.NAME.*`` beside it, which gets the
    replaced file's mode (else ``user_mode()``) and is renamed onto ``path`` (a hard link's other names are untouched).

    Raises:
        OSError: the directory is missing or not writable; whatever ``write`` raises (no file is left).
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else user_mode()
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _inside(path: Path, directory: Path) -> bool:
    return path.resolve().is_relative_to(directory.resolve())


def check_new_output(out: Path, inputs: Iterable[Path], force: bool = False, kind: str = "file") -> None:
    """Refuse an output that exists (unless ``force``, and never a directory), lies inside an input
    directory or is an input file, or whose parent directory is missing or read-only.

    Raises:
        UsageError: the reason and the fix.
    """
    out = Path(out)
    for source in map(Path, inputs):
        if source.is_dir() and _inside(out, source):
            raise UsageError(f"{out}: inside the input {source}; write the {kind} outside it (inputs are never "
                             "written)")
        if out.exists() and source.exists() and os.path.samefile(out, source):
            raise UsageError(f"{out}: is the input {source}; choose another output")
    if out.exists() and (out.is_dir() or kind == "directory"):
        raise UsageError(f"{out}: already exists; choose a new output {kind}")
    if out.exists() and not force:
        raise UsageError(f"{out}: already exists; choose a new output {kind} or pass --force to replace it")
    if out.exists():
        _check_writable(out)
    parent = out.absolute().parent
    if not parent.is_dir():
        raise UsageError(f"{parent}: no such directory; create it first or choose another output")
    _check_writable(parent)


def _check_writable(path: Path) -> None:
    """Refuse ``path`` unless writable both by ``os.access`` and by its mode (so root too keeps a read-only file)."""
    if not os.access(path, os.W_OK) or not path.stat().st_mode & stat.S_IWUSR:
        what = "directory" if path.is_dir() else "file"
        raise UsageError(f"{path}: read-only {what}; make it writable (chmod u+w) or work on a copy")


def check_replaceable(path: Path) -> None:
    """Refuse to replace existing file ``path`` (e.g. config.json) when it or its directory is read-only.

    Raises:
        UsageError: the file or directory that is read-only, and the fix.
    """
    path = Path(path)
    _check_writable(path)
    _check_writable(path.absolute().parent)


@contextlib.contextmanager
def terminating_cleanly():
    """While active (main thread only; elsewhere a no-op), SIGTERM and SIGHUP raise ``Terminated``, so that every
    ``except BaseException`` cleanup runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated(signum)

    previous = {s: signal.signal(s, handler) for s in TERMINATING}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)
