"""mlx-lm adapter: each handled model class's ``sanitize`` never sees head tensors (mlx-lm 0.30.7–0.31.3 shift RMSNorms
a second time on ``mtp.*`` keys; Qwen3-Next raises on them), ``load_model`` keeps the head on ``model.mtp_head``;
decoding in ``mlx_lm_decoding``, ``mlx_lm.server`` in ``mlx_lm_server``. Design: docs/checkpoints.md#head-forms."""

from __future__ import annotations

import functools
import importlib
import sys
import threading

from mtp_plugin.hookspecs import hookimpl

from . import capture
from .mlx_lm_decoding import (
    CAPTURED,
    add_cli_flags,
    mtp_generate_step,
    print_summary,
    stock_with_draft_model,
    structured_output,
    with_cli_options,
)
from .mlx_lm_download import fetch_head_files
from .mlx_lm_sampling import describe_samplers
from .mlx_lm_server import patch_server
from .patching import Patches, keep_head, version_in_range, wrap_sanitizers

TESTED = ("0.30.7", "0.33")
_patches = Patches()
_server_patches = Patches()
_lock = threading.RLock()  # re-entered when patching imports the runtime itself


@hookimpl
def mtp_patch_runtime(runtime):
    """Wrap mlx-lm's loading and decoding, and ``mlx_lm.server`` once imported (``runtime`` None imports it)."""
    with _lock:
        if runtime not in (None, "mlx_lm", "mlx_lm.server") or not version_in_range("mlx-lm", *TESTED):
            return
        import mlx_lm.sample_utils
        import mlx_lm.utils  # may re-enter this hook through the post-import hook

        if not _patches.active:
            wrap_sanitizers(_patches, "mlx_lm")
            _patches.wrap(mlx_lm.utils, "load_model", keep_head)
            _patches.wrap(mlx_lm.utils, "_download", fetch_head_files)
            _patch_decoding()
        if runtime is None:
            importlib.import_module("mlx_lm.server")  # re-enters this hook through the post-import hook
        server = sys.modules.get("mlx_lm.server")
        if server is not None and not _server_patches.active:
            if server.make_sampler is not mlx_lm.sample_utils.make_sampler:  # imported before the patch
                _server_patches.wrap(server, "make_sampler", describe_samplers)
            patch_server(_server_patches, server)


def _patch_decoding():
    import mlx_lm
    import mlx_lm.sample_utils

    generate_module = importlib.import_module("mlx_lm.generate")  # ``mlx_lm.generate`` is also a function
    captured = capture.install(_patches, "mlx_lm")
    CAPTURED.clear()
    CAPTURED.update(captured)
    for module in (mlx_lm.sample_utils, generate_module):
        _patches.wrap(module, "make_sampler", describe_samplers)
    _patches.wrap(generate_module, "generate_step", functools.partial(mtp_generate_step, captured=captured))
    for module in (generate_module, mlx_lm):
        _patches.wrap(module, "generate", print_summary)
        _patches.wrap(module, "stream_generate", structured_output)
        _patches.wrap(module, "stream_generate", stock_with_draft_model)
    _patches.wrap(generate_module, "setup_arg_parser", add_cli_flags)
    _patches.wrap(generate_module, "main", functools.partial(with_cli_options, module=generate_module,
                                                             calls=("generate",)))


@hookimpl
def mtp_layer_sanitize(model_type, config, weights):
    """mlx-lm's ``sanitize`` of ``model_type`` on a one-layer model of that class (built lazily: no weights are
    allocated); None when mlx-lm has no such model type."""
    try:
        module = importlib.import_module(f"mlx_lm.models.{model_type}")
    except ImportError:
        return None
    text = config.get("text_config") or config
    return module.Model(module.ModelArgs.from_dict({**text, "num_hidden_layers": 1})).sanitize(dict(weights))


@hookimpl
def mtp_build_model(config):
    """The mlx-lm model of ``config`` as ``load_model`` builds it before reading weights (its own class lookup,
    ``_get_classes``), unloaded and unquantized; None when mlx-lm has no such model type."""
    from mlx_lm.utils import _get_classes

    try:
        model_class, args_class = _get_classes(config)
    except ValueError:  # "Model type … not supported."
        return None
    return model_class(args_class.from_dict(config))


@hookimpl
def mtp_download_model(repo_id):
    """``mlx_lm.utils._download``: mlx-lm's file patterns and huggingface_hub's cache (the head's files too)."""
    from mlx_lm.utils import _download

    return _download(repo_id)


@hookimpl
def mtp_load_model(model_dir):
    """``mlx_lm.load`` (patched, so the head is attached)."""
    from mlx_lm import load

    return load(str(model_dir))


@hookimpl
def mtp_decode(model, prompt, max_tokens, depth):
    """Greedy tokens of mlx-lm's ``generate_step`` as patched: stock when ``depth`` is None, the head alone at a fixed
    depth, else (0 or a policy) the plugin's default decoding at that depth policy."""
    import mlx.core as mx

    generate_step = importlib.import_module("mlx_lm.generate").generate_step
    options = {"enable_mtp": False} if depth is None else {"mtp_depth": depth}
    if type(depth) is int and depth > 0:
        options["mtp_lookup"] = False
    return (token for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, **options))


@hookimpl
def mtp_new_caches(model):
    """mlx-lm's prompt cache for the trunk and a ``KVCache`` for the head of an mlx-lm model; None for others."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    if not type(model).__module__.startswith("mlx_lm."):
        return None
    return make_prompt_cache(model), KVCache()


@hookimpl
def mtp_unpatch_runtime():
    """Restore stock mlx-lm."""
    with _lock:
        _server_patches.restore()
        _patches.restore()
        CAPTURED.clear()
