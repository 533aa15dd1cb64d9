"""Decode-speed measurements shared by ``mtp-plugin tune`` and ``bench``: the code prompt suite, tokens/s of each
decoding candidate through the runtime's own loop, the loop's component costs and the rollback ways.
Method: docs/commands.md#how-tune-and-bench-measure.
"""

from __future__ import annotations

import datetime
import re
import statistics
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from tqdm import tqdm

from .. import tuning
from ..decoding import rollback
from ..decoding.acceptance import accept_greedy
from ..decoding.drafter import draft_logits, log_softmax, propose
from ..decoding.stats import MTPStats
from ..decoding.trunk import trunk_parts
from ..files import atomic_write
from ..plugins import hook

PROMPT_SOURCES = ("textwrap.py", "shlex.py", "string.py", "fractions.py")  # standard library, on every machine
FILLER_SOURCES = (*PROMPT_SOURCES, "argparse.py", "inspect.py", "typing.py")  # a long context's, about 150k tokens
PROMPT_CHARS = 1000


def code_prompts(sources: tuple[str, ...] = PROMPT_SOURCES) -> list[str]:
    """From each standard-library module, up to PROMPT_CHARS characters of source ending with its third ``def`` line."""
    prompts = []
    for name in sources:
        text = (Path(sysconfig.get_paths()["stdlib"]) / name).read_text()
        start = -1
        for _ in range(3):
            start = text.index("def ", start + 1)
        end = text.index("\n", start) + 1
        prompts.append(text[max(0, end - PROMPT_CHARS) : end])
    return prompts


def with_context(prompts: list[list[int]], tokens: int, encode) -> list[list[int]]:
    """Each prompt (token ids) preceded by the tail of the ``FILLER_SOURCES`` modules' source, up to ``tokens`` tokens
    in all (a longer prompt is kept as it is; the filler is not repeated); ``encode``: the tokenizer's text → token
    ids."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    filler = encode("\n".join((stdlib / name).read_text() for name in FILLER_SOURCES))
    return [filler[max(0, len(filler) - (tokens - len(p))):] + p if len(p) < tokens else p for p in prompts]


@dataclass
class Result:
    """One candidate's tokens/s: the median over repeats, each repeat's (``runs``), each generation's; ``stats``: MTP
    counters summed over every run (None for plain decoding); ``differs``: prompts whose tokens in the first repeat
    differed from the first candidate's (greedy: 0 is lossless on this suite)."""

    name: str
    tokens_per_second: float
    runs: list[float]
    generations: list[float]
    stats: MTPStats | None
    differs: int = 0


def write_result(out: Path, name: str, text: str) -> Path:
    """Write ``text`` atomically as ``out/DATE-DEVICE-NAME.txt`` (``-2``, ``-3``… rather than overwrite); the path.
    Raises ``OSError`` when ``out`` cannot be created or written."""
    device = re.sub(r"[^A-Za-z0-9]+", "-", tuning.machine()["device_name"]).strip("-")
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{datetime.date.today().isoformat()}-{device}-{name}"
    path, n = out / f"{stem}.txt", 2
    while path.exists():
        path, n = out / f"{stem}-{n}.txt", n + 1
    atomic_write(path, lambda tmp: tmp.write_text(text))
    return path


def _timed(stream) -> tuple[list[int], float]:
    """(the tokens, seconds from the first token to the last) of one generation's token stream."""
    tokens = [next(stream)]
    start = time.perf_counter()
    tokens.extend(stream)
    return tokens, time.perf_counter() - start


def runtime_decoder(model):
    """``(decode, stats)``: ``decode(prompt, max_tokens, depth)`` streams greedy tokens (``mtp_decode``), ``stats()``
    gives the last MTP generation's counters."""
    def decode(prompt, max_tokens, depth):
        return hook().mtp_decode(model=model, prompt=prompt, max_tokens=max_tokens, depth=depth)

    return decode, lambda: model.mtp_head.stats


def candidates(decode, stats, prompts: list[list[int]], depths: dict, max_tokens: int,
               repeats: int, label: str = "measure", setup=None, warm: list[int] | None = None) -> dict[str, Result]:
    """Measure each candidate after a warm-up, interleaved in an order rotating by one at each prompt, with a
    progress bar on stderr. Tokens/s count the tokens after the first over the seconds from the first to the last.

    Args:
        decode, stats: as ``runtime_decoder`` returns them.
        depths: name → depth argument of ``decode`` (None: plain decoding, 0: adaptive, 1..8).
        max_tokens: tokens generated per prompt (≥ 2); repeats: runs of the whole suite (≥ 1).
        setup: ``setup(name)`` called before each run of candidate ``name`` (e.g. to set a draft vocabulary), or None.
        warm: the prompt the warm-up decodes (default ``prompts[0]``; a short one spares a long prompt's prefill).

    Returns:
        name → Result, in the order of ``depths``.
    """
    runs: dict[str, list[float]] = {name: [] for name in depths}
    generations: dict[str, list[float]] = {name: [] for name in depths}
    totals: dict[str, MTPStats | None] = dict.fromkeys(depths)
    texts: dict[tuple[str, int], list[int]] = {}  # (candidate, prompt index) -> tokens of the first repeat
    setup = setup or (lambda name: None)
    with tqdm(total=len(depths) * (1 + repeats * len(prompts)), desc=f"{label}: warm-up", unit="run") as progress:
        for name, depth in depths.items():  # warm-up: first calls allocate and trace
            progress.set_postfix_str(name)
            setup(name)
            _timed(decode(prompts[0] if warm is None else warm, 8, depth))
            progress.update()
        progress.set_description(f"{label}: decode")
        order = list(depths)
        for repeat in range(repeats):
            tokens, seconds = dict.fromkeys(depths, 0.0), dict.fromkeys(depths, 0.0)
            for i, prompt in enumerate(prompts):
                shift = (repeat * len(prompts) + i) % len(order)
                for name in order[shift:] + order[:shift]:
                    depth = depths[name]
                    progress.set_postfix_str(f"{name}, run {repeat + 1}/{repeats}")
                    setup(name)
                    text, s = _timed(decode(prompt, max_tokens, depth))
                    n = len(text) - 1
                    progress.update()
                    if repeat == 0:
                        texts[name, i] = text
                    tokens[name], seconds[name] = tokens[name] + n, seconds[name] + s
                    generations[name].append(n / s)
                    if depth is not None and stats() is not None:
                        totals[name] = totals[name] or MTPStats(depth or None)
                        totals[name].add(stats())
            for name in depths:
                runs[name].append(tokens[name] / seconds[name])
    first = next(iter(depths))
    return {name: Result(name, statistics.median(runs[name]), runs[name], generations[name], totals[name],
                         sum(texts[name, i] != texts[first, i] for i in range(len(prompts)))) for name in depths}


class _Warm:
    """Trunk and head caches filled with a prompt, to time the loop's parts on; ``last_hidden`` (1, 1, H) and
    ``token`` (1,) are the prompt's last."""

    def __init__(self, model, prompt: list[int]):
        self.head = model.mtp_head.module
        self.trunk = hook().mtp_trunk(model=model, contract=self.head.contract)
        self.cache, self.head_cache = hook().mtp_new_caches(model=model)
        ids = mx.array(prompt)
        hidden = self.trunk.hidden(ids[None], self.cache)
        self.head(hidden[:, :-1], self.trunk.embed(ids[None, 1:]), cache=self.head_cache)
        mx.eval([c.state for c in self.cache], self.head_cache.state)
        self.last_hidden, self.token = hidden[:, -1:], ids[-1:]

    def cycle(self, d: int, vocab=None) -> tuple[float, float, rollback.Recorder]:
        """Build and evaluate one cycle at depth ``d``, then its commit at a rejection of the first draft (the cache
        grows by one token); ``(seconds building the graph, seconds building the commit, the rollback recorder)``."""
        trunk, head, head_cache = self.trunk, self.head, self.head_cache
        start = time.perf_counter()
        g, x, drafts = self.last_hidden, self.token, []
        for _ in range(d):
            g = head(g, trunk.embed(x[None]), cache=head_cache)
            x = propose(draft_logits(g[0], trunk, vocab), vocab=vocab)[0]
            drafts.append(x)
        inputs = mx.concatenate([self.token, *drafts])
        with rollback.capturing(d + 1) as recorder:
            h = trunk.hidden(inputs[None], self.cache)
        outcome = accept_greedy(log_softmax(trunk.trunk_logits(h[0])), inputs[1:])
        built = time.perf_counter() - start
        mx.eval(outcome)
        start = time.perf_counter()
        recorder.commit(self.cache, 1)
        committed = time.perf_counter() - start
        mx.eval([c.state for c in self.cache])
        head_cache.trim(d)
        return built, committed, recorder


def component_costs(model, prompt: list[int], max_depth: int, repeats: int = 30, vocab=None) -> dict:
    """Seconds (medians over ``repeats``, warm cache, one host sync each) of the loop's parts.

    Returns:
        ``{"plain": t(1), "verify": {k: t_verify(k)} for k = 2..max_depth+1, "draft": {d: t_draft(d)} for
        d = 1..max_depth, "draft_subset": as "draft" over ``vocab`` (only with one), "host": {d: building a cycle's
        graph and commit, unevaluated; 0: a plain step's}, "layers": trunk layers}``.
    """
    warm = _Warm(model, prompt)
    head, trunk, cache, head_cache, last_hidden, token = (warm.head, warm.trunk, warm.cache, warm.head_cache,
                                                          warm.last_hidden, warm.token)

    def plain():
        h = trunk.hidden(token[None], cache)
        mx.eval(mx.argmax(log_softmax(trunk.trunk_logits(h[0])), axis=-1))

    def verify(k):
        inputs = mx.concatenate([token] * k)
        with rollback.capturing(k) as recorder:
            h = trunk.hidden(inputs[None], cache)
        mx.eval(mx.argmax(log_softmax(trunk.trunk_logits(h[0])), axis=-1))
        recorder.commit(cache, 1)  # the cache grows by one token per measurement, as in decoding

    def draft(d, subset=None):
        g, x = last_hidden, token
        for _ in range(d):
            g = head(g, trunk.embed(x[None]), cache=head_cache)
            x = propose(draft_logits(g[0], trunk, subset), vocab=subset)[0]
        mx.eval(x)
        head_cache.trim(d)

    def host(d):
        built, committed, _ = warm.cycle(d, vocab)
        return built + committed

    def host_plain():
        start = time.perf_counter()
        token = mx.argmax(log_softmax(trunk.trunk_logits(trunk.hidden(warm.token[None], cache)[0])), axis=-1)
        built = time.perf_counter() - start
        mx.eval(token, [c.state for c in cache])
        return built

    parts = {("plain", 1): plain}
    parts.update({("verify", k): (lambda k=k: verify(k)) for k in range(2, max_depth + 2)})
    parts.update({("draft", d): (lambda d=d: draft(d)) for d in range(1, max_depth + 1)})
    if vocab is not None:
        parts.update({("draft_subset", d): (lambda d=d: draft(d, vocab)) for d in range(1, max_depth + 1)})
    parts.update({("host", d): (lambda d=d: host(d)) for d in range(1, max_depth + 1)})
    parts[("host", 0)] = host_plain
    seconds: dict = {part: [] for part in parts}
    for _ in tqdm(range(repeats), desc="bench: component costs", unit="round"):
        for part, run in parts.items():
            start = time.perf_counter()
            own = run()  # a part that times itself returns its seconds
            seconds[part].append(time.perf_counter() - start if own is None else own)
    median = {part: statistics.median(s) for part, s in seconds.items()}
    costs = {"plain": median[("plain", 1)],
             "verify": {k: median[("verify", k)] for k in range(2, max_depth + 2)},
             "draft": {d: median[("draft", d)] for d in range(1, max_depth + 1)},
             "host": {d: median[("host", d)] for d in range(max_depth + 1)},
             "layers": len(trunk_parts(model)[0].layers)}
    if vocab is not None:
        costs["draft_subset"] = {d: median[("draft_subset", d)] for d in range(1, max_depth + 1)}
    return costs


def rollback_ways(model, prompts: list[list[int]], depth: int, max_tokens: int, repeats: int,
                  ways: tuple[str, ...] = ("capture", "replay")) -> dict:
    """Decoding at ``depth`` with each rollback way forced in turn (``decoding.rollback.force``), as ``candidates``.

    Returns:
        ``{"auto": the way auto takes here, way: {"tokens_per_second", "runs", "host": seconds per cycle}}``;
        ``{"auto": None}`` when every trunk cache is trimmable.
    """
    decode, stats = runtime_decoder(model)
    warm = _Warm(model, prompts[0])
    try:
        rollback.force("auto")
        recorded = warm.cycle(depth)[2].layers.values()
        if not recorded:
            return {"auto": None}
        report = {"auto": "replay" if any(r.replay for r in recorded) else "capture"}
        results = candidates(decode, stats, prompts, dict.fromkeys(ways, depth), max_tokens, repeats,
                             "bench: rollback ways", setup=rollback.force)
        for way in ways:
            rollback.force(way)
            report[way] = {"tokens_per_second": results[way].tokens_per_second, "runs": results[way].runs,
                           "host": statistics.median(sum(warm.cycle(depth)[:2]) for _ in range(30))}
    finally:
        rollback.force(None)
    return report
