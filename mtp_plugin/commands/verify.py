"""``mtp-plugin verify``: teacher-forced depth-1 greedy acceptance (the head's draft of x[t+2] from (h[t], x[t+1])
against the trunk's argmax at t+1) under every wiring contract and norm reading. Usage: docs/commands.md#verify.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
from tqdm import tqdm

from ..files import atomic_write, check_replaceable
from ..head import norm_settling
from ..head.conventions import ABSOLUTE, CONTRACT_KEY, NORM_KEY, ZERO_CENTRED, Contract
from ..loading.checkpoint import CheckpointError, load_tensors
from ..plugins import hook
from ..usage import UsageError
from .inspect import inspect_dir

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


def _norm_sets(loaded, score) -> tuple[dict[str, dict[str, str]], dict[str, dict[str, mx.array]]]:
    """``(readings, weights)``: each norm reading as conventions per norm (``decided``, ``stored_absolute``,
    ``all_zero_centred``, ``per_tensor`` when ``score`` is given and it differs), and each norm's weight under each."""
    location = loaded.location
    stored = hook().mtp_sanitize_head(weights=load_tensors(list(location.tensors.values())),
                                      config=location.config)
    names = sorted(loaded.norms)
    candidates = {n: norm_settling.readings(stored[n]) for n in names}
    decided = {n: loaded.norms[n].convention for n in names}
    sets = {"decided": decided, "stored_absolute": dict.fromkeys(names, ABSOLUTE),
            "all_zero_centred": dict.fromkeys(names, ZERO_CENTRED)}  # on a tie the first wins
    if score is not None:
        per_tensor = norm_settling.search(loaded.module, candidates, decided, score)[0]
        if per_tensor not in sets.values():
            sets["per_tensor"] = per_tensor
    return sets, candidates


def sweep(model, tokens: mx.array) -> tuple[list[Candidate], dict[str, dict[str, str]]]:
    """Every wiring's acceptance on ``tokens`` (T,), best first (the first swept on a tie), and each norm reading's
    conventions; open norms are settled on ``tokens`` first (``head.norm_settling.on_prompt``)."""
    loaded = model.mtp_head
    head = loaded.module
    trunks = {h: hook().mtp_trunk(model=model, contract=Contract(hidden=h)) for h in ("post_norm", "pre_norm")}
    inputs = tokens[None]
    wirings = list(itertools.product(("post_norm", "pre_norm"), ("embedding_first", "hidden_first")))
    hidden = {}
    for h, t in tqdm(trunks.items(), desc="verify: trunk passes", unit="pass"):
        hidden[h] = t.hidden(inputs, None)
        mx.eval(hidden[h])
    target = mx.argmax(trunks["post_norm"].trunk_logits(hidden["post_norm"]), axis=-1)[0, 1:]
    embeddings = trunks["post_norm"].embed(inputs[:, 1:])
    own = head.contract.hidden
    _, head_cache = hook().mtp_new_caches(model=model)
    norm_settling.on_prompt(head, trunks[own], hidden[own][:, :-1], tokens[1:], head_cache)
    original = dict(head.parameters())
    results, progress = [], None
    try:
        score = None if tokens.size - 2 < norm_settling.MIN_POSITIONS else norm_settling.prompt_score(
            head, trunks[own], hidden[own][:, :-1], tokens[1:], head_cache)
        norm_sets, candidates = _norm_sets(loaded, score)
        progress = tqdm(total=len(norm_sets) * len(wirings), desc="verify: head passes (wiring sweep)", unit="pass")
        for norms, conventions in norm_sets.items():
            head.load_weights([(n, candidates[n][c]) for n, c in conventions.items()], strict=False)
            for h, order in wirings:
                head.contract = Contract(hidden=h, concat_order=order)
                draft = mx.argmax(trunks[h].logits(head(hidden[h][:, :-1], embeddings)), axis=-1)[0]
                results.append(Candidate(norms, h, order, (draft == target).mean().item()))
                progress.update()
    finally:
        if progress is not None:
            progress.close()
        head.update(original)
        head.contract = Contract.from_metadata({**loaded.location.metadata, **loaded.location.config})
    return sorted(results, key=lambda c: -c.acceptance), norm_sets


def verify(model_dir: Path, text: str, write: bool = False) -> dict:
    """Load ``model_dir`` with the installed runtime, sweep the wiring on ``text`` (first ``MAX_TOKENS`` tokens),
    and with ``write`` record the best in config.json.

    Returns:
        ``{"best", "current", "candidates", "written", "head_trained", "problems", …}``: acceptances in 0..1;
        ``problems`` (empty when the head is usable): inspect's, plus the best accepting under ``MIN_ACCEPTANCE``.

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
    candidates, norm_sets = sweep(model, tokens)
    contract = model.mtp_head.module.contract
    current = next(c for c in candidates if c.norms == "decided" and c.hidden == contract.hidden
                   and c.concat_order == contract.concat_order)
    best = candidates[0]
    if write:
        _write_config(Path(model_dir), model.mtp_head, best, norm_sets[best.norms])
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


def _write_config(model_dir: Path, loaded, best: Candidate, conventions: dict[str, str]) -> None:
    """Record ``best``'s contract and the norm ``conventions`` in config.json (atomic, mode kept)."""
    config = dict(loaded.location.config)
    config[CONTRACT_KEY] = Contract(hidden=best.hidden, concat_order=best.concat_order).to_json()
    config[NORM_KEY] = json.dumps(conventions)
    atomic_write(model_dir / "config.json", lambda tmp: tmp.write_text(json.dumps(config, indent=2)))
