"""mtp_plugin: multi-token-prediction (MTP) speculative decoding for MLX runtimes (mlx-lm, mlx-vlm).

``patch()`` / ``unpatch()`` are idempotent and thread-safe. Imports nothing heavy (the post-import hook imports it
at interpreter start-up).
"""

import _thread

__version__ = "0.1.0"
_lock = _thread.RLock() if hasattr(_thread, "RLock") else _thread.allocate_lock()


def patch(runtime: str | None = None) -> None:
    """Install every plugin's runtime patches (head-carrying checkpoints load, keep the head and decode with it) for
    ``runtime`` (``"mlx_lm"``, ``"mlx_lm.server"``, ``"mlx_vlm"`` or ``"mlx_vlm.server"``; None: all installed)."""
    from .plugins import hook

    with _lock:
        hook().mtp_patch_runtime(runtime=runtime)


def unpatch() -> None:
    """Remove every plugin's runtime patches."""
    from .plugins import hook

    with _lock:
        hook().mtp_unpatch_runtime()
