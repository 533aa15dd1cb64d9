"""Agent trace: a coding agent's growing conversation replayed against a stock and the plugin's ``mlx_lm.server``.

    python benchmarks/agent_trace.py [--model examples/tiny-qwen3_5/hf] [--turns 8] [--file-tokens 3000]
                                     [--max-tokens 48] [--out benchmarks/results]

Both servers start side by side (stock: ``MTP_PLUGIN_DISABLE=1``) and get the same conversation, turn by turn,
alternating which goes first: a system prompt with the agent's tool schemas, then turns whose user message is a tool
result (in turn a real source file, mlx-lm's own modules of about ``--file-tokens`` tokens each, and a short test
report) and an instruction, each turn extending the conversation the server's prompt cache holds; every request
carries the tool schemas (``tools``). The assistant's reply of each turn is the stock server's, so both servers see
the same context. Greedy, streamed. Prints per turn: context tokens and those the turn added to the cached
conversation, time to first token of each server and their ratio, decode tokens/s of each (tokens after the first
over the time after it), the plugin's drafted and accepted tokens, and whether its text and tool calls equal stock's.
Loopback only; bounded by ``--turns``.
"""

import argparse
import importlib
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from server_load import REPO, Server, result_name
from tqdm import tqdm

from mtp_plugin.commands import measure

MODULES = ("mlx_lm.generate", "mlx_lm.server", "mlx_lm.utils", "mlx_lm.sample_utils", "mlx_lm.tokenizer_utils",
           "mlx_lm.models.cache", "mlx_lm.models.qwen3_5", "mlx_lm.convert")
TOOLS = [{"type": "function", "function": {"name": name, "description": text, "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, **extra}, "required": ["path"]}}}
         for name, text, extra in (
             ("read_file", "Read a file of the repository.", {}),
             ("edit_file", "Replace a span of a file.", {"old": {"type": "string"}, "new": {"type": "string"}}),
             ("run_tests", "Run the tests of a path.", {"filter": {"type": "string"}}))]
SYSTEM = ("You are a coding agent. You work in a Python repository through these tools; call one per turn.\n"
          + json.dumps(TOOLS, indent=1))


def stream(server: Server, messages: list[dict], max_tokens: int) -> dict:
    """One streamed greedy chat completion: text, seconds to the first and to the last token, token count, timings."""
    body = {"model": server.model, "messages": messages, "tools": TOOLS, "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(f"http://127.0.0.1:{server.port}/v1/chat/completions",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    start, first, text, tokens, last, usage, calls = time.perf_counter(), None, "", 0, {}, {}, []
    with urllib.request.urlopen(request, timeout=1800) as response:
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            event = json.loads(line[5:])
            last, usage = event, event.get("usage") or usage
            for choice in event.get("choices", []):
                calls += choice.get("delta", {}).get("tool_calls") or []
                piece = choice.get("delta", {}).get("content") or ""
                if piece:
                    first = first or time.perf_counter() - start
                    text, tokens = text + piece, tokens + 1
    return {"text": text, "calls": calls, "first": first or 0.0, "total": time.perf_counter() - start,
            "tokens": usage.get("completion_tokens", tokens), "context": usage.get("prompt_tokens", 0),
            "timings": last.get("timings") or {}}


def tool_results(count: int, file_tokens: int) -> list[str]:
    """``count`` tool results: a real source file cut to about ``file_tokens`` tokens (4 characters each; the next
    modules follow a shorter one), then a short test report, in turn."""
    sources = [Path(importlib.import_module(m).__file__).read_text() for m in MODULES]
    files = [f"read_file returned {MODULES[i % len(MODULES)].replace('.', '/')}.py:\n"
             f"{''.join(sources[i % len(sources):] + sources[: i % len(sources)])[: file_tokens * 4]}\n"
             for i in range(count)]
    return [files[i // 2] if i % 2 == 0 else f"run_tests returned: 3 passed, 1 failed ({MODULES[i // 2 % len(MODULES)]}"
            f" test {i}).\n" for i in range(count)]


def main() -> None:
    """Parse arguments, replay the trace on both servers, print (and maybe write) the per-turn table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO / "examples" / "tiny-qwen3_5" / "hf")
    parser.add_argument("--turns", type=int, default=8, help="conversation turns (default 8)")
    parser.add_argument("--file-tokens", type=int, default=3000, help="about how long each tool result is")
    parser.add_argument("--max-tokens", type=int, default=48, help="reply length per turn (default 48)")
    parser.add_argument("--out", type=Path, help="directory for the dated result file")
    args = parser.parse_args()
    if args.turns < 1 or args.file_tokens < 1 or args.max_tokens < 2:
        parser.error("--turns and --file-tokens must be at least 1, --max-tokens at least 2")
    if not args.model.is_dir():
        parser.error(f"{args.model}: no such directory")
    logs = Path(tempfile.mkdtemp(prefix="agent-trace-"))
    servers = {"stock": Server("mlx_lm", args.model, True, logs / "stock.log"),
               "plugin": Server("mlx_lm", args.model, False, logs / "plugin.log")}
    messages = [{"role": "system", "content": SYSTEM}]
    lines = [f"# agent trace: {args.model.name}, {args.turns} turns, tool results of ~{args.file_tokens} tokens, "
             f"{args.max_tokens}-token replies, greedy",
             "turn  context  added  ttft stock  ttft plugin  ratio  tok/s stock  tok/s plugin  drafted  accepted  "
             "same"]
    context = 0
    try:
        for turn, result in enumerate(tqdm(tool_results(args.turns, args.file_tokens), desc="turns", unit="turn")):
            messages.append({"role": "user", "content": result + f"Turn {turn + 1}: fix the first function above."})
            order = list(servers) if turn % 2 == 0 else list(reversed(servers))
            runs = {name: stream(servers[name], messages, args.max_tokens) for name in order}
            stock, ours = runs["stock"], runs["plugin"]
            rate = {k: (r["tokens"] - 1) / max(r["total"] - r["first"], 1e-9) for k, r in runs.items()}
            same = ours["text"] == stock["text"] and ours["calls"] == stock["calls"]
            lines.append(f"{turn + 1:>4}  {stock['context']:>7}  {stock['context'] - context:>5}  "
                         f"{stock['first']:>10.2f}  {ours['first']:>11.2f}  "
                         f"{ours['first'] / stock['first']:>5.2f}  {rate['stock']:>11.1f}  {rate['plugin']:>12.1f}  "
                         f"{ours['timings'].get('draft_n', 0):>7}  {ours['timings'].get('draft_n_accepted', 0):>8}  "
                         f"{'yes' if same else 'NO'}")
            context = stock["context"] + stock["tokens"]
            messages.append({"role": "assistant", "content": stock["text"]})
    finally:
        for server in servers.values():
            server.stop()
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        print(f"wrote {measure.write_result(args.out, result_name('agent-trace', 'mlx_lm', args.model), text)}")
    if any(line.endswith("NO") for line in lines):
        sys.exit(1)


if __name__ == "__main__":
    main()
