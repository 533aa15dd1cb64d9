"""Server load benchmark: a stock server against the plugin's, same model, same mixed workload.

    python benchmarks/server_load.py [--model examples/tiny-qwen3_5/hf] [--concurrency 1 2 4 8]
                                     [--requests 8] [--repeats 3] [--time-cap 900] [--out benchmarks/results]
                                     [--repeating] [--structured] [--pace 7] [--variant no-lookup=--no-mtp-lookup]
    python benchmarks/server_load.py --runtime mlx_vlm --model build/tiny-qwen3_5-vl [--image picture.png]

``--runtime mlx_lm`` (default) runs ``mlx_lm.server`` with completions; ``mlx_vlm`` runs ``mlx_vlm.server`` with
chat completions (the model a vision checkpoint such as ``examples/add_vision_tower.py`` writes; ``--image``
attaches a picture to every other request).

Starts three servers on loopback ports: stock (``MTP_PLUGIN_DISABLE=1``), a second stock one (the control), and
the plugin's. For each concurrency c, c clients each send ``--requests`` greedy completions that alternate long
(128 tokens) and short (16 tokens) code prompts (with ``--repeating``, every other long one a prompt whose greedy
continuation repeats it: prompt-lookup drafts pay there), against each server in turn (interleaved, rotating the
order, ``--repeats`` times). A client sends its next request when the last one is answered, so a faster server
also brings its clients' next requests sooner; ``--pace S`` fixes the arrivals instead (client c of C sends request i
at (i + c/C) × S seconds, or when its last one is answered if that is later), the same for every server, so that
latencies compare like with like. ``--variant NAME=ARGS`` adds a plugin server run with those flags. Prints, per c and
server, the aggregate tokens/s and its ratio to stock's (the control's ratio is the run's noise floor: mlx-lm's
server admits a new request only between its 0.5 s generation windows, so how requests overlap, and the throughput,
shifts from run to run), the p50 latency of the short requests (they arrive while long ones decode) and its ratio,
their p95, and the acceptance and drafted tokens per generated token (``timings`` of the responses). Ratios are
medians over repeats of one run. Bounded: a fixed number of requests, ``--time-cap`` seconds in all, loopback only.
"""

import argparse
import base64
import datetime
import importlib.metadata
import json
import mimetypes
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from mtp_plugin import tuning
from mtp_plugin.commands import measure

REPO = Path(__file__).resolve().parents[1]
REPEATING = "def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n\n\n" * 3 + \
    "def read_config(path):\n"  # the fixtures' greedy continuation repeats the text above
PROMPTS = ["def read_config(path):\n", "import os\n\n\ndef main():\n", "class Parser:\n    def __init__(self",
           "for line in lines:\n", "    return self._", "# Copyright\nimport sys\n"]
LONG, SHORT = 128, 16
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "tags": {"type": "array", "maxItems": 6, "items": {"type": "string",
                                                                                          "maxLength": 16}},
                                           "count": {"type": "integer"}},
          "required": ["name", "tags", "count"], "additionalProperties": False}  # ``--structured`` requests
HEADLESS = ("a copy without the head's files where stock cannot load the head (mlx-vlm 0.6.5-0.6.8 shift its norms "
            "twice)")


class Server:
    """An ``mlx_lm.server`` or ``mlx_vlm.server`` subprocess on a free loopback port."""

    def __init__(self, runtime: str, model: Path, stock: bool, log: Path, extra: tuple[str, ...] = ()):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k != "MTP_PLUGIN_DISABLE"}
        if stock:
            env["MTP_PLUGIN_DISABLE"] = "1"
        self.runtime, self.model = runtime, str(model)
        command = [sys.executable, "-m", f"{runtime}.server", "--model", str(model),
                   "--host", "127.0.0.1", "--port", str(self.port), *extra]
        self.log = log.open("w")
        self.process = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=5)
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"server did not start; see {log}") from None
                time.sleep(0.3)

    def route(self, body: dict) -> tuple[str, dict]:
        """The path and body of a completion ``body`` (``prompt``, maybe ``image``: a data URL) for this server:
        itself for mlx-lm, a chat with one user message for mlx-vlm."""
        body = dict(body)
        if self.runtime != "mlx_vlm":
            return "/v1/completions", body
        image, text = body.pop("image", None), body.pop("prompt")
        content = text if image is None else [{"type": "image_url", "image_url": {"url": image}},
                                              {"type": "text", "text": text}]
        return "/v1/chat/completions", {**body, "model": self.model, "messages": [{"role": "user", "content": content}]}

    def complete(self, body: dict) -> tuple[float, dict]:
        """Seconds to the whole answer, and the answer (``body``: as ``route`` takes it)."""
        path, body = self.route(body)
        data = json.dumps(body).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data,
                                         headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=600) as r:
            answer = json.loads(r.read())
        return time.perf_counter() - start, answer

    def stop(self):
        self.process.terminate()
        self.process.wait(timeout=30)
        self.log.close()


def text_of(answer: dict) -> str:
    """The generated text of a whole (not streamed) completion or chat completion."""
    choice = answer["choices"][0]
    return choice.get("text", choice.get("message", {}).get("content")) or ""


def data_url(path: Path) -> str:
    """``path`` (a picture) as a data URL a chat request can carry."""
    kind = mimetypes.guess_type(path.name)[0] or "image/png"
    return f"data:{kind};base64," + base64.b64encode(path.read_bytes()).decode()


def workload(clients: int, requests: int, image: str | None = None, repeating: bool = False,
             structured: bool = False) -> list[list[dict]]:
    """Per client, its requests in order: long and short alternating (odd clients start short); with ``image`` (a
    data URL), every other request carries it; with ``repeating``, every other long request repeats its prompt; with
    ``structured``, every other long request asks for JSON under ``SCHEMA``."""
    out = []
    for c in range(clients):
        bodies = []
        for i in range(requests):
            n = LONG if (i + c) % 2 == 0 else SHORT
            prompt = REPEATING if repeating and n == LONG and (i // 2 + c) % 2 == 0 else PROMPTS[(c + i) % len(PROMPTS)]
            bodies.append({"prompt": prompt, "max_tokens": n, "temperature": 0.0})
            if image is not None and (c + i // 2) % 2:
                bodies[-1]["image"] = image
            if structured and n == LONG and (i // 2 + c) % 2:
                bodies[-1]["response_format"] = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
        out.append(bodies)
    return out


def run_load(server: Server, load: list[list[dict]], pace: float | None = None) -> dict:
    """Run every client's requests concurrently; aggregate tokens/s, short-request latencies, draft counters. With
    ``pace`` (seconds), client c of C sends request i no earlier than (i + c / C) × ``pace`` after the start."""
    def client(c: int):
        answers = []
        for i, body in enumerate(load[c]):
            if pace is not None:
                time.sleep(max(0.0, start + (i + c / len(load)) * pace - time.perf_counter()))
            answers.append((body["max_tokens"], *server.complete(body)))
        return answers

    start = time.perf_counter()
    with ThreadPoolExecutor(len(load)) as pool:
        answers = [a for done in pool.map(client, range(len(load))) for a in done]
    wall = time.perf_counter() - start
    tokens = sum(a["usage"]["completion_tokens"] for _, _, a in answers)
    short = sorted(seconds for n, seconds, _ in answers if n == SHORT)
    timings = [a.get("timings", {}) for _, _, a in answers]
    grammar = [(t["grammar_ms"], a["usage"]["completion_tokens"]) for (_, _, a), t in zip(answers, timings, strict=True)
               if "grammar_ms" in t]
    return {"tok_s": tokens / wall, "tokens": tokens, "short": short,
            "drafted": sum(t.get("draft_n") or 0 for t in timings),
            "accepted": sum(t.get("draft_n_accepted") or 0 for t in timings),
            "grammar_ms_per_token": sum(ms for ms, _ in grammar) / sum(n for _, n in grammar) if grammar else None}


def result_name(kind: str, runtime: str, model: Path) -> str:
    """``KIND-MODEL`` (mlx-lm) or ``mlx_vlm-KIND-MODEL-mlx-vlm-VERSION``: a result file's name after its date and
    device (``measure.write_result``)."""
    if runtime == "mlx_lm":
        return f"{kind}-{model.name}"
    return f"{runtime}-{kind}-{model.name}-mlx-vlm-{importlib.metadata.version('mlx-vlm')}"


def _median_known(values) -> float | None:
    """The median of the values that are not None, or None."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def main() -> None:
    """Parse arguments, run every server through every concurrency, print (and maybe write) the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", choices=["mlx_lm", "mlx_vlm"], default="mlx_lm", help="whose server")
    parser.add_argument("--model", type=Path, default=REPO / "examples" / "tiny-qwen3_5" / "hf")
    parser.add_argument("--image", type=Path, help="mlx_vlm: a picture every other request carries")
    parser.add_argument("--stock-model", type=Path,
                        help=f"the stock and control servers' model (default: --model); {HEADLESS}")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--requests", type=int, default=8, help="requests per client (default 8)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per server and concurrency")
    parser.add_argument("--time-cap", type=float, default=900.0, help="seconds for the whole benchmark")
    parser.add_argument("--pace", type=float, help="seconds between a client's request starts (default: none, each "
                        "client sends its next request when the last one is answered)")
    parser.add_argument("--repeating", action="store_true", help="every other long request repeats its prompt")
    parser.add_argument("--structured", action="store_true", help="mlx_lm: every other long request asks for JSON "
                        "under a schema (stock mlx-lm ignores response_format: short requests compare like with like)")
    parser.add_argument("--plugin-args", default="", help="extra arguments of the plugin's server, e.g. '--no-mtp'")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                        help="another plugin server with these flags, e.g. no-lookup=--no-mtp-lookup")
    parser.add_argument("--out", type=Path, help="directory for the dated result file")
    args = parser.parse_args()
    if min(args.concurrency) < 1 or args.requests < 1 or args.repeats < 1 or (args.pace or 1) <= 0:
        parser.error("--concurrency, --requests and --repeats must be at least 1, --pace above 0")
    if args.image is not None and args.runtime != "mlx_vlm":
        parser.error("--image needs --runtime mlx_vlm")
    if args.structured and args.runtime != "mlx_lm":
        parser.error("--structured needs --runtime mlx_lm (stock mlx-vlm's grammar mask needs Metal)")
    if any("=" not in v for v in args.variant):
        parser.error("--variant takes NAME=ARGS")
    image = None if args.image is None else data_url(args.image)

    logs = Path(tempfile.mkdtemp(prefix="mtp-server-load-"))
    plugins = {"plugin": args.plugin_args, **dict(v.split("=", 1) for v in args.variant)}
    stock_model = args.stock_model or args.model
    servers = {"stock": Server(args.runtime, stock_model, True, logs / "stock.log"),
               "control": Server(args.runtime, stock_model, True, logs / "control.log"),
               **{name: Server(args.runtime, args.model, False, logs / f"{name}.log", tuple(flags.split()))
                  for name, flags in plugins.items()}}
    deadline = time.monotonic() + args.time_cap
    rows = []
    try:
        for server in servers.values():  # warm up each server once (model load, first compile)
            run_load(server, workload(1, 1))
        steps = [(c, r) for c in args.concurrency for r in range(args.repeats)]
        results = {c: {name: [] for name in servers} for c in args.concurrency}
        for c, r in tqdm(steps, desc="server load", unit="run"):
            if time.monotonic() > deadline:
                print(f"time cap reached at concurrency {c}, repeat {r}", file=sys.stderr)
                break
            names = list(servers)
            for name in names[r % len(names):] + names[: r % len(names)]:
                load = workload(c, args.requests, image, args.repeating, args.structured)
                results[c][name].append(run_load(servers[name], load, args.pace))
        for c in args.concurrency:
            runs = min(len(v) for v in results[c].values())
            if not runs:
                continue
            stock = results[c]["stock"][:runs]
            for name in servers:
                done = results[c][name][:runs]
                drafted, accepted = sum(p["drafted"] for p in done), sum(p["accepted"] for p in done)
                tokens = sum(p["tokens"] for p in done)
                rows.append((c, name, statistics.median(p["tok_s"] for p in done),
                             statistics.median(p["tok_s"] / s["tok_s"] for s, p in zip(stock, done, strict=True)),
                             statistics.median(percentile(p["short"], 50) for p in done),
                             statistics.median(percentile(p["short"], 50) / percentile(s["short"], 50)
                                               for s, p in zip(stock, done, strict=True)),
                             statistics.median(percentile(p["short"], 95) for p in done),
                             accepted / drafted if drafted else 0.0, drafted / tokens if tokens else 0.0,
                             _median_known(p["grammar_ms_per_token"] for p in done)))
    finally:
        for server in servers.values():
            server.stop()

    versions = tuning.versions()
    if args.runtime == "mlx_vlm":
        versions["mlx-vlm"] = importlib.metadata.version("mlx-vlm")
    header = [f"server load: {args.runtime}.server, {args.model.name}, greedy, {args.requests} requests per client "
              f"(long {LONG} / short {SHORT} tokens alternating"
              + ("; every other long one repeats its prompt" if args.repeating else "")
              + (f"; every other one with {args.image.name}" if image else "")
              + ("; every other long one asks for JSON under a schema (stock: free text)" if args.structured else "")
              + (f"; stock: {args.stock_model.name}" if args.stock_model else "")
              + (f"; paced: request i of client c of C sent at (i + c/C) x {args.pace:g} s or when the last is answered"
                 if args.pace else "")
              + f"), median of {args.repeats} interleaved runs; "
              + ", ".join(f"{name}: {flags or 'defaults'}" for name, flags in plugins.items()),
              f"date: {datetime.datetime.now().isoformat(timespec='seconds')}",
              f"machine: {json.dumps(tuning.machine())}, {os.cpu_count()} CPUs",
              f"versions: {json.dumps(versions)}",
              "clients  server      tok/s  / stock | short p50 s  / stock | short p95 s | acceptance drafted/token"
              + (" | grammar ms/token" if args.structured else "")]
    lines = [f"{c:7d}  {name:10s} {tok:6.1f}  {ratio:7.2f} | {p50:11.3f}  {r50:7.2f} | {p95:11.3f} | "
             f"{acc:10.2f} {per:15.2f}" + (f" | {'-' if ms is None else f'{ms:16.3f}'}" if args.structured else "")
             for c, name, tok, ratio, p50, r50, p95, acc, per, ms in rows]
    text = "\n".join(header + lines) + "\n"
    print(text, end="")
    if args.out:
        kind = "server-load-paced" if args.pace else "server-load"
        path = measure.write_result(args.out, result_name(kind, args.runtime, args.model), text)
        print(f"written to {path}")


if __name__ == "__main__":
    main()
