"""Every stock ``mlx_lm.generate`` option works with the plugin active exactly as without it.

Each option runs through the real console scripts on the bundled trained tiny checkpoint, once with the
plugin and once with ``MTP_PLUGIN_DISABLE=1`` (stock mlx-lm): the same exit status, the same text (greedy
decoding is lossless), and where stock fails, the same error. Options MTP can honour decode with MTP
(the summary line); the rest decode stock, and the plugin says nothing.
"""

import json
import subprocess
import tempfile

import mlx.core as mx
import pytest
from helpers.console_runs import BIN, DISABLE, MLX4, PROMPT, Generation, console, environment, generate_args
from mlx.utils import tree_flatten

PREFIX, REST = PROMPT[:24], PROMPT[24:]  # a prompt cache file holds the prefix; the generation adds the rest
KV_BITS = ("--kv-bits", "8", "--quantized-kv-start", "0")


def attempt(command: list, disabled: bool) -> subprocess.CompletedProcess:
    """Run a console script with the plugin active (``disabled`` False) or not, whatever its exit status."""
    extra = {DISABLE: "1"} if disabled else {}
    return subprocess.run([str(c) for c in command], capture_output=True, text=True, env=environment(**extra),
                          cwd=tempfile.gettempdir(), timeout=600)


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def assert_same_as_stock(command: list, with_mtp: bool) -> None:
    """``command`` behaves as stock: same exit status, and the same text (or the same final error line);
    with ``with_mtp`` the plugin's run decodes with MTP, else nothing in its output comes from the plugin."""
    ours, stock = attempt(command, disabled=False), attempt(command, disabled=True)
    assert ours.returncode == stock.returncode, ours.stderr[-3000:]
    if stock.returncode:
        assert last_line(ours.stderr) == last_line(stock.stderr)
        return
    ours, stock = Generation.parse(ours), Generation.parse(stock)
    assert ours.text == stock.text and stock.stock
    assert (ours.mtp is not None and ours.announced is not None) if with_mtp else ours.stock, ours.stdout + ours.stderr


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """A LoRA adapter for the tiny checkpoint (random, non-zero ``lora_b``, so that it changes the output), in
    the directory layout ``mlx_lm.lora`` writes."""
    from mlx_lm import load
    from mlx_lm.tuner.utils import linear_to_lora_layers

    path = tmp_path_factory.mktemp("adapter")
    config = {"fine_tune_type": "lora", "num_layers": 4,
              "lora_parameters": {"rank": 4, "scale": 20.0, "dropout": 0.0}}
    model, _ = load(str(MLX4))
    model.freeze()
    linear_to_lora_layers(model, config["num_layers"], config["lora_parameters"])
    mx.random.seed(0)
    weights = {k: mx.random.normal(v.shape) * 0.05 for k, v in tree_flatten(model.trainable_parameters())}
    assert weights and all(".lora_" in k for k in weights)
    mx.save_safetensors(str(path / "adapters.safetensors"), weights)
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


OPTIONS = {  # id: (extra mlx_lm.generate flags, whether MTP decodes)
    "kv-bits": (("--kv-bits", "8"), True),
    # Qwen3.5-family models build their own caches (no rotation); the KV cache is quantized while decoding
    "max-kv-size+kv-bits-from-20": (("--max-kv-size", "16", "--kv-bits", "4", "--quantized-kv-start", "20"), True),
    "draft-model": (("--draft-model", MLX4, "--num-draft-tokens", "2"), False),  # stock fails: ArraysCache
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_generate_option(option):
    flags, with_mtp = OPTIONS[option]
    assert_same_as_stock([BIN / "mlx_lm.generate", *generate_args(MLX4, *flags)], with_mtp)


def test_adapter_path(adapter):
    command = [BIN / "mlx_lm.generate", *generate_args(MLX4, "--adapter-path", adapter)]
    assert_same_as_stock(command, with_mtp=True)
    assert Generation.parse(attempt(command, disabled=True)).text != console(MLX4, disabled=True).text  # it matters


@pytest.mark.parametrize("flags,disabled", [((), True), (KV_BITS, False)], ids=["plain-stock-file", "kv-bits"])
def test_prompt_cache_file(tmp_path, flags, disabled):
    """A prompt cache written by ``mlx_lm.cache_prompt`` (stock, or with the plugin active), then used by
    ``mlx_lm.generate --prompt-cache-file``."""
    cache_file = tmp_path / "cache.safetensors"
    made = attempt([BIN / "mlx_lm.cache_prompt", "--model", MLX4, "--prompt", PREFIX, *flags,
                    "--prompt-cache-file", cache_file], disabled)
    assert made.returncode == 0, made.stderr[-3000:]
    command = [BIN / "mlx_lm.generate", "--prompt-cache-file", cache_file, "--prompt", REST, "--max-tokens", "24",
               "--ignore-chat-template", *flags]
    assert_same_as_stock(command, with_mtp=True)


def test_load_model_with_callers_own_classes():
    """``load_model(get_model_classes=…)`` builds the caller's own class for a checkpoint with a head: the
    plugin leaves it alone (no head, no error), as mlx-lm's own test suite checks."""
    import mlx.nn as nn
    from mlx_lm.utils import load_model

    class Custom(nn.Module):
        def __init__(self, args):
            super().__init__()
            self.args = args

        def load_weights(self, weights, **kwargs):
            self.weights_given = weights

    class Args:
        @classmethod
        def from_dict(cls, config):
            return cls()

    model, _ = load_model(MLX4, get_model_classes=lambda config: (Custom, Args))
    assert isinstance(model, Custom) and model.weights_given
    assert getattr(model, "mtp_head", None) is None
