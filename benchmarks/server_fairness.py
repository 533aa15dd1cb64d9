"""Server fairness benchmark: short requests beside a long one whose output repeats, stock against the plugin.

    python benchmarks/server_fairness.py [--model build/deep48] [--repeats 3] [--variant no-lookup=--no-mtp-lookup]
                                         [--time-cap 1500] [--out benchmarks/results]
    python benchmarks/server_fairness.py --runtime mlx_vlm --model build/deep48-vl [--image picture.png]

The workload of issue 34: one client sends a long greedy completion (``--long`` tokens) of a prompt whose greedy
continuation repeats it (prompt-lookup drafts pay there); ``--delay`` seconds later, ``--clients`` clients each send
``--requests`` short greedy completions (``--short`` tokens) one after another (``--runtime mlx_vlm``: chat completions
of mlx-vlm's server, every other short one with the ``--image`` picture). Also the long request alone. Servers:
stock (``MTP_PLUGIN_DISABLE=1``), the plugin with its defaults, and each ``--variant NAME=ARGS`` (the plugin's server
with those flags). Runs are interleaved, the order rotating each repeat. Prints, per server, medians over repeats:
the long request alone (seconds and speed against stock), the short requests' median latency and its ratio to
stock's, the wall time of the mixed run and its ratio, and whether every text equals stock's. Bounded: a fixed number
of requests, ``--time-cap`` seconds, loopback only.
"""

import argparse
import datetime
import importlib.metadata
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from server_load import HEADLESS, PROMPTS, Server, data_url, result_name, text_of
from tqdm import tqdm

from mtp_plugin import tuning
from mtp_plugin.commands import measure

REPO = Path(__file__).resolve().parents[1]
SOURCE = "def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n\n\n"
REPEATING = SOURCE * 3 + "def read_config(path):\n"  # the fixture's greedy continuation repeats the text above


def mixed(server: Server, args) -> dict:
    """The long request, and after ``args.delay`` seconds the short clients; latencies, wall and texts."""
    long_body = {"prompt": REPEATING, "max_tokens": args.long, "temperature": 0.0}
    out = {}

    def long_request():
        out["long"] = server.complete(long_body)

    def client(c: int):
        bodies = [{"prompt": PROMPTS[(c + i) % len(PROMPTS)], "max_tokens": args.short, "temperature": 0.0}
                  for i in range(args.requests)]
        for i, body in enumerate(bodies):
            if args.image is not None and (c + i) % 2:
                body["image"] = data_url(args.image)
        return [server.complete(body) for body in bodies]

    start = time.perf_counter()
    first = threading.Thread(target=long_request)
    first.start()
    time.sleep(args.delay)
    with ThreadPoolExecutor(args.clients) as pool:
        short = [a for answers in pool.map(client, range(args.clients)) for a in answers]
    first.join()
    wall = time.perf_counter() - start
    texts = [text_of(out["long"][1])] + [text_of(a) for _, a in short]
    return {"short": statistics.median(s for s, _ in short), "wall": wall, "texts": texts}


def alone(server: Server, args) -> dict:
    seconds, answer = server.complete({"prompt": REPEATING, "max_tokens": args.long, "temperature": 0.0})
    return {"alone": seconds, "alone_text": text_of(answer)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", choices=["mlx_lm", "mlx_vlm"], default="mlx_lm", help="whose server")
    parser.add_argument("--image", type=Path, help="mlx_vlm: a picture every other short request carries")
    parser.add_argument("--model", type=Path, default=REPO / "build" / "deep48",
                        help="a checkpoint (default build/deep48: python benchmarks/deepen.py --out build/deep48)")
    parser.add_argument("--stock-model", type=Path, help=f"the stock server's model (default: --model); {HEADLESS}")
    parser.add_argument("--long", type=int, default=600, help="tokens of the long request (default 600)")
    parser.add_argument("--short", type=int, default=24, help="tokens of each short request (default 24)")
    parser.add_argument("--clients", type=int, default=3, help="clients sending short requests (default 3)")
    parser.add_argument("--requests", type=int, default=2, help="short requests per client (default 2)")
    parser.add_argument("--delay", type=float, default=1.0, help="seconds between the long request and the others")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                        help="another plugin server, e.g. no-lookup=--no-mtp-lookup")
    parser.add_argument("--time-cap", type=float, default=1500.0, help="seconds for the whole benchmark")
    parser.add_argument("--out", type=Path, help="directory for the dated result file")
    args = parser.parse_args()
    if min(args.long, args.short, args.clients, args.requests, args.repeats) < 1 or args.delay < 0:
        parser.error("--long, --short, --clients, --requests and --repeats must be at least 1, --delay at least 0")
    if args.image is not None and (args.runtime != "mlx_vlm" or not args.image.is_file()):
        parser.error("--image takes a picture file and needs --runtime mlx_vlm")
    if any("=" not in v for v in args.variant):
        parser.error("--variant takes NAME=ARGS")
    if not (args.model / "config.json").is_file():
        parser.error(f"{args.model} is not a checkpoint (build one: python benchmarks/deepen.py --out {args.model})")

    logs = Path(tempfile.mkdtemp(prefix="mtp-server-fairness-"))
    flags = {"stock": None, "plugin": (), **{v.split("=", 1)[0]: tuple(v.split("=", 1)[1].split())
                                              for v in args.variant}}
    models = {"stock": args.stock_model or args.model}
    servers = {name: Server(args.runtime, models.get(name, args.model), extra is None, logs / f"{name}.log",
                            extra or ()) for name, extra in flags.items()}
    results = {name: [] for name in servers}
    deadline = time.monotonic() + args.time_cap
    try:
        for server in servers.values():  # warm up: model load, first compile
            server.complete({"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0.0})
        for r in tqdm(range(args.repeats), desc="server fairness", unit="round"):
            if time.monotonic() > deadline:
                print(f"time cap reached after {r} rounds", file=sys.stderr)
                break
            names = list(servers)
            for name in names[r % len(names):] + names[: r % len(names)]:
                results[name].append({**alone(servers[name], args), **mixed(servers[name], args)})
    finally:
        for server in servers.values():
            server.stop()

    rounds = min(len(v) for v in results.values())
    if not rounds:
        sys.exit("no round finished within --time-cap")
    stock = results["stock"][:rounds]
    versions = tuning.versions()
    if args.runtime == "mlx_vlm":
        versions["mlx-vlm"] = importlib.metadata.version("mlx-vlm")
    header = [f"server fairness: {args.runtime}.server, {args.model.name}, greedy; a {args.long}-token request whose "
              f"output repeats, then after {args.delay:g} s {args.clients} clients x {args.requests} requests of "
              f"{args.short} tokens" + (f" (every other one with {args.image.name})" if args.image else "")
              + (f" (stock: {args.stock_model.name})" if args.stock_model else "")
              + f"; medians of {rounds} interleaved rounds",
              f"date: {datetime.datetime.now().isoformat(timespec='seconds')}",
              f"machine: {json.dumps(tuning.machine())}, {os.cpu_count()} CPUs",
              f"versions: {json.dumps(versions)}",
              "server       long alone s  x stock | short p50 s  / stock | wall s  / stock | texts = stock | "
              "short p50 / stock by round"]
    lines = []
    for name, runs in results.items():
        runs = runs[:rounds]
        speed = statistics.median(s["alone"] / r["alone"] for s, r in zip(stock, runs, strict=True))
        short = statistics.median(r["short"] / s["short"] for s, r in zip(stock, runs, strict=True))
        wall = statistics.median(r["wall"] / s["wall"] for s, r in zip(stock, runs, strict=True))
        same = "yes" if all(r["texts"] == s["texts"] and r["alone_text"] == s["alone_text"]
                            for s, r in zip(stock, runs, strict=True)) else "NO"
        by_round = " ".join(f"{r['short'] / s['short']:.2f}" for s, r in zip(stock, runs, strict=True))
        lines.append(f"{name:12s} {statistics.median(r['alone'] for r in runs):12.2f}  {speed:7.2f} | "
                     f"{statistics.median(r['short'] for r in runs):11.2f}  {short:7.2f} | "
                     f"{statistics.median(r['wall'] for r in runs):6.2f}  {wall:7.2f} | {same:>13} | {by_round}")
    text = "\n".join(header + lines) + "\n"
    print(text, end="")
    if args.out:
        path = measure.write_result(args.out, result_name("server-fairness", args.runtime, args.model), text)
        print(f"written to {path}")


if __name__ == "__main__":
    main()
