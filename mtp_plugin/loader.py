"""Load a checkpoint's MTP head for an already-loaded trunk: find, read, normalise, quantize, verify."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from . import draft_vocab, health, settle
from .checkpoint import CheckpointError, HeadLocation, find_head
from .conventions import (
    ZERO_CENTRED,
    Contract,
    NormDecision,
    describe_quantization,
    quantization_of,
)
from .diagnostics import head_statistics, judge
from .health import HeadHealth
from .plugins import hook
from .stats import MTPStats
from .validation import validate

log = logging.getLogger("mtp_plugin")


@dataclass
class LoadedHead:
    """A head ready for drafting, with the decisions made while loading it.

    Attributes:
        module: the ``MTPHead`` (weights loaded, norms absolute, quantized as stored).
        location: where its tensors came from.
        norms: convention decided per RMSNorm weight (canonical name → decision); those the files leave open are
            settled by the first prompt with enough evidence (``settle.py``).
        quantization: label per linear module path (``int4/g64``, ``bf16`` …).
        stats: counters of the last generation that used this head, or None.
        controller: the adaptive depth controller (``controller.DepthController``) of automatic-depth
            generations, created by the first and kept for the next ones (``tuning.depth_policy``).
        health: lifetime acceptance of the head and whether it is parked (``health.HeadHealth``).
        batching: a runtime adapter's state for batched MTP decoding with this head (e.g. its depth
            policies per batch size), created on first use and kept across batches.
        draft_vocab: the tuned subset of the vocabulary the head drafts from (``draft_vocab.DraftVocabulary``), or
            None: the full vocabulary.
    """

    module: nn.Module
    location: HeadLocation
    norms: dict[str, NormDecision] = field(default_factory=dict)
    quantization: dict[str, str] = field(default_factory=dict)
    stats: MTPStats | None = None
    controller: object | None = None
    health: HeadHealth | None = None
    batching: object | None = None
    draft_vocab: object | None = None

    def __post_init__(self):
        if self.health is None:
            self.health = HeadHealth(", ".join(map(str, self.location.files)))

    def summary(self) -> str:
        """One line: where the head came from, its naming, quantization and norm conventions (and why it is
        parked, if it is)."""
        files = ", ".join(self.location.display(f) for f in self.location.files)
        quant = ",".join(sorted(set(self.quantization.values())))
        zero = sum(d.convention == ZERO_CENTRED for d in self.norms.values())
        pending = sum(not d.settled for d in self.norms.values())
        open_norms = f", {pending} read as stored until a prompt settles them" if pending else ""
        parked = f"; parked: {self.health.parked}" if self.health.parked else ""
        vocab = "" if self.draft_vocab is None else f", draft vocabulary {self.draft_vocab.size} tokens"
        return (f"head from {files} ({', '.join(self.location.naming)}), {quant}, "
                f"norms: {zero} zero-centred / {len(self.norms) - zero} absolute{open_norms}{vocab}{parked}")


def load_head(model: nn.Module, model_dir: Path, config: dict) -> LoadedHead | None:
    """Load the head of ``model_dir`` for trunk ``model``; None when the directory carries no head.

    Raises:
        CheckpointError: every problem ``validation.validate`` finds (head files that cannot be read, metadata
            that does not parse, tensors missing, misshapen or not finite), or a head that does not load
            into the built module; the message names the file and the tensor or key.
    """
    location = find_head(Path(model_dir), config)
    if not location.tensors and not location.unusable:
        return None
    head = hook().mtp_build_head(model=model, config=config)
    if head is None:
        return None
    problems, weights, norms = validate(location)
    if problems:
        raise CheckpointError("; ".join(problems))
    quantization = _quantize_like(head, weights)
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        files = ", ".join(map(str, location.files))
        raise CheckpointError(
            f"{files}: head does not fit this trunk ({e}); check that the head comes from the same base "
            f"model, or re-extract it with `mtp-plugin extract`."
        ) from None
    head.contract = Contract.from_metadata({**location.metadata, **config})
    mx.eval(head.parameters())
    _warn_if_random(location, weights, norms)
    return LoadedHead(head, location, norms, quantization)


def _warn_if_random(location: HeadLocation, weights: dict, norms: dict) -> None:
    """One warning when the head's statistics say random initialisation (``diagnostics.judge``)."""
    in_features = hook().mtp_head_in_features(config=location.config) or {}
    verdict = judge(*head_statistics(weights, norms, in_features)[:2])
    if not verdict.trained:
        log.warning("mtp_plugin: MTP head in %s looks like random initialisation (%s); it is parked if it "
                    "accepts under %d%% of its first %d draft tokens", ", ".join(map(str, location.files)),
                    verdict.evidence, round(100 * health.MIN_ACCEPTANCE), health.PROBE_DRAFTS)


def _quantize_like(head: nn.Module, weights: dict) -> dict[str, str]:
    """Quantize ``head``'s linear layers exactly as stored in ``weights``; returns a label per module."""
    labels = {}

    def predicate(path, module):
        if not hasattr(module, "to_quantized") or f"{path}.weight" not in weights:
            return False
        scales = weights.get(f"{path}.scales")
        q = quantization_of(weights[f"{path}.weight"].shape, None if scales is None else scales.shape,
                            module.weight.shape[-1])
        labels[path] = describe_quantization(q, str(weights[f"{path}.weight"].dtype).split(".")[-1])
        return q or False

    nn.quantize(head, class_predicate=predicate)
    return labels



def attach_head(model: nn.Module, model_dir: Path, config: dict) -> LoadedHead | None:
    """Load the head of ``model_dir`` and keep it on ``model.mtp_head`` (a plain attribute, not a child).

    Norm conventions that the files leave open are kept open, read as stored, for the first prompt with enough
    evidence to settle them (``settle.attach``); a draft vocabulary recorded by ``mtp-plugin tune`` is attached
    (``draft_vocab.attach``).
    Never raises for a bad head: the trunk stays usable, the problem is logged once as a warning.
    """
    try:
        model.mtp_head = load_head(model, model_dir, config)
        if model.mtp_head is not None:
            settle.attach(model.mtp_head)
            draft_vocab.attach(model, model.mtp_head)
    except (CheckpointError, ValueError) as e:
        log.warning("mtp_plugin: MTP head ignored, decoding without it: %s", e)
        model.mtp_head = None
    return model.mtp_head
