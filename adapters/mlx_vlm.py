"""mlx-vlm adapter: load-time strip-and-keep of head tensors.

mlx-vlm 0.6.5–0.6.8 shifts RMSNorms a second time when it sees ``mtp.*`` keys, and loads every
``*.safetensors`` in the directory (a sidecar ``mtp.safetensors`` included). Each handled model
class's ``sanitize`` is wrapped so it never sees head tensors; ``load_model`` is wrapped to keep
the head on ``model.mtp_head``.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path

from mtp_plugin.hookspecs import hookimpl

from .patching import Patches, version_in_range, wrap_sanitizers

TESTED = ("0.6.5", "0.8")
_patches = Patches()
_lock = threading.RLock()  # re-entered when patching imports the runtime itself


def _keep_head(load_model):
    from mtp_plugin.checkpoint import read_config
    from mtp_plugin.loader import attach_head

    @functools.wraps(load_model)
    def wrapper(model_path, *args, **kwargs):
        model = load_model(model_path, *args, **kwargs)
        attach_head(model, Path(model_path), read_config(Path(model_path)))
        return model

    return wrapper


@hookimpl
def mtp_patch_runtime(runtime):
    """Wrap ``sanitize`` of every handled model class and ``mlx_vlm.utils.load_model``."""
    with _lock:
        if runtime not in (None, "mlx_vlm") or not version_in_range("mlx-vlm", *TESTED):
            return
        import mlx_vlm.utils  # may re-enter this hook through the post-import hook

        if _patches.active:
            return

        wrap_sanitizers(_patches, "mlx_vlm")
        _patches.wrap(mlx_vlm.utils, "load_model", _keep_head)


@hookimpl
def mtp_unpatch_runtime():
    """Restore stock mlx-vlm."""
    with _lock:
        _patches.restore()
