"""mtp_plugin: multi-token-prediction (MTP) speculative decoding for MLX runtimes (mlx-lm, mlx-vlm).

``patch()`` makes mlx-lm and mlx-vlm load checkpoints that carry an MTP head correctly and keep the
head; ``unpatch()`` restores stock behaviour. Both are idempotent and thread-safe.
"""

from __future__ import annotations

import threading

__version__ = "0.1.0"
_lock = threading.Lock()


def patch() -> None:
    """Install every plugin's runtime patches (for runtimes that are installed)."""
    from .plugins import hook

    with _lock:
        hook().mtp_patch_runtime()


def unpatch() -> None:
    """Remove every plugin's runtime patches."""
    from .plugins import hook

    with _lock:
        hook().mtp_unpatch_runtime()
