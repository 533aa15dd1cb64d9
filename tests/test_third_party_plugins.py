"""A third-party plugin (an ``mtp_plugin`` entry point) that cannot be imported, implements a hook the spec lacks,
or raises from a hook is disabled alone, with one warning naming it: ``mlx_lm.generate`` still decodes with MTP and
the same text as with no such plugin installed."""

import pytest
from helpers.console_runs import BIN, MLX4, Generation, console, generate_args, run

PLUGINS = {
    "import": "raise ImportError('no module named torch')\n",
    "unknown-hook": ("from mtp_plugin.hookspecs import hookimpl\n\n\n@hookimpl\ndef mtp_head_nam(name, model_type):\n"
                     "    return None\n"),
    "raising-hook": ("from mtp_plugin.hookspecs import hookimpl\n\n\n@hookimpl\n"
                     "def mtp_head_name(name, model_type, sidecar, config):\n    raise RuntimeError('boom')\n"),
}
WHY = {"import": "cannot be loaded (ImportError: no module named torch)",
       "unknown-hook": "cannot be loaded (PluginValidationError",
       "raising-hook": "raised from mtp_head_name (RuntimeError"}


def install(site, fault: str) -> None:
    """A distribution ``broken_family`` in ``site`` whose ``mtp_plugin`` entry point has ``fault``."""
    (site / "broken_family.py").write_text(PLUGINS[fault])
    info = site / "broken_family-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-family\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[mtp_plugin]\nbroken = broken_family\n")


@pytest.mark.parametrize("fault", sorted(PLUGINS))
def test_a_broken_third_party_plugin_disables_itself_alone(tmp_path, fault):
    install(tmp_path, fault)
    out = run([BIN / "mlx_lm.generate", *generate_args(MLX4)], PYTHONPATH=str(tmp_path))
    generation, reference = Generation.parse(out), console(MLX4)
    assert generation.text == reference.text
    assert generation.mtp is not None and int(generation.mtp[2]) > 0, out.stdout  # drafted
    warnings = [line for line in out.stderr.splitlines() if "plugin 'broken'" in line]
    assert len(warnings) == 1 and WHY[fault] in warnings[0] and "disabled" in warnings[0], out.stderr
