"""A real ``mlx_lm.server`` on a loopback port, serving the bundled trained tiny checkpoint."""

import importlib
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import pytest
from helpers.console_runs import CONCURRENT, MLX4, PROMPTS, REPO, environment
from mlx_lm.tokenizer_utils import load as load_tokenizer

CHAT = [{"role": "user", "content": "def parse(text):"}]
REPEATING = "x = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3,"  # the bundled model's answer repeats a token pair


class Server:
    """One ``mlx_lm.server`` subprocess; ``post`` answers ``(status, json)``, ``stream`` the SSE events."""

    def __init__(self, command: list[str], workdir: Path, env: dict | None = None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = workdir / f"server-{self.port}.log"
        with open(self.log, "w") as log:
            self.process = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(self.port)],
                                            cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=5)
                return
            except OSError:
                time.sleep(0.3)
        raise TimeoutError(self.log.read_text())

    def _request(self, path: str, body: dict):
        return urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                      headers={"Content-Type": "application/json"})

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(self._request(path, body), timeout=300) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stream(self, path: str, body: dict) -> list[dict]:
        with urllib.request.urlopen(self._request(path, {**body, "stream": True}), timeout=300) as r:
            lines = r.read().decode().splitlines()
        events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return [json.loads(e) for e in events[:-1]]

    def stop(self):
        self.process.terminate()
        self.process.wait(timeout=30)


def server_command(*args) -> list[str]:
    return [str(Path(sys.executable).parent / "mlx_lm.server"), *args]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("server")


@pytest.fixture(scope="module")
def server(workdir):
    s = Server(server_command("--model", str(MLX4), "--plugin", "mtp", "--mtp-depth", "2"), workdir, environment())
    yield s
    s.stop()


@pytest.fixture(scope="module")
def headless(workdir):
    """A copy of the checkpoint without its sidecar head (never modify examples/ in place)."""
    path = workdir / "no-head"
    shutil.copytree(MLX4, path, ignore=shutil.ignore_patterns("mtp.safetensors"))
    return path


def completion(prompt: str, **options) -> dict:
    return {"prompt": prompt, "max_tokens": 24, "temperature": 0.0, **options}


def text_of(response: dict) -> str:
    choice = response["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def streamed_text(events: list[dict]) -> str:
    return "".join(c["delta"].get("content", "") for e in events for c in e["choices"])


def test_completion_with_mtp_matches_plain_and_counts_drafts(server):
    status, mtp = server.post("/v1/completions", completion(PROMPTS[0]))
    assert status == 200
    _, plain = server.post("/v1/completions", completion(PROMPTS[0], enable_mtp=False))
    assert text_of(mtp) == text_of(plain) and mtp["usage"]["completion_tokens"] == 24
    assert mtp["timings"]["draft_n"] > 0 and 0 < mtp["timings"]["draft_n_accepted"] <= mtp["timings"]["draft_n"]
    assert plain["timings"] == {"draft_n": 0, "draft_n_accepted": 0}


def test_lookup_drafts_are_counted(server):
    """On a prompt whose continuation repeats it, ``draft_n`` / ``draft_n_accepted`` count the lookup drafts beside
    the head's (mlx-vlm's server counts them the same way)."""
    _, head = server.post("/v1/completions", completion(REPEATING, mtp_depth=1, mtp_lookup=False, max_tokens=64))
    _, both = server.post("/v1/completions", completion(REPEATING, mtp_depth=1, max_tokens=64))
    assert text_of(head) == text_of(both)
    assert head["timings"]["draft_n"] <= 64  # depth 1: at most a head draft a token
    assert both["timings"]["draft_n_accepted"] > head["timings"]["draft_n_accepted"], (head, both)


def test_request_depth_is_used(server):
    _, deep = server.post("/v1/completions", completion(PROMPTS[1], mtp_depth=4, mtp_lookup=False))
    _, default = server.post("/v1/completions", completion(PROMPTS[1], mtp_lookup=False))
    assert text_of(deep) == text_of(default)
    assert deep["timings"]["draft_n"] % 4 == 0 and default["timings"]["draft_n"] % 2 == 0
    assert deep["timings"]["draft_n"] != default["timings"]["draft_n"]


def test_request_lookup_option(server):
    """``mtp_lookup`` per request: on (the default) and off give the same text."""
    _, on = server.post("/v1/completions", completion(PROMPTS[1], mtp_lookup=True))
    _, off = server.post("/v1/completions", completion(PROMPTS[1], mtp_lookup=False))
    assert text_of(on) == text_of(off) and on["timings"]["draft_n"] > 0


def test_streamed_chat_matches_unstreamed_and_reports_counters(server):
    body = {"messages": CHAT, "max_tokens": 24, "temperature": 0.0}
    _, whole = server.post("/v1/chat/completions", body)
    events = server.stream("/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert streamed_text(events) == text_of(whole)
    final = [e for e in events if any(c.get("finish_reason") for c in e["choices"])]
    assert len(final) == 1 and final[0]["timings"]["draft_n"] > 0
    assert events[-1]["usage"]["completion_tokens"] == 24 and events[-1]["timings"] == final[0]["timings"]


@pytest.mark.parametrize("options", [{"mtp_depth": 1}, {"mtp_depth": 2, "mtp_lookup": False}, {"mtp_depth": 3},
                                     {"mtp_depth": 0}, {"mtp_depth": 0, "mtp_lookup": False}])
def test_seed_repeats_whatever_the_prompt_cache_holds(server, options):
    """A seeded sampled request; then a request whose prompt is a prefix of it, which leaves a cache entry (its prompt
    and completion) that the seeded request's prompt extends; then the seeded request again, restoring that entry:
    the same text (neither the drafts nor the head's state after a cache hit decide the tokens)."""
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, tokenizer = load(str(MLX4))
    prefix = f"# case {sorted(options.items())}\n{PROMPTS[0]}"
    tokens = tokenizer.encode(prefix)
    greedy = tokenizer.decode([t for t, _ in generate_step(mx.array(tokens), model, max_tokens=4)])
    prompt = prefix + greedy + "\n\n# more\n"
    cached = len(tokenizer.encode(prefix + greedy))
    assert tokenizer.encode(prompt)[:cached] == tokenizer.encode(prefix + greedy)  # the entry's tokens lead the prompt
    body = completion(prompt, temperature=0.8, seed=5, max_tokens=32, **options)
    _, first = server.post("/v1/completions", body)
    _, shorter = server.post("/v1/completions", completion(prefix, seed=1, max_tokens=4, **options))
    _, again = server.post("/v1/completions", body)
    assert shorter["usage"]["completion_tokens"] == 4
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == cached
    assert text_of(again) == text_of(first) and first["timings"]["draft_n"] + again["timings"]["draft_n"] > 0


@pytest.mark.parametrize("options", [{"enable_mtp": "yes"}, {"enable_mtp": 1}, {"mtp_depth": -1},
                                     {"mtp_depth": 9}, {"mtp_depth": True}, {"mtp_depth": 2.5},
                                     {"mtp_lookup": "on"}, {"mtp_lookup": 0}, {"prompt": ""}, {"prompt": []}])
def test_bad_options_get_400(server, options):
    status, answer = server.post("/v1/completions", {**completion(PROMPTS[0]), **options})
    assert status == 400 and next(iter(options)) in answer["error"]
    assert server.post("/v1/completions", completion(PROMPTS[0], max_tokens=2))[0] == 200


def test_concurrent_requests_with_and_without_mtp(server):
    if CONCURRENT is not PROMPTS:
        tokenizer = load_tokenizer(MLX4)
        assert len({len(tokenizer.encode(p)) for p in CONCURRENT}) == 1
    expected = {p: text_of(server.post("/v1/completions", completion(p, enable_mtp=False))[1]) for p in CONCURRENT}

    def ask(i):
        prompt, options = CONCURRENT[i % len(CONCURRENT)], {"enable_mtp": i % 2 == 0}
        if i % 3 == 0:
            events = server.stream("/v1/completions", completion(prompt, **options))
            return prompt, "".join(c["text"] for e in events for c in e["choices"]), events[-1]["timings"]
        _, answer = server.post("/v1/completions", completion(prompt, **options))
        return prompt, text_of(answer), answer["timings"]

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(12)))
    for i, (prompt, text, timings) in enumerate(answers):
        assert text == expected[prompt], (i, prompt)
        assert (timings["draft_n"] > 0) == (i % 2 == 0), (i, timings)


def test_no_mtp_flag_and_python_m_entry(workdir):
    s = Server([sys.executable, "-m", "mlx_lm", "server", "--model", str(MLX4), "--no-mtp"], workdir, environment())
    try:
        _, off = s.post("/v1/completions", completion(PROMPTS[0]))
        _, on = s.post("/v1/completions", completion(PROMPTS[0], enable_mtp=True))
    finally:
        s.stop()
    assert off["timings"]["draft_n"] == 0 and on["timings"]["draft_n"] > 0
    assert text_of(off) == text_of(on)


SHORT_REQUESTS = [{"prompt": "x", "max_tokens": 4, "enable_mtp": False}, {"prompt": "x", "max_tokens": 1},
                  {"prompt": PROMPTS[0], "max_tokens": 8}, {"prompt": "import os", "max_tokens": 4},
                  {"prompt": "import os", "max_tokens": 3, "mtp_depth": 3}]


@pytest.mark.parametrize("flags", [["--plugin", "mtp"], ["--no-mtp"]], ids=["plugin-mtp", "no-mtp"])
def test_short_prompts_on_a_fresh_server(workdir, flags):
    """1- and 2-token prompts that finish before the head has a pair (they once killed the generation thread),
    first on a fresh ``python -m mlx_lm.server`` (the module run as ``__main__``, the plugin active there too),
    then after ordinary requests, then a prompt that repeats a cached sequence (an earlier prompt and its
    completion: stock mlx-lm's thread dies there, "empty prompt"): every answer is the same server's with MTP off,
    and the server lives."""
    s = Server([sys.executable, "-m", "mlx_lm.server", "--model", str(MLX4), *flags], workdir, environment())
    try:
        answers = [s.post("/v1/completions", completion(**body)) for body in SHORT_REQUESTS]
        plain = [s.post("/v1/completions", completion(**{**body, "enable_mtp": False})) for body in SHORT_REQUESTS]
        _, first = s.post("/v1/completions", completion(PROMPTS[3], max_tokens=1))
        repeats = [completion(PROMPTS[3], max_tokens=4), completion(PROMPTS[3] + text_of(first), max_tokens=4)]
        repeated = [s.post("/v1/completions", {**body, "enable_mtp": enabled}) for body in repeats
                    for enabled in (True, False)]
        after = s.post("/v1/completions", completion(PROMPTS[1], enable_mtp=True, mtp_depth=2))
    finally:
        s.stop()
    for (status, answer), (_, stock), body in zip(answers, plain, SHORT_REQUESTS, strict=True):
        assert status == 200, answer
        assert text_of(answer) == text_of(stock) and answer["usage"]["completion_tokens"] == body["max_tokens"]
        assert "timings" in answer  # the plugin answered
    assert [status for status, _ in repeated] == [200] * 4, repeated
    assert text_of(repeated[0][1]) == text_of(repeated[1][1]) and text_of(repeated[2][1]) == text_of(repeated[3][1])
    assert after[0] == 200 and after[1]["timings"]["draft_n"] > 0


def test_soak_of_every_request_shape():
    """``benchmarks/server_soak.py`` (as in the README; 40 requests here, 200 in the dated results): 1- and
    2-token prompts, max_tokens 1-64, MTP on, off and per request, streamed, sampled with a seed, alone and from 8
    clients: no request fails and every greedy answer is stock's."""
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "server_soak.py"), "--requests", "40"],
                         capture_output=True, text=True, env=environment(), timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "plugin faults: 0" in out.stdout and "plugin: 0 failed, 0 greedy answers differ" in out.stdout


def test_model_without_head_is_served_as_stock(workdir, headless):
    answers = []
    for env in (environment(), environment(MTP_PLUGIN_DISABLE="1")):
        s = Server(server_command("--model", str(headless)), workdir, env)
        try:
            answers.append([s.post("/v1/completions", completion(p))[1] for p in PROMPTS[:2]])
            answers[-1].append(s.post("/v1/completions", completion(PROMPTS[0], temperature=0.8, seed=3))[1])
        finally:
            s.stop()
    patched, stock = answers
    for a, b in zip(patched, stock, strict=True):
        assert "timings" not in a and a.keys() == b.keys()
        assert text_of(a) == text_of(b)


KV_BITS = ["--kv-bits", "8", "--quantized-kv-start", "0"]


@pytest.mark.skipif(subprocess.run(server_command("--help"), capture_output=True, text=True,
                                   env=environment()).stdout.count("--kv-bits") == 0,
                    reason="this mlx-lm's server has no --kv-bits")
@pytest.mark.parametrize("flags", [KV_BITS, ["--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "12"]],
                         ids=["kv-bits-8", "kv-bits-4-from-12"])
def test_quantized_kv_cache_server(workdir, flags):
    """``mlx_lm.server --kv-bits`` answers default requests with MTP, with the text of stock decoding."""
    s = Server(server_command("--model", str(MLX4), *flags), workdir, environment())
    try:
        status, mtp = s.post("/v1/completions", completion(PROMPTS[0]))
        _, plain = s.post("/v1/completions", completion(PROMPTS[0], enable_mtp=False))
        chat = {"messages": CHAT, "max_tokens": 24, "temperature": 0.0}
        streamed = streamed_text(s.stream("/v1/chat/completions", chat))
        _, stock_chat = s.post("/v1/chat/completions", {**chat, "enable_mtp": False})
    finally:
        s.stop()
    assert status == 200 and mtp["timings"]["draft_n"] > 0
    assert text_of(mtp) == text_of(plain) and streamed == text_of(stock_chat)


class FailingModelProvider:
    """A model provider whose model cannot load: mlx-lm's generation thread dies as it starts."""

    def load_default(self):
        raise RuntimeError("simulated crash")


@pytest.mark.parametrize("call", [lambda rg: rg.generate(None, None),
                                  lambda rg: rg.generate(request=None, generation_args=None)],
                         ids=["positional", "keywords"])
def test_dead_generation_thread_raises_mlx_lms_own_error(call):
    """The wrapped ``ResponseGenerator.generate`` lets mlx-lm raise its own "generation thread died"."""
    server = importlib.import_module("mlx_lm.server")
    if not hasattr(server.ResponseGenerator, "generation_available"):
        pytest.skip("this mlx-lm's ResponseGenerator does not detect a dead generation thread")
    assert hasattr(server.ResponseGenerator.generate, "__wrapped__")  # the plugin's wrapper is in place
    rg = server.ResponseGenerator(FailingModelProvider(), server.LRUPromptCache())
    rg.join()
    with pytest.raises(RuntimeError, match="generation thread died"):
        call(rg)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the provider's simulated crash
def test_only_the_servers_prompt_cache_keeps_a_token_to_run():
    """A prompt equal to a cached sequence: the server's own prompt cache (the one its ``ResponseGenerator`` holds)
    answers with the cache of all but its last token and that token to run (stock's generation thread dies on an
    empty remainder); any other ``LRUPromptCache`` answers as stock (mlx-lm's own suite tests the class so)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    server = importlib.import_module("mlx_lm.server")
    own, serving = server.LRUPromptCache(), server.LRUPromptCache()
    rg = server.ResponseGenerator(FailingModelProvider(), serving)
    rg.join()
    for cache in (own, serving):
        kv = KVCache()
        kv.update_and_fetch(mx.zeros((1, 1, 2, 4)), mx.zeros((1, 1, 2, 4)))  # the cache of tokens 1, 2
        cache.insert_cache("model", [1, 2], [kv])
    assert own.fetch_nearest_cache("model", [1, 2])[1] == []
    assert serving.fetch_nearest_cache("model", [1, 2])[1][-1:] == [2]  # at least the last token is run


def outcome(server: Server, path: str, body: dict) -> tuple:
    """``(status, text)`` of a request, or ``("disconnected",)`` when the server dropped the connection."""
    try:
        status, answer = server.post(path, body)
    except (urllib.error.URLError, ConnectionError) as e:  # http.client.RemoteDisconnected is a ConnectionError
        return ("disconnected", type(e).__name__)
    return status, text_of(answer) if status == 200 else answer


def test_draft_model_server_is_stock(workdir):
    """``mlx_lm.server --draft-model``: mlx-lm's own speculative decoding, answered as stock mlx-lm answers (on
    this hybrid checkpoint stock mlx-lm fails: its GatedDeltaNet caches cannot be trimmed)."""
    answers, logs = [], []
    for env in (environment(), environment(MTP_PLUGIN_DISABLE="1")):
        s = Server(server_command("--model", str(MLX4), "--draft-model", str(MLX4), "--num-draft-tokens", "2"),
                   workdir, env)
        try:
            answers.append([outcome(s, "/v1/completions", completion(PROMPTS[0])),
                            outcome(s, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 12})])
        finally:
            s.stop()
        logs.append([line for line in s.log.read_text().splitlines() if "Error" in line])
    assert answers[0] == answers[1]
    assert logs[0] == logs[1]  # the same errors (if any), stock's own


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
STRUCTURED = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_response_format_decodes_as_constrained_plain_decoding(server, path):
    """A ``json_schema`` request drafts under its grammar and answers what the same request without MTP answers:
    JSON valid under the schema, streamed or whole; ``json_object`` gives a JSON object."""
    import jsonschema

    def body(**options):
        base = completion(PROMPTS[0]) if path == "/v1/completions" else {"messages": CHAT, "temperature": 0.0}
        return {**base, "max_tokens": 80, "response_format": STRUCTURED, **options}

    status, mtp = server.post(path, body())
    _, plain = server.post(path, body(enable_mtp=False))
    assert status == 200 and text_of(mtp) == text_of(plain)
    jsonschema.validate(json.loads(text_of(mtp)), PERSON)
    assert mtp["timings"]["draft_n"] > 0 and plain["timings"]["draft_n"] == 0
    events = server.stream(path, body())
    streamed = "".join(c.get("text") or c.get("delta", {}).get("content") or "" for e in events for c in e["choices"])
    assert streamed == text_of(mtp)
    _, anything = server.post(path, body(response_format={"type": "json_object"}))
    assert isinstance(json.loads(text_of(anything)), dict)


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}},
    {"type": "json_schema", "json_schema": {"name": "no schema"}}, {"type": "yaml"}, "json"])
def test_a_bad_response_format_gets_400(server, response_format):
    status, answer = server.post("/v1/completions", completion(PROMPTS[0], response_format=response_format))
    assert status == 400 and "response_format" in answer["error"], answer
    assert server.post("/v1/completions", completion(PROMPTS[0], max_tokens=2))[0] == 200


def test_a_grammar_that_cannot_finish_ends_at_max_tokens(server):
    unbounded = {"type": "json_schema", "json_schema": {"schema": {"type": "array", "items": {"type": "string"},
                                                                   "minItems": 20}}}
    _, answer = server.post("/v1/completions", completion(PROMPTS[0], max_tokens=16, response_format=unbounded))
    assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 16


def test_constrained_and_free_requests_from_eight_clients(server):
    """Eight clients at once, every other request under the schema: each answer is its own request's without MTP,
    whatever shares its batch."""
    def body(i: int, **options) -> dict:
        structured = {"response_format": STRUCTURED} if i % 2 else {}
        return completion(CONCURRENT[i % len(CONCURRENT)], max_tokens=60, **structured, **options)

    expected = [text_of(server.post("/v1/completions", body(i, enable_mtp=False))[1]) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: server.post("/v1/completions", body(i))[1], range(8)))
    assert [text_of(a) for a in answers] == expected
    assert all(json.loads(text_of(a)) for a in answers[1::2])
    assert all(a["timings"]["draft_n"] > 0 for a in answers)
