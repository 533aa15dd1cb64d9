"""The runtimes' command lines with the MTP flags: ``--help`` prints one usage block listing them, and ``--no-mtp``
beside a flag it makes moot is said once, on every command that takes them."""

import subprocess
import sys
from pathlib import Path

import pytest
from helpers.console_runs import environment

BIN = Path(sys.executable).parent
COMMANDS = {"mlx_lm.generate": [str(BIN / "mlx_lm.generate")], "mlx_lm.server": [str(BIN / "mlx_lm.server")],
            "mlx_vlm.server": [sys.executable, "-m", "mlx_vlm.server"]}


def run(command: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*COMMANDS[command], *args], capture_output=True, text=True, timeout=300, check=True,
                          env=environment())


@pytest.mark.parametrize("command", COMMANDS)
def test_help_is_one_usage_block_with_the_mtp_flags(command):
    out = run(command, "--help").stdout
    assert out.count("usage:") == 1, out
    assert all(flag in out for flag in ("--mtp-depth N", "--no-mtp", "--mtp-lookup", "--no-mtp-lookup")), out
    assert ("--plugin {mtp}" in out) == command.endswith("server")


@pytest.mark.parametrize("command", COMMANDS)
def test_no_mtp_beside_a_depth_or_lookup_is_said_once(command):
    """Flags are acted on in order, before ``--help`` ends the command."""
    err = run(command, "--mtp-depth", "3", "--no-mtp", "--mtp-lookup", "--help").stderr
    lines = [line for line in err.splitlines() if "--no-mtp" in line]
    assert len(lines) == 1 and "--mtp-depth 3" in lines[0], err
    if command.endswith("server"):
        assert '"enable_mtp": true' in lines[0]  # a request may still ask for MTP, at the server's depth
    else:
        assert "no effect" in lines[0]
    assert not [line for line in run(command, "--mtp-depth", "3", "--help").stderr.splitlines() if "--no-mtp" in line]
