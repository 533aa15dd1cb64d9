"""A third-party plugin (an ``mtp_plugin`` entry point) that cannot be imported, exits at import, implements a hook
the spec lacks, raises from a hook or returns what its hookspec forbids is disabled alone, with one warning naming it
and the hook: ``mlx_lm.generate`` still decodes with MTP and the same text as with no such plugin installed, and
``mtp-plugin inspect`` still reports the head."""

import pytest
from helpers.console_runs import BIN, MLX4, Generation, console, generate_args, run

from mtp_plugin import hookspecs
from mtp_plugin.hook_results import CONTRACTS

HOOK = "from mtp_plugin.hookspecs import hookimpl\n\n\n@hookimpl\n"
PLUGINS = {
    "import": "raise ImportError('no module named torch')\n",
    "exit": "import sys\n\nsys.exit(3)\n",
    "unknown-hook": HOOK + "def mtp_head_nam(name, model_type):\n    return None\n",
    "raising-hook": HOOK + "def mtp_head_name(name, model_type, sidecar, config):\n    raise RuntimeError('boom')\n",
    "model-types-str": HOOK + "def mtp_model_types():\n    return 'qwen3_5'\n",
    "object-head": HOOK + "def mtp_build_head(model, config):\n    return object()\n",
    "claims-every-tensor": HOOK + "def mtp_head_name(name, model_type, sidecar, config):\n    return name\n",
    "base-exception": "class Odd(BaseException):\n    pass\n\n\n" + HOOK
                      + "def mtp_head_name(name, model_type, sidecar, config):\n    raise Odd('odd')\n",
    "bytes-path": "import os\n\n\nclass P(os.PathLike):\n    def __fspath__(self):\n        return b'x'\n\n\n" + HOOK
                  + "def mtp_sidecar_paths(model_dir, config):\n    return [P()]\n",
    "path-outside": HOOK + "def mtp_sidecar_paths(model_dir, config):\n    return ['/etc/hostname.safetensors']\n",
    "sidecar-missing-tensors": HOOK + "def mtp_load_sidecar(path, names):\n    return {}\n",
    "headers-empty": HOOK + "def mtp_read_tensor_names(path):\n    return ({}, {})\n",
    "linear-head": "import mlx.nn as nn\n\n\n" + HOOK
                   + "def mtp_build_head(model, config):\n    return nn.Linear(1, 1)\n",
    "step-breaks": HOOK + "def mtp_generate_step(prompt, model, options):\n"
                   "    def tokens():\n        raise RuntimeError('later')\n        yield\n    return tokens()\n",
}
WHY = {"import": "cannot be loaded (ImportError: no module named torch)",
       "exit": "exited at import (SystemExit: 3)",
       "unknown-hook": "cannot be loaded (PluginValidationError",
       "raising-hook": "raised from mtp_head_name (RuntimeError",
       "model-types-str": "returned 'qwen3_5' from mtp_model_types, which must return a list of model-type strings",
       "object-head": "from mtp_build_head, which must return an mlx.nn.Module, or None",
       "claims-every-tensor": "answered mtp_head_name in a way that broke ",
       "base-exception": "raised from mtp_head_name (Odd: odd)",
       "bytes-path": "from mtp_sidecar_paths, which must return paths inside the model directory",
       "path-outside": "from mtp_sidecar_paths, which must return paths inside the model directory",
       "sidecar-missing-tensors": "from mtp_load_sidecar, which must return every tensor it was asked for",
       "headers-empty": "answered mtp_read_tensor_names in a way that broke ",
       "linear-head": "answered mtp_build_head in a way that broke ",
       "step-breaks": "raised from mtp_generate_step (RuntimeError: later)"}


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


@pytest.mark.parametrize("fault", ["exit", "model-types-str", "object-head", "claims-every-tensor", "base-exception",
                                   "bytes-path", "path-outside", "sidecar-missing-tensors", "headers-empty",
                                   "linear-head"])
def test_inspect_goes_on_without_a_broken_plugin(tmp_path, fault):
    install(tmp_path, fault)
    out = run([BIN / "mtp-plugin", "inspect", MLX4], PYTHONPATH=str(tmp_path))
    assert "can_run:            yes" in out.stdout and "Traceback" not in out.stderr, out.stdout + out.stderr
    warnings = [line for line in out.stderr.splitlines() if "plugin 'broken'" in line]
    assert len(warnings) == 1 and WHY[fault] in warnings[0], out.stderr


def test_every_hook_has_a_result_contract():
    specs = {name for name in dir(hookspecs) if name.startswith("mtp_")}
    assert specs == set(CONTRACTS)
