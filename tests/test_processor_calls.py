"""Logits processors see exactly the token sequences they see in stock decoding, to the end of a generation.

A recording processor (it keeps the token sequence of each call) gets the same list of calls with MTP as with stock
decoding: greedy, draft depths 1-8 and adaptive, every ``max_tokens`` from 1 to 12, for mlx-lm's ``generate_step``,
the server's batched rows (mlx-lm's ``BatchGenerator``, whose ``GenerationBatch`` calls a row's processors once per
step) and mlx-vlm's ``generate_step``; also when the consumer stops early or a row ends on a stop token, and,
sampled, the calls follow the emitted tokens. Stock feeds the token after the last one it emits (and calls the
processors on it); a rejected draft is never shown to them. The trained tiny checkpoint in float32: its head is often
right, so verify passes end at every position.
"""

import importlib

import mlx.core as mx
import pytest
from helpers.builders import to_float32
from helpers.console_runs import HF
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from mtp_plugin.adapters import mlx_lm_server
from mtp_plugin.adapters.mlx_lm_server import MTPRequest
from mtp_plugin.adapters.patching import release

PROMPT = 'def read_config(path):\n    """Read a JSON configuration file."""\n'
BATCH_PROMPTS = ["def fib(n):", "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path", "for i in (",
                 "x", "    return self._data[key]\n", "def main():\n    parser = argparse.ArgumentParser("]
MAX_TOKENS = range(1, 13)
DEPTHS = [*range(1, 9), 0]  # 0: adaptive
# mlx-lm < 0.32 batches right-padded prompts into GatedDeltaNet state (``test_batching.py``): there stock's record is
# that of the rows batched together, elsewhere that of each row alone.
ALONE_IS_REFERENCE = release("mlx-lm") >= (0, 32)


class Recorder:
    """A logits processor that records the token sequence of every call and leaves the logits as they are."""

    def __init__(self):
        self.calls = []

    def __call__(self, tokens, logits):
        self.calls.append(tokens.tolist())
        return logits


@pytest.fixture(scope="module")
def trained():
    """The bundled trained checkpoint in float32 through mlx-lm, and its tokenizer."""
    from mlx_lm import load

    model, tokenizer = load(str(HF))
    return to_float32(model), tokenizer


def mlx_lm_record(model, prompt, stop=None, **kwargs):
    """``(tokens, calls)`` of mlx-lm's ``generate_step`` (as patched now) with a recording processor; ``stop``: the
    consumer closes the generator after that many tokens."""
    recorder = Recorder()
    extra = kwargs.pop("processors", [])
    generator = importlib.import_module("mlx_lm.generate").generate_step(
        mx.array(prompt), model, logits_processors=[recorder, *extra], **kwargs)
    out = []
    for token, _ in generator:
        out.append(token)
        if len(out) == stop:
            break
    generator.close()
    return out, recorder.calls


@pytest.fixture(scope="module")
def stock_single(trained):
    """Stock mlx-lm's record at each ``max_tokens``."""
    model, tokenizer = trained
    prompt = tokenizer.encode(PROMPT)
    return {m: mlx_lm_record(model, prompt, max_tokens=m, enable_mtp=False) for m in MAX_TOKENS}


@pytest.mark.parametrize("depth", DEPTHS)
def test_generate_step_calls_as_stock(trained, stock_single, depth):
    model, tokenizer = trained
    prompt, accepted = tokenizer.encode(PROMPT), 0
    for m in MAX_TOKENS:
        assert mlx_lm_record(model, prompt, max_tokens=m, mtp_depth=depth) == stock_single[m], f"max_tokens={m}"
        accepted += model.mtp_head.stats.accepted
    assert accepted > 0 or depth == 0  # drafts were accepted: verify passes were read past their first position


@pytest.mark.parametrize("depth", [2, 8])
def test_calls_when_the_consumer_stops(trained, depth):
    """A consumer that stops after k tokens (an end of sequence it detects itself), inside a block or at its end:
    the processors have seen the k tokens and nothing after them, as with stock."""
    model, tokenizer = trained
    prompt = tokenizer.encode(PROMPT)
    for k in MAX_TOKENS:
        stock = mlx_lm_record(model, prompt, stop=k, max_tokens=40, enable_mtp=False)
        assert mlx_lm_record(model, prompt, stop=k, max_tokens=40, mtp_depth=depth) == stock, f"stopped after {k}"


@pytest.mark.parametrize("depth", [1, 3, 0])
def test_sampled_calls_follow_the_emitted_tokens(trained, stock_single, depth):
    """Exact rejection sampling, with a repetition penalty after the recorder: one call per emitted token, with every
    token up to it, and the call for the last one (a draft the sampler rejects is never shown)."""
    model, tokenizer = trained
    prompt = tokenizer.encode(PROMPT)
    history = stock_single[1][1][0]  # what stock shows of the prompt (mlx-lm < 0.32: its last token only)
    drafted = 0
    for m in (1, 6, 12):
        mx.random.seed(m)
        out, calls = mlx_lm_record(model, prompt, max_tokens=m, mtp_depth=depth, sampler=make_sampler(temp=1.0),
                                   processors=make_logits_processors(repetition_penalty=1.3))
        assert calls == [history + out[:k] for k in range(m + 1)]
        drafted += model.mtp_head.stats.drafted
    assert drafted > 0


def batch_records(model, prompts, max_tokens, depth=None, stop_tokens=None, sampler=None) -> list:
    """Per row, ``(tokens, calls)`` of the rows decoded by mlx-lm's own ``BatchGenerator`` (``depth`` None: stock; each
    row alone where that is stock's reference), or by the server's, every row at ``depth`` (0: adaptive); rows end
    after ``max_tokens`` (per row) or on a stop sequence of ``stop_tokens``; ``sampler``: every row's (None: greedy)."""
    if depth is None:
        generator_class = importlib.import_module("mlx_lm.generate").BatchGenerator
        groups = [[i] for i in range(len(prompts))] if ALONE_IS_REFERENCE else [list(range(len(prompts)))]
    else:
        generator_class = importlib.import_module("mlx_lm.server").BatchGenerator
        groups = [list(range(len(prompts)))]
    records = {}
    for group in groups:
        generator = generator_class(model, completion_batch_size=len(prompts), prefill_batch_size=len(prompts),
                                    stop_tokens=stop_tokens)
        recorders, uids = {i: Recorder() for i in group}, {}
        for i in group:  # one request at a time, as the server inserts them, its options carried by its processors
            carried = mlx_lm_server.RequestProcessors([recorders[i]])
            carried.mtp = None if depth is None else MTPRequest(True, depth)
            uids[i] = generator.insert([prompts[i]], max_tokens=[max_tokens[i]],
                                       samplers=[sampler or make_sampler(0.0)], logits_processors=[carried])[0]
        tokens = {}
        while responses := generator.next_generated():
            for r in responses:
                tokens.setdefault(r.uid, []).append(r.token)
        records.update({i: (tokens[uids[i]], recorders[i].calls) for i in group})
    return [records[i] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def batch_case(trained):
    """Twelve rows, one for each ``max_tokens`` 1-12, and stock's record of each."""
    model, tokenizer = trained
    prompts = [tokenizer.encode(BATCH_PROMPTS[m % len(BATCH_PROMPTS)]) for m in MAX_TOKENS]
    max_tokens = list(MAX_TOKENS)
    return prompts, max_tokens, batch_records(model, prompts, max_tokens)


@pytest.mark.parametrize("depth", DEPTHS)
def test_batched_rows_calls_as_stock(trained, batch_case, depth):
    """Rows finishing at every length, on an accepted draft, a correction or a bonus token, in cycles, in pipelined
    plain steps and where those end (adaptive batches start parked and probe)."""
    model, _ = trained
    prompts, max_tokens, stock = batch_case
    assert batch_records(model, prompts, max_tokens, depth) == stock


@pytest.mark.parametrize("depth", [2, 8, 0])
def test_batched_rows_stopping_inside_blocks_calls_as_stock(trained, batch_case, depth):
    """Rows that end on a stop token, often an accepted draft inside a verify pass: their processors see that token
    and nothing after it."""
    model, _ = trained
    prompts, _, stock = batch_case
    inside = [set(out[1:]) for out, _ in stock]
    stop = [[max(set().union(*inside), key=lambda t: sum(t in row for row in inside))]]  # in the most rows' outputs
    max_tokens = [12] * len(prompts)
    reference = batch_records(model, prompts, max_tokens, stop_tokens=stop)
    assert sum(len(out) < 12 for out, _ in reference) >= 3  # rows did stop on it
    assert batch_records(model, prompts, max_tokens, depth, stop) == reference


def test_batched_sampled_rows_calls_follow_the_emitted_tokens(trained, batch_case):
    """Exact rejection sampling per row: one call per emitted token, with the row's prompt and every token up to it,
    and the call for its last one."""
    model, _ = trained
    prompts, max_tokens, _ = batch_case
    mx.random.seed(3)
    records = batch_records(model, prompts, max_tokens, 3, sampler=make_sampler(temp=1.0))
    for prompt, (out, calls) in zip(prompts, records, strict=True):
        assert calls == [prompt + out[:k] for k in range(len(out) + 1)]


@pytest.fixture(scope="module")
def vlm_trained():
    """The bundled trained checkpoint in float32 through mlx-vlm (no vision weights), its prompt's ids, and stock
    mlx-vlm's record at each ``max_tokens``."""
    from mlx_vlm import load

    model, processor = load(str(HF), strict=False)
    to_float32(model)
    prompt = processor.tokenizer.encode(PROMPT)
    return model, prompt, {m: vlm_record(model, prompt, max_tokens=m, enable_mtp=False) for m in MAX_TOKENS}


def vlm_record(model, prompt, **kwargs):
    """``(tokens, calls)`` of mlx-vlm's ``generate_step`` (as patched now), greedy, with a recording processor."""
    recorder = Recorder()
    step = importlib.import_module("mlx_vlm.generate").generate_step
    out = [t for t, _ in step(mx.array([prompt]), model, None, None, temperature=0.0, logits_processors=[recorder],
                              **kwargs)]
    return out, recorder.calls


@pytest.mark.parametrize("depth", DEPTHS)
def test_mlx_vlm_generate_step_calls_as_stock(vlm_trained, depth):
    model, prompt, stock = vlm_trained
    for m in MAX_TOKENS:
        assert vlm_record(model, prompt, max_tokens=m, mtp_depth=depth) == stock[m], f"max_tokens={m}"
