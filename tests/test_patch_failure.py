"""A patch error never breaks the host program: a real third-party plugin, registered through the
``mtp_plugin`` entry-point group, whose ``mtp_patch_runtime`` raises is disabled alone, with one warning naming it;
``mlx_lm.generate`` runs with the built-in MTP as without that plugin (``plugins._guarded``)."""

import pytest
from helpers.console_runs import BIN, MLX4, PATCH_FAILED, Generation, console, generate_args, run

PLUGIN = '''"""A third-party MTP plugin whose runtime patch fails."""

from mtp_plugin.hookspecs import hookimpl


@hookimpl({options})
def mtp_patch_runtime(runtime):
    raise RuntimeError(f"broken plugin: cannot patch {{runtime}}")
'''


def install_broken_plugin(path, options: str):
    """A module and its ``.dist-info`` (entry point ``mtp_plugin: broken = broken_mtp``) in ``path``."""
    (path / "broken_mtp.py").write_text(PLUGIN.format(options=options))
    info = path / "broken_mtp-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-mtp\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[mtp_plugin]\nbroken = broken_mtp\n")
    return path


@pytest.mark.parametrize("options", [
    "",  # pluggy calls plugins registered later first: before the built-in adapters patch anything
    "trylast=True",  # it raises after the built-in adapters have patched: their patches must be undone
], ids=["before-adapters", "after-adapters"])
def test_failing_plugin_is_disabled_alone(tmp_path, options):
    plugins = install_broken_plugin(tmp_path, options)
    out = run([BIN / "mlx_lm.generate", *generate_args(MLX4)], PYTHONPATH=str(plugins))
    warnings = [line for line in out.stderr.splitlines() if "plugin 'broken'" in line]
    assert len(warnings) == 1, out.stderr
    assert "raised from mtp_patch_runtime (RuntimeError: broken plugin: cannot patch mlx_lm)" in warnings[0]
    assert PATCH_FAILED not in out.stderr
    generation = Generation.parse(out)
    assert generation.mtp is not None and int(generation.mtp[2]) > 0, out.stdout  # the built-in MTP drafted
    assert generation.text == console(MLX4).text
