"""``mtp-plugin verify``: measure depth-1 greedy acceptance and sweep the wiring contract.

No decoding loop: the trunk reads the text twice (teacher forcing; its hidden states before and after the final
norm), then the head runs once per wiring (3 norm readings x 2 hidden variants x 2 concat orders); for every position t
the head drafts token t+2 from (h[t], x[t+1]) and the draft counts as accepted when it equals the
trunk's own argmax at t+1. A wrong contract (hidden before/after the final norm, concat order) or a
wrong norm convention makes acceptance collapse without any error (seed 003), so every combination
is measured and the best reported; ``--write`` records it in config.json.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from tqdm import tqdm

from ..checkpoint import CheckpointError, load_tensors
from ..conventions import ABSOLUTE, CONTRACT_KEY, NORM_KEY, ZERO_CENTRED, Contract
from ..files import atomic_write, check_replaceable
from ..plugins import hook
from ..usage import UsageError
from .report import inspect_dir

MAX_TOKENS = 1024
MIN_TOKENS = 2  # a draft of token t+2 from (h[t], x[t+1]) needs two tokens
MIN_ACCEPTANCE = 0.05  # below this the head's drafts are almost never accepted


@dataclass(frozen=True)
class Candidate:
    """One wiring tried: norm reading, trunk hidden variant, concat order, and its acceptance (0..1)."""

    norms: str
    hidden: str
    concat_order: str
    acceptance: float


def _norm_sets(loaded) -> dict[str, tuple[dict, dict]]:
    """For each norm reading of the loaded head ``loaded``: (norm weights as the head should load them, conventions
    to record). "decided" is the loader's own reading: the files' evidence, settled by the head's predictions where
    the files leave it open (``settle.py``)."""
    location = loaded.location
    stored = hook().mtp_sanitize_head(weights=load_tensors(list(location.tensors.values())),
                                      config=location.config)
    loaded_weights = dict(tree_flatten(loaded.module.parameters()))
    names = sorted(loaded.norms)
    return {
        "decided": ({n: loaded_weights[n] for n in names}, {n: d.convention for n, d in loaded.norms.items()}),
        "stored_absolute": ({n: stored[n] for n in names}, dict.fromkeys(names, ABSOLUTE)),
        "all_zero_centred": ({n: (stored[n].astype(mx.float32) + 1).astype(stored[n].dtype) for n in names},
                             dict.fromkeys(names, ZERO_CENTRED)),
    }


def sweep(model, tokens: mx.array) -> list[Candidate]:
    """Acceptance of every wiring for trunk ``model`` (with ``model.mtp_head``) on ``tokens`` (T,), best first."""
    loaded = model.mtp_head
    head = loaded.module
    original = dict(head.parameters())
    trunks = {h: hook().mtp_trunk(model=model, contract=Contract(hidden=h)) for h in ("post_norm", "pre_norm")}
    inputs = tokens[None]
    wirings = list(itertools.product(("post_norm", "pre_norm"), ("embedding_first", "hidden_first")))
    norm_sets = _norm_sets(loaded)
    hidden = {}
    for h, t in tqdm(trunks.items(), desc="verify: trunk passes", unit="pass"):
        hidden[h] = t.hidden(inputs, None)
        mx.eval(hidden[h])
    target = mx.argmax(trunks["post_norm"].trunk_logits(hidden["post_norm"]), axis=-1)[0, 1:]
    embeddings = trunks["post_norm"].embed(inputs[:, 1:])
    progress = tqdm(total=len(norm_sets) * len(wirings), desc="verify: head passes (wiring sweep)", unit="pass")
    results = []
    try:
        for norms, (weights, _) in norm_sets.items():
            head.load_weights(list(weights.items()), strict=False)
            for h, order in wirings:
                head.contract = Contract(hidden=h, concat_order=order)
                draft = mx.argmax(trunks[h].logits(head(hidden[h][:, :-1], embeddings)), axis=-1)[0]
                results.append(Candidate(norms, h, order, (draft == target).mean().item()))
                progress.update()
    finally:
        progress.close()
        head.update(original)
        head.contract = Contract.from_metadata({**loaded.location.metadata, **loaded.location.config})
    return sorted(results, key=lambda c: -c.acceptance)


def verify(model_dir: Path, text: str, write: bool = False) -> dict:
    """Load ``model_dir`` with the installed runtime, sweep the wiring on ``text``, maybe record the best.

    Returns:
        ``{"best": …, "current": …, "candidates": [...], "written": bool, "head_trained": bool, "problems": [...],
        …}`` (acceptances in 0..1; ``head_trained`` is inspect's verdict on the head's statistics; ``problems`` says
        why the head is not usable, one line each: the best wiring accepting under ``MIN_ACCEPTANCE``, random
        initialisation, or whatever else inspect reports; empty when it is usable).

    Raises:
        UsageError: ``write`` and config.json or ``model_dir`` is read-only; ``text`` shorter than two tokens.
        CheckpointError: no usable head in ``model_dir``.
    """
    if write:
        check_replaceable(Path(model_dir) / "config.json")
    model, tokenizer = hook().mtp_load_model(model_dir=model_dir)
    if getattr(model, "mtp_head", None) is None:
        raise CheckpointError(f"{model_dir}: no usable MTP head; run `mtp-plugin inspect {model_dir}`")
    tokens = mx.array(tokenizer.encode(text)[:MAX_TOKENS])
    if tokens.size < MIN_TOKENS:
        raise UsageError(f"the prompt text has {tokens.size} token(s); verify needs at least {MIN_TOKENS} "
                         "(pass a longer --prompt-file)")
    candidates = sweep(model, tokens)
    contract = model.mtp_head.module.contract
    current = next(c for c in candidates if c.norms == "decided" and c.hidden == contract.hidden
                   and c.concat_order == contract.concat_order)
    best = candidates[0]
    if write:
        _write_config(Path(model_dir), model.mtp_head, best)
    report = inspect_dir(Path(model_dir))
    problems = list(report["problems"])
    if best.acceptance < MIN_ACCEPTANCE:
        problems.append(f"even the best wiring ({best.norms} norms, {best.hidden} hidden, {best.concat_order}) "
                        f"accepts {best.acceptance:.3f} of depth-1 drafts, under {MIN_ACCEPTANCE}: the head does not "
                        "fit this trunk (graft the head of the same base model) or is untrained")
    return {"tokens": tokens.size, "best": asdict(best), "current": asdict(current),
            "candidates": [asdict(c) for c in candidates], "written": write,
            "head_trained": report["head_trained"], "head_trained_evidence": report.get("head_trained_evidence"),
            "problems": problems}


def _write_config(model_dir: Path, loaded, best: Candidate) -> None:
    """Record the winning contract and norm conventions of ``loaded`` (the head) in config.json (atomic replace,
    mode kept)."""
    config = dict(loaded.location.config)
    config[CONTRACT_KEY] = Contract(hidden=best.hidden, concat_order=best.concat_order).to_json()
    config[NORM_KEY] = json.dumps(_norm_sets(loaded)[best.norms][1])
    atomic_write(model_dir / "config.json", lambda tmp: tmp.write_text(json.dumps(config, indent=2)))
