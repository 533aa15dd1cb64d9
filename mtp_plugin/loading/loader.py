"""Load a checkpoint's MTP head for an already-loaded trunk: find, read, normalise, quantize, verify."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

from ..head import draft_vocab, health, norm_settling
from ..head.conventions import ZERO_CENTRED, Contract, NormDecision
from ..head.health import HeadHealth
from ..plugins import hook, retried_without_answerers, third_party
from .card import graft_command
from .checkpoint import CheckpointError, HeadLocation, find_head, read_config
from .diagnostics import head_statistics, judge
from .validation import Validation, validate

if TYPE_CHECKING:
    from ..decoding.stats import MTPStats

log = logging.getLogger("mtp_plugin")


@dataclass
class LoadedHead:
    """A head ready for drafting and the decisions made loading it. ``module``: the ``MTPHead`` (norms absolute,
    quantized as stored); ``norms``: ``NormDecision`` per RMSNorm weight (open ones: ``head/norm_settling.py``);
    ``quantization``: label per linear module (``int4/g64``, ``bf16`` …); ``stats``: the last generation's counters;
    ``draft_vocab``: ``head.draft_vocab.DraftVocabulary`` or None (full). What decoding keeps across generations is
    the model's ``decoding.state.ModelState``."""

    module: nn.Module
    location: HeadLocation
    norms: dict[str, NormDecision] = field(default_factory=dict)
    quantization: dict[str, str] = field(default_factory=dict)
    stats: MTPStats | None = None
    health: HeadHealth | None = None
    draft_vocab: object | None = None

    def __post_init__(self):
        if self.health is None:
            self.health = HeadHealth(", ".join(map(str, self.location.files)))

    def summary(self) -> str:
        """One line: the head's files, naming, quantization, norm conventions, draft vocabulary, why it is parked."""
        files = ", ".join(self.location.display(f) for f in self.location.files)
        quant = ",".join(sorted(set(self.quantization.values())))
        zero = sum(d.convention == ZERO_CENTRED for d in self.norms.values())
        pending = sum(not d.settled for d in self.norms.values())
        open_norms = f", {pending} read as stored until a prompt settles them" if pending else ""
        parked = f"; parked: {self.health.parked}" if self.health.parked else ""
        vocab = "" if self.draft_vocab is None else f", draft vocabulary {self.draft_vocab.size} tokens"
        return (f"head from {files} ({', '.join(self.location.naming)}), {quant}, "
                f"norms: {zero} zero-centred / {len(self.norms) - zero} absolute{open_norms}{vocab}{parked}")


def locate_head(model_dir: Path) -> HeadLocation | None:
    """``find_head``'s location of ``model_dir``'s head, for a runtime about to load the trunk; None when config.json
    cannot be read, the model type is unhandled or the head cannot be located. Never raises."""
    try:
        config = read_config(Path(model_dir))
        if config.get("model_type") not in sum(hook().mtp_model_types(), []):
            return None
        return find_head(Path(model_dir), config)
    except (CheckpointError, OSError, ValueError):
        return None


def load_head(model: nn.Module, model_dir: Path, config: dict, location: HeadLocation | None = None
              ) -> LoadedHead | None:
    """Load the head of ``model_dir`` for trunk ``model`` (at ``location`` if ``locate_head`` found it); None without a
    head or for an unhandled model type (files unread). CheckpointError: every problem ``validation.validate`` finds,
    naming file and tensor or key; what the search skipped harmlessly joins it, else is one warning."""
    if config.get("model_type") not in sum(hook().mtp_model_types(), []):
        return None
    location = location or find_head(Path(model_dir), config)
    head = hook().mtp_build_head(model=model, config=config) if location.tensors or location.unusable else None
    if head is None:
        _warn(location)
        _warn_if_dropped(location)
        return None
    validation = validate(location, head)
    if validation.problems:
        raise CheckpointError("; ".join(validation.problems + location.warnings))
    _warn(location)
    head.load_weights(list(validation.weights.items()), strict=True)  # names and shapes checked: it fits
    head.contract = Contract.from_metadata({**location.metadata, **config})
    mx.eval(head.parameters())
    _warn_if_random(location, validation)
    return LoadedHead(head, location, validation.norms, validation.quantization)


def _warn(location: HeadLocation) -> None:
    """One warning for what the search skipped (``HeadLocation.warnings``), if anything."""
    if location.warnings:
        log.warning("mtp_plugin: %s", "; ".join(location.warnings))


def _warn_if_dropped(location: HeadLocation) -> None:
    """One warning when config.json declares MTP layers but no file holds a head, naming ``card.graft_command``."""
    try:
        declared = location.declared_layers
    except CheckpointError:
        return
    if declared and not location.tensors and not location.unusable:
        log.warning("mtp_plugin: %s declares %s=%d but carries no MTP head (the conversion dropped it); decoding "
                    "without MTP. To get the head: %s", location.model_dir, location.declared_key, declared,
                    graft_command(location.model_dir))


def _warn_if_random(location: HeadLocation, validation: Validation) -> None:
    """One warning when the head's statistics say random initialisation (``diagnostics.judge``)."""
    verdict = judge(*head_statistics(validation.weights, validation.norms, validation.in_features)[:2])
    if not verdict.trained:
        log.warning("mtp_plugin: MTP head in %s looks like random initialisation (%s); it is parked if it "
                    "accepts under %d%% of its first %d draft tokens", ", ".join(map(str, location.files)),
                    verdict.evidence, round(100 * health.MIN_ACCEPTANCE), health.PROBE_DRAFTS)


def attach_head(model: nn.Module, model_dir: Path, config: dict, location: HeadLocation | None = None
                ) -> LoadedHead | None:
    """Load the head of ``model_dir`` onto ``model.mtp_head`` (a plain attribute, not a child) with its open norms
    (``norm_settling.attach``) and tuned draft vocabulary (``draft_vocab.attach``); a head that third-party plugins'
    answers broke is loaded once more without them (``plugins.retried_without_answerers``). Never raises for a bad
    head: one warning, ``mtp_head`` None, the trunk usable."""
    located = iter([None if third_party() else location, None])  # with their answers seen; a retry finds it again
    try:
        model.mtp_head = retried_without_answerers(f"the head of {model_dir}",
                                                   lambda: load_head(model, model_dir, config, next(located)),
                                                   lambda head: "no head found" if head is None else None)
        if model.mtp_head is not None:
            norm_settling.attach(model.mtp_head)
            draft_vocab.attach(model, model.mtp_head)
    except (CheckpointError, ValueError) as e:
        log.warning("mtp_plugin: MTP head ignored, decoding without it: %s", e)
        model.mtp_head = None
    return model.mtp_head
