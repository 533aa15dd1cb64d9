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


def response_format_processor(tokenizer, response_format):
    """An mlx-lm logits processor constraining one generation to an OpenAI ``response_format`` (``{"type":
    "json_schema", "json_schema": {"schema": …}}`` or ``{"type": "json_object"}``; None for ``{"type": "text"}``), over
    an mlx-lm tokenizer or mlx-vlm processor. Pass it in ``logits_processors``: stock decoding is constrained by it, MTP
    drafts under it. ``decoding.grammar.GrammarError`` (a ValueError): a format or schema that cannot be used."""
    from .decoding.grammar import response_format_processor as make

    return make(tokenizer, response_format)
