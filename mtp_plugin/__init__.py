"""mtp_plugin: multi-token-prediction (MTP) speculative decoding for MLX runtimes (mlx-lm, mlx-vlm).

``patch()`` makes mlx-lm and mlx-vlm load checkpoints that carry an MTP head correctly, keep the
head and decode with it; ``unpatch()`` restores stock behaviour. Both are idempotent and thread-safe.
This module imports nothing heavy: it is imported at interpreter start-up by the post-import hook.
"""

import _thread

__version__ = "0.1.0"
_lock = _thread.RLock() if hasattr(_thread, "RLock") else _thread.allocate_lock()


def patch(runtime: str | None = None) -> None:
    """Install the runtime patches of every plugin.

    Args:
        runtime: ``"mlx_lm"``, ``"mlx_lm.server"``, ``"mlx_vlm"`` or ``"mlx_vlm.server"`` to patch just that
            runtime (the post-import hook does this as each is imported); None patches every installed runtime.
    """
    from .plugins import hook

    with _lock:
        hook().mtp_patch_runtime(runtime=runtime)


def unpatch() -> None:
    """Remove every plugin's runtime patches."""
    from .plugins import hook

    with _lock:
        hook().mtp_unpatch_runtime()
