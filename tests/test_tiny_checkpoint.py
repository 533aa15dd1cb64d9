"""The bundled trained tiny checkpoint: its HF original and its 4-bit mlx-lm conversion + sidecar head."""

import importlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from helpers.builders import to_float32
from mlx_lm import load

from mtp_plugin.commands.inspect import inspect_dir

ROOT = Path(__file__).resolve().parents[1] / "examples" / "tiny-qwen3_5"
HF, MLX4 = ROOT / "hf", ROOT / "mlx-4bit"
PROMPT = "def read_config(path):\n    \"\"\"Read a JSON configuration file.\"\"\"\n    with open(path) as f:\n"


def generate_step(*args, **kwargs):
    return importlib.import_module("mlx_lm.generate").generate_step(*args, **kwargs)


def run(model, tokenizer, **kwargs):
    prompt = mx.array(tokenizer.encode(PROMPT))
    return [t for t, _ in generate_step(prompt, model, max_tokens=48, **kwargs)]


@pytest.mark.parametrize("path,convention", [(HF, "zero_centred"), (MLX4, "absolute")])
def test_inspect_says_mtp_can_run(path, convention):
    report = inspect_dir(path)
    assert report["can_run"], report["problems"]
    assert report["head_trained"] is True
    assert report["declared_mtp_layers"] == 1 == report["present_mtp_layers"]
    assert {v["convention"] for v in report["norm_convention"].values()} == {convention}


def test_sidecar_leaves_trunk_logits_untouched(tmp_path):
    bare = tmp_path / "no-head"
    shutil.copytree(MLX4, bare, ignore=shutil.ignore_patterns("mtp.safetensors"))
    with_head, tokenizer = load(str(MLX4))
    without, _ = load(str(bare))
    tokens = mx.array([tokenizer.encode(PROMPT)])
    assert with_head.mtp_head is not None and without.mtp_head is None
    assert mx.array_equal(with_head(tokens), without(tokens))


def test_explicit_depth_without_a_head_says_once_why_it_decodes_stock(tmp_path, caplog):
    bare = tmp_path / "no-head"
    shutil.copytree(MLX4, bare, ignore=shutil.ignore_patterns("mtp.safetensors"))
    model, tokenizer = load(str(bare))
    assert run(model, tokenizer) == run(model, tokenizer, enable_mtp=False)
    assert "no usable MTP head" not in caplog.text  # the automatic default says nothing
    for _ in range(2):
        assert run(model, tokenizer, mtp_depth=3) == run(model, tokenizer, enable_mtp=False)
    told = [r for r in caplog.records if "no usable MTP head" in r.getMessage()]
    assert len(told) == 1 and "depth 3" in told[0].getMessage() and told[0].levelname == "WARNING"


@pytest.fixture(scope="module")
def float32_model():
    model, tokenizer = load(str(HF))
    to_float32(model)
    return model, tokenizer


@pytest.mark.parametrize("depth", range(1, 9))
def test_float32_greedy_identical_and_accepting(float32_model, depth):
    model, tokenizer = float32_model
    plain = run(model, tokenizer, enable_mtp=False)
    assert run(model, tokenizer, mtp_depth=depth) == plain
    stats = model.mtp_head.stats
    assert stats.accepted > 0
    if depth > 1:
        assert stats.reached[1] > 0  # drafts beyond the first were verified too


def test_4bit_greedy_identical_and_accepting():
    model, tokenizer = load(str(MLX4))
    plain = run(model, tokenizer, enable_mtp=False)
    assert run(model, tokenizer, mtp_depth=2) == plain
    assert model.mtp_head.stats.acceptance > 0


def test_mlx_lm_generate_cli_prints_mtp_line():
    code = ("import sys, mtp_plugin; mtp_plugin.patch(); from mlx_lm.generate import main; "
            "sys.argv = ['mlx_lm.generate', *sys.argv[1:]]; main()")
    out = subprocess.run([sys.executable, "-c", code, "--model", str(MLX4), "--prompt", PROMPT,
                          "--max-tokens", "40", "--ignore-chat-template"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    match = re.fullmatch(r"MTP: depth=auto drafted=(\d+) accepted=(\d+) acceptance=([0-9.]+) tokens/cycle=([0-9.]+) "
                         r"cycles=(\S+) plain=(\d+)(?: lookup: cycles=\d+ drafted=\d+ accepted=\d+)?", lines[-1])
    assert match, lines[-3:]
    assert "Peak memory" in lines[-2]
    assert int(match[2]) > 0 and float(match[3]) > 0
