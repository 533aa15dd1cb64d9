"""What each hook must return (``hookspecs``), checked on every answer of a third-party plugin before it is used:
``problem(hook, result)`` says what is wrong, or None. Built-in plugins are not checked. Guide: docs/plugins.md."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from .confine import OutsideRoot, relative_inside

NORM_CONVENTIONS = ("zero_centred", "absolute")  # head.conventions.ZERO_CENTRED, ABSOLUTE
TRUNK_METHODS = ("hidden", "embed", "head_inputs", "logits", "trunk_logits")  # decoding.single.Trunk


def _module(value) -> bool:
    import mlx.nn as nn

    return isinstance(value, nn.Module)


def _arrays(value) -> bool:
    import mlx.core as mx

    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, mx.array) for k, v in value.items())


def _header(value) -> bool:
    if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], dict)
            and isinstance(value[1], dict)):
        return False
    return all(isinstance(name, str) and isinstance(entry, tuple | list) and len(entry) == 2
               and isinstance(entry[0], tuple | list) and all(isinstance(d, int) and d >= 0 for d in entry[0])
               and isinstance(entry[1], str) for name, entry in value[0].items())


def _strings(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _pair(value) -> bool:
    return isinstance(value, tuple) and len(value) == 2


# hook name: (test of a non-None result, what the hook must return); None is every firstresult hook's "not mine"
CONTRACTS: dict[str, tuple[Callable[[object], bool], str]] = {
    "mtp_model_types": (_strings, "a list of model-type strings"),
    "mtp_head_name": (lambda v: isinstance(v, str) and bool(v), "a canonical tensor name (a non-empty str) or None"),
    "mtp_sidecar_paths": (lambda v: isinstance(v, list) and all(isinstance(p, str | os.PathLike) for p in v),
                          "a list of paths (str or os.PathLike of str)"),
    "mtp_sanitize_head": (_arrays, "a dict of name: mx.array, or None"),
    "mtp_norm_roles": (lambda v: isinstance(v, dict) and all(isinstance(x, str) for kv in v.items() for x in kv),
                       "a dict of head norm name: trunk norm name, or None"),
    "mtp_stored_norm_convention": (lambda v: _pair(v) and v[0] in NORM_CONVENTIONS and isinstance(v[1], str),
                                   f"(one of {NORM_CONVENTIONS}, why), or None"),
    "mtp_build_head": (_module, "an mlx.nn.Module, or None"),
    "mtp_trunk": (lambda v: all(callable(getattr(v, m, None)) for m in TRUNK_METHODS),
                  f"a trunk with methods {', '.join(TRUNK_METHODS)}, or None"),
    "mtp_capture_points": (lambda v: isinstance(v, list) and all(isinstance(p, tuple) and len(p) == 3 for p in v),
                           "a list of (model_type, module, layer_class)"),
    "mtp_read_tensor_names": (_header, "({name: (shape, dtype)}, metadata), or None"),
    "mtp_load_sidecar": (_arrays, "a dict of name: mx.array, or None"),
    "mtp_patch_runtime": (lambda v: False, "None"),
    "mtp_unpatch_runtime": (lambda v: False, "None"),
    "mtp_build_model": (_module, "an mlx.nn.Module, or None"),
    "mtp_layer_sanitize": (_arrays, "a dict of name: mx.array, or None"),
    "mtp_download_model": (lambda v: isinstance(v, str | os.PathLike), "a directory path, or None"),
    "mtp_load_model": (_pair, "(model, tokenizer), or None"),
    "mtp_new_caches": (_pair, "(trunk_caches, head_cache), or None"),
    "mtp_generate_step": (lambda v: hasattr(v, "__next__"), "a generator, or None"),
    "mtp_decode": (lambda v: hasattr(v, "__iter__"), "an iterable of token ids, or None"),
    "mtp_reference_decoders": (lambda v: isinstance(v, list), "a list"),
}


def _inside(paths: list, model_dir) -> bool:
    """Every path names a file inside ``model_dir`` (``confine``; it may be a link)."""
    try:
        for path in paths:
            relative_inside(Path(model_dir), Path(os.fspath(path)), "a path", links=True)
    except (OutsideRoot, TypeError):  # TypeError: an os.PathLike of bytes
        return False
    return True


# hook name: (test of a result against the call's keywords, what the answer must be), beyond its type
CALL_CONTRACTS: dict[str, tuple[Callable[[object, dict], bool], str]] = {
    "mtp_sidecar_paths": (lambda v, kw: _inside(v, kw["model_dir"]), "paths inside the model directory"),
    "mtp_load_sidecar": (lambda v, kw: set(kw["names"]) <= set(v), "every tensor it was asked for"),
}


def problem(hook: str, result, call: dict | None = None) -> str | None:
    """What is wrong with ``result`` as hook ``hook``'s answer to a call with keywords ``call`` (one phrase), or None
    when it keeps the contract."""
    if result is None:
        return None
    test, contract = CONTRACTS.get(hook, (lambda v: True, ""))
    kept = test(result)
    if kept and call is not None and hook in CALL_CONTRACTS:
        test_call, contract = CALL_CONTRACTS[hook]
        try:
            kept = test_call(result, call)
        except KeyError:  # the implementation does not take the argument the check needs
            kept = True
    if kept:
        return None
    shown = repr(result)
    return f"returned {shown[:60] + '…' if len(shown) > 60 else shown} from {hook}, which must return {contract}"
