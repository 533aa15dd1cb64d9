"""A real ``mlx_vlm.server`` on a loopback port, serving the trained tiny checkpoint with a tiny vision tower
(``examples/add_vision_tower.py``: mlx-vlm's own Qwen processor takes real PNG images), beside a stock server
(plugin disabled) on the same checkpoint without its head."""

import base64
import functools
import importlib.util
import logging
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from queue import Queue

import mlx.core as mx
import pytest
from helpers.builders import png
from helpers.console_runs import HF, environment
from mtp_plugin.adapters.patching import release
from test_server import Server, text_of

# mlx-vlm 0.7's response schema carries the speculative counters; 0.6's has no such field
COUNTERS = release("mlx-vlm") >= (0, 7)
NO_COUNTERS = "mlx-vlm 0.6's server responses have no draft counters (its timings schema lacks draft_n)"
TEXT = "def read_config(path):\n"
MAX_TOKENS = 32


def data_url(width: int, height: int, seed: int) -> str:
    """A PNG image (``builders.png``) as a data URL, as clients send images."""
    return "data:image/png;base64," + base64.b64encode(png(width, height, seed)).decode()


IMAGE = data_url(64, 48, 3)


def chat(text: str = TEXT, image: str | None = None, **options) -> dict:
    content = text if image is None else [{"type": "image_url", "image_url": {"url": image}},
                                          {"type": "text", "text": text}]
    return {"messages": [{"role": "user", "content": content}],
            "max_tokens": MAX_TOKENS, "temperature": 0.0, **options}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The trained tiny checkpoint with a tiny vision tower and Qwen's processor files, the head as a sidecar."""
    spec = importlib.util.spec_from_file_location("add_vision_tower", HF.parents[1] / "add_vision_tower.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = tmp_path_factory.mktemp("vlm-server") / "model"
    example.add_vision_tower(HF, model)
    return model


@pytest.fixture(scope="module")
def servers(checkpoint):
    """``(plugin, stock)``: a plugin server on the checkpoint with its head (sidecar), a stock one on a copy
    without it."""
    model, workdir = checkpoint, checkpoint.parent
    headless = workdir / "headless"
    shutil.copytree(model, headless, ignore=shutil.ignore_patterns("mtp.safetensors"))
    command = [sys.executable, "-m", "mlx_vlm.server", "--model"]
    plugin = Server([*command, str(model)], workdir, environment())
    stock = Server([*command, str(headless)], workdir, environment(MTP_PLUGIN_DISABLE="1"))
    plugin.model, stock.model = str(model), str(headless)
    yield plugin, stock
    plugin.stop()
    stock.stop()


def answer(server: Server, body: dict, stream: bool = False) -> tuple[str, dict]:
    """The text and the timings of a chat completion by ``server``'s model."""
    body = {**body, "model": server.model}
    if stream:
        events = server.stream("/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
        text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])  # None: no text
        return text, next((e["timings"] for e in reversed(events) if e.get("timings")), {})  # the final ones
    status, response = server.post("/v1/chat/completions", body)
    assert status == 200, response
    return text_of(response), response.get("timings") or {}


@pytest.mark.parametrize("stream", [False, True], ids=["complete", "stream"])
@pytest.mark.parametrize("image", [None, IMAGE], ids=["text", "image"])
def test_request_decodes_with_mtp_as_stock(servers, image, stream):
    plugin, stock = servers
    text, timings = answer(plugin, chat(image=image, enable_mtp=True), stream)
    expected, stock_timings = answer(stock, chat(image=image), stream)
    assert text == expected and len(text) > 20
    if COUNTERS:
        # decoded by the MTP loop (its adaptive depth may have measured plain steps the faster: 0 drafts then)
        assert 0 <= timings["draft_n_accepted"] <= timings["draft_n"], timings
        assert stock_timings.get("draft_n") is None


@pytest.mark.parametrize("options", [{"mtp_depth": 1}, {"mtp_depth": 3}, {"enable_mtp": True, "mtp_depth": 2},
                                     {"enable_mtp": False, "mtp_depth": 2}, {}],
                         ids=["depth1", "depth3", "enabled-depth2", "off", "none"])
def test_image_request_options(servers, options):
    """A request asks for MTP with ``enable_mtp`` or ``mtp_depth``; one that says nothing is served by mlx-vlm's
    batch (the server's default without ``--mtp-depth``)."""
    plugin, stock = servers
    text, timings = answer(plugin, chat(image=IMAGE, **options))
    assert text == answer(stock, chat(image=IMAGE))[0]
    if COUNTERS:
        lane = options.get("enable_mtp", "mtp_depth" in options)
        assert (timings.get("draft_n") is not None) == lane, timings
        if lane and "mtp_depth" in options:
            assert timings["draft_n"] == options["mtp_depth"] * timings["draft_rounds"], timings


@pytest.mark.skipif(not COUNTERS, reason="mlx-vlm 0.6 returns bfloat16 log-probs: a verify pass and single-token "
                    "steps can differ by one bfloat16 step, so a near tie may draw otherwise under the same key (the "
                    "sampled distribution stays exact: test_vlm_sampling)")
@pytest.mark.parametrize("image", [None, IMAGE], ids=["text", "image"])
def test_seeded_request_gets_the_servers_own_tokens(servers, image):
    """The server keys a seeded request's draws by token position: with MTP the seed gives its own tokens."""
    plugin, _ = servers
    sampled = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 7}
    text, timings = answer(plugin, chat(image=image, **sampled, mtp_depth=2))
    assert text == answer(plugin, chat(image=image, **sampled, enable_mtp=False))[0]
    assert timings["draft_n"] > 0


@pytest.mark.skipif(not COUNTERS, reason="mlx-vlm 0.6 returns bfloat16 log-probs: passes of other widths can differ "
                    "by one bfloat16 step, so a near tie may draw otherwise (as in the test above)")
@pytest.mark.parametrize("options", [{"mtp_depth": 1}, {"mtp_depth": 2, "mtp_lookup": False}, {"mtp_depth": 3},
                                     {"enable_mtp": True}, {"enable_mtp": True, "mtp_lookup": False}])
def test_seed_repeats_after_a_prefix_request(servers, options):
    """A seeded request, a request whose prompt is a prefix of it, the seeded request again: the same text."""
    plugin, _ = servers
    sampled = {"temperature": 0.8, "top_p": 0.9, "seed": 5, **options}
    first, timings = answer(plugin, chat(TEXT + "    with open(path) as f:\n", **sampled))
    answer(plugin, chat(TEXT, **sampled))
    again, _ = answer(plugin, chat(TEXT + "    with open(path) as f:\n", **sampled))
    assert again == first and len(first) > 20
    if "mtp_depth" in options:
        assert timings["draft_n"] > 0


@pytest.mark.parametrize("options", [{"mtp_depth": 9}, {"enable_mtp": "yes"}, {"mtp_depth": 1.5}])
def test_bad_options_are_refused(servers, options):
    """A bad value is answered with 400 and a message naming the option, on each endpoint (those that wrap an
    error's text in a 400 of their own show the message alone)."""
    plugin, _ = servers
    requests = {"/v1/chat/completions": chat(**options), "/v1/responses": {"input": "hi", **options},
                "/v1/messages": {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **options}}
    for path, body in requests.items():
        status, response = plugin.post(path, {**body, "model": plugin.model})
        message = response["detail"] if "detail" in response else response["error"]["message"]
        assert status == 400 and message.startswith(("mtp_depth must", "enable_mtp must")), (path, response)


def test_penalties_see_the_whole_prompt(servers):
    """The server's batch gives logits processors (penalties) the whole prompt; so does a lane."""
    plugin, stock = servers
    text = "def main():\n" + "".join(f"    value_{i} = compute({i})\n" for i in range(24))
    penalties = {"frequency_penalty": 1.0, "presence_penalty": 0.5, "repetition_penalty": 1.3}
    expected = answer(stock, chat(text=text, **penalties))[0]
    for depth in (1, 3):
        assert answer(plugin, chat(text=text, **penalties, mtp_depth=depth))[0] == expected, depth


def test_response_format_and_failures_stay_with_their_request(checkpoint):
    """A request with its own logits processors (``response_format``: a grammar matcher must not see drafts that
    are then rejected) decodes in mlx-vlm's batch; a lane whose loop raises fails its own request only."""
    from mlx_vlm import load
    from mlx_vlm.server.generation import GenerationArguments
    from mtp_plugin.adapters.mlx_vlm_server import Lane, Lanes

    from mtp_plugin.decoding.stats import MTPStats

    model, processor = load(str(checkpoint))
    lanes = Lanes(importlib.import_module("mlx_vlm.generate.ar").BatchGenerator(model.language_model, processor),
                  model, {})
    assert lanes._stock_reason(GenerationArguments(logits_processors=[lambda tokens, logits: logits]), None)
    assert lanes._stock_reason(GenerationArguments(), None) is None

    def failing():
        yield 5, None
        raise RuntimeError("lane failed")

    answers = {uid: Queue() for uid in (1, 2)}
    for uid, tokens in ((1, failing()), (2, (drawn for drawn in [(5, None), (6, None), (7, None)]))):
        lanes.lanes[uid] = Lane(uid, tokens, MTPStats(), 3, lambda token: False, 4, answers[uid])
    steps = [lanes.next()[1] for _ in range(3)]
    assert [(r.uid, r.token, r.finish_reason) for step in steps for r in step] == [
        (1, 5, None), (2, 5, None), (1, None, "stop"), (2, 6, None), (2, 7, "length")]
    assert isinstance(answers[1].get_nowait(), RuntimeError) and answers[2].empty() and not lanes.has_work


def test_a_lane_that_cannot_be_built_leaves_the_request_to_the_batch(checkpoint, monkeypatch, caplog):
    """A fault of the plugin's while a request's lane is built (here in its decoding options): the request decodes
    in mlx-vlm's own batch, with mlx-vlm's tokens, and the warning names the fault."""
    from mlx_vlm import load
    from mlx_vlm.server.generation import GenerationArguments
    from mtp_plugin.adapters import mlx_vlm_server
    from mtp_plugin.adapters.mlx_lm_server import MTPRequest

    model, processor = load(str(checkpoint))
    batch_class = importlib.import_module("mlx_vlm.generate.ar").BatchGenerator
    prompt = processor.tokenizer.encode(TEXT)
    fields = model.get_input_embeddings(mx.array([prompt]), None).to_dict()
    keywords = {k: v for k, v in fields.items() if v is not None}  # as the server embeds a prompt

    def decode(generator, request=None) -> list[int]:
        mlx_vlm_server._serving.current = (None, request)
        (uid,) = generator.insert([prompt], max_tokens=8, prompt_kwargs=[keywords])
        tokens = []
        while generator.has_work:
            tokens += [r.token for r in generator.next()[1] if r.uid == uid and r.token is not None]
        return tokens

    stock = decode(batch_class(model.language_model, processor))
    monkeypatch.setattr(mlx_vlm_server, "decoding_options", lambda *a, **k: 1 / 0)
    lanes = mlx_vlm_server.Lanes(batch_class(model.language_model, processor), model, {})
    request = type("Request", (), {"args": GenerationArguments(), "rqueue": Queue()})()
    request.args.mtp = MTPRequest(True, 2)
    with caplog.at_level(logging.WARNING, logger="mtp_plugin"):
        assert decode(lanes, request) == stock
    assert not lanes.lanes and "ZeroDivisionError" in caplog.text


def test_concurrent_requests_as_alone(servers):
    """Concurrent requests (text and images, MTP lanes asked for and others in mlx-vlm's batch) get the answers
    each gets alone."""
    plugin, _ = servers
    texts = [TEXT, "import os\n", "class Parser:\n", "for line in lines:\n"]
    bodies = [chat(text=t, image=data_url(32 + 16 * i, 48, i) if i % 2 else None,
                   **({"enable_mtp": True} if i < 2 else {})) for i, t in enumerate(texts)]
    alone = [answer(plugin, body)[0] for body in bodies]
    for _ in range(2):
        with ThreadPoolExecutor(len(bodies)) as pool:
            together = list(pool.map(lambda body: answer(plugin, body), bodies))
        assert [text for text, _ in together] == alone
        if COUNTERS:
            assert all(timings.get("draft_n") is not None for _, timings in together[:2])  # asked: own lanes


def test_lane_passes_keep_their_own_positions(checkpoint):
    """mlx-vlm's Qwen language model keeps the last prompt's rope deltas on the model object and derives later
    passes' positions from them; an image prefilled in the batch between two passes of a lane leaves other deltas
    there. A lane's pass sees its own and leaves the batch's in place."""
    from mlx_vlm import load
    from mlx_vlm.models.cache import make_prompt_cache
    from mtp_plugin.adapters.mlx_vlm_decoding import _language_model_pass
    from mtp_plugin.adapters.mlx_vlm_server import OwnPositions

    model, processor = load(str(checkpoint))
    language_model = model.language_model
    prompt = mx.array([processor.tokenizer.encode(TEXT)])
    fields = model.get_input_embeddings(prompt, None).to_dict()
    keywords = {k: v for k, v in fields.items() if v is not None}
    run = functools.partial(_language_model_pass, language_model)

    def second_pass(own: bool, batch_deltas: mx.array | None) -> mx.array:
        cache, lane = make_prompt_cache(language_model), OwnPositions(run, language_model) if own else run
        language_model._rope_deltas = language_model._position_ids = None
        lane(prompt, cache, keywords)
        language_model._rope_deltas = batch_deltas  # as an image prefilled in the batch leaves them
        hidden = lane(mx.array([[prompt[0, -1].item()]]), cache, {})
        assert language_model._rope_deltas is batch_deltas or not own  # the batch's are kept
        return hidden

    alone = second_pass(True, None)
    shifted = mx.array([[-5]], dtype=mx.int32)
    assert not mx.array_equal(second_pass(False, shifted), alone)  # the deltas matter to the pass
    assert mx.array_equal(second_pass(True, shifted), alone)


def test_help_lists_the_mtp_flags():
    out = subprocess.run([sys.executable, "-m", "mlx_vlm.server", "--help"], capture_output=True, text=True,
                         timeout=300, check=True, env=environment()).stdout
    assert "--mtp-depth N" in out and "--no-mtp" in out and "--max-tokens" in out  # ours, then mlx-vlm's own


@pytest.mark.skipif(not COUNTERS, reason=NO_COUNTERS)
@pytest.mark.parametrize("flags", [("--mtp-depth", "2"), ("--no-mtp",)])
def test_command_line_defaults(checkpoint, servers, flags):
    """``--mtp-depth N`` and ``--no-mtp`` set the server's default; a request's own options still win."""
    _, stock = servers
    server = Server([sys.executable, "-m", "mlx_vlm.server", "--model", str(checkpoint), *flags],
                    checkpoint.parent, environment())
    server.model = str(checkpoint)
    try:
        text, timings = answer(server, chat(image=IMAGE))
        assert text == answer(stock, chat(image=IMAGE))[0]
        if flags[0] == "--no-mtp":  # only an explicit enable_mtp takes a lane
            assert timings.get("draft_n") is None
            assert answer(server, chat(image=IMAGE, mtp_depth=2))[1].get("draft_n") is None
            assert answer(server, chat(image=IMAGE, enable_mtp=True))[1]["draft_n"] is not None
        else:
            assert timings["draft_n"] == 2 * timings["draft_rounds"] > 0
    finally:
        server.stop()


@pytest.mark.skipif(release("mlx-vlm") < (0, 7), reason="mlx-vlm 0.6's own MTP drafter cannot run (its rounds "
                    "call a reset its Qwen3.5 model lacks)")
def test_mlx_vlms_own_drafter_when_asked_for(checkpoint):
    """``--draft-model DIR --draft-kind mtp`` serves with mlx-vlm's own MTP drafter, as without the plugin."""
    command = [sys.executable, "-m", "mlx_vlm.server", "--model", str(checkpoint), "--draft-model", str(checkpoint),
               "--draft-kind", "mtp"]
    answers = []
    for env in (environment(), environment(MTP_PLUGIN_DISABLE="1")):
        server = Server(command, checkpoint.parent, env)
        server.model = str(checkpoint)
        try:
            answers.append(answer(server, chat()))
        finally:
            server.stop()
    (text, timings), (stock_text, stock_timings) = answers
    assert text == stock_text and timings["draft_kind"] == "mtp" and timings["draft_n"] > 0, timings
    assert (timings["draft_n"], timings["draft_n_accepted"]) == (stock_timings["draft_n"],
                                                                  stock_timings["draft_n_accepted"])
