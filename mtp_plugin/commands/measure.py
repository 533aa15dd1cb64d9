"""Decode-speed measurements shared by ``mtp-plugin tune`` and ``bench``: a code prompt suite, tokens per
second of each decoding candidate (through the runtime's own generation loop), and the cost of the
loop's parts (plain step, verify pass, draft steps) relative to a plain step; tokens per second and host cost of
each GatedDeltaNet rollback way (``rollback_ways``).

Tokens per second count the tokens after the first (the first comes from the prompt pass, the same for
every candidate) over the seconds from the first token to the last, greedy. Candidates are run
interleaved (each prompt of each repeat is decoded by every candidate in turn, in a rotating order) so that a change of
machine load hits them alike; each candidate's figure is the median over repeats of its tokens /
seconds over the suite.
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
from ..decoding.drafter import draft_logits, log_softmax, propose
from ..decoding.single import accept_greedy
from ..decoding.stats import MTPStats
from ..decoding.trunk import trunk_parts
from ..files import atomic_write
from ..plugins import hook

PROMPT_SOURCES = ("textwrap.py", "shlex.py", "string.py", "fractions.py")  # standard library, on every machine
PROMPT_CHARS = 1000


def code_prompts(sources: tuple[str, ...] = PROMPT_SOURCES) -> list[str]:
    """Code prompts: from each standard-library module, about PROMPT_CHARS characters of source ending with the
    signature line of its third function definition (the model continues the function)."""
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
    """Each prompt (token ids) preceded by earlier standard-library source, up to ``tokens`` tokens in all: the same
    function to continue, at a long context (the prompt's own beginning is kept; the filler is the suite's modules
    in full, in order, the prompt's last tokens kept).

    Args:
        prompts: token ids of the suite's prompts.
        tokens: total prompt length wanted; a prompt already that long is kept as it is.
        encode: the tokenizer's ``encode`` (text → token ids).
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    filler = encode("\n".join((stdlib / name).read_text() for name in PROMPT_SOURCES))
    return [filler[max(0, len(filler) - (tokens - len(p))):] + p if len(p) < tokens else p for p in prompts]


@dataclass
class Result:
    """One candidate's measurements.

    Attributes:
        name: ``plain``, ``depth N`` or ``adaptive``.
        tokens_per_second: median over repeats.
        runs: tokens per second of each repeat.
        generations: tokens per second of each generation, repeat by repeat, prompt by prompt.
        stats: MTP counters summed over every run (None for plain decoding).
    """

    name: str
    tokens_per_second: float
    runs: list[float]
    generations: list[float]
    stats: MTPStats | None


def write_result(out: Path, name: str, text: str) -> Path:
    """Write a benchmark's report atomically as ``out/DATE-DEVICE-NAME.txt`` (today's date, MLX's device name with
    every run of other characters than letters and digits made one ``-``), never over an earlier report: the second
    of a day is ``…-NAME-2.txt``, and so on; the path written.

    Raises:
        OSError: ``out`` cannot be created or written.
    """
    device = re.sub(r"[^A-Za-z0-9]+", "-", tuning.machine()["device_name"]).strip("-")
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{datetime.date.today().isoformat()}-{device}-{name}"
    path, n = out / f"{stem}.txt", 2
    while path.exists():
        path, n = out / f"{stem}-{n}.txt", n + 1
    atomic_write(path, lambda tmp: tmp.write_text(text))
    return path


def _timed(stream) -> tuple[int, float]:
    """(tokens after the first, seconds from the first token to the last) of one generation's token stream."""
    next(stream)
    start = time.perf_counter()
    count = sum(1 for _ in stream)
    return count, time.perf_counter() - start


def runtime_decoder(model):
    """``(decode, stats)`` for ``model`` in the installed runtime: ``decode(prompt, max_tokens, depth)`` streams
    greedy tokens (``mtp_decode`` hook), ``stats()`` the counters of the last MTP generation."""
    def decode(prompt, max_tokens, depth):
        return hook().mtp_decode(model=model, prompt=prompt, max_tokens=max_tokens, depth=depth)

    return decode, lambda: model.mtp_head.stats


def candidates(decode, stats, prompts: list[list[int]], depths: dict, max_tokens: int,
               repeats: int, label: str = "measure", setup=None) -> dict[str, Result]:
    """Measure each candidate, interleaved, with a progress bar on stderr (phases ``LABEL: warm-up``,
    ``LABEL: decode``; the candidate and repeat as its postfix). The order of the candidates rotates by one at each
    prompt of each repeat, so that each takes every place in the order alike (a run's speed depends on the run
    before it on some machines).

    Args:
        decode: ``decode(prompt, max_tokens, depth)`` → iterator of greedy token ids.
        stats: ``stats()`` → ``MTPStats`` of the last MTP generation (or None).
        prompts: token ids of each prompt.
        depths: name → depth argument of ``decode`` (None: plain decoding, 0: adaptive, 1..8).
        max_tokens: tokens generated per prompt (≥ 2: speeds count the tokens after the first).
        repeats: repeats of the whole suite (≥ 1).
        label: the command (or runtime) named in the progress bar.
        setup: ``setup(name)`` called before each run of candidate ``name`` (e.g. to give the head a draft
            vocabulary), or None.

    Returns:
        name → Result, in the order of ``depths``.
    """
    runs: dict[str, list[float]] = {name: [] for name in depths}
    generations: dict[str, list[float]] = {name: [] for name in depths}
    totals: dict[str, MTPStats | None] = dict.fromkeys(depths)
    setup = setup or (lambda name: None)
    with tqdm(total=len(depths) * (1 + repeats * len(prompts)), desc=f"{label}: warm-up", unit="run") as progress:
        for name, depth in depths.items():  # warm-up: first calls allocate and trace
            progress.set_postfix_str(name)
            setup(name)
            _timed(decode(prompts[0], 8, depth))
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
                    n, s = _timed(decode(prompt, max_tokens, depth))
                    progress.update()
                    tokens[name], seconds[name] = tokens[name] + n, seconds[name] + s
                    generations[name].append(n / s)
                    if depth is not None and stats() is not None:
                        totals[name] = totals[name] or MTPStats(depth or None)
                        totals[name].add(stats())
            for name in depths:
                runs[name].append(tokens[name] / seconds[name])
    return {name: Result(name, statistics.median(runs[name]), runs[name], generations[name], totals[name])
            for name in depths}


class _Warm:
    """A model's trunk and head caches filled with a prompt (all but its last token's pair for the head), to time
    the loop's parts on: ``last_hidden`` (1, 1, H) and ``token`` (1,) are the prompt's last."""

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
        """Build a whole cycle's graph (d draft steps, the verify pass, greedy acceptance), evaluate it, then build
        its commit at a rejection of the first draft (only the newest token kept, as the cache grows by one token a
        measurement) and evaluate that.

        Returns:
            ``(build, commit, recorder)``: seconds building the cycle's graph, seconds building the commit (neither
            evaluating), and the pass's recorder.
        """
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
    """Seconds of the loop's parts with a warm cache, each ending in one host sync, medians over ``repeats``.

    Args:
        vocab: a ``draft_vocab.DraftVocabulary``: draft steps are also timed with their logits over its subset
            (``draft_subset``); None: full vocabulary only.

    Returns:
        ``{"plain": t(1), "verify": {k: t_verify(k)}, "draft": {d: t_draft(d)}, "draft_subset": {d: …},
        "host": {d: …}, "layers": trunk layers}``: a plain step (1-token trunk pass, logits, log-softmax, argmax); a
        verify pass of k = 2..max_depth+1 tokens with rollback capture, its logits and log-softmax; d = 1..max_depth
        draft steps of the head with its output projection and argmax (``draft_subset`` only with ``vocab``); the
        host's share of a cycle at depth d: building its graph (drafts over ``vocab`` when given, verify pass,
        acceptance) and its commit at a rejection, without evaluating them (``host[0]``: building a plain step's
        graph). Seconds.
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
    """MTP decoding at ``depth`` with each rollback way forced in turn (``rollback.force``), interleaved as
    ``candidates`` runs them, and the host's share of a cycle with each.

    Returns:
        ``{"auto": the way "auto" takes on this backend, way: {"tokens_per_second": median, "runs": [...],
        "host": seconds building a cycle's graph and its commit at a rejection, median of 30}}``; only
        ``{"auto": None}`` for a trunk whose caches are all trimmable (no way to choose).
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
