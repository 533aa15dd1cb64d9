"""The head's files arrive with the trunk's when mlx-lm fetches a checkpoint from the Hub
(``adapters/mlx_lm_download.py``), served here from a local folder by ``hub.py``."""

import importlib
import json
import shutil

import huggingface_hub.constants
import mlx_lm.utils
import pytest
from helpers.console_runs import MLX4
from helpers.hub import REPO_ID, snapshot_download

import mtp_plugin
from mtp_plugin.loading.checkpoint import head_files


def test_head_files_of_a_sidecar_checkpoint():
    assert head_files(MLX4) == ["model-mtp.safetensors", "mtp.safetensors", "mtp/weights.safetensors"]


def test_head_files_include_the_shards_holding_head_tensors(tmp_path):
    shutil.copy(MLX4 / "config.json", tmp_path)
    weight_map = {"language_model.model.norm.weight": "model-00001-of-00002.safetensors",
                  "mtp.fc.weight": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert "model-00002-of-00002.safetensors" in head_files(tmp_path)
    assert "model-00001-of-00002.safetensors" not in head_files(tmp_path)


def test_head_files_of_a_model_no_family_handles(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert head_files(tmp_path) == []
    assert head_files(tmp_path / "missing") == []


@pytest.mark.parametrize("config, index", [
    ({"model_type": "qwen3_5", "mtp_sidecar": "/elsewhere/mtp.safetensors"}, None),  # relative to the folder
    ({"model_type": "qwen3_5"}, {"weight_map": ["not", "a", "map"]}),
    (["not", "an", "object"], None),
])
def test_head_files_of_odd_files_never_raise(tmp_path, config, index):
    (tmp_path / "config.json").write_text(json.dumps(config))
    if index is not None:
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "/elsewhere/mtp.safetensors" not in head_files(tmp_path)


@pytest.mark.parametrize("plugin, offline", [(True, False), (False, False), (True, True)])
def test_load_from_the_hub_fetches_the_sidecar(tmp_path, monkeypatch, plugin, offline):
    download = snapshot_download(MLX4, tmp_path / "snapshot")
    monkeypatch.setattr(mlx_lm.utils, "snapshot_download", download)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline)
    if not plugin:
        mtp_plugin.unpatch()  # conftest's autouse fixture ``patched`` patches again afterwards
    load = importlib.import_module("mlx_lm.utils").load
    model, _ = load(REPO_ID)
    fetched = plugin and not offline  # stock's filter leaves the sidecar; offline, only what is cached
    assert (tmp_path / "snapshot" / "mtp.safetensors").exists() == fetched
    assert (getattr(model, "mtp_head", None) is not None) == fetched
    assert len(download.calls) == 1 + fetched


def test_an_index_entry_is_a_file_name_not_a_pattern(tmp_path, monkeypatch):
    """An index naming the head's file ``*`` fetches a file named ``*`` (none here), not the whole repository."""
    remote = tmp_path / "remote"
    shutil.copytree(MLX4, remote)
    index = json.loads((remote / "model.safetensors.index.json").read_text())
    index["weight_map"]["mtp.fc.weight"] = "*"
    (remote / "model.safetensors.index.json").write_text(json.dumps(index))
    (remote / "secret.bin").write_bytes(b"not a file mlx-lm downloads")
    download = snapshot_download(remote, tmp_path / "snapshot")
    monkeypatch.setattr(mlx_lm.utils, "snapshot_download", download)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    importlib.import_module("mlx_lm.utils").load(REPO_ID)
    assert not (tmp_path / "snapshot" / "secret.bin").exists(), download.calls
    assert (tmp_path / "snapshot" / "mtp.safetensors").exists()  # the sidecars are still fetched by name
