"""MTP on mlx-lm's own sharding: two ranks on loopback (``mlx.launch --backend ring -n 2``), pipeline and tensor
parallel, over the model families mlx-lm shards, each rank running ``tests/helpers/distributed_run.py``.

The reference is stock mlx-lm under the same sharding in the same processes (tensor parallelism changes the order of
sums, so single-process stock is not it). ``mlx.launch`` exits 0 even when a rank fails, so a run passes only when
every rank wrote its results and printed no warning.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers.builders import build_head, build_model, config_for, save_checkpoint, trunk_weights, untied_copy
from helpers.console_runs import CONCURRENT, MLX4, environment
from helpers.nextn_builders import distilled

from mtp_plugin.head.draft_vocab import FILE_NAME

SCRIPT = Path(__file__).parent / "helpers" / "distributed_run.py"
TIMEOUT = 240  # seconds for one launch of two ranks (about 20 on two cores)
MODULES = {"qwen3_5 tied": "qwen3_5", "qwen3_5 untied": "qwen3_5", "qwen3_5_moe": "qwen3_5_moe",
           "deepseek_v3": "deepseek_v3"}


def supports(model: str, sharding: str) -> bool:
    """Whether the installed mlx-lm shards ``model`` that way (mlx-lm < 0.32 pipelines no Qwen3.5 model)."""
    module = importlib.import_module(f"mlx_lm.models.{MODULES[model]}")
    if sharding == "tensor":
        return hasattr(module.Model, "shard")
    homes = {sys.modules[base.__module__] for base in module.Model.__mro__}  # qwen3_5_moe's Model is qwen3_5's
    return any(isinstance(v, type) and hasattr(v, "pipeline") for home in homes for v in vars(home).values())


CASES = [(s, m) for s in ("pipeline", "tensor") for m in MODULES]
FROM_HUB = {"deepseek_v3"}  # served as a Hub repository (``hub.py``): each rank fetches what its filter selects


def free_port_pair() -> int:
    """A loopback port p with p and p + 1 free (the ring backend listens on one port per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free loopback ports")


def on_two_ranks(program: str, *args: str) -> list[str]:
    """``mlx.launch --backend ring -n 2`` on free loopback ports running ``program`` (a script of this interpreter,
    or one of its console scripts) with ``args``."""
    launcher = Path(sys.executable).with_name("mlx.launch")
    command = [sys.executable, program] if program.endswith(".py") else [str(launcher.with_name(program))]
    return [str(launcher), "--backend", "ring", "-n", "2", "--starting-port", str(free_port_pair()), "--",
            *command, *args]


def launch(command: list[str], workdir: Path, timeout: int = TIMEOUT) -> str:
    """Run ``command`` (``on_two_ranks``); its output (both ranks)."""
    process = subprocess.Popen(command, cwd=workdir, env=environment(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"the two ranks did not finish in {timeout} s:\n{output[-4000:]}")
    return output


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The four models: the bundled checkpoint (tied embeddings), its untied twin with a draft vocabulary (its rows
    of an lm_head that tensor parallelism shards), a random Qwen3.5-MoE with a head in a sidecar, and a DeepSeek-V3
    whose head is distilled from its trunk (a next-n layer's family)."""
    root = tmp_path_factory.mktemp("distributed")
    tokenizer_files = [MLX4 / name for name in ("tokenizer.json", "tokenizer_config.json")]
    models = {"qwen3_5 tied": MLX4, "qwen3_5 untied": untied_copy(MLX4, root / "untied")}
    (models["qwen3_5 untied"] / FILE_NAME).write_text(json.dumps({"token_ids": list(range(1024))}))
    config = config_for("qwen3_5_moe")
    config["text_config"]["vocab_size"] = 2048  # the bundled tokenizer's
    model = build_model(config)
    models["qwen3_5_moe"] = save_checkpoint(root / "moe", config, trunk_weights(model), build_head(model, config),
                                            "mtp.safetensors", index=True)
    config, trunk, head = distilled("deepseek_v3")
    models["deepseek_v3"] = save_checkpoint(root / "nextn", config, trunk, head, "mtp.safetensors", index=True)
    for name in ("qwen3_5_moe", "deepseek_v3"):
        for file in tokenizer_files:
            shutil.copy(file, models[name])
    return models


@pytest.fixture(scope="module")
def runs(checkpoints):
    """Launch once per case, on first use: ``(case) -> (rank 0 results, rank 1 results, launch output)``."""
    done = {}

    def get(sharding: str, model: str):
        if (sharding, model) not in done:
            out = Path(tempfile.mkdtemp(prefix="mtp-distributed-"))
            hub = ["hub"] if model in FROM_HUB else []
            output = launch(on_two_ranks(str(SCRIPT), str(checkpoints[model]), sharding, str(out), *hub), out)
            ranks = [out / f"rank{r}.json" for r in range(2)]
            assert all(p.exists() for p in ranks), output[-4000:]
            done[sharding, model] = (*(json.loads(p.read_text()) for p in ranks), output)
        return done[sharding, model]

    return get


@pytest.fixture(params=CASES, ids=[f"{s}-{m.replace(' ', '-')}" for s, m in CASES])
def case(request, runs):
    sharding, model = request.param
    if not supports(model, sharding):
        pytest.skip(f"this mlx-lm has no {sharding} parallelism for {MODULES[model]}")
    return runs(sharding, model)


def test_greedy_equals_distributed_stock(case, request):
    first, second, output = case
    assert first["head"] and second["head"], output[-4000:]
    for name in ("depth 1", "depth 3", "adaptive", "lookup"):
        assert first[name]["tokens"] == first["stock"]["tokens"], (name, output[-4000:])
        assert first[name] == second[name], name
    assert first["depth 3"]["drafted"] > 0 and first["depth 1"]["drafted"] > 0
    if "qwen3_5-" in request.node.callspec.id:  # the trained checkpoint's output repeats its prompt; random ones not
        assert first["lookup"]["looked"] > 0


def test_draft_vocabulary_under_sharding(case, request):
    first, second, _ = case
    expected = 1024 if "untied" in request.node.callspec.id else None
    assert first["draft vocabulary"] == second["draft vocabulary"] == expected


def test_head_files_reach_every_rank(case):
    first, second, _ = case
    for rank in (first, second):
        assert rank["files"] is None or "mtp.safetensors" in rank["files"]


def test_sampling_agrees_across_ranks(case):
    first, second, _ = case
    for name in ("sampled", "sampled, seed 5"):
        assert first[name] == second[name], name
        assert first[name]["drafted"] > 0
    assert first["sampled, seed 5"] == first["sampled, seed 5 again"]


def test_disagreement_raises_on_every_rank(case):
    first, second, _ = case
    for rank in (first, second):
        for name in ("disagreement", "lookup disagreement"):  # at the first cycle, before a rank stops early
            assert "disagree on the tokens left to generate" in rank[name]
        assert "disagree on the prompt's length" in rank["prompt disagreement"]


def test_draft_vocabulary_of_one_rank_is_dropped_on_every_rank(case, request):
    first, second, _ = case
    run, other = first["one rank's draft vocabulary"], second["one rank's draft vocabulary"]
    assert run["tokens"] == first["stock"]["tokens"] and run == {**other, "warnings": run["warnings"]}
    assert run["draft vocabulary"] is None
    dropped = ["hold different draft vocabularies" in w for w in run["warnings"]]
    assert dropped == ([True] if "untied" in request.node.callspec.id else [])


STOCK_WARNING = "mlx_lm.server is not recommended for production"  # mlx-lm's own, at every server start


def problems(output: str) -> list[str]:
    """The lines of a launch's output that report a warning or an error: a traceback, ``mlx.launch``'s ``[WARN]`` for a
    rank that exited non-zero, a logged warning (formatted by mlx-lm's server, or bare: the plugin's ``mtp_plugin:``
    lines), a Python warning."""
    return [line for line in output.splitlines() if STOCK_WARNING not in line and (
        any(mark in line for mark in ("Traceback", "[WARN]", "WARNING", "Warning:")) or line.startswith("mtp_plugin:"))]


def test_no_rank_warns(case):
    output = case[2]
    assert not problems(output), output[-4000:]


SERVER_PROMPTS = CONCURRENT[:4]  # on mlx-lm < 0.32, of one token length (stock answers others differently)


@pytest.fixture(scope="module", params=["pipeline", "tensor"])
def server(request, tmp_path_factory):
    """``mlx.launch -n 2 … python -m mlx_lm.server --model <bundled> [--pipeline]`` (rank 0 answers HTTP), with its
    log (both ranks) read at the end."""
    if not supports("qwen3_5 tied", request.param):
        pytest.skip(f"this mlx-lm has no {request.param} parallelism for qwen3_5")
    workdir = tmp_path_factory.mktemp("distributed-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = on_two_ranks("mlx_lm.server", "--model", str(MLX4), "--host", "127.0.0.1", "--port", str(port),
                           *(["--pipeline"] if request.param == "pipeline" else []))
    log = workdir / "server.log"
    with open(log, "w") as sink:
        process = subprocess.Popen(command, cwd=workdir, env=environment(), stdout=sink, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while True:
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                time.sleep(0.5)
        yield port, log
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def post(port: int, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
        return json.loads(response.read())


def test_server_answers_concurrent_requests_with_stock_text(server):
    port, log = server
    bodies = [{"prompt": p, "max_tokens": 24, "temperature": 0.0, **options} for options in
              ({}, {"mtp_depth": 2}, {"enable_mtp": False}) for p in SERVER_PROMPTS]
    with ThreadPoolExecutor(len(SERVER_PROMPTS)) as pool:
        answers = list(pool.map(lambda body: post(port, body), bodies))
    texts = [a["choices"][0]["text"] for a in answers]
    n = len(SERVER_PROMPTS)
    assert texts[:n] == texts[2 * n:] and texts[n : 2 * n] == texts[2 * n:]
    assert all(a["timings"]["draft_n"] > 0 for a in answers[n : 2 * n])
    assert not problems(log.read_text()), log.read_text()[-4000:]
