"""A patch error never breaks the host program: a real third-party plugin, registered through the
``mtp_plugin`` entry-point group, whose ``mtp_patch_runtime`` raises; ``mlx_lm.generate`` must still
run, stock, with one warning."""

import pytest
from console_runs import BIN, MLX4, PATCH_FAILED, Generation, console, generate_args, run

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
def test_failing_plugin_leaves_mlx_lm_generate_stock(tmp_path, options):
    plugins = install_broken_plugin(tmp_path, options)
    out = run([BIN / "mlx_lm.generate", *generate_args(MLX4)], PYTHONPATH=str(plugins))
    assert "RuntimeError: broken plugin: cannot patch mlx_lm" in out.stderr  # the plugin was loaded and raised
    assert out.stderr.count(PATCH_FAILED) == 1
    generation = Generation.parse(out)
    assert generation.stock, generation.stderr[-2000:]
    assert generation.stdout == console(MLX4, disabled=True).stdout  # timing figures masked
