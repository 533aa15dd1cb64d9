"""The pluggy hook specs between mtp_plugin and its plugins (built-in families and adapters included).
``firstresult`` hooks answer "who handles this" (None: not mine); the others collect from every plugin.
Guide: docs/plugins.md."""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("mtp_plugin")
hookimpl = pluggy.HookimplMarker("mtp_plugin")


# --------------------------------------------------------------------------------------------------------------------
# Families: which checkpoints carry a head, where its tensors are, how they map onto the head module, and how the
# trunk is read and rolled back. A family answers None (firstresult) or [] for a model type it does not handle.
# --------------------------------------------------------------------------------------------------------------------


@hookspec
def mtp_model_types() -> list[str]:
    """Model types (config.json ``model_type``) whose checkpoints may carry a head this plugin handles."""


@hookspec(firstresult=True)
def mtp_head_name(name: str, model_type: str, sidecar: bool, config: dict | None) -> str | None:
    """Canonical name (a parameter of ``mtp_build_head``'s module, e.g. ``fc.weight``) of tensor ``name``, or None.
    ``sidecar``: a head-only file (bare names allowed); ``config``: config.json, None outside a load."""


@hookspec
def mtp_sidecar_paths(model_dir, config: dict) -> list:
    """Paths (``pathlib.Path``) beside the trunk shards that may hold a head, whether they exist or not."""


@hookspec(firstresult=True)
def mtp_sanitize_head(weights: dict, config: dict) -> dict | None:
    """Canonical ``weights`` in the built head's layout (experts stacked, duplicated trunk tensors dropped), or None.
    Weights already in that layout must come back unchanged."""


@hookspec(firstresult=True)
def mtp_norm_roles(config: dict) -> dict | None:
    """``{head RMSNorm canonical name: trunk norm with the same role}``, trunk names without the stack prefix
    (``norm.weight``: the final norm; see ``head.conventions.plays_role``), or None."""


@hookspec(firstresult=True)
def mtp_stored_norm_convention(config: dict, shapes: dict, pytorch: bool) -> tuple[str, str] | None:
    """``(head.conventions.ZERO_CENTRED (the runtime adds 1) or ABSOLUTE, why)`` for one weights file's RMSNorms
    (``shapes``: ``{name: shape}``, empty if head-only; ``pytorch``: metadata ``format: pt``), or None: no evidence."""


@hookspec(firstresult=True)
def mtp_build_head(model, config: dict):
    """A float, unloaded ``mlx.nn.Module`` head from trunk ``model``'s own layer classes, or None; its parameters
    are exactly a valid head's (``loading/validation.py``), e.g. ``head.model.MTPHead``."""


@hookspec(firstresult=True)
def mtp_trunk(model, contract):
    """The decoding loop's view of trunk ``model`` (a ``decoding.single.Trunk``), or None."""


@hookspec
def mtp_capture_points(runtime: str) -> list:
    """``(model_type, module, layer_class)`` items: layers of ``{runtime}.models.{module}`` whose caches cannot be
    trimmed and need rollback capture points (``decoding/rollback.py``); ``runtime``: "mlx_lm" or "mlx_vlm"."""


# --------------------------------------------------------------------------------------------------------------------
# Weights files: the built-in plugin reads safetensors; a plugin may add another format.
# --------------------------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def mtp_read_tensor_names(path) -> tuple[dict, dict] | None:
    """Header of a weights file as ``({name: (shape, dtype)}, metadata)`` without reading data, or None."""


@hookspec(firstresult=True)
def mtp_load_sidecar(path, names: list[str]) -> dict | None:
    """The tensors ``names`` of weights file ``path`` as ``{name: mx.array}``, or None if the format is not handled."""


# --------------------------------------------------------------------------------------------------------------------
# Runtime adapters: one per runtime (mlx-lm, mlx-vlm); the only code that knows a runtime's internals.
# --------------------------------------------------------------------------------------------------------------------


@hookspec
def mtp_patch_runtime(runtime: str | None) -> None:
    """Install this plugin's patches for ``runtime`` (an imported module name such as ``"mlx_lm"``; None: all)."""


@hookspec
def mtp_unpatch_runtime() -> None:
    """Remove this plugin's runtime patches, restoring stock behaviour (idempotent)."""


@hookspec(firstresult=True)
def mtp_build_model(config: dict):
    """An unloaded model (nothing allocated) of the runtime's own class for ``config`` (a config.json), or None
    when no installed runtime has its model type."""


@hookspec(firstresult=True)
def mtp_layer_sanitize(model_type: str, config: dict, weights: dict) -> dict | None:
    """Decoder-layer ``weights`` (under ``model.layers.0.``) put in the runtime's layout by its own ``sanitize``, or
    None when no runtime has ``model_type``. Raises ``KeyError`` when that ``sanitize`` misses a tensor."""


@hookspec(firstresult=True)
def mtp_download_model(repo_id: str):
    """Local directory of Hub model ``repo_id``, downloaded as the runtime downloads models, or None if no runtime
    is installed. Raises what the download raises."""


@hookspec(firstresult=True)
def mtp_load_model(model_dir):
    """``(model, tokenizer)`` loaded by a runtime (with its head attached), or None if no runtime is installed."""


@hookspec(firstresult=True)
def mtp_new_caches(model) -> tuple | None:
    """``(trunk_caches, head_cache)``: fresh runtime caches for ``model``'s trunk and its head, or None."""


@hookspec(firstresult=True)
def mtp_generate_step(prompt, model, options: dict):
    """A generator replacing the runtime's ``generate_step`` (yields ``(token, logprobs)``), or None. ``options``:
    ``single.generate``'s keywords, plus ``prompt_inputs`` (``decoding.trunk.PromptInputs``) for mlx-vlm."""


@hookspec(firstresult=True)
def mtp_decode(model, prompt: list, max_tokens: int, depth):
    """Greedy token ids (iterator of int) from the runtime's own loop, or None. ``depth``: None plain, 0 adaptive,
    1..8 fixed, or a ``decoding.single.DepthPolicy``; counters land on ``model.mtp_head.stats``."""


# --------------------------------------------------------------------------------------------------------------------
# Benchmark: what `mtp-plugin bench` compares against.
# --------------------------------------------------------------------------------------------------------------------


@hookspec
def mtp_reference_decoders(model_dir, dtype) -> list:
    """``commands.bench.ReferenceDecoder`` items to compare against on ``model_dir`` (cast to ``dtype``, an
    ``mx.Dtype`` or None), or one-line strings saying why a runtime cannot run."""
