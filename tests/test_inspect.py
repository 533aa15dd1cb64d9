"""``mtp-plugin inspect`` verdicts, and per-tensor norm conventions applied by the loader."""

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers.builders import build_head, build_model, config_for, save_checkpoint, trunk_weights
from mlx.utils import tree_flatten

from mtp_plugin.commands.cli import main
from mtp_plugin.commands.inspect import inspect_dir
from mtp_plugin.head.conventions import is_norm

JSON_KEYS = {"can_run", "mtp_tensors", "declared_mtp_layers", "naming", "files", "norm_convention",
             "head_quantization", "trunk_quantization", "head_trained", "problems"}


@pytest.fixture(scope="module")
def trunk():
    config = config_for("qwen3_5")
    model = build_model(config)
    return config, model, trunk_weights(model)


def random_init_head(head):
    """Hugging Face initialisation: zero-centred norms at 0, projections N(0, 0.02)."""
    return {k: mx.zeros_like(v) if is_norm(k, v.shape) else 0.02 * mx.random.normal(v.shape)
            for k, v in head.items()}


def test_head_with_quantized_trunk_can_run(tmp_path, trunk):
    config, model, weights = trunk
    head = build_head(model, config, {"bits": 4, "group_size": 32})
    path = save_checkpoint(tmp_path / "m", config, weights, head, "mtp.safetensors")
    report = inspect_dir(path)
    assert JSON_KEYS <= set(report)
    assert report["can_run"] and report["problems"] == []
    assert report["mtp_tensors"] == len(head)
    assert report["naming"] == ["mtp.*"] and report["files"] == {"mtp.safetensors": len(head)}
    assert set(report["head_quantization"].values()) == {"int4/g32"}
    assert report["trunk_quantization"] == "fp32"
    assert report["head_trained"] is True
    assert main(["inspect", str(path)]) == 0


def test_random_init_head_is_flagged(tmp_path, trunk):
    config, model, weights = trunk
    head = random_init_head(build_head(model, config))
    path = save_checkpoint(tmp_path / "m", config, weights, head, "mtp.safetensors")
    report = inspect_dir(path)
    assert report["head_trained"] is False and not report["can_run"]
    assert any("random initialisation" in p for p in report["problems"])
    assert main(["inspect", str(path)]) == 1


def test_random_projections_with_moved_norms_are_flagged(tmp_path, trunk):
    config, model, weights = trunk
    head = {k: v if is_norm(k, v.shape) else 0.02 * mx.random.normal(v.shape)
            for k, v in build_head(model, config).items()}
    report = inspect_dir(save_checkpoint(tmp_path / "m", config, weights, head, "mtp.safetensors"))
    assert report["head_trained"] is False
    assert all(abs(k - 3) < 0.5 for k in report["projection_kurtosis"].values())


def test_declared_but_missing_head(tmp_path, trunk):
    config, _, weights = trunk
    path = save_checkpoint(tmp_path / "m", config, weights)
    report = inspect_dir(path)
    assert report["declared_mtp_layers"] == 1 and report["mtp_tensors"] == 0
    assert not report["can_run"]
    assert "declares mtp_num_hidden_layers=1 but no head" in report["problems"][0]


def test_mixed_convention_head_decided_per_tensor(tmp_path, trunk):
    config, model, weights = trunk
    head = build_head(model, config)
    norms = sorted(k for k, v in head.items() if is_norm(k, v.shape))
    shifted = set(norms[::2])
    stored = {k: (v - 1.0 if k in shifted else v) for k, v in head.items()}
    path = save_checkpoint(tmp_path / "m", config, weights, stored, "mtp.safetensors")
    report = inspect_dir(path)
    decided = {k: v["convention"] for k, v in report["norm_convention"].items()}
    assert decided == {k: "zero_centred" if k in shifted else "absolute" for k in norms}

    from mlx_lm.utils import load_model

    loaded = dict(tree_flatten(load_model(path)[0].mtp_head.module.parameters()))
    for k in norms:
        np.testing.assert_allclose(np.array(loaded[k]), np.array(head[k]), rtol=0, atol=1e-6)


def test_cli_json_and_usage_errors(tmp_path, trunk):
    config, model, weights = trunk
    path = save_checkpoint(tmp_path / "m", config, weights, build_head(model, config), "mtp.safetensors")
    exe = str(Path(sys.executable).parent / "mtp-plugin")
    out = subprocess.run([exe, "inspect", "--json", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["can_run"] is True
    assert subprocess.run([exe, "inspect", str(tmp_path / "nope")], capture_output=True).returncode == 2
    assert subprocess.run([exe, "frobnicate"], capture_output=True).returncode == 2
    module = subprocess.run([sys.executable, "-m", "mtp_plugin", "inspect", str(path)], capture_output=True,
                            text=True, cwd=tmp_path)  # the installed package, not the source tree
    assert module.returncode == 0 and "can_run:            yes" in module.stdout

