"""``mtp-plugin tune``: measure plain decoding and draft depths 1..N on a code prompt suite, record the fastest.

The recommended depth must beat plain decoding by ``MARGIN`` (speedup: the median over repeated runs of
its tokens per second ÷ plain's in the same run); otherwise plain decoding is recommended (recorded as
depth 0: the adaptive controller then starts parked). The record goes to the user cache (``tuning.py``)
and, with ``write``, to config.json; ``mlx_lm.generate`` with automatic depth starts its adaptive
controller there.

Then the draft vocabulary (``draft_vocab.py``): token frequencies from the model's own greedy output on the suite
(and a user's text file), a subset of each size of ``draft_vocab.candidate_sizes`` ranked by them, each measured at
the best depth (depth 1 when plain decoding won) beside the full vocabulary in the same run. The fastest subset is
kept when it beats the full vocabulary at that depth by ``MARGIN``, and the depth is then recommended if the subset
makes it beat plain decoding by ``MARGIN``; otherwise the full vocabulary is kept. The subset goes with the record
and, with ``write``, to ``mtp_draft_vocab.json`` beside the model.
"""

from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path

from .. import tuning
from ..files import check_replaceable
from ..head import draft_vocab
from ..loading.checkpoint import CheckpointError
from ..plugins import hook
from ..usage import UsageError, check
from . import measure

MARGIN = 0.02  # a depth is recommended only if at least 2 % faster than plain decoding


def summarise(results: dict[str, measure.Result]) -> list[dict]:
    """Per candidate: name, tokens/s (median), speedup vs plain, tokens per cycle, acceptance by depth.

    The speedup is the median over repeats of the candidate's tokens/s ÷ plain's in the same repeat
    (paired, so that a change of machine speed between repeats cancels).
    """
    plain = results["plain"].runs
    rows = []
    for name, r in results.items():
        speedup = statistics.median(mine / theirs for mine, theirs in zip(r.runs, plain, strict=True))
        rows.append({"name": name, "tokens_per_second": r.tokens_per_second, "speedup": speedup,
                     "runs": r.runs,
                     "tokens_per_cycle": r.stats.tokens_per_cycle if r.stats else None,
                     "acceptance_by_depth": r.stats.acceptance_by_depth if r.stats else None,
                     "passes_per_token": r.stats.passes_per_token if r.stats else 1.0})
    return rows


def check_measure_options(depths: int, max_tokens: int, repeats: int) -> None:
    """Refuse out-of-range options of tune and bench (``usage.RANGES``) before anything is loaded.

    Raises:
        UsageError: the option, its range and the value given.
    """
    for option, value in (("depths", depths), ("max_tokens", max_tokens), ("repeats", repeats)):
        check(option, value)


def load(model_dir: Path):
    """``(model, tokenizer)`` through the installed runtime, with a usable head.

    Raises:
        CheckpointError: no usable head.
    """
    model, tokenizer = hook().mtp_load_model(model_dir=model_dir)
    if getattr(model, "mtp_head", None) is None:
        raise CheckpointError(f"{model_dir}: no usable MTP head; run `mtp-plugin inspect {model_dir}`")
    return model, tokenizer


def token_counts(decode, prompts: list[list[int]], max_tokens: int, text: list[int] | None) -> Counter:
    """Token id → occurrences in the model's greedy output (``decode(prompt, max_tokens, None)``: plain decoding) on
    each prompt, plus in ``text`` (a user's text file's token ids, or None)."""
    counts = Counter(text or [])
    for prompt in prompts:
        counts.update(decode(prompt, max_tokens, None))
    return counts


def _vocabulary(model, loaded, decoder, prompts, depth: int, max_tokens: int, repeats: int,
                text: list[int] | None) -> dict:
    """Measure the candidate draft vocabularies at ``depth`` with ``decoder`` (``measure.runtime_decoder``'s
    ``(decode, stats)``; module docstring); leaves ``loaded.draft_vocab`` None.

    Returns:
        ``{"depth": depth, "candidates": summarise rows ("plain", "depth D", "depth D S=k" …), "size": the chosen
        k or None (full vocabulary), "token_ids": the chosen ids or None, "speedup": the chosen row's speedup over
        plain}``.
    """
    trunk = hook().mtp_trunk(model=model, contract=loaded.module.contract)
    if not hasattr(trunk, "logits_over"):  # a family's trunk that cannot project onto a subset
        return {"depth": depth, "candidates": [], "size": None, "token_ids": None, "speedup": None}
    counts = token_counts(decoder[0], prompts, max_tokens, text)
    vocab_size = trunk.vocab_size()
    subsets = {f"depth {depth} S={k}": draft_vocab.rank(counts, vocab_size, k)
               for k in draft_vocab.candidate_sizes(vocab_size) if k < vocab_size}
    vocabs = {name: draft_vocab.build(trunk, ids, "tune") for name, ids in subsets.items()}

    def setup(name):
        loaded.draft_vocab = vocabs.get(name)

    full = f"depth {depth}"
    candidates = {"plain": None, full: depth, **dict.fromkeys(vocabs, depth)}
    try:
        results = measure.candidates(*decoder, prompts, candidates, max_tokens, repeats, "tune: draft vocabulary",
                                     setup)
    finally:
        loaded.draft_vocab = None
    rows = summarise(results)
    by_name = {r["name"]: r for r in rows}
    versus_full = {name: statistics.median(a / b for a, b in zip(results[name].runs, results[full].runs,
                                                                  strict=True)) for name in vocabs}
    best = max(versus_full, key=versus_full.get, default=None)
    if best is None or versus_full[best] < 1 + MARGIN:
        return {"depth": depth, "candidates": rows, "size": None, "token_ids": None,
                "speedup": by_name[full]["speedup"]}
    return {"depth": depth, "candidates": rows, "size": len(subsets[best]), "token_ids": subsets[best],
            "speedup": by_name[best]["speedup"]}


def read_text(path: Path | None) -> str | None:
    """A user's UTF-8 text file (None: no file).

    Raises:
        UsageError: the file cannot be read as UTF-8 text.
    """
    if path is None:
        return None
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: cannot be read as text ({e}); pass a UTF-8 text file") from None


def tune(model_dir: Path, depths: int = 3, max_tokens: int = 128, repeats: int = 3, write: bool = False,
         vocab_text: Path | None = None) -> dict:
    """Measure and record the best depth and draft vocabulary for ``model_dir`` on this machine.

    Args:
        model_dir: model directory with a head.
        depths: fixed depths 1..depths are measured.
        max_tokens: tokens per prompt.
        repeats: repeats of the suite (medians).
        write: also record the depth in config.json and the draft vocabulary in ``mtp_draft_vocab.json``.
        vocab_text: a UTF-8 text file whose tokens count towards the draft vocabulary's frequencies, or None.

    Returns:
        ``{"candidates": [...summarise rows], "depth": recommended (0: plain), "vocabulary": see ``_vocabulary``,
        "cache": path, "written": bool}``.

    Raises:
        UsageError: ``depths``, ``max_tokens`` or ``repeats`` out of range (``usage.RANGES``); ``write`` and
            config.json, ``mtp_draft_vocab.json`` or their directory read-only (checked before measuring);
            ``vocab_text`` unreadable.
        CheckpointError: no usable head.
    """
    check_measure_options(depths, max_tokens, repeats)
    if write:
        check_replaceable(Path(model_dir) / "config.json")
        vocab_file = Path(model_dir) / draft_vocab.FILE_NAME
        if vocab_file.exists() and not vocab_file.is_file():
            raise UsageError(f"{vocab_file}: not a file; remove it, or run tune without --write")
        if vocab_file.exists():
            check_replaceable(vocab_file)
    text = read_text(vocab_text)
    model, tokenizer = load(model_dir)
    loaded = model.mtp_head
    loaded.draft_vocab = None  # depths are measured over the full vocabulary
    prompts = [tokenizer.encode(p) for p in measure.code_prompts()]
    decode, stats = measure.runtime_decoder(model)
    candidates = {"plain": None, **{f"depth {d}": d for d in range(1, depths + 1)}}
    rows = summarise(measure.candidates(decode, stats, prompts, candidates, max_tokens, repeats, "tune"))
    best = max(rows[1:], key=lambda r: r["speedup"])
    depth = candidates[best["name"]] if best["speedup"] >= 1 + MARGIN else 0
    vocabulary = _vocabulary(model, loaded, (decode, stats), prompts, depth or 1, max_tokens, repeats,
                             None if text is None else tokenizer.encode(text))
    if vocabulary["size"] is not None and not depth and vocabulary["speedup"] >= 1 + MARGIN:
        depth = vocabulary["depth"]  # the subset makes drafting pay
    ids = vocabulary["token_ids"]
    results = {**{r["name"]: r["tokens_per_second"] for r in rows},
               **{f"vocabulary: {r['name']}": r["tokens_per_second"] for r in vocabulary["candidates"]}}
    if write:
        draft_vocab.write(Path(model_dir), ids, results)
    path = tuning.record(Path(model_dir), depth, results, write, ids)
    return {"candidates": rows, "depth": depth, "vocabulary": vocabulary, "cache": str(path), "written": write}
