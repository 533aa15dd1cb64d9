"""A user's install: the built wheel into a fresh virtual environment (dependencies from the package
index), then that environment's own ``mlx_lm.generate`` decodes with MTP with no code change, and
``pip uninstall`` restores stock behaviour. mlx-vlm is an extra (``mtp-plugin[vlm]``): an mlx-lm user's
environment gets neither it nor its dependencies, and every command works without it. Slow (one to two
minutes: the dependencies are installed)."""

import re
import subprocess
import sys
from importlib import metadata

import pytest
from helpers.console_runs import MLX4, REPO, Generation, environment, generate_args, run

# Messages of pip and urllib3 when the package index cannot be reached.
NO_NETWORK = re.compile(r"NewConnectionError|Failed to establish a new connection|Temporary failure in name "
                        r"resolution|Name or service not known|Network is unreachable|No route to host")


# Dependencies mlx-vlm brings and mlx-lm does not: none of them in an mlx-lm user's environment.
VLM_ONLY = {"mlx-vlm", "opencv-python", "pandas", "pyarrow", "datasets"}


def pip(*args) -> None:
    """Run ``pip`` with ``args``; skip the test only when it failed for lack of network."""
    out = subprocess.run([str(a) for a in args], capture_output=True, text=True, env=environment(), timeout=1200)
    offline = NO_NETWORK.search(out.stdout + out.stderr)
    if out.returncode != 0 and offline:
        pytest.skip(f"installing the wheel's dependencies needs the package index, unreachable here: {offline[0]}")
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]


def pins(path):
    """A constraints file pinning every distribution of this test run but the plugin itself, so that the fresh
    environment gets the runtime versions under test and pip resolves quickly."""
    lines = sorted({f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions()
                    if d.metadata["Name"] and d.metadata["Name"].lower() != "mtp-plugin"})
    path.write_text("\n".join(lines) + "\n")
    return path


def test_wheel_in_fresh_venv_then_uninstall(tmp_path):
    pip(sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", tmp_path / "dist", REPO)
    (wheel,) = (tmp_path / "dist").glob("mtp_plugin-*.whl")
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv])
    python = venv / "bin" / "python"
    pip(python, "-m", "pip", "install", "-c", pins(tmp_path / "pins.txt"), wheel)
    for runtime in ("mlx", "mlx-lm"):  # the wheel's dependencies, at the versions under test
        assert run([python, "-c", f"from importlib.metadata import version; print(version('{runtime}'))"]
                   ).stdout.strip() == metadata.version(runtime)
    installed = run([python, "-m", "pip", "list", "--format=freeze"]).stdout.lower()
    assert not VLM_ONLY & {line.split("==")[0] for line in installed.splitlines()}, installed
    assert run([venv / "bin" / "mtp-plugin", "inspect", MLX4]).stdout.count("can_run:            yes") == 1

    command = [venv / "bin" / "mlx_lm.generate", *generate_args(MLX4)]
    with_plugin = Generation.parse(run(command))
    assert with_plugin.announced is not None, with_plugin.stderr[-2000:]
    assert with_plugin.mtp is not None and float(with_plugin.mtp[4]) > 0, with_plugin.stdout[-2000:]

    pip(python, "-m", "pip", "uninstall", "-y", "mtp-plugin")
    assert not list(venv.glob("lib/python*/site-packages/mtp_plugin*"))
    stock = Generation.parse(run(command))
    assert stock.stock, stock.stderr[-2000:]
    assert stock.text == with_plugin.text
