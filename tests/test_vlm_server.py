"""A real ``mlx_vlm.server`` on a loopback port, serving the trained tiny checkpoint with a tiny vision tower
(``examples/add_vision_tower.py``: mlx-vlm's own Qwen processor takes real PNG images), beside a stock server
(plugin disabled) on the same checkpoint without its head."""

import base64
import importlib.util
import json
import logging
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import pytest
from helpers.builders import png
from helpers.console_runs import HF, environment
from mtp_plugin.adapters.patching import release
from test_server import REPEATING, Server, text_of

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
def test_default_request_decodes_with_mtp_as_stock(servers, image, stream):
    """A request that names no MTP option drafts in mlx-vlm's batch and answers the stock server's text."""
    plugin, stock = servers
    text, timings = answer(plugin, chat(image=image), stream)
    expected, stock_timings = answer(stock, chat(image=image), stream)
    assert text == expected and len(text) > 20
    if COUNTERS:
        assert 0 < timings["draft_n"] and 0 <= timings["draft_n_accepted"] <= timings["draft_n"], timings
        assert stock_timings.get("draft_n") is None


@pytest.mark.parametrize("options", [{"mtp_depth": 1, "mtp_lookup": False}, {"mtp_depth": 3, "mtp_lookup": False},
                                     {"enable_mtp": True, "mtp_depth": 2, "mtp_lookup": False},
                                     {"enable_mtp": False, "mtp_depth": 2}, {}],
                         ids=["depth1", "depth3", "enabled-depth2", "off", "none"])
def test_image_request_options(servers, options):
    """``enable_mtp`` and ``mtp_depth`` as in mlx-lm's server: every request drafts unless it says
    ``"enable_mtp": false``; a depth is drafted at every head cycle of a lone request."""
    plugin, stock = servers
    text, timings = answer(plugin, chat(image=IMAGE, **options))
    assert text == answer(stock, chat(image=IMAGE))[0]
    if COUNTERS:
        wanted = options.get("enable_mtp", True)
        assert (timings.get("draft_n") is not None) == wanted, timings
        if wanted and "mtp_depth" in options:
            assert timings["draft_n"] == options["mtp_depth"] * timings["draft_rounds"], timings


@pytest.mark.skipif(not COUNTERS, reason=NO_COUNTERS)
def test_lookup_drafts_are_counted_as_in_mlx_lms_server(servers):
    """On a prompt whose answer repeats it, ``draft_n`` / ``draft_n_accepted`` count the lookup drafts beside the
    head's (``draft_rounds``: every cycle), as mlx-lm's server counts them."""
    plugin, _ = servers
    head = answer(plugin, chat(REPEATING, mtp_depth=1, mtp_lookup=False, max_tokens=64))[1]
    both = answer(plugin, chat(REPEATING, mtp_depth=1, max_tokens=64))[1]
    assert head["draft_n"] == head["draft_rounds"], head  # one head draft a cycle
    assert both["draft_n"] > both["draft_rounds"] and both["draft_n_accepted"] > head["draft_n_accepted"], both


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


@pytest.mark.parametrize("image", [None, IMAGE], ids=["text", "image"])
def test_logprobs_are_the_emitted_tokens(servers, image):
    """A request for log-probs decodes with MTP in the batch: each emitted token's log-prob, from the verify pass,
    is stock's (to bfloat16 rounding: passes of other widths sum in another order)."""
    plugin, stock = servers

    def logprobs(server) -> tuple[list, dict]:
        status, response = server.post("/v1/chat/completions", {**chat(image=image, logprobs=True, mtp_depth=2),
                                                                 "model": server.model})
        assert status == 200, response
        content = response["choices"][0]["logprobs"]["content"]
        return [(c["token"], c["logprob"]) for c in content], response.get("timings") or {}

    (ours, timings), (theirs, _) = logprobs(plugin), logprobs(stock)
    assert [t for t, _ in ours] == [t for t, _ in theirs] and len(ours) > 10
    assert max(abs(a - b) for (_, a), (_, b) in zip(ours, theirs, strict=True)) < 0.1
    assert any(lp != 0.0 for _, lp in ours)
    if COUNTERS:
        assert timings["draft_n"] > 0, timings


def test_penalties_see_the_whole_prompt(servers):
    """Logits processors (penalties) see the whole prompt in the MTP batch, as in stock's, at every depth."""
    plugin, stock = servers
    text = "def main():\n" + "".join(f"    value_{i} = compute({i})\n" for i in range(24))
    penalties = {"frequency_penalty": 1.0, "presence_penalty": 0.5, "repetition_penalty": 1.3}
    expected = answer(stock, chat(text=text, **penalties))[0]
    for depth in (1, 3):
        assert answer(plugin, chat(text=text, **penalties, mtp_depth=depth))[0] == expected, depth


def _generators(checkpoint):
    """``(model, make, decode)``: the checkpoint loaded as the server loads it; ``make(wrapped, args)`` a server
    generator built for a request with ``args`` (the plugin's, or mlx-vlm's own); ``decode(generator, args)`` the
    tokens of two text prompts, embedded as the server embeds them and inserted at once."""
    from mlx_vlm import load
    from mtp_plugin.adapters import mlx_vlm_server

    model, processor = load(str(checkpoint))
    generation = importlib.import_module("mlx_vlm.server.generation")
    server = type("Server", (), {"model": model})()
    texts = [processor.tokenizer.encode(TEXT), processor.tokenizer.encode("import os\n")]
    keywords = []
    for ids in texts:
        fields = model.get_input_embeddings(mx.array([ids]), None).to_dict()
        keywords.append({k: v for k, v in fields.items() if v is not None})

    def make(wrapped: bool, args):  # as the server builds it: its sampler first (greedy: None)
        ar = importlib.import_module("mlx_vlm.generate.ar")
        factory = generation.BatchGenerator if wrapped else ar.BatchGenerator
        sampler = generation.ResponseGenerator._make_sampler(server, args)
        return factory(model.language_model, processor, sampler=sampler, compute_logprobs=False)

    def decode(generator, args) -> list[list[int]]:
        uids = []
        for ids, kw in zip(texts, keywords, strict=True):  # each request's options carried by its processors
            carried = mlx_vlm_server.RequestProcessors(args.logits_processors or [])
            carried.mtp = getattr(args, "mtp", None)
            uids += generator.insert([ids], max_tokens=12, prompt_kwargs=[kw], logits_processors=[carried])
        tokens = {uid: [] for uid in uids}
        while generator.has_work:
            for r in generator.next()[1]:
                if r.token is not None:
                    tokens[r.uid].append(r.token)
        return [tokens[uid] for uid in uids]

    return model, make, decode


def test_requests_the_batch_cannot_serve_decode_in_mlx_vlms_own(checkpoint):
    """A request with a thinking budget decodes in a stock generator beside the MTP batch; one with its own logits
    processors decodes in the MTP batch (they are called position by position, as in plain decoding): stock's tokens
    either way."""
    from mlx_vlm.server.generation import GenerationArguments
    from mtp_plugin.adapters.mlx_vlm_server import SplitGenerator

    assert SplitGenerator.stock_reason(object()) == "thinking budget"
    assert SplitGenerator.stock_reason(None) is None
    _, make, decode = _generators(checkpoint)
    formatted = GenerationArguments(max_tokens=12, logits_processors=[lambda tokens, logits: logits])
    split = make(True, formatted)
    assert decode(split, formatted) == decode(make(False, formatted), formatted)
    assert split.stock is None  # the row stayed in the MTP batch


def test_a_fault_hands_the_rows_to_mlx_vlms_batch(checkpoint, monkeypatch, caplog):
    """A fault of the plugin's in a cycle: the rows go on in mlx-vlm's own ``GenerationBatch`` from where they stood
    (their caches rebuilt from their tokens), with stock's tokens, and the warning names the fault."""
    from mlx_vlm.server.generation import GenerationArguments
    from mtp_plugin.adapters.mlx_lm_server import MTPRequest

    from mtp_plugin.decoding.batch import BatchDrafter

    model, make, decode = _generators(checkpoint)
    args = GenerationArguments(max_tokens=12)
    args.mtp = MTPRequest(None, 2)
    expected = decode(make(False, args), args)
    commit, calls = BatchDrafter.commit, []

    def failing(self, *a, **k):
        commit(self, *a, **k)
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected fault")

    monkeypatch.setattr(BatchDrafter, "commit", failing)
    with caplog.at_level(logging.WARNING, logger="mtp_plugin"):
        assert decode(make(True, args), args) == expected
    assert len(calls) == 3 and "injected fault" in caplog.text
    assert model.language_model.mtp_state.batching.failed  # later batches of this model decode stock
    assert decode(make(True, args), args) == expected


def test_a_cancelled_request_leaves_the_others_as_stock(checkpoint):
    """A request removed mid-decoding (a client gone) leaves the batch; the other row goes on with stock's tokens."""
    from mlx_vlm.server.generation import GenerationArguments
    from mtp_plugin.adapters.mlx_lm_server import MTPRequest

    _, make, decode = _generators(checkpoint)
    args = GenerationArguments(max_tokens=12)
    args.mtp = MTPRequest(None, 2)
    expected = decode(make(False, args), args)
    split = make(True, args)
    original = split.next

    def next_and_cancel(**kwargs):  # after the batch's third step, the first request's client is gone
        out = original(**kwargs)
        next_and_cancel.steps += 1
        if next_and_cancel.steps == 3:
            assert split.remove(0)
        return out

    next_and_cancel.steps = 0
    split.next = next_and_cancel
    first, second = decode(split, args)
    assert 0 < len(first) < len(expected[0]) and first == expected[0][: len(first)]
    assert second == expected[1] and not split.has_work and not split.requests


@pytest.mark.parametrize("depth", [None, 2], ids=["default", "fixed-depth"])
def test_a_batch_drafts_where_mlx_vlm_verifies_it_in_one_pass(checkpoint, monkeypatch, depth):
    """mlx-vlm 0.7 verifies a batch's rows in one pass: two rows draft together. 0.6 verifies them one at a time: two
    rows draft together only when their requests fix ``mtp_depth``, else they take plain steps. Stock's tokens."""
    from mlx_vlm.server.generation import GenerationArguments
    from mtp_plugin.adapters.mlx_lm_server import MTPRequest

    from mtp_plugin.decoding.batch import BatchDrafter

    _, make, decode = _generators(checkpoint)
    args = GenerationArguments(max_tokens=12)
    args.mtp = MTPRequest(None, depth)
    expected = decode(make(False, args), args)
    launch, widths = BatchDrafter.launch, []

    def counted(self, rows, *a, **k):
        widths.append(len(rows))
        return launch(self, rows, *a, **k)

    monkeypatch.setattr(BatchDrafter, "launch", counted)
    assert decode(make(True, args), args) == expected
    together = widths.count(2)
    assert together > 0 if release("mlx-vlm") >= (0, 7) or depth else together == 0, widths


def test_concurrent_requests_as_alone(servers):
    """Concurrent requests (text and images, greedy and sampled) draft in one batch and get the stock server's
    answers (the server's sampler keys its draws by position: sampled ones too)."""
    plugin, stock = servers
    texts = [TEXT, "import os\n", "class Parser:\n", "for line in lines:\n"]
    for sampled in ({}, {"temperature": 0.8, "top_p": 0.9}):
        bodies = [chat(text=t, image=data_url(32 + 16 * i, 48, i) if i % 2 else None, **sampled)
                  for i, t in enumerate(texts)]
        alone = [answer(stock, body)[0] for body in bodies]
        with ThreadPoolExecutor(len(bodies)) as pool:
            together = list(pool.map(lambda body: answer(plugin, body), bodies))
        if sampled and not COUNTERS:
            continue  # mlx-vlm 0.6's bfloat16 log-probs: a near tie may draw otherwise (see the seeded test)
        assert [text for text, _ in together] == alone
        if COUNTERS:
            assert all(timings.get("draft_n") is not None for _, timings in together)


@pytest.mark.skipif(not COUNTERS, reason=NO_COUNTERS)
@pytest.mark.parametrize("flags", [("--mtp-depth", "2"), ("--no-mtp",)])
def test_command_line_defaults(checkpoint, servers, flags):
    """``--mtp-depth N`` and ``--no-mtp`` set the server's default; a request's own options still win."""
    _, stock = servers
    server = Server([sys.executable, "-m", "mlx_vlm.server", "--model", str(checkpoint), *flags],
                    checkpoint.parent, environment())
    server.model = str(checkpoint)
    try:
        text, timings = answer(server, chat(image=IMAGE, mtp_lookup=False))
        assert text == answer(stock, chat(image=IMAGE))[0]
        if flags[0] == "--no-mtp":  # only an explicit enable_mtp drafts
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


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
STRUCTURED = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def test_response_format_rows_join_the_mtp_batch(servers):
    """Requests under a JSON schema (text and image) decode in the MTP batch with their drafts made under the grammar,
    mlx-vlm's Metal-only mask replaced by one that runs on every device: the answer of the same request without MTP,
    valid JSON; eight at once, every other one constrained, each answers as alone."""
    import jsonschema

    plugin, _ = servers
    bodies = [chat(text=t, image=IMAGE if i % 4 == 1 else None, max_tokens=60,
                   **({"response_format": STRUCTURED} if i % 2 == 0 else {}))
              for i, t in enumerate([TEXT, "import os\n", "class Parser:\n", "for line in lines:\n"] * 2)]
    alone = [answer(plugin, {**body, "enable_mtp": False})[0] for body in bodies]
    text, timings = answer(plugin, bodies[0])
    assert text == alone[0]
    jsonschema.validate(json.loads(text), PERSON)
    if COUNTERS:
        assert timings["draft_n"] > 0
    with ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(lambda body: answer(plugin, body), bodies))
    assert [text for text, _ in together] == alone
    for text in alone[::2]:
        jsonschema.validate(json.loads(text), PERSON)
