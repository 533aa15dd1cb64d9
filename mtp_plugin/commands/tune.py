"""``mtp-plugin tune``: measure plain decoding and draft depths 1..N on the code prompt suite, then draft vocabularies
at the best depth; record the fastest (``tuning.py``). Usage: docs/commands.md#tune.
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
    """Per candidate: name, tokens/s (median), speedup (median over repeats of tokens/s ÷ plain's in the same
    repeat), tokens per cycle, acceptance by depth, trunk passes per token, prompts whose tokens differed from the
    first candidate's (``measure.Result.differs``); ``results`` must hold ``plain``."""
    plain = results["plain"].runs
    rows = []
    for name, r in results.items():
        speedup = statistics.median(mine / theirs for mine, theirs in zip(r.runs, plain, strict=True))
        rows.append({"name": name, "tokens_per_second": r.tokens_per_second, "speedup": speedup,
                     "runs": r.runs,
                     "tokens_per_cycle": r.stats.tokens_per_cycle if r.stats else None,
                     "acceptance_by_depth": r.stats.acceptance_by_depth if r.stats else None,
                     "passes_per_token": r.stats.passes_per_token if r.stats else 1.0, "differs": r.differs})
    return rows


def check_measure_options(depths: int, max_tokens: int, repeats: int) -> None:
    """Raise ``UsageError`` for an option of tune or bench out of ``usage.RANGES``."""
    for option, value in (("depths", depths), ("max_tokens", max_tokens), ("repeats", repeats)):
        check(option, value)


def load(model_dir: Path):
    """``(model, tokenizer)`` through the installed runtime; ``CheckpointError`` without a usable head."""
    model, tokenizer = hook().mtp_load_model(model_dir=model_dir)
    if getattr(model, "mtp_head", None) is None:
        raise CheckpointError(f"{model_dir}: no usable MTP head; run `mtp-plugin inspect {model_dir}`")
    return model, tokenizer


def token_counts(decode, prompts: list[list[int]], max_tokens: int, text: list[int] | None) -> Counter:
    """Token id → occurrences in plain greedy output on each prompt plus in ``text`` (token ids, or None)."""
    counts = Counter(text or [])
    for prompt in prompts:
        counts.update(decode(prompt, max_tokens, None))
    return counts


def _vocabulary(model, loaded, decoder, prompts, depth: int, max_tokens: int, repeats: int,
                text: list[int] | None) -> dict:
    """Measure the candidate draft vocabularies at ``depth`` (``decoder``: ``measure.runtime_decoder``'s pair);
    leaves ``loaded.draft_vocab`` None. A subset is chosen only when it beats the full vocabulary by ``MARGIN``.

    Returns:
        ``{"depth", "candidates": summarise rows ("plain", "depth D", "depth D S=k"…), "size": k or None (full
        vocabulary), "token_ids": ids or None, "speedup": the chosen row's over plain}``.
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
    """A UTF-8 text file's content (None: no file); ``UsageError`` when it cannot be read as text."""
    if path is None:
        return None
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: cannot be read as text ({e}); pass a UTF-8 text file") from None


def tune(model_dir: Path, depths: int = 3, max_tokens: int = 128, repeats: int = 3, write: bool = False,
         vocab_text: Path | None = None) -> dict:
    """Measure and record the best depth (0: plain, when no depth beats it by ``MARGIN``) and draft vocabulary
    for ``model_dir`` on this machine.

    Args:
        depths: fixed depths 1..depths are measured; max_tokens: tokens per prompt; repeats: runs of the suite.
        write: also record the depth in config.json and the draft vocabulary in ``mtp_draft_vocab.json``.
        vocab_text: a UTF-8 text file whose tokens count towards the draft vocabulary's frequencies, or None.

    Returns:
        ``{"candidates": summarise rows, "depth", "vocabulary": see ``_vocabulary``, "cache": path, "written"}``.

    Raises:
        UsageError: options out of ``usage.RANGES``; ``write`` with config.json, ``mtp_draft_vocab.json`` or their
            directory read-only (checked before measuring); ``vocab_text`` unreadable.
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
