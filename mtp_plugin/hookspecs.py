"""The contract between mtp_plugin and its plugins: one documented hook spec per extension point.

Built-in support (in ``families/``: Qwen3.5/3.6/3.8 and Qwen3-Next, DeepSeek-V3-style next-n heads; the
mlx-lm and mlx-vlm adapters) implements these hooks exactly as a third-party plugin registered under the
``mtp_plugin`` entry-point group would; docs/plugins.md lists what a family provides.
``firstresult`` hooks answer "who handles this"; the others collect from every plugin.
"""

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
    """Head-relative canonical name (``fc.weight``) of checkpoint tensor ``name``, or None if not a head tensor.

    Canonical names are those of the built head module (``mtp_build_head``). ``sidecar`` is True for a file
    holding only the head, where bare names (no prefix) are allowed. ``config`` is the checkpoint's config.json
    (None when the caller has none: a runtime's ``sanitize`` seen outside a load): a head stored as an extra
    decoder layer (``model.layers.{num_hidden_layers}.…``, DeepSeek-V3's next-n layer) is recognisable only
    with it. A copy of a trunk tensor that the head layout duplicates (DeepSeek-V3's ``embed_tokens``,
    ``shared_head.head``) is a head tensor too, so that the runtime never sees it; ``mtp_sanitize_head`` drops it.
    """


@hookspec
def mtp_sidecar_paths(model_dir, config: dict) -> list:
    """Paths (``pathlib.Path``) beside the trunk shards that may hold a head, whether they exist or not."""


@hookspec(firstresult=True)
def mtp_sanitize_head(weights: dict, config: dict) -> dict | None:
    """Canonical head ``weights`` rearranged to the layout of the built head (e.g. experts stacked, MLA's
    ``kv_b_proj`` split as the runtime's own ``sanitize`` splits it, duplicated trunk tensors dropped), or None.
    Must accept weights already in the built layout (a head the plugin wrote) and leave them unchanged."""


@hookspec(firstresult=True)
def mtp_norm_roles(config: dict) -> dict | None:
    """For each head RMSNorm (canonical name), the trunk norms with the same role, named without the stack prefix
    (``norm.weight``: the final norm; ``input_layernorm.weight``: every layer's; see ``conventions.plays_role``)."""


@hookspec(firstresult=True)
def mtp_stored_norm_convention(config: dict, shapes: dict, pytorch: bool) -> tuple[str, str] | None:
    """How the trunk tensors of one weights file (``shapes``: ``{name: shape}`` from its header; empty for a
    head-only file) store RMSNorm weights, ``pytorch`` True when the file says it was written by PyTorch
    (safetensors metadata ``format: pt``, the original checkpoint), as
    ``(convention, why)``: ``conventions.ZERO_CENTRED`` when the runtime adds 1 at load (Qwen3.5's original
    Hugging Face layout), ``conventions.ABSOLUTE`` when it uses them as stored (an MLX conversion; DeepSeek-V3 and
    GLM-4 in every layout). A head stored in that file shares its trunk's convention. None: no evidence (the
    first prompt then settles the head's norms by its own predictions, per tensor). Negative entries, a stronger
    evidence, are checked by the core first."""


@hookspec(firstresult=True)
def mtp_build_head(model, config: dict):
    """A float, unloaded ``mlx.nn.Module`` head built from trunk ``model``'s own layer classes, or None.

    Its parameter names are the canonical names (``mtp_head_name``), and its parameters are exactly what a valid
    head holds (``validation.py``: every one present with its shape, nothing else; linear modules may be stored
    quantized). ``head.MTPHead`` serves the wiring
    ``norm(layer(fc(concat[norm(embed(x[t+1])), norm(h[t])])))`` of Qwen3.5 and DeepSeek-V3 alike; pass
    ``array_mask=True`` when the layer's attention cannot take the string mask ``"causal"`` (DeepSeek's MLA).
    The head's KV cache is a runtime ``KVCache`` (``mtp_new_caches``), batched by the server adapter."""


@hookspec(firstresult=True)
def mtp_trunk(model, contract):
    """The decoding loop's view of trunk ``model`` (``hidden``/``embed``/``logits``, see ``decoding.Trunk``)."""


@hookspec
def mtp_capture_points(runtime: str) -> list:
    """Trunk layers whose caches cannot be trimmed, so that rollback needs capture points inside them (see
    ``rollback.py``): items ``(model_type, module, layer_class)``, the layer class ``layer_class`` of module
    ``{runtime}.models.{module}`` for checkpoints of ``model_type``. ``runtime`` is ``"mlx_lm"`` or ``"mlx_vlm"``.
    A model type listed here decodes with MTP only when its layers got their capture points; a model type whose
    trunk caches are all trimmable (attention-only: KV caches) lists nothing and is rolled back by trimming."""


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
    """An unloaded model of the runtime's own class for ``config`` (a config.json), as the runtime builds it before
    reading weights, or None when no installed runtime has its model type. mlx builds arrays lazily: nothing is
    allocated. ``validation.expected_head`` passes it to ``mtp_build_head`` to know every parameter of the head
    (names, shapes, input widths) without loading the trunk."""


@hookspec(firstresult=True)
def mtp_layer_sanitize(model_type: str, config: dict, weights: dict) -> dict | None:
    """One decoder layer's ``weights`` (names under ``model.layers.0.``) in the runtime's layout, by the runtime's own
    ``sanitize`` of ``model_type`` (experts stacked, MLA's ``kv_b_proj`` split, FP8 blocks dequantized); None when no
    installed runtime has that model type. Raises ``KeyError`` where that ``sanitize`` misses a tensor it needs."""


@hookspec(firstresult=True)
def mtp_download_model(repo_id: str):
    """The local directory of Hub model ``repo_id``, downloaded as the runtime downloads a model (its files, its
    cache), or None if no runtime is installed. Raises what the download raises."""


@hookspec(firstresult=True)
def mtp_load_model(model_dir):
    """``(model, tokenizer)`` loaded by a runtime (with its head attached), or None if no runtime is installed."""


@hookspec(firstresult=True)
def mtp_new_caches(model) -> tuple | None:
    """``(trunk_caches, head_cache)``: fresh runtime caches for ``model``'s trunk and its head, or None."""


@hookspec(firstresult=True)
def mtp_generate_step(prompt, model, options: dict):
    """A generator replacing the runtime's ``generate_step`` for ``model`` (yields ``(token, logprobs)``), or None.

    ``options`` are ``decoding.generate``'s keywords, and ``prompt_inputs`` (a ``trunk.PromptInputs``, or absent)
    when the runtime runs its prompt pass on embeddings and keywords of its own (mlx-vlm: media features merged,
    multimodal positions)."""


@hookspec(firstresult=True)
def mtp_decode(model, prompt: list, max_tokens: int, depth):
    """Greedy token ids (an iterator of int) from the runtime's own generation loop, or None if no runtime handles
    ``model``. ``depth``: None for stock decoding without MTP, 0 for the default decoding (adaptive depth, drafts from
    the context too), 1..8 for the head alone at a fixed draft depth, or a depth policy object
    (``decoding.DepthPolicy``). Counters land on ``model.mtp_head.stats``."""


# --------------------------------------------------------------------------------------------------------------------
# Benchmark: what `mtp-plugin bench` compares against.
# --------------------------------------------------------------------------------------------------------------------


@hookspec
def mtp_reference_decoders(model_dir, dtype) -> list:
    """Decoders to compare against on ``model_dir`` (weights cast to ``dtype``, an ``mx.Dtype`` or None): other
    runtimes' own MTP decoders, and this plugin's decoding where the bench's own rows cannot show it (another
    runtime's media prompts); each item a ``ReferenceDecoder`` (see ``commands/bench.py``) or a one-line string
    saying why that runtime cannot run it."""
