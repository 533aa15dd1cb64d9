"""Heads of the bundled trained checkpoint stored with norm conventions their files do not tell (issue 25, item 4).

Each is a copy of the 4-bit conversion with its sidecar ``mtp.safetensors`` rewritten, all norm entries that are
stored zero-centred made positive by construction, so that only the head's predictions can tell the readings
apart; the head computes what the trained head computes when each norm is read in its true convention
(``truth``), which ``declared=True`` records in the sidecar's metadata (``mtp_norm_convention``, per tensor):

* ``mixed_sidecar``: one pre-fc norm stored zero-centred beside absolute ones, as an MLX writer that copied one
  tensor from the original leaves it. Its scale s·w (s·min w = 1.1) is stored as s·w - 1 > 0 and fc's input
  columns of that half are divided by s (fc stored dequantized, bf16), so the head computes the same function.
* ``hf_sidecar``: the Hugging Face original's head verbatim (bf16, every norm zero-centred) in an MLX sidecar. Each
  norm whose scale a following projection can absorb is rescaled so that s·(1 + w) - 1 > 0 (pre-fc norms: fc's
  input columns; the layer's input and post-attention norms: q/k/v and gate/up projections' input columns; the
  final norm: the drafts' logits scale by s ≈ 1.1, the same greedy drafts); q_norm / k_norm keep their negative
  entries (the loader reads those zero-centred from their own evidence).
"""

from __future__ import annotations

import ast
import json
import shutil
import sysconfig
from pathlib import Path

import mlx.core as mx

from mtp_plugin.head.conventions import is_norm

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny-qwen3_5"
MARGIN = 1.1  # the smallest effective scale of a rescaled norm: its stored entries are all ≥ 0.1


def _copy_trunk(path: Path) -> Path:
    shutil.copytree(TINY / "mlx-4bit", path, ignore=shutil.ignore_patterns("mtp.safetensors"))
    return path


def _save(path: Path, head: dict, truth: dict[str, str], declared: bool | str) -> Path:
    """Write ``head`` (``mtp.*`` names) as the sidecar; metadata: the truth per tensor when ``declared`` is True, the
    string itself when it is a convention (a declaration that may be wrong), none when False."""
    metadata = {"format": "mlx"}
    if declared is True:
        metadata["mtp_norm_convention"] = json.dumps(truth)
    elif declared:
        metadata["mtp_norm_convention"] = declared
    mx.save_safetensors(str(path / "mtp.safetensors"), {k: v.astype(mx.bfloat16) if v.dtype == mx.float32 else v
                                                        for k, v in head.items()}, metadata=metadata)
    return path


def _absorb(head: dict, norm: str, columns: list[tuple[str, int, int]], shift: float) -> None:
    """Scale the effective weight of ``norm`` (float32 w + shift) by s so that its smallest entry is ``MARGIN``,
    store it zero-centred (s·(w + shift) - 1) and divide input columns ``start:stop`` of each linear in
    ``columns`` by s (float weights)."""
    effective = head[norm].astype(mx.float32) + shift
    s = MARGIN / mx.min(effective).item()
    head[norm] = s * effective - 1.0
    for name, start, stop in columns:
        weight = head[name].astype(mx.float32)
        scale = mx.concatenate([mx.ones((start,)), mx.full((stop - start,), 1 / s),
                                mx.ones((weight.shape[1] - stop,))])
        head[name] = weight * scale


def mixed_sidecar(path: Path, name: str = "pre_fc_norm_embedding.weight",
                  declared: bool | str = False) -> tuple[Path, dict[str, str]]:
    """The 4-bit checkpoint with ``name`` (a pre-fc norm) stored zero-centred and positive beside absolute norms.

    Returns:
        the model directory and the true convention per norm (canonical names).
    """
    _copy_trunk(path)
    head = dict(mx.load(str(TINY / "mlx-4bit" / "mtp.safetensors")))
    head["mtp.fc.weight"] = mx.dequantize(head.pop("mtp.fc.weight"), head.pop("mtp.fc.scales"),
                                          head.pop("mtp.fc.biases"), group_size=64, bits=4)
    hidden = head["mtp.fc.weight"].shape[0]
    half = (0, hidden) if name == "pre_fc_norm_embedding.weight" else (hidden, 2 * hidden)
    _absorb(head, f"mtp.{name}", [("mtp.fc.weight", *half)], shift=0.0)
    truth = {k[len("mtp."):]: "absolute" for k, v in head.items() if is_norm(k, v.shape)}
    truth[name] = "zero_centred"
    return _save(path, head, truth, declared), truth


def hf_sidecar(path: Path, declared: bool | str = False) -> tuple[Path, dict[str, str]]:
    """The Hugging Face original's head (zero-centred norms, rescaled positive where absorbed) as an MLX sidecar.

    Returns:
        the model directory and the true convention per norm (all zero-centred).
    """
    _copy_trunk(path)
    tensors = mx.load(str(TINY / "hf" / "model.safetensors"))
    head = {k: v.astype(mx.float32) for k, v in tensors.items() if k.startswith("mtp.")}
    hidden = head["mtp.fc.weight"].shape[0]
    layer = "mtp.layers.0."
    _absorb(head, "mtp.pre_fc_norm_embedding.weight", [("mtp.fc.weight", 0, hidden)], shift=1.0)
    _absorb(head, "mtp.pre_fc_norm_hidden.weight", [("mtp.fc.weight", hidden, 2 * hidden)], shift=1.0)
    _absorb(head, f"{layer}input_layernorm.weight",
            [(f"{layer}self_attn.{p}_proj.weight", 0, hidden) for p in "qkv"], shift=1.0)
    _absorb(head, f"{layer}post_attention_layernorm.weight",
            [(f"{layer}mlp.{p}_proj.weight", 0, hidden) for p in ("gate", "up")], shift=1.0)
    _absorb(head, "mtp.norm.weight", [], shift=1.0)
    truth = {k[len("mtp."):]: "zero_centred" for k, v in head.items() if is_norm(k, v.shape)}
    return _save(path, head, truth, declared), truth


def code_prompt(module: str, start: int, chars: int) -> str:
    """Python code as the bundled checkpoint was trained on: standard-library ``module`` without comments and
    docstrings (``ast.unparse``), ``chars`` characters from character ``start``."""
    tree = ast.parse((Path(sysconfig.get_paths()["stdlib"]) / f"{module}.py").read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.unparse(tree)[start : start + chars]
