"""The real console scripts in subprocesses, as a user runs them, and ``mlx_lm.generate``'s output parsed.

Subprocesses run the interpreter of this test run (its ``bin/`` holds the console scripts), from a
neutral working directory and without ``PYTHONPATH``: the source tree lacks ``mtp_plugin.adapters``,
so the plugin must come from the installed package and its ``.pth`` file alone.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mtp_plugin.adapters.patching import release

REPO = Path(__file__).resolve().parents[2]
MLX4, HF = REPO / "examples" / "tiny-qwen3_5" / "mlx-4bit", REPO / "examples" / "tiny-qwen3_5" / "hf"
BIN = Path(sys.executable).parent
PROMPT = "def read_config(path):\n    \"\"\"Read a JSON configuration file.\"\"\"\n    with open(path) as f:\n"
MAX_TOKENS = 24
DISABLE = "MTP_PLUGIN_DISABLE"
PATCH_FAILED = "mtp_plugin: patching mlx_lm failed; runtimes left stock."
MTP_LINE = re.compile(r"^MTP: depth=(\d+|auto) drafted=(\d+) accepted=(\d+) acceptance=([0-9.]+) "
                      r"tokens/cycle=([0-9.]+)(?: cycles=\S+ plain=\d+)?(?: lookup: cycles=\d+ drafted=\d+ "
                      r"accepted=\d+)?(?: grammar: forced=\d+ masked=\d+)?$", re.M)
TEXT = re.compile(r"^==========\n(.*?)\n==========$", re.M | re.S)
FIGURES = re.compile(r"[0-9.]+ (tokens-per-sec|GB)")
# What the server tests send: short code prompts, as the bundled model was trained on.
PROMPTS = ["def read_config(path):\n", "import os\n\n\ndef main():\n", "class Parser:\n    def __init__(self",
           "for line in lines:\n", "    return self._", "# Copyright\nimport sys\n"]
# mlx-lm < 0.32 right-pads the prompts it prefills together and its GatedDeltaNet state then reads the padding,
# so stock itself answers a request that shared a prefill with a longer prompt differently from the same request
# alone (measured: 2 of 8 rounds of the concurrent test on a stock 0.31.3 server). There the concurrent requests
# use prompts of one token length, which both stock and the plugin answer as alone (0 of 10 rounds each).
CONCURRENT = PROMPTS if release("mlx-lm") >= (0, 32) else [
    "for line in lines:\n", "def main(args):\n", "import json\n", "while True:\n", "def parse(text):\n",
    "class Reader:\n"]


def environment(**extra: str) -> dict[str, str]:
    """This process's environment without ``PYTHONPATH`` and ``MTP_PLUGIN_DISABLE``, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", DISABLE)}
    env.update(extra)
    return env


def run(command: list, **extra_env: str) -> subprocess.CompletedProcess:
    """Run ``command`` in a neutral directory; it must exit 0 (the assertion message is its stderr)."""
    out = subprocess.run([str(c) for c in command], capture_output=True, text=True, env=environment(**extra_env),
                         cwd=tempfile.gettempdir(), timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


@dataclass(frozen=True)
class Generation:
    """One verbose ``mlx_lm`` generation: the text, the MTP summary line and the "MTP on" stderr line
    (None when absent), and the whole stdout with timing and memory figures masked (for exact comparison)."""

    text: str
    mtp: re.Match | None
    announced: str | None
    stdout: str
    stderr: str

    @classmethod
    def parse(cls, out: subprocess.CompletedProcess) -> Generation:
        """Parse a finished process; its stdout must hold mlx-lm's ``==========`` framed text."""
        text = TEXT.search(out.stdout)
        assert text, out.stdout[-2000:] + out.stderr[-2000:]
        announced = [line for line in out.stderr.splitlines() if line.startswith("MTP on:")]
        assert len(announced) <= 1, announced
        return cls(text=text[1], mtp=MTP_LINE.search(out.stdout), announced=announced[0] if announced else None,
                   stdout=FIGURES.sub(r"_ \1", out.stdout), stderr=out.stderr)

    @property
    def stock(self) -> bool:
        """True when nothing in the output comes from the plugin."""
        return self.mtp is None and self.announced is None


def generate_args(model: Path, *flags: str) -> list[str]:
    """``mlx_lm.generate`` arguments: the code prompt without chat template, ``MAX_TOKENS`` tokens, ``flags``."""
    return ["--model", str(model), "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), "--ignore-chat-template",
            *flags]


@functools.cache
def console(model: Path, *flags: str, disabled: bool = False) -> Generation:
    """The ``mlx_lm.generate`` console script of this environment on ``model`` (cached per process)."""
    extra = {DISABLE: "1"} if disabled else {}
    return Generation.parse(run([BIN / "mlx_lm.generate", *generate_args(model, *flags)], **extra))
