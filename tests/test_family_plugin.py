"""The out-of-tree example plugin (``examples/family-plugin``) installed with pip into a folder of the test
environment: its one hook makes a head stored under ``draft_head.*`` names load, and ``mlx_lm.generate`` decodes
with it the text it decodes with the bundled sidecar head."""

import shutil
import subprocess
import sys

import mlx.core as mx
import pytest
from helpers.console_runs import BIN, MLX4, REPO, Generation, console, generate_args, run


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """``examples/family-plugin`` installed by pip (built from its pyproject.toml) into a folder for PYTHONPATH."""
    site = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                    str(REPO / "examples" / "family-plugin")], check=True, capture_output=True, timeout=600)
    return site


def test_the_example_plugin_loads_a_head_under_its_names(site, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(MLX4, model, ignore=shutil.ignore_patterns("mtp.safetensors"))
    head, metadata = mx.load(str(MLX4 / "mtp.safetensors"), return_metadata=True)
    mx.save_safetensors(str(model / "draft_head.safetensors"),
                        {"draft_head." + k.removeprefix("mtp."): v for k, v in head.items()}, metadata)
    without = Generation.parse(run([BIN / "mlx_lm.generate", *generate_args(model)]))
    assert without.mtp is None or int(without.mtp[2]) == 0  # no plugin knows these names: no head
    out = run([BIN / "mlx_lm.generate", *generate_args(model)], PYTHONPATH=str(site))
    generation = Generation.parse(out)
    assert generation.mtp is not None and int(generation.mtp[2]) > 0, out.stdout + out.stderr
    assert generation.text == console(MLX4).text
