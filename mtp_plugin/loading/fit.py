"""One definition of "this head fits this trunk", shared by ``inspect`` and ``graft``.

Two checkpoints can share a head when their text configs agree on every field in ``FIELDS`` and
their trunks use the same base quantization scheme (bits, group size, mode): a head tuned on one
conversion reads that conversion's hidden states. An unquantized donor (the original checkpoint the
head was trained with) fits every quantization of the same base model.
"""

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
    """Every way in which ``donor``'s head cannot serve ``recipient``'s trunk, as readable lines.

    Args:
        recipient: the recipient's config.json.
        donor: the donor checkpoint's config.json (a head-only donor: use ``head_config``).
    """
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
    """What a head's own tensors say about its trunk (``hidden_size``, from its norms), as a donor config.

    Args:
        shapes: canonical head tensor name → shape.
    """
    hidden = shapes.get("pre_fc_norm_hidden.weight", shapes.get("norm.weight", (None,)))[0]
    return {"hidden_size": hidden, "quantization_scheme": "unknown"}
