"""Server soak test: many requests of every shape against the plugin's server, none may fail or change.

    python benchmarks/server_soak.py [--runtime mlx_lm] [--model examples/tiny-qwen3_5/hf] [--requests 200]
                                     [--clients 8] [--seed 0] [--out benchmarks/results]
    python benchmarks/server_soak.py --runtime mlx_vlm --model build/tiny-qwen3_5-vl --image picture.png

Starts a stock server (``MTP_PLUGIN_DISABLE=1``) and the plugin's on the same model. The workload (seeded) begins
with the requests that once killed the server, then mixes 1- and 2-token prompts with longer ones, ``max_tokens``
from 1 to 64, MTP options per request (none, ``enable_mtp`` false or true, ``mtp_depth`` 1-4), streamed and whole
answers, one request in four sampled with a seed (mlx-lm serves those on its single-request path), and with
``--image`` (mlx_vlm) every third request carrying the picture. First the
stock server answers every greedy request alone, one at a time (the reference), and the plugin's server every
request alone; then ``--clients`` clients send the whole workload to the plugin's server, and again to the stock
server (the control: what concurrency alone changes, e.g. mlx-lm < 0.32's padded prompt rows). Prints the
failures (an HTTP error, a dropped connection, a broken answer) and the greedy answers that differ from the
reference, for each phase. Exit 1 when the plugin's server failed a request, changed a greedy answer alone, or
changed one under load that the stock server kept under the same load.
"""

import argparse
import datetime
import importlib.metadata
import json
import os
import random
import sys
import tempfile
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from server_load import HEADLESS, PROMPTS, REPO, Server, data_url, result_name, text_of
from tqdm import tqdm

from mtp_plugin import tuning
from mtp_plugin.commands import measure

SHORT_PROMPTS = ["x", "import os", "(", "def", " return"]  # 1 and 2 tokens: the head has no pair before step one
LENGTHS = [1, 1, 2, 3, 8, 16, 32, 64]
REPORTED = [{"prompt": "x", "max_tokens": 4, "enable_mtp": False},  # the requests that once killed mlx_lm.server
            {"prompt": "def f(x):", "max_tokens": 8}, {"prompt": "import os", "max_tokens": 4},
            {"prompt": "x", "max_tokens": 1}]
OPTIONS = [{}, {}, {"enable_mtp": False}, {"enable_mtp": True}, {"mtp_depth": 1}, {"mtp_depth": 2}, {"mtp_depth": 3},
           {"mtp_depth": 4}]


def workload(requests: int, seed: int, image: str | None = None) -> list[dict]:
    """``requests`` request bodies (the ``REPORTED`` ones first, then mixed shapes, seeded): a completion body and
    ``stream``; with ``image`` (a data URL), every third one carries it."""
    rng = random.Random(seed)
    bodies = [{"body": {**body, "temperature": 0.0}, "stream": False} for body in REPORTED[:requests]]
    for i in range(len(bodies), requests):
        prompt = rng.choice(SHORT_PROMPTS if i % 3 == 0 else PROMPTS)
        body = {"prompt": prompt, "max_tokens": rng.choice(LENGTHS), "temperature": 0.0, **rng.choice(OPTIONS)}
        if i % 4 == 3:
            body.update(temperature=0.8, seed=rng.randrange(1000))
        if image is not None and i % 3 == 2:
            body["image"] = image
        bodies.append({"body": body, "stream": i % 5 == 1})
    return bodies


def ask(server: Server, request: dict) -> tuple[str | None, str | None]:
    """``(text, None)`` for an answer, ``(None, why)`` for a failure."""
    stream = request["stream"]
    path, body = server.route(request["body"])
    data = json.dumps({**body, "stream": stream}).encode()
    http = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", data=data,
                                  headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(http, timeout=300) as r:
            raw = r.read().decode()
    except urllib.error.HTTPError as e:
        return None, f"HTTP {e.code}: {e.read().decode()[:200]}"
    except (OSError, ConnectionError) as e:
        return None, f"{type(e).__name__}: {e}"
    try:
        if not stream:
            return text_of(json.loads(raw)), None
        events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return None, "stream ended without [DONE]"
        choices = [c for e in events[:-1] for c in json.loads(e)["choices"]]
        return "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in choices), None
    except (ValueError, KeyError, IndexError) as e:
        return None, f"broken answer ({type(e).__name__}): {raw[:200]}"


def under_load(server: Server, load: list[dict], clients: int, label: str) -> list[tuple[str | None, str | None]]:
    """Every request of ``load`` from ``clients`` concurrent clients; the answers in workload order."""
    with ThreadPoolExecutor(clients) as pool, tqdm(total=len(load), desc=label, unit="req") as bar:
        def one(request):
            out = ask(server, request)
            bar.update()
            return out
        return list(pool.map(one, load))


def report(name: str, load: list[dict], answers: list, reference: dict) -> tuple[list[str], set[int]]:
    """Lines for a server's failures and changed greedy answers; the indices of the changed ones."""
    lines, changed = [], set()
    for i, (text, why) in enumerate(answers):
        if why is not None:
            lines.append(f"  {name} FAILED #{i} {json.dumps(load[i]['body'])}: {why}")
        elif i in reference and text != reference[i]:
            changed.add(i)
            lines.append(f"  {name} changed #{i} {json.dumps(load[i]['body'])}: {text!r} != {reference[i]!r}")
    return lines, changed


def main() -> None:
    """Parse arguments, run the soak, print (and maybe write) the findings; exit 1 on a plugin fault."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", choices=["mlx_lm", "mlx_vlm"], default="mlx_lm", help="whose server")
    parser.add_argument("--model", type=Path, default=REPO / "examples" / "tiny-qwen3_5" / "hf")
    parser.add_argument("--stock-model", type=Path, help=f"the stock server's model (default: --model); {HEADLESS}")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image", type=Path, help="mlx_vlm: a picture every third request carries")
    parser.add_argument("--out", type=Path, help="directory for the dated result file")
    args = parser.parse_args()
    if args.requests < 1 or args.clients < 1:
        parser.error("--requests and --clients must be at least 1")
    if args.image is not None and args.runtime != "mlx_vlm":
        parser.error("--image needs --runtime mlx_vlm")
    image = None if args.image is None else data_url(args.image)
    load = workload(args.requests, args.seed, image)
    logs = Path(tempfile.mkdtemp(prefix="mtp-server-soak-"))
    stock = Server(args.runtime, args.stock_model or args.model, True, logs / "stock.log")
    plugin = Server(args.runtime, args.model, False, logs / "plugin.log")
    try:
        greedy = [i for i, r in enumerate(load) if r["body"]["temperature"] == 0.0]
        alone = {}
        for i in tqdm(greedy, desc="stock, alone", unit="req"):
            text, why = ask(stock, load[i])
            if why is not None:
                sys.exit(f"the stock server failed request #{i} alone ({why}); see {logs / 'stock.log'}")
            alone[i] = text
        answers = {"plugin alone": under_load(plugin, load, 1, "plugin, alone"),
                   "plugin": under_load(plugin, load, args.clients, "plugin, loaded"),
                   "stock": under_load(stock, load, args.clients, "stock, loaded")}
    finally:
        stock.stop()
        plugin.stop()
    lines, changed = {}, {}
    for name in answers:
        lines[name], changed[name] = report(name, load, answers[name], alone)
    versions = tuning.versions()
    if args.runtime == "mlx_vlm":
        versions["mlx-vlm"] = importlib.metadata.version("mlx-vlm")
    failures = {name: sum(why is not None for _, why in answers[name]) for name in answers}
    blamed = changed["plugin alone"] | (changed["plugin"] - changed["stock"])
    summary = [f"server soak: {args.runtime}.server, {args.model.name}"
               + (f" (stock: {args.stock_model.name})" if args.stock_model else "")
               + f", {args.requests} requests (seed {args.seed}, {len(alone)} greedy), {args.clients} clients"
               + (f", every third with {args.image.name}" if image else ""),
               f"date: {datetime.datetime.now().isoformat(timespec='seconds')}",
               f"machine: {json.dumps(tuning.machine())}, {os.cpu_count()} CPUs",
               f"versions: {json.dumps(versions)}",
               *(f"{name}: {failures[name]} failed, {len(changed[name])} greedy answers differ from stock alone"
                 for name in answers),
               f"plugin faults: {failures['plugin alone'] + failures['plugin'] + len(blamed)} (failures, and changes "
               "the stock control kept)",
               *(line for name in answers for line in lines[name])]
    text = "\n".join(summary) + "\n"
    print(text, end="")
    if args.out:
        path = measure.write_result(args.out, result_name("server-soak", args.runtime, args.model), text)
        print(f"written to {path}")
    sys.exit(1 if failures["plugin alone"] or failures["plugin"] or blamed else 0)


if __name__ == "__main__":
    main()
