"""``benchmarks/deepen.py``: the deepened bundled checkpoint is the bundled model's function, layer for layer added.

Inert layers add exactly 0 to the residual stream, so in float32 the deep checkpoint's trunk logits (prompt pass and
every decoding step) equal the 6-layer model's bit for bit, its greedy tokens are the same, and its head drafts with
the same acceptance.
"""

import importlib
import importlib.util
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers.builders import to_float32
from mlx_lm import load

ROOT = Path(__file__).resolve().parents[1]
HF = ROOT / "examples" / "tiny-qwen3_5" / "hf"
PROMPT = "def read_config(path):\n    \"\"\"Read a JSON configuration file.\"\"\"\n    with open(path) as f:\n"
LAYERS = 12


def _deepen():
    spec = importlib.util.spec_from_file_location("deepen", ROOT / "benchmarks" / "deepen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


deepen = _deepen()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The bundled model and its 12-layer deepening, both loaded as stored (bfloat16) and cast to float32 (loading
    shifts the zero-centred norms by 1 in the stored dtype, so both must be stored alike to compare bit for bit)."""
    out = tmp_path_factory.mktemp("deep") / "deep12"
    assert deepen.main([str(HF), "--out", str(out), "--layers", str(LAYERS)]) == 0
    bundled, tokenizer = load(str(HF))
    deep, _ = load(str(out))
    return to_float32(bundled), to_float32(deep), tokenizer, out


def _steps(model, prompt, **options):
    """Greedy tokens and the log-probs (as numpy) at each of 40 steps."""
    generate_step = importlib.import_module("mlx_lm.generate").generate_step  # as patched
    pairs = list(generate_step(prompt, model, max_tokens=40, **options))
    return [t for t, _ in pairs], [np.array(lp) for _, lp in pairs]


def test_checkpoint_layout(models):
    _, deep, _, out = models
    config = json.loads((out / "config.json").read_text())["text_config"]
    assert config["num_hidden_layers"] == LAYERS == len(deep.language_model.model.layers)
    assert config["layer_types"] == ["full_attention" if (i + 1) % 3 == 0 else "linear_attention"
                                     for i in range(LAYERS)]
    assert config["dtype"] == "bfloat16"
    assert {p.name for p in out.iterdir()} >= {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    tensors = mx.load(str(out / "model.safetensors"))
    zero = [k for k, a in tensors.items() if k.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight"))
            and not k.startswith("mtp.") and not mx.any(a).item()]
    # every layer but the 6 trained ones has its output projections zero (linear: out_proj, attention: o_proj; MLP)
    assert len(zero) == 2 * (LAYERS - 6)
    assert deep.mtp_head is not None


def test_trunk_logits_and_greedy_tokens_equal_bundled(models):
    bundled, deep, tokenizer, _ = models
    prompt = mx.array(tokenizer.encode(PROMPT))
    assert np.array_equal(np.array(bundled(prompt[None])), np.array(deep(prompt[None])))  # bit for bit
    tokens, logprobs = _steps(bundled, prompt, enable_mtp=False)
    deep_tokens, deep_logprobs = _steps(deep, prompt, enable_mtp=False)
    assert deep_tokens == tokens
    assert all(np.array_equal(a, b) for a, b in zip(logprobs, deep_logprobs, strict=True))


@pytest.mark.parametrize("depth", [1, 3])
def test_head_drafts_with_the_same_acceptance(models, depth):
    bundled, deep, tokenizer, _ = models
    prompt = mx.array(tokenizer.encode(PROMPT))
    tokens, _ = _steps(bundled, prompt, mtp_depth=depth)
    expected = bundled.mtp_head.stats
    deep_tokens, _ = _steps(deep, prompt, mtp_depth=depth)
    got = deep.mtp_head.stats
    assert deep_tokens == tokens
    assert expected.accepted > 0
    assert (got.drafted, got.accepted, got.acceptance_by_depth) == (expected.drafted, expected.accepted,
                                                                    expected.acceptance_by_depth)


def test_dtype_casts_every_floating_tensor(tmp_path):
    out = tmp_path / "deep7"
    assert deepen.main([str(HF), "--out", str(out), "--layers", "7", "--dtype", "float32"]) == 0
    assert json.loads((out / "config.json").read_text())["text_config"]["dtype"] == "float32"
    assert {a.dtype for a in mx.load(str(out / "model.safetensors")).values()} == {mx.float32}
    assert deepen.main([str(HF), "--out", str(out), "--layers", "8", "--force"]) == 0  # replaces it
    assert json.loads((out / "config.json").read_text())["text_config"]["num_hidden_layers"] == 8
    assert [p.name for p in tmp_path.iterdir()] == ["deep7"]


def test_usage_errors_exit_2_and_leave_the_output(tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    for argv in ([str(HF), "--out", str(out), "--layers", "8"],  # not empty, no --force
                 [str(HF), "--out", str(tmp_path / "new"), "--layers", "4"],  # below the 6 trained layers
                 [str(HF), "--out", str(HF / "inside")]):  # into the source
        with pytest.raises(SystemExit) as exit_:
            deepen.main(argv)
        assert exit_.value.code == 2
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and not (tmp_path / "new").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left behind
    assert "--force" in capsys.readouterr().err


def test_source_that_is_no_checkpoint_fails_with_1(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert deepen.main([str(tmp_path / "empty"), "--out", str(tmp_path / "out")]) == 1
    assert "config.json" in capsys.readouterr().err
