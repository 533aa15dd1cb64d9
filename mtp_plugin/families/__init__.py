"""Model families, one file each; every family is a built-in plugin of ``mtp_plugin.hookspecs``."""

from __future__ import annotations

import functools
import inspect


def for_model_types(model_types):
    """Decorator (under ``@hookimpl``): the hook answers None unless its ``model_type`` argument, else
    ``config["model_type"]``, is in ``model_types``; the signature is kept for pluggy."""

    def decorate(function):
        names = list(inspect.signature(function).parameters)
        key = "model_type" if "model_type" in names else "config"
        index = names.index(key)

        @functools.wraps(function)
        def hook(*args, **kwargs):
            value = args[index] if index < len(args) else kwargs[key]
            model_type = value if key == "model_type" else (value or {}).get("model_type")
            return function(*args, **kwargs) if model_type in model_types else None

        return hook

    return decorate
