"""The contract between mtp_plugin and its plugins: one documented hook spec per extension point.

Built-in support (Qwen3.5/3.6/3.8 and Qwen3-Next in ``families/``, the mlx-lm and mlx-vlm adapters)
implements these hooks exactly as a third-party plugin registered under the ``mtp_plugin`` entry-point
group would. ``firstresult`` hooks answer "who handles this"; the others collect from every plugin.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("mtp_plugin")
hookimpl = pluggy.HookimplMarker("mtp_plugin")


@hookspec
def mtp_model_types() -> list[str]:
    """Model types (config.json ``model_type``) whose checkpoints may carry a head this plugin handles."""


@hookspec(firstresult=True)
def mtp_head_name(name: str, model_type: str, sidecar: bool) -> str | None:
    """Head-relative canonical name (``fc.weight``) of checkpoint tensor ``name``, or None if not a head tensor.

    ``sidecar`` is True for a file holding only the head, where bare names (no prefix) are allowed.
    """


@hookspec
def mtp_sidecar_paths(model_dir, config: dict) -> list:
    """Paths (``pathlib.Path``) beside the trunk shards that may hold a head, whether they exist or not."""


@hookspec(firstresult=True)
def mtp_read_tensor_names(path) -> tuple[dict, dict] | None:
    """Header of a weights file as ``({name: (shape, dtype)}, metadata)`` without reading data, or None."""


@hookspec(firstresult=True)
def mtp_load_sidecar(path, names: list[str]) -> dict | None:
    """The tensors ``names`` of weights file ``path`` as ``{name: mx.array}``, or None if the format is not handled."""


@hookspec(firstresult=True)
def mtp_sanitize_head(weights: dict, config: dict) -> dict | None:
    """Canonical head ``weights`` rearranged to the layout of the built head (e.g. experts stacked), or None."""


@hookspec(firstresult=True)
def mtp_norm_roles(config: dict) -> dict | None:
    """For each head RMSNorm (canonical name), the trunk norms with the same role, named without the stack prefix
    (``norm.weight``: the final norm; ``input_layernorm.weight``: every layer's; see ``conventions.plays_role``)."""


@hookspec(firstresult=True)
def mtp_required_tensors(config: dict) -> list | None:
    """Canonical names every complete head of this model must have (quantized or not), or None."""


@hookspec(firstresult=True)
def mtp_head_in_features(config: dict) -> dict | None:
    """Input width of each head linear module (canonical path without ``.weight``), to read packed shapes."""


@hookspec(firstresult=True)
def mtp_build_head(model, config: dict):
    """A float, unloaded ``mlx.nn.Module`` head built from trunk ``model``'s own layer classes, or None."""


@hookspec(firstresult=True)
def mtp_load_model(model_dir):
    """``(model, tokenizer)`` loaded by a runtime (with its head attached), or None if no runtime is installed."""


@hookspec(firstresult=True)
def mtp_decode(model, prompt: list, max_tokens: int, depth):
    """Greedy token ids (an iterator of int) from the runtime's own generation loop, or None if no runtime handles
    ``model``. ``depth``: None for stock decoding without MTP, 0 for automatic (adaptive) depth, 1..8 for a fixed
    draft depth, or a depth policy object (``decoding.DepthPolicy``). Counters land on ``model.mtp_head.stats``."""


@hookspec(firstresult=True)
def mtp_new_caches(model) -> tuple | None:
    """``(trunk_caches, head_cache)``: fresh runtime caches for ``model``'s trunk and its head, or None."""


@hookspec
def mtp_reference_decoders(model_dir, dtype) -> list:
    """Other runtimes' own MTP decoders to compare against on ``model_dir`` (weights cast to ``dtype``, an
    ``mx.Dtype`` or None): each item a ``ReferenceDecoder`` (see ``bench.py``) or a one-line string saying why
    that runtime cannot run it."""


@hookspec(firstresult=True)
def mtp_trunk(model, contract):
    """The decoding loop's view of trunk ``model`` (``hidden``/``embed``/``logits``, see ``decoding.Trunk``)."""


@hookspec(firstresult=True)
def mtp_generate_step(prompt, model, options: dict):
    """A generator replacing the runtime's ``generate_step`` for ``model`` (yields ``(token, logprobs)``), or None."""


@hookspec
def mtp_patch_runtime(runtime: str | None) -> None:
    """Install this plugin's patches for ``runtime`` (an imported module name such as ``"mlx_lm"``; None: all)."""


@hookspec
def mtp_unpatch_runtime() -> None:
    """Remove this plugin's runtime patches, restoring stock behaviour (idempotent)."""
