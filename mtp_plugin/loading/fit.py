"""One definition of "this head fits this trunk", shared by ``inspect`` and ``graft``: text configs that agree on
``FIELDS`` and trunks of the same base quantization scheme; an unquantized donor fits every quantization of its base
model. Design: docs/checkpoints.md#a-head-for-a-converted-model."""

from __future__ import annotations

FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
          "num_experts", "n_routed_experts", "moe_intermediate_size", "kv_lora_rank", "q_lora_rank")


def text_config(config: dict) -> dict:
    """The text part of a config.json (``text_config`` when present, else the config itself)."""
    return config.get("text_config") or config


def quantization_scheme(config: dict) -> str:
    """The trunk's base quantization as ``affine/int4/g64``, or ``float`` for an unquantized trunk."""
    q = config.get("quantization") or config.get("quantization_config") or text_config(config).get("quantization")
    if not q or "bits" not in q:
        return "float"
    return f"{q.get('mode', 'affine')}/int{q['bits']}/g{q.get('group_size', 64)}"


def mismatches(recipient: dict, donor: dict) -> list[str]:
    """Every way ``donor``'s head cannot serve ``recipient``'s trunk, one line each; both are config.json dicts (for a
    head-only donor, ``head_config``)."""
    r, d = text_config(recipient), text_config(donor)
    out = [f"{f}: recipient {r.get(f)} vs donor {d.get(f)}" for f in FIELDS
           if f in d and r.get(f, d[f]) != d[f]]
    if "quantization_scheme" in donor:
        scheme = donor["quantization_scheme"]
    else:
        scheme = quantization_scheme(donor)
    if scheme not in ("unknown", "float") and quantization_scheme(recipient) != scheme:
        out.append(f"base quantization: recipient {quantization_scheme(recipient)} vs donor {scheme}")
    return out


def head_config(shapes: dict[str, tuple]) -> dict:
    """A donor config from a head's own ``{canonical: shape}``: ``hidden_size`` from its norms, scheme unknown."""
    hidden = shapes.get("pre_fc_norm_hidden.weight", shapes.get("norm.weight", (None,)))[0]
    return {"hidden_size": hidden, "quantization_scheme": "unknown"}
