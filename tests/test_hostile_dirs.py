"""A model directory whose index or config.json names a head file outside it, or whose head file's header lies: the
loader and ``inspect`` refuse it, naming the entry or the file; the trunk loads and decodes as stock; a file the
directory links in (as huggingface_hub's snapshots do) still serves."""

import json
import logging
import shutil

import mlx.core as mx
import pytest
from helpers.console_runs import MLX4
from mlx_lm import generate, load

from mtp_plugin.commands.inspect import inspect_dir

INDEX = "model.safetensors.index.json"
PROMPT = "def read_config(path):\n"


@pytest.fixture(scope="module")
def stock_text():
    model, tokenizer = load(str(MLX4))
    return generate(model, tokenizer, PROMPT, max_tokens=12, enable_mtp=False)


def headless(tmp_path):
    """The bundled checkpoint without its sidecar, as ``tmp_path/model``; its head at ``tmp_path/outside``."""
    model_dir = tmp_path / "model"
    shutil.copytree(MLX4, model_dir, ignore=shutil.ignore_patterns("mtp.safetensors"))
    (tmp_path / "outside").mkdir()
    shutil.copy(MLX4 / "mtp.safetensors", tmp_path / "outside" / "head.safetensors")
    return model_dir


def point_index(model_dir, name: str) -> None:
    """The index maps every head tensor to ``name``."""
    index = json.loads((model_dir / INDEX).read_text())
    head = mx.load(str(MLX4 / "mtp.safetensors"))
    index["weight_map"].update(dict.fromkeys(head, name))
    (model_dir / INDEX).write_text(json.dumps(index))


@pytest.mark.parametrize("how", ["index:../outside/head.safetensors", "index:sub/../../outside/head.safetensors",
                                 "index:ABSOLUTE", "config:../outside/head.safetensors", "config:ABSOLUTE",
                                 "index:linked/head.safetensors"])
def test_a_head_file_named_outside_the_directory_is_never_read(tmp_path, caplog, stock_text, how):
    model_dir = headless(tmp_path)
    where, name = how.split(":")
    name = str(tmp_path / "outside" / "head.safetensors") if name == "ABSOLUTE" else name
    if name.startswith("linked/"):
        (model_dir / "linked").symlink_to(tmp_path / "outside")  # a directory on the way that leads out
    if where == "index":
        point_index(model_dir, name)
    else:
        config = json.loads((model_dir / "config.json").read_text())
        (model_dir / "config.json").write_text(json.dumps({**config, "mtp_sidecar": name}))
    with caplog.at_level(logging.WARNING, logger="mtp_plugin"):
        model, tokenizer = load(str(model_dir))
    assert model.mtp_head is None  # a head read from outside would have loaded: it is the bundled one
    warnings = [r.getMessage() for r in caplog.records if "outside" in r.getMessage()]
    assert len(warnings) == 1 and f"'{name}'" in warnings[0], caplog.text
    assert generate(model, tokenizer, PROMPT, max_tokens=12) == stock_text
    report = inspect_dir(model_dir)
    assert not report["can_run"] and any("outside" in p and name in p for p in report["problems"]), report


def test_a_head_file_linked_into_the_directory_serves(tmp_path):
    model_dir = headless(tmp_path)
    (model_dir / "mtp.safetensors").symlink_to(tmp_path / "outside" / "head.safetensors")
    model, _ = load(str(model_dir))
    assert model.mtp_head is not None
    assert inspect_dir(model_dir)["can_run"]


def lie(data: bytes, how: str) -> bytes:
    """``data`` (a safetensors file) with its header lying ``how``."""
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    tensors = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    if how == "huge-length":
        return (2 ** 62).to_bytes(8, "little") + data[8:]
    if how == "overlapping":
        for key in tensors[1:]:
            header[key]["data_offsets"] = [0, header[key]["data_offsets"][1] - header[key]["data_offsets"][0]]
    elif how == "negative":
        header[tensors[0]]["data_offsets"][0] = -1
    elif how == "array":
        header = list(header)
    elif how == "surrogate":
        header["__metadata__"]["note"] = "\ud800"
    elif how == "dtype":  # a dtype of the format that mlx cannot read, of the same byte size
        begin, end = header[tensors[0]]["data_offsets"]
        header[tensors[0]].update(dtype="F8_E5M2", shape=[end - begin])
    elif how == "wrapped-shape":  # 0 elements in Python's arithmetic, a negative dimension in mlx's int32
        header[tensors[0]]["shape"] = [0, 2**64 + 1]
    text = json.dumps(header).encode()
    if how == "utf16":
        text = json.dumps(header).encode("utf-16")
    elif how == "deep":
        text = b"[" * 100_000 + b"]" * 100_000
    elif how == "bigint":
        text = json.dumps(header).replace('"shape": [', '"shape": [' + "9" * 5000 + ", ", 1).encode()
    return len(text).to_bytes(8, "little") + text + data[8 + length:]


@pytest.mark.parametrize("how,says", [("overlapping", "overlap another tensor"), ("negative", "0 <= begin <= end"),
                                      ("huge-length", f"header length {2 ** 62} exceeds"),
                                      ("array", "a JSON list, not an object"), ("utf16", "not UTF-8 JSON"),
                                      ("surrogate", "not valid UTF-8"), ("dtype", "one mlx cannot read"),
                                      ("deep", "not UTF-8 JSON"), ("bigint", "not UTF-8 JSON"),
                                      ("wrapped-shape", "is not a list of integers 0..")])
def test_a_lying_local_header_is_refused_like_a_fetched_one(tmp_path, caplog, stock_text, how, says):
    model_dir = headless(tmp_path)
    (model_dir / "mtp.safetensors").write_bytes(lie((MLX4 / "mtp.safetensors").read_bytes(), how))
    with caplog.at_level(logging.WARNING, logger="mtp_plugin"):
        model, tokenizer = load(str(model_dir))
    assert model.mtp_head is None and "mtp.safetensors: unreadable safetensors header" in caplog.text, caplog.text
    assert says in caplog.text
    assert generate(model, tokenizer, PROMPT, max_tokens=12) == stock_text
