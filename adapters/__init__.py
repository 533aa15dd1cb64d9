"""Runtime adapters (installed as ``mtp_plugin.adapters``), the only code that knows mlx-lm / mlx-vlm internals:
built-in plugins implementing ``mtp_patch_runtime`` / ``mtp_unpatch_runtime``."""
