"""MTP under continuous batching in a real ``mlx_lm.server``: several clients at once, against a stock server.

One plugin server (automatic depth by default) and one stock server (``MTP_PLUGIN_DISABLE=1``) on the bundled
4-bit checkpoint, built once for the module. Temperature-0 answers under concurrent load must equal what the
stock server answers to each request alone; a short request must not wait behind a long one; a client that
disconnects must not disturb the others.
"""

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers.console_runs import MLX4, environment
from mtp_plugin.adapters.patching import release
from test_server import PROMPTS, Server, server_command, text_of

pytestmark = pytest.mark.skipif(
    release("mlx-lm") < (0, 32),
    reason="mlx-lm < 0.32's own batching changes the output of right-padded prompt rows (its GatedDeltaNet mask "
           "ignores prompt lengths), so a request batched with others need not match it served alone; "
           "tests/test_batching.py compares with mlx-lm's own batch there")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("batching")
    plugin = Server(server_command("--model", str(MLX4)), workdir, environment())
    stock = Server(server_command("--model", str(MLX4)), workdir, environment(MTP_PLUGIN_DISABLE="1"))
    yield plugin, stock
    plugin.stop()
    stock.stop()


def request(i: int) -> dict:
    """The i-th request of the mixed load: prompt, length, depth (fixed, automatic, or MTP off), streaming."""
    body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": (16, 40, 24, 32)[i % 4], "temperature": 0.0}
    head_only = {"mtp_lookup": False}  # draft_n then counts whole cycles of the head
    body.update(({"mtp_depth": 2, **head_only}, {}, {"enable_mtp": False}, {"mtp_depth": 3, **head_only},
                 {"mtp_depth": 1, **head_only})[i % 5])
    return body


def answer(server: Server, body: dict, stream: bool) -> tuple[str, dict]:
    """The completion text and the final ``timings`` of one request."""
    if stream:
        events = server.stream("/v1/completions", body)
        return "".join(c["text"] for e in events for c in e["choices"]), events[-1].get("timings")
    status, out = server.post("/v1/completions", body)
    assert status == 200, out
    return text_of(out), out.get("timings")


@pytest.fixture(scope="module")
def alone(servers):
    """The stock server's answer to each request of the load, served one at a time."""
    _, stock = servers
    return {i: answer(stock, request(i), False)[0] for i in range(16)}


@pytest.mark.parametrize("clients", [1, 2, 4, 8])
def test_concurrent_clients_get_stock_answers(servers, alone, clients):
    plugin, _ = servers
    order = list(range(16))[: 2 * clients]

    def client(k):
        return [(i, *answer(plugin, request(i), stream=i % 3 == 0)) for i in order[k::clients]]

    with ThreadPoolExecutor(clients) as pool:
        results = [r for batch in pool.map(client, range(clients)) for r in batch]
    for i, text, timings in results:
        assert text == alone[i], (i, request(i))
        if request(i).get("mtp_depth"):
            assert timings["draft_n"] > 0 and timings["draft_n"] % request(i)["mtp_depth"] == 0, (i, timings)
        if request(i).get("enable_mtp") is False:
            assert timings == {"draft_n": 0, "draft_n_accepted": 0}


def test_short_request_is_not_blocked_by_a_long_one(servers):
    """A short request sent while a long one decodes with MTP finishes before the long one (it joins the batch)."""
    plugin, _ = servers
    finished = {}

    def long_request():
        plugin.stream("/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 400, "mtp_depth": 2,
                                          "temperature": 0.0})
        finished["long"] = time.monotonic()

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(1.0)
    text, _ = answer(plugin, {**request(0), "max_tokens": 8}, stream=False)
    finished["short"] = time.monotonic()
    thread.join(timeout=600)
    assert finished["short"] < finished["long"]
    assert text


def test_disconnected_client_leaves_the_others_undisturbed(servers, alone):
    plugin, _ = servers
    body = json.dumps({"prompt": PROMPTS[2], "max_tokens": 2000, "mtp_depth": 2, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", plugin.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        received = b""
        while received.count(b"data: ") < 3:
            received += s.recv(4096)
    with ThreadPoolExecutor(3) as pool:
        texts = list(pool.map(lambda i: answer(plugin, request(i), stream=False)[0], range(3)))
    assert texts == [alone[i] for i in range(3)]


def test_a_long_conversation_gets_stock_answers_turn_after_turn(servers):
    """A prompt past the head's window (``drafter.window``: its prompt pass is cut where the window starts), then two
    turns that extend it (the server's prompt cache holds the conversation), at a fixed depth (the shared servers'
    policy may be parked): the stock server's answers, drafting."""
    import importlib
    from pathlib import Path

    text = Path(importlib.import_module("mlx_lm.generate").__file__).read_text()[:9000]  # ~2k tokens here
    plugin, stock = servers
    drafted = 0
    for turn in range(3):
        body = {"prompt": text, "max_tokens": 24, "temperature": 0.0, "mtp_depth": 2}  # drafts whatever the policy
        ours, timings = answer(plugin, body, False)
        assert ours == answer(stock, body, False)[0], f"turn {turn}"
        drafted += timings["draft_n"]
        text += ours + f"\n# turn {turn + 2}\n"
    assert drafted > 0
