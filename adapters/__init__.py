"""Runtime adapters (installed as ``mtp_plugin.adapters``): the only code that knows mlx-lm / mlx-vlm internals.

Each adapter is a built-in plugin implementing ``mtp_patch_runtime`` / ``mtp_unpatch_runtime``.
"""
