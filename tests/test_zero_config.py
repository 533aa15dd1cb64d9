"""Zero-configuration use: the installed package alone (its ``.pth`` post-import hook) makes the real
``mlx_lm.generate`` console script, ``python -m mlx_lm generate`` and ``from mlx_lm import load, generate``
decode the bundled trained tiny checkpoint with MTP, and leaves everything else stock."""

import json
import shutil
import sys

import pytest
from helpers.console_runs import DISABLE, HF, MAX_TOKENS, MLX4, PROMPT, Generation, console, generate_args, run

from mtp_plugin.decoding.single import MAX_DEPTH

API = """
import sys
from mlx_lm import generate, load
model, tokenizer = load(sys.argv[1])
generate(model, tokenizer, sys.argv[2], max_tokens=int(sys.argv[3]), verbose=True)
"""
HEAD_FILE = {MLX4: "mtp.safetensors", HF: "model.safetensors"}  # where each checkpoint keeps its head
START_UP = """
import json, os, site, sys
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("mlx", "mlx_lm", "mlx_vlm", "pluggy", "numpy"))
pth = [d for d in site.getsitepackages() if os.path.exists(os.path.join(d, "mtp_plugin.pth"))]
print(json.dumps({"heavy": heavy, "pth": pth, "loaded": "mtp_plugin.adapters.autopatch" in sys.modules,
                  "finders": [f.__module__ for f in sys.meta_path]}))
"""


def assert_decodes_with_mtp(generation: Generation, model=MLX4, depth: int | None = None) -> None:
    """The "MTP on" stderr line (head, file, depth) and the MTP summary line at ``depth`` (None: the
    automatic, adaptive depth), with accepted drafts."""
    assert generation.announced is not None, generation.stderr[-2000:]
    assert generation.announced.startswith(f"MTP on: head from {HEAD_FILE[model]} "), generation.announced
    assert generation.announced.endswith(f", depth {depth or 'adaptive'}"), generation.announced
    assert generation.mtp is not None, generation.stdout[-2000:]
    found_depth, drafted, accepted, acceptance, tokens_per_cycle = generation.mtp.groups()
    assert found_depth == str(depth or "auto")
    assert int(drafted) > 0 and int(accepted) > 0 and float(acceptance) > 0
    assert 1 < float(tokens_per_cycle) <= (depth or MAX_DEPTH) + 1


@pytest.mark.parametrize("model", [MLX4, HF], ids=["mlx-4bit", "hf"])
def test_console_script_decodes_with_mtp(model):
    generation = console(model)
    assert_decodes_with_mtp(generation, model)
    assert generation.text.strip()


@pytest.mark.parametrize("model", [MLX4, HF], ids=["mlx-4bit", "hf"])
def test_disable_env_gives_stock_behaviour_and_same_text(model):
    stock = console(model, disabled=True)
    assert stock.stock
    assert stock.text == console(model).text


def test_no_mtp_flag_is_stock_output():
    plain = console(MLX4, "--no-mtp")
    assert plain.stock
    assert plain.stdout == console(MLX4, disabled=True).stdout  # timing figures masked


def test_mtp_depth_flag():
    deeper = console(MLX4, "--mtp-depth", "3")
    assert_decodes_with_mtp(deeper, depth=3)
    assert deeper.text == console(MLX4, "--no-mtp").text


def test_python_m_mlx_lm_generate():
    generation = Generation.parse(run([sys.executable, "-m", "mlx_lm", "generate", *generate_args(MLX4)]))
    assert_decodes_with_mtp(generation)
    assert generation.text == console(MLX4, disabled=True).text


def test_python_m_mlx_lm_dot_generate():
    """``python -m mlx_lm.generate`` (mlx-lm's deprecated spelling, still common) runs the module as ``__main__``:
    the plugin is active there too, its flags included, and the text is stock's."""
    out = run([sys.executable, "-m", "mlx_lm.generate", *generate_args(MLX4, "--mtp-depth", "2")])
    assert "deprecated" in out.stdout + out.stderr  # mlx-lm's own main block ran
    generation = Generation.parse(out)
    assert_decodes_with_mtp(generation, depth=2)
    assert generation.text == console(MLX4, disabled=True).text


def test_python_api_without_importing_the_plugin():
    generation = Generation.parse(run([sys.executable, "-c", API, MLX4, PROMPT, MAX_TOKENS]))
    assert_decodes_with_mtp(generation)
    assert generation.text == console(MLX4, disabled=True).text


def test_model_without_head_generates_as_stock(tmp_path):
    bare = tmp_path / "no-head"
    shutil.copytree(MLX4, bare, ignore=shutil.ignore_patterns("mtp.safetensors"))
    generation, stock = console(bare), console(bare, disabled=True)
    assert generation.stock and stock.stock
    assert generation.stdout == stock.stdout  # timing figures masked
    assert generation.text == console(MLX4, disabled=True).text  # the same trunk


def test_start_up_imports_no_mlx_and_the_pth_hook_is_active():
    active = json.loads(run([sys.executable, "-c", START_UP]).stdout)
    assert active["heavy"] == []
    assert active["pth"] and active["loaded"]
    finders = active["finders"]  # the hook must come before the path finder that finds mlx_lm
    assert finders.index("mtp_plugin.adapters.autopatch") < finders.index("_frozen_importlib_external"), finders
    disabled = json.loads(run([sys.executable, "-c", START_UP], **{DISABLE: "1"}).stdout)
    assert disabled["heavy"] == [] and "mtp_plugin.adapters.autopatch" not in disabled["finders"]
