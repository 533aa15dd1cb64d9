"""Memory and time of loading at the shapes users run, the plugin against stock mlx-lm in the same run.

    python benchmarks/real_sizes.py [--shape NAME ...] [--repeats 3] [--cache DIR] [--out benchmarks/results]

Each load runs in a fresh process (``mlx_lm.utils.load_model``, as ``mlx_lm.load`` calls it; stock: the plugin
disabled by ``MTP_PLUGIN_DISABLE=1``), on checkpoints of ``real_shapes.py`` (built on demand), after one unmeasured
load of each (the page cache then holds the files for both). Per shape and runtime, medians over ``--repeats``
alternating loads: seconds to a loaded, evaluated model; MLX's peak memory while loading; its active memory once
loaded; and the head's weights as loaded. Exit status 2 on a usage error, 1 when a load fails.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_shapes  # noqa: E402

from mtp_plugin import tuning  # noqa: E402
from mtp_plugin.commands import measure  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GB = 1e9
CHILD = """
import json, sys, time
from pathlib import Path
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model
start = time.perf_counter()
model, _ = load_model(Path(sys.argv[1]))
seconds = time.perf_counter() - start
loaded = getattr(model, "mtp_head", None)
head = 0 if loaded is None else sum(v.nbytes for _, v in tree_flatten(loaded.module.parameters()))
print(json.dumps({"seconds": seconds, "peak": mx.get_peak_memory(), "active": mx.get_active_memory(), "head": head}))
"""


def load_once(model_dir: Path, runtime: str) -> dict:
    """One load of ``model_dir`` in a fresh process, ``runtime`` "stock" or "plugin": the child's figures.

    Raises:
        SystemExit: the load failed (its stderr is in the message).
    """
    env = dict(os.environ, MTP_PLUGIN_DISABLE="1" if runtime == "stock" else "0")
    done = subprocess.run([sys.executable, "-c", CHILD, str(model_dir)], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{runtime} load of {model_dir} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_loads(model_dir: Path, repeats: int, bar) -> dict[str, dict[str, float]]:
    """Medians per runtime of ``load_once``'s figures over ``repeats`` alternating loads (one warm-up each)."""
    runs = {"stock": [], "plugin": []}
    for i in range(repeats + 1):
        for runtime in runs if i % 2 == 0 else reversed(runs):
            bar.set_postfix_str(f"{model_dir.name}, {runtime}")
            figures = load_once(model_dir, runtime)
            if i:
                runs[runtime].append(figures)
            bar.update()
    return {runtime: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for runtime, rs in runs.items()}


def lines_of(name: str, figures: dict[str, dict[str, float]]) -> list[str]:
    """The result lines of one shape.

    Raises:
        SystemExit: the plugin loaded no head (the figures would not be the head's).
    """
    stock, plugin = figures["stock"], figures["plugin"]
    if not plugin["head"]:
        raise SystemExit(f"{name}: the plugin loaded no head (see its warning above); nothing to compare")
    head, t0, t1 = plugin["head"] / GB, stock["seconds"], plugin["seconds"]
    return [f"{name}: head {head:.3f} GB as loaded",
            f"  load seconds      stock {t0:7.2f}  plugin {t1:7.2f}  ratio {t1 / t0:.3f}  over stock {t1 - t0:+.2f} s",
            f"  peak while loading stock {stock['peak'] / GB:6.2f}  plugin {plugin['peak'] / GB:6.2f} GB  "
            f"beyond stock + head {(plugin['peak'] - stock['peak']) / GB - head:+.3f} GB",
            f"  active once loaded stock {stock['active'] / GB:6.2f}  plugin {plugin['active'] / GB:6.2f} GB  "
            f"beyond stock + head {(plugin['active'] - stock['active']) / GB - head:+.3f} GB"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", choices=list(real_shapes.SHAPES),
                        help="repeatable; default: every shape")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=real_shapes.CACHE)
    parser.add_argument("--out", type=Path, help="directory for the dated result file")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    shapes = args.shape or list(real_shapes.SHAPES)
    lines = [f"loading at real shapes (random weights, converted MLX layout, head under mtp.*; real_shapes.py), "
             f"median of {args.repeats} loads per runtime, each in a fresh process",
             f"date: {datetime.datetime.now().isoformat(timespec='seconds')}",
             f"machine: {json.dumps(tuning.machine())}, {os.cpu_count()} CPUs",
             f"versions: {json.dumps(tuning.versions())}", ""]
    with tqdm(total=len(shapes) * 2 * (args.repeats + 1), desc="real sizes: loads", unit="load") as bar:
        for name in shapes:
            bar.set_postfix_str(f"{name}: building")
            model_dir = real_shapes.ensure(name, args.cache)
            mx.clear_cache()  # what building left in MLX's buffer cache is not held while the loads are timed
            lines += lines_of(name, measure_loads(model_dir, args.repeats, bar))
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        path = measure.write_result(args.out, "real-sizes-load", text)
        print(f"written to {os.path.relpath(path, REPO)}")


if __name__ == "__main__":
    main()
