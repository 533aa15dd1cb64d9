"""No command loses or touches user data (each case on a copy of the bundled checkpoints).

extract and graft refuse outputs over or inside their inputs, existing outputs (extract: unless --force) and
missing or read-only output directories, with exit 2 and nothing written; verify/tune --write refuse a
read-only config.json or model directory before any work and otherwise keep the file's mode; new files get
the modes of the user's own files; SIGINT/SIGTERM/SIGHUP leave no temporary file or directory.
"""

import hashlib
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from mtp_plugin import tuning
from mtp_plugin.commands.cli import main
from mtp_plugin.files import user_mode

ROOT = Path(__file__).resolve().parents[1] / "examples" / "tiny-qwen3_5"
HF, MLX4 = ROOT / "hf", ROOT / "mlx-4bit"


def snapshot(*roots: Path) -> dict:
    """Every path under ``roots`` with its mode and content hash (directories: mode only)."""
    state = {}
    for root in roots:
        for path in [root, *sorted(root.rglob("*"))]:
            st = path.stat()
            digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
            state[path] = (stat.S_IMODE(st.st_mode), digest)
    return state


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def hf(tmp_path):
    """A copy of the Hugging Face original (it carries the head)."""
    return Path(shutil.copytree(HF, tmp_path / "hf"))


@pytest.fixture
def recipient(tmp_path):
    """A copy of the 4-bit conversion without its head."""
    return Path(shutil.copytree(MLX4, tmp_path / "recipient", ignore=shutil.ignore_patterns("mtp.safetensors")))


@pytest.fixture
def umask():
    """Run with umask 027 (so that modes differ from mkstemp's 0600 and from 0644), restored afterwards."""
    old = os.umask(0o027)
    yield 0o027
    os.umask(old)


@pytest.mark.parametrize("out", ["model.safetensors", "config.json", "head.safetensors", "sub/head.safetensors"])
@pytest.mark.parametrize("force", [False, True])
def test_extract_never_writes_into_its_input(hf, capsys, out, force):
    (hf / "sub").mkdir()
    before = snapshot(hf)
    assert main(["extract", "--hf", str(hf), "--out", str(hf / out), *(["--force"] if force else [])]) == 2
    assert "inside the input" in capsys.readouterr().err
    assert snapshot(hf) == before


def test_extract_refuses_existing_output_unless_forced(hf, tmp_path, capsys, umask):
    out = tmp_path / "head.safetensors"
    out.write_bytes(b"user data")
    out.chmod(0o604)
    assert main(["extract", "--hf", str(hf), "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err and out.read_bytes() == b"user data"
    assert main(["extract", "--hf", str(hf), "--out", str(out), "--force"]) == 0
    assert out.read_bytes() != b"user data" and mode(out) == 0o604  # replaced, the file's mode kept
    out.chmod(0o444)
    assert main(["extract", "--hf", str(hf), "--out", str(out), "--force"]) == 2
    assert "read-only" in capsys.readouterr().err


def test_extract_new_file_mode_and_missing_directory(hf, tmp_path, capsys, umask):
    out = tmp_path / "head.safetensors"
    assert main(["extract", "--hf", str(hf), "--out", str(out)]) == 0
    assert mode(out) == 0o666 & ~umask
    assert main(["extract", "--hf", str(hf), "--out", str(tmp_path / "missing" / "head.safetensors")]) == 2
    assert "no such directory" in capsys.readouterr().err and not (tmp_path / "missing").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("where", ["inside-recipient", "inside-donor", "missing-parent", "existing", "read-only"])
def test_graft_refuses_outputs_that_touch_user_data(recipient, hf, tmp_path, capsys, where):
    out = {"inside-recipient": recipient / "grafted", "inside-donor": hf / "grafted",
           "missing-parent": tmp_path / "missing" / "grafted", "existing": tmp_path / "existing",
           "read-only": tmp_path / "locked" / "grafted"}[where]
    if where == "existing":
        out.mkdir()
    if where == "read-only":
        out.parent.mkdir()
        out.parent.chmod(0o555)
    before = snapshot(recipient, hf)
    listing = sorted(tmp_path.rglob("*"))
    assert main(["graft", "--recipient", str(recipient), "--donor", str(hf), "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith("mtp-plugin: ")
    assert snapshot(recipient, hf) == before and sorted(tmp_path.rglob("*")) == listing


def test_graft_output_has_the_users_modes(recipient, tmp_path, umask):
    out = tmp_path / "grafted"
    assert main(["graft", "--recipient", str(recipient), "--donor", str(HF), "--out", str(out)]) == 0
    assert mode(out) == 0o777 & ~umask and mode(out / "mtp.safetensors") == 0o666 & ~umask


def test_graft_across_filesystems_says_it_copied(tmp_path, capsys):
    """A recipient on another filesystem (tmpfs /dev/shm) cannot be hard-linked: its files are copied, and the
    summary says so."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev or not os.access(shm, os.W_OK):
        pytest.skip("no second filesystem to graft across")
    elsewhere = Path(tempfile.mkdtemp(dir=shm))
    try:
        recipient = elsewhere / "recipient"
        shutil.copytree(MLX4, recipient, ignore=shutil.ignore_patterns("mtp.safetensors"))
        before = snapshot(recipient)
        out = tmp_path / "grafted"
        assert main(["graft", "--recipient", str(recipient), "--donor", str(HF), "--out", str(out)]) == 0
        said = capsys.readouterr().out
        assert "recipient files copied" in said and "hard-linked" not in said, said
        assert all(p.stat().st_nlink == 1 for p in out.rglob("*") if p.is_file())
        assert snapshot(recipient) == before
    finally:
        shutil.rmtree(elsewhere)


SIGNALLED = """
import os, signal, sys
from mtp_plugin.commands.cli import main

signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a background job inherits it ignored)
replace = os.replace

def signal_then_replace(*args):  # the signal arrives just before a finished temporary file is renamed
    os.kill(os.getpid(), signal.{name})
    replace(*args)

os.replace = signal_then_replace
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command,signum", [("graft", signal.SIGTERM), ("graft", signal.SIGHUP),
                                            ("graft", signal.SIGINT), ("extract", signal.SIGTERM)],
                         ids=lambda x: getattr(x, "name", x))
def test_signals_leave_no_temporary_files(recipient, tmp_path, command, signum):
    """graft: the output directory is half built (recipient linked, head file written, not yet renamed)."""
    out = tmp_path / "out" / ("grafted" if command == "graft" else "head.safetensors")
    out.parent.mkdir()
    before = snapshot(recipient, HF)
    args = (["graft", "--recipient", recipient, "--donor", HF] if command == "graft" else ["extract", "--hf", HF])
    done = subprocess.run([sys.executable, "-c", SIGNALLED.format(name=signum.name), *args, "--out", out],
                          capture_output=True, text=True, timeout=300, cwd=tempfile.gettempdir())
    # ended by the signal as it would end without the plugin's handler (Ctrl-C: exit 130)
    assert done.returncode == (130 if signum == signal.SIGINT else -signum), done.stderr[-3000:]
    assert list(out.parent.iterdir()) == [] and snapshot(recipient, HF) == before


@pytest.mark.parametrize("command", ["verify", "tune"])
@pytest.mark.parametrize("locked", ["config.json", "directory"])
def test_write_refuses_read_only_targets_before_any_work(tmp_path, capsys, command, locked):
    model = Path(shutil.copytree(MLX4, tmp_path / "model"))
    target = model / "config.json" if locked == "config.json" else model
    target.chmod(0o444 if locked == "config.json" else 0o555)
    before = snapshot(model)
    try:
        assert main([command, str(model), "--write"]) == 2
        err = capsys.readouterr().err
        assert "read-only" in err and str(target) in err
        assert "warm-up" not in err and "trunk passes" not in err  # refused before measuring
        assert snapshot(model) == before
    finally:
        model.chmod(0o755)


def test_verify_write_keeps_config_mode(tmp_path, capsys):
    model = Path(shutil.copytree(MLX4, tmp_path / "model"))
    (model / "config.json").chmod(0o640)
    prompt = tmp_path / "prompt.py"
    prompt.write_text(Path(tuning.__file__).read_text()[:600])
    assert main(["verify", str(model), "--prompt-file", str(prompt), "--write"]) == 0
    captured = capsys.readouterr()
    assert "recorded in config.json" in captured.out
    bars = captured.err.replace("\r", "\n")  # a bar per kind of pass, counting its passes as docs/commands.md says
    assert re.search(r"verify: trunk passes: 100%\S* +2/2 ", bars), bars
    assert re.search(r"verify: head passes \(wiring sweep\): 100%\S* +12/12 ", bars), bars
    assert "2 trunk passes and 12 head passes" in captured.out
    assert mode(model / "config.json") == 0o640
    assert [p.name for p in model.iterdir() if p.name.startswith(".")] == []


def test_tune_write_keeps_config_mode(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = Path(shutil.copytree(MLX4, tmp_path / "model"))
    (model / "config.json").chmod(0o640)
    tuning.record(model, 1, {}, write_config=True)
    assert mode(model / "config.json") == 0o640
    assert tuning.recorded_depth(model) == 1


def test_user_mode_follows_umask(umask):
    assert user_mode() == 0o640 and user_mode(directory=True) == 0o750


def test_write_into_a_graft_never_writes_through_its_hard_links(recipient, tmp_path, monkeypatch):
    """A graft's config.json is a hard link to the recipient's: recording a tuned depth replaces the link."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "grafted"
    assert main(["graft", "--recipient", str(recipient), "--donor", str(HF), "--out", str(out)]) == 0
    assert (out / "config.json").stat().st_nlink == 2
    before = snapshot(recipient)
    tuning.record(out, 2, {}, write_config=True)
    assert snapshot(recipient) == before and tuning.recorded_depth(out) == 2
    assert (out / "config.json").stat().st_nlink == 1
