"""An out-of-tree mtp_plugin plugin: Qwen3.5-family heads stored under ``draft_head.*`` names (say, by a training
script of your own) load as heads. One hook: the canonical name of each such tensor."""

from mtp_plugin.hookspecs import hookimpl

PREFIX = "draft_head."
MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


@hookimpl
def mtp_head_name(name, model_type, sidecar, config):
    """``draft_head.fc.weight`` -> ``fc.weight`` for the model types above; None (not mine) for anything else."""
    if model_type in MODEL_TYPES and name.startswith(PREFIX):
        return name[len(PREFIX):]
    return None
