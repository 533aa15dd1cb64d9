"""`mtp-plugin tune` and `bench` on the trained tiny checkpoint: what they record, where, what generate does with it.

Speeds on a shared CPU are noise; these tests check the plumbing (records, keys, start depth, report
fields, ratios computed from the measured parts), never a timing.
"""

import importlib
import json
import os
import shutil
from collections import Counter
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.sample_utils import make_sampler

from mtp_plugin import tuning
from mtp_plugin.commands import measure, sweep
from mtp_plugin.commands.bench import _row, bench, efficiency, notes, render
from mtp_plugin.commands.cli import main
from mtp_plugin.commands.tune import token_counts
from mtp_plugin.decoding import drafter
from mtp_plugin.decoding.scheduler import context_band
from mtp_plugin.head import draft_vocab

HF = Path(__file__).resolve().parents[1] / "examples" / "tiny-qwen3_5" / "hf"
QUICK = ["--depths", "2", "--max-tokens", "6", "--repeats", "1"]


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    """A copy of the tiny checkpoint (tune --write edits config.json) and a private user cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return Path(shutil.copytree(HF, tmp_path / "model"))


def test_tune_records_in_user_cache_and_config(model_dir, capsys):
    text = model_dir / "words.txt"
    text.write_text("def parse(value):\n    return value.strip()\n" * 20)
    assert main(["tune", str(model_dir), *QUICK, "--write", "--vocab-text", str(text)]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()[1:4]] == ["plain", "depth", "depth"]
    assert "recommended:" in out and "draft vocabulary at depth" in out
    records = json.loads(tuning.cache_file().read_text())["records"]
    (record,) = records.values()
    assert record["model"] == str(model_dir.resolve())
    sizes = draft_vocab.candidate_sizes(2048)
    depth = max(record["depth"], 1)
    assert set(record["results"]) == {"plain", "depth 1", "depth 2", "vocabulary: plain", f"vocabulary: depth {depth}",
                                      *(f"vocabulary: depth {depth} S={k}" for k in sizes)}
    assert 0 <= record["depth"] <= 2
    assert json.loads((model_dir / "config.json").read_text())[tuning.CONFIG_KEY] == record["depth"]
    written = json.loads((model_dir / draft_vocab.FILE_NAME).read_text())
    assert written["token_ids"] == record["draft_vocab"]  # the subset chosen, or None: the full vocabulary
    assert record["draft_vocab"] is None or len(record["draft_vocab"]) in sizes
    assert tuning.recorded_depth(model_dir) == record["depth"]  # --write kept the key
    assert not [p for p in tuning.cache_file().parent.iterdir() if p.name.startswith(".")]  # no temp files left


def test_key_follows_weights_and_cache_beats_config(model_dir):
    tuning.record(model_dir, 3, {})
    assert tuning.recorded_depth(model_dir) == 3
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, tuning.CONFIG_KEY: 1}))
    assert tuning.recorded_depth(model_dir) == 3  # the user cache's record for this machine wins
    weights = model_dir / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # new mtime: another model for the key
    assert tuning.recorded_depth(model_dir) == 1  # falls back to config.json
    (model_dir / "config.json").write_text(json.dumps(config))
    assert tuning.recorded_depth(model_dir) is None


@pytest.mark.parametrize("recorded", [0, 2])
def test_automatic_depth_starts_at_recorded_depth(model_dir, recorded):
    tuning.record(model_dir, recorded, {})
    model, tokenizer = load(str(model_dir))
    generate_step = importlib.import_module("mlx_lm.generate").generate_step
    list(generate_step(mx.array(tokenizer.encode("def f(x):\n")), model, max_tokens=6))
    stats = model.mtp_head.stats
    if recorded == 0:  # tuning said plain: start parked
        assert stats.cycles == 0 and stats.plain == 5
    else:
        assert stats.depths[0] == recorded


def test_automatic_depth_controller_kept_across_generations(model_dir):
    model, tokenizer = load(str(model_dir))
    generate_step = importlib.import_module("mlx_lm.generate").generate_step
    measured = []
    for _ in range(2):
        list(generate_step(mx.array(tokenizer.encode("def f(x):\n")), model, max_tokens=12))
        controller = model.mtp_state.scheduler.controllers[0.0, 1, 0]
        measured.append((controller, sum(len(c) for c in controller.costs)))
    (first, before), (second, after) = measured
    assert second is first and after > before  # the second generation went on from the first's measurements
    list(generate_step(mx.array(tokenizer.encode("x")), model, max_tokens=4, mtp_depth=2))
    assert model.mtp_state.scheduler.controllers == {(0.0, 1, 0): first}  # a fixed depth leaves it alone


def test_each_temperature_keeps_its_own_controller(model_dir):
    """Acceptance, and with it the best depth, changes with the temperature: one controller per temperature."""
    model, tokenizer = load(str(model_dir))
    generate_step = importlib.import_module("mlx_lm.generate").generate_step
    prompt = mx.array(tokenizer.encode("def f(x):\n"))
    seen = []
    for temperature in (0.7, 1.0, 0.0, 0.7, 0.72):
        sampler = make_sampler(temperature) if temperature else None
        list(generate_step(prompt, model, max_tokens=8, sampler=sampler))
        seen.append(dict(model.mtp_state.scheduler.controllers))
    assert list(seen[2]) == [(0.7, 1, 0), (1.0, 1, 0), (0.0, 1, 0)]
    assert len({id(c) for c in seen[2].values()}) == 3
    assert seen[4] == seen[2]  # 0.7 again, and 0.72 (rounded to 0.7), went on with the first 0.7 controller


def test_each_context_band_keeps_its_own_controller(model_dir):
    """A verify pass costs more, and drafts are accepted less, as the context grows: one controller per context band
    (doubling from 2048 tokens), a new band starting at the nearest shorter band's choice."""
    model, tokenizer = load(str(model_dir))
    generate_step = importlib.import_module("mlx_lm.generate").generate_step
    source = Path(importlib.import_module("mlx_lm.generate").__file__).read_text()
    tokens = tokenizer.encode(source)
    assert [context_band(n) for n in (0, 2047, 2048, 4095, 4096, 40000)] == [0, 0, 1, 1, 2, 5]
    list(generate_step(mx.array(tokens[:50]), model, max_tokens=8))
    controllers = model.mtp_state.scheduler.controllers
    short = controllers[0.0, 1, 0]
    short.choice = 3  # as if it had settled there
    before = list(short.cycles_at)
    list(generate_step(mx.array(tokens[:2100]), model, max_tokens=6, mtp_lookup=False))
    assert list(controllers) == [(0.0, 1, 0), (0.0, 1, 1)]
    assert controllers[0.0, 1, 1].choice == 3 and model.mtp_head.stats.depths[0] == 3
    assert short.cycles_at == before  # the short band's left alone


def test_efficiency_from_measured_parts():
    rows = [{"name": "plain", "speedup": 1.0, "tokens_per_second": 10.0},
            {"name": "depth 2", "speedup": 1.5, "tokens_per_cycle": 2.4, "tokens_per_second": 15.0}]
    efficiency(rows, {"plain": 0.010, "verify": {3: 0.012}, "draft": {2: 0.004}})
    assert rows[1]["ideal"] == pytest.approx(2.4 / 1.6) and rows[1]["efficiency"] == pytest.approx(1.5 / 1.5)
    assert "ideal" not in rows[0]
    assert notes(128, rows) == [] and "*" not in _row(rows[1])
    rows[1]["speedup"] = 1.8  # beyond the ideal
    efficiency(rows, {"plain": 0.010, "verify": {3: 0.012}, "draft": {2: 0.004}})
    assert notes(128, rows)[0].startswith("* an efficiency above 1") and "1.200*" in _row(rows[1])
    assert len(notes(2, rows)) == 2 and notes(2, rows)[0].startswith("--max-tokens 2 is below 32")


def test_candidates_take_every_place_in_the_order_alike():
    """A run's speed may depend on the run before it: over repeats × prompts a multiple of the candidates, each
    candidate runs at each place of the order equally often, and each prompt of each repeat is run by every one."""
    runs = []

    def decode(prompt, max_tokens, name):
        runs.append((prompt[0], max_tokens, name))
        yield from range(max_tokens)

    names = {"plain": None, "depth 1": 1, "adaptive": 0}
    results = measure.candidates(decode, lambda: None, [[0], [1]], names, 4, 3)
    timed = [name for _, max_tokens, name in runs if max_tokens == 4]
    places = Counter((i % 3, name) for i, name in enumerate(timed))
    assert set(places.values()) == {2} and len(places) == 9
    assert all(sorted(map(str, timed[i : i + 3])) == ["0", "1", "None"] for i in range(0, len(timed), 3))
    assert list(results) == list(names)


def test_bench_report(model_dir, capsys):
    report = bench(model_dir, depths=1, max_tokens=6, repeats=1, dtype="float32")
    progress = capsys.readouterr().err  # the phases, on stderr
    phases = ["warm-up", "decode", "component costs", "rollback ways"]
    phases += [f"{r['name']}: decode" for r in report["references"] if not isinstance(r, str)]
    assert all(f"bench: {phase}" in progress for phase in phases), progress
    names = [r["name"] for r in report["candidates"]]
    assert names == ["plain", "depth 1", "adaptive"]
    depth1 = report["candidates"][1]
    assert depth1["passes_per_token"] == pytest.approx(1 / depth1["tokens_per_cycle"])
    assert depth1["efficiency"] == pytest.approx(depth1["speedup"] / depth1["ideal"])
    assert set(report["costs"]["verify"]) == {2} and set(report["costs"]["draft"]) == {1}
    assert set(report["costs"]["draft_subset"]) == {1} and report["costs"]["subset_size"] == 256  # cost only: V/8
    assert not report["costs"]["subset_tuned"] and report["costs"]["host"][1] > 0
    assert len(report["references"]) == 1  # mlx-vlm is installed: its native MTP, or why not
    ways = report["rollback"]
    assert ways["depth"] == 1 and ways["auto"] == "capture"  # the CPU: one-call capture
    assert all(ways[way]["tokens_per_second"] > 0 and ways[way]["host"] > 0 for way in ("capture", "replay"))
    adaptive = report["adaptive"]["depths"]
    assert sum(d["cycles"] for d in adaptive.values()) > 0 and report["adaptive"]["rounds"] >= 1
    assert report["costs"]["host"][0] > 0 and report["costs"]["layers"] > 0
    text = render(report)
    assert "t_verify(k)/t(1)" in text and "mlx-vlm" in text and "host ms per cycle" in text
    assert "adaptive spent (cycles/tokens per depth" in text and "adaptive's estimates at the end" in text
    assert "a plain step's graph" in text and f"prompts of {report['prompt_tokens'][0]}," in text
    assert "rollback at depth 1 (auto takes capture here): capture" in text and "of capture)" in text
    assert "draft vocabulary of 256 tokens (none tuned: cost only)" in text and "plain decoding's own loop" in text
    assert "\nnote: --max-tokens 6 is below 32: so few tokens" in text
    assert render(json.loads(json.dumps(report))) == text  # what --json wrote renders the same


def test_long_context_prompts(model_dir, capsys):
    """``bench --context N``: each prompt preceded by earlier standard-library source, N tokens in all, its own
    tokens last; a prompt already that long is kept."""
    prompts = [[7, 8, 9], list(range(50))]
    longer = measure.with_context(prompts, 40, lambda text: [ord(c) for c in text])
    assert [len(p) for p in longer] == [40, 50]
    assert longer[0][-3:] == [7, 8, 9] and longer[1] == prompts[1]
    for bad in ("-1", "1024,x", "0,8192"):
        with pytest.raises(SystemExit, match="2"):
            main(["bench", str(model_dir), "--context", bad])
        assert "argument --context:" in capsys.readouterr().err


def test_long_context_sweep(model_dir, capsys):
    """``bench --context N,N``: per length, plain, each fixed depth and the default on prompts padded to it, the
    default's ratios to the best fixed depth and to plain, and the head's window at that length."""
    assert main(["bench", str(model_dir), *QUICK, "--depths", "1", "--context", "500,1500", "--prompts", "1",
                 "--json"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert [c["context"] for c in report["contexts"]] == [500, 1500]
    for c in report["contexts"]:
        assert c["prompt_tokens"] == [c["context"]] and c["window"] == drafter.window(c["context"])
        assert [r["name"] for r in c["candidates"]] == ["plain", "depth 1", "default"]
        fixed, default = c["candidates"][1], c["candidates"][2]
        assert c["default_vs_best"] == pytest.approx(default["tokens_per_second"] / fixed["tokens_per_second"])
        assert c["default_vs_plain"] == default["speedup"] and fixed["tokens_per_cycle"] >= 1
        assert [r["differs"] for r in c["candidates"]] == [0, 0, 0]  # greedy MTP: plain's tokens
    assert "bench: context 500: warm-up" in err and "bench: context 1500: decode" in err
    text = sweep.render(report)
    window = drafter.window(1500)
    assert f"context 1500 (prompts of 1500 tokens; the head is fed the last {window} prompt pairs)" in text
    assert "default / best fixed depth:" in text and "default / plain:" in text and "same tokens as plain" in text
    report["contexts"][0]["candidates"][1]["differs"] = 1
    assert "NO (1 of 1 prompts differ)" in sweep.render(report)


def test_result_files_never_overwritten(tmp_path):
    first = measure.write_result(tmp_path / "results", "bench", "first\n")
    second = measure.write_result(tmp_path / "results", "bench", "second\n")
    assert second.name == first.name.replace(".txt", "-2.txt")
    assert first.read_text() == "first\n" and second.read_text() == "second\n"


def test_vocab_text_token_counts():
    counts = token_counts(lambda prompt, n, depth: iter(prompt[:n]), [[1, 2, 2], [2, 5]], 2, [9, 9, 1])
    assert counts == Counter({1: 2, 2: 2, 5: 1, 9: 2})


def test_bad_arguments(model_dir, capsys):
    assert main(["bench", str(model_dir / "missing")]) == 2
    capsys.readouterr()
    assert main(["bench", str(model_dir), "--max-tokens", "4", "--prompts", "5"]) == 2  # told before anything
    err = capsys.readouterr().err
    assert err.startswith("mtp-plugin bench: --max-tokens 4 is below 32") and "--prompts must be 1-4, got 5" in err
    with pytest.raises(SystemExit, match="2"):
        main(["tune", str(model_dir), "--depths", "9"])
    assert "argument --depths: must be 1-8, got 9" in capsys.readouterr().err
    assert main(["tune", str(model_dir), "--vocab-text", str(model_dir / "missing.txt")]) == 2  # before loading
    assert "missing.txt: cannot be read as text" in capsys.readouterr().err
    config = (model_dir / "config.json").read_text()
    (model_dir / draft_vocab.FILE_NAME).mkdir()
    assert main(["tune", str(model_dir), "--write"]) == 2  # refused before measuring: nothing written
    assert f"{draft_vocab.FILE_NAME}: not a file" in capsys.readouterr().err
    assert (model_dir / "config.json").read_text() == config and not tuning.cache_file().exists()
