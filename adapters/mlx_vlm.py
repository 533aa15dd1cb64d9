"""mlx-vlm adapter: each handled model class's ``sanitize`` never sees head tensors (mlx-vlm 0.6.5–0.6.8 shift RMSNorms
a second time on ``mtp.*`` keys and load every ``*.safetensors``, a sidecar included), ``load_model`` keeps the head
on ``model.mtp_head``; decoding in ``mlx_vlm_decoding``, the server's batch in ``mlx_vlm_server``."""

from __future__ import annotations

import functools
import importlib
import sys
import threading

from mtp_plugin.hookspecs import hookimpl

from . import capture
from .mlx_lm_decoding import with_cli_options
from .mlx_vlm_decoding import cli_argparse, mtp_generate_step, print_summary
from .mlx_vlm_server import patch_server
from .patching import Patches, keep_head, version_in_range, wrap_sanitizers

TESTED = ("0.6.5", "0.8")
_patches = Patches()
_server_patches = Patches()
_captured: dict[str, bool] = {}  # ``capture.install``'s answer: model types whose trunk layers are captured
_lock = threading.RLock()  # re-entered when patching imports the runtime itself


@hookimpl
def mtp_patch_runtime(runtime):
    """Wrap ``sanitize`` of every handled model class, ``mlx_vlm.utils.load_model``, the decoding entry points and,
    once ``mlx_vlm.server`` is imported, its generation thread (``mlx_vlm_server``)."""
    with _lock:
        if runtime not in (None, "mlx_vlm", "mlx_vlm.server") or not version_in_range("mlx-vlm", *TESTED):
            return
        import mlx_vlm.utils  # may re-enter this hook through the post-import hook

        if not _patches.active:
            wrap_sanitizers(_patches, "mlx_vlm")
            _patches.wrap(mlx_vlm.utils, "load_model", keep_head)
            _captured.update(_patch_decoding())
        # the server once it has executed: its post-import hook, or a later ``patch()``
        if runtime != "mlx_vlm" and "mlx_vlm.server" in sys.modules and not _server_patches.active:
            patch_server(_server_patches, _captured)


def _patch_decoding():
    import mlx_vlm

    captured = capture.install(_patches, "mlx_vlm")
    package = importlib.import_module("mlx_vlm.generate")  # ``mlx_vlm.generate`` is also a function
    ar = importlib.import_module("mlx_vlm.generate.ar")
    dispatch = importlib.import_module("mlx_vlm.generate.dispatch")
    step = functools.partial(mtp_generate_step, ar=ar, captured=captured)
    for module in (ar, dispatch, package):
        _patches.wrap(module, "generate_step", step)
    for module in (dispatch, package, mlx_vlm):
        _patches.wrap(module, "generate", print_summary)
    _patches.wrap(dispatch, "argparse", cli_argparse)
    with_options = functools.partial(with_cli_options, module=dispatch, calls=("generate", "stream_generate"))
    for module in (dispatch, importlib.import_module("mlx_vlm.generate.cli"), package):
        _patches.wrap(module, "main", with_options)
    return captured


@hookimpl
def mtp_new_caches(model):
    """mlx-vlm's prompt cache for the language model and a ``KVCache`` for the head of an mlx-vlm model; None for
    others."""
    if not type(model).__module__.startswith("mlx_vlm."):
        return None
    from mlx_vlm.models.cache import KVCache, make_prompt_cache

    return make_prompt_cache(model.language_model), KVCache()


@hookimpl
def mtp_unpatch_runtime():
    """Restore stock mlx-vlm."""
    with _lock:
        _server_patches.restore()
        _patches.restore()
        _captured.clear()
