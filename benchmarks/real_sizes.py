"""Memory and time of loading at the shapes users run, the plugin against stock mlx-lm in the same run.

    python benchmarks/real_sizes.py [--shape NAME ...] [--repeats 3] [--cache DIR] [--out benchmarks/results]

Each load runs in a fresh process (``mlx_lm.utils.load_model``, as ``mlx_lm.load`` calls it; stock: the plugin disabled
by ``MTP_PLUGIN_DISABLE=1``), on checkpoints of ``real_shapes.py`` (built on demand), after one unmeasured load of each
(the page cache then holds the files for all). Per shape and runtime, medians over ``--repeats`` rounds (the order
reversing each round): seconds to a loaded, evaluated model; MLX's peak memory while loading; its active memory once
loaded; and the head's weights as loaded. A control times stock followed by allocating as many bytes as the head holds:
on machines where memory touched late costs more than memory touched early, it separates what the head's memory costs
from what the plugin's work does. Then one plugin load under cProfile: where loading spends its time (``PARTS``). Exit
status 2 on a usage error, 1 when a load fails.
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
import cProfile, json, pstats, sys, time
from pathlib import Path
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model
profile = cProfile.Profile() if sys.argv[2:] == ["profile"] else None
allocate = int(sys.argv[3]) if sys.argv[2:3] == ["allocate"] else 0
start = time.perf_counter()
if profile:
    profile.enable()
model, _ = load_model(Path(sys.argv[1]))
if allocate:  # the control: stock, then as many fresh bytes as the head's, written once
    mx.eval(mx.ones((allocate // 8192, 4096), mx.bfloat16))  # rows of 8 kB: a dimension stays below 2**31
seconds = time.perf_counter() - start
loaded = getattr(model, "mtp_head", None)
head = 0 if loaded is None else sum(v.nbytes for _, v in tree_flatten(loaded.module.parameters()))
figures = {"seconds": seconds, "peak": mx.get_peak_memory(), "active": mx.get_active_memory(), "head": head}
if profile:
    profile.disable()
    for (file, _, function), (_, _, _, cumulative, _) in pstats.Stats(profile).stats.items():
        part = f"{Path(file).parent.name}/{Path(file).name}:{function}"
        figures[part] = figures.get(part, 0) + cumulative
print(json.dumps(figures))
"""
PARTS = {  # what loading spends its time on: profiled functions (cumulative seconds), in call order
    "stock load_model (trunk)": ("mlx_lm/utils.py:load_model",),
    "find the head (headers, index)": ("mtp_plugin/loading/checkpoint.py:find_head",),
    "build the head module": ("families/qwen3_5.py:mtp_build_head", "families/nextn.py:mtp_build_head"),
    "read and normalise (lazy)": ("mtp_plugin/loading/headfile.py:normalised_head",),
    "check names and shapes": ("mtp_plugin/loading/validation.py:structure_problems",),
    "non-finite check (reads the tensors)": ("mtp_plugin/loading/validation.py:_nonfinite",),
    "trained-head judgement": ("mtp_plugin/loading/loader.py:_warn_if_random",),
    "norm settling set-up": ("mtp_plugin/head/norm_settling.py:attach",),
    "draft vocabulary": ("mtp_plugin/head/draft_vocab.py:attach",),
    "the head, all of it": ("mtp_plugin/loading/loader.py:attach_head",),
}


def child(code: str, args: list[str], stock: bool) -> dict:
    """Run ``code`` with ``args`` in a fresh Python process (the plugin disabled when ``stock``): the JSON object of
    its last stdout line.

    Raises:
        SystemExit: the child failed (its stderr is in the message).
    """
    env = dict(os.environ, MTP_PLUGIN_DISABLE="1" if stock else "0")
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{'stock' if stock else 'plugin'} run on {args[0]} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_loads(model_dir: Path, repeats: int, bar) -> dict[str, dict[str, float]]:
    """Medians per runtime of a load's figures (``CHILD``) over ``repeats`` rounds (one warm-up round; the order
    reverses each round), and ``profiled``: one plugin load's figures under cProfile, with each function's cumulative
    seconds. Runtimes: ``stock``, ``plugin``, and ``allocate``, the control: stock, then allocating and writing as
    many bytes as the plugin's head holds (what memory alone costs at that point)."""
    runs = {"stock": [], "plugin": [], "allocate": []}
    head = 0
    for i in range(repeats + 1):
        for runtime in runs if i % 2 == 0 else reversed(runs):
            bar.set_postfix_str(f"{model_dir.name}, {runtime}")
            extra = ["allocate", str(int(head))] if runtime == "allocate" else []
            figures = child(CHILD, [str(model_dir), *extra], runtime != "plugin")
            head = figures["head"] if runtime == "plugin" else head
            if i:
                runs[runtime].append(figures)
            bar.update()
    figures = {runtime: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for runtime, rs in runs.items()}
    bar.set_postfix_str(f"{model_dir.name}, plugin, profiled")
    figures["profiled"] = child(CHILD, [str(model_dir), "profile"], stock=False)
    bar.update()
    return figures


def lines_of(name: str, figures: dict[str, dict[str, float]]) -> list[str]:
    """The result lines of one shape.

    Raises:
        SystemExit: the plugin loaded no head (the figures would not be the head's).
    """
    stock, plugin = figures["stock"], figures["plugin"]
    if not plugin["head"]:
        raise SystemExit(f"{name}: the plugin loaded no head (see its warning above); nothing to compare")
    head, t0, t1 = plugin["head"] / GB, stock["seconds"], plugin["seconds"]
    t2 = figures["allocate"]["seconds"]
    lines = [f"{name}: head {head:.3f} GB as loaded",
             f"  load seconds      stock {t0:7.2f}  plugin {t1:7.2f}  ratio {t1 / t0:.3f}  over stock {t1 - t0:+.2f} s",
             f"  control: stock, then allocating the head's bytes {t2:.2f} s (plugin / control {t1 / t2:.3f})",
             f"  peak while loading stock {stock['peak'] / GB:6.2f}  plugin {plugin['peak'] / GB:6.2f} GB  "
             f"beyond stock + head {(plugin['peak'] - stock['peak']) / GB - head:+.3f} GB",
             f"  active once loaded stock {stock['active'] / GB:6.2f}  plugin {plugin['active'] / GB:6.2f} GB  "
             f"beyond stock + head {(plugin['active'] - stock['active']) / GB - head:+.3f} GB",
             f"  one plugin load under cProfile, {figures['profiled']['seconds']:.2f} s; cumulative seconds:"]
    for part, keys in PARTS.items():
        lines.append(f"    {part:38s} {sum(figures['profiled'].get(key, 0.0) for key in keys):6.2f}")
    return lines


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
    title = (f"loading at real shapes (random weights, converted MLX layout, head under mtp.*; real_shapes.py), "
             f"median of {args.repeats} loads per runtime, each in a fresh process")
    report(title, args.shape or list(real_shapes.SHAPES), args.cache, 3 * (args.repeats + 1) + 1, "loads",
           lambda name, model_dir, bar: lines_of(name, measure_loads(model_dir, args.repeats, bar)),
           "real-sizes-load", args.out)


def report(title: str, shapes: list[str], cache: Path, runs: int, unit: str, measure_shape, name: str,
           out: Path | None) -> None:
    """Build each of ``shapes`` in ``cache`` (``real_shapes.ensure``), measure it (``measure_shape(shape, model_dir,
    bar)``: its result lines; ``runs`` bar steps per shape), print the report under ``title`` and the machine's
    description, and with ``out`` write it there as a dated result file ``name`` (``name-SHAPE`` for one shape)."""
    lines = [title, f"date: {datetime.datetime.now().isoformat(timespec='seconds')}",
             f"machine: {json.dumps(tuning.machine())}, {os.cpu_count()} CPUs",
             f"versions: {json.dumps(tuning.versions())}", ""]
    with tqdm(total=len(shapes) * runs, desc=f"real sizes: {unit}", unit=unit.rstrip("s")) as bar:
        for shape in shapes:
            bar.set_postfix_str(f"{shape}: building")
            model_dir = real_shapes.ensure(shape, cache)
            mx.clear_cache()  # what building left in MLX's buffer cache is not held while measuring
            lines += measure_shape(shape, model_dir, bar)
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if out:
        path = measure.write_result(out, f"{name}-{shapes[0]}" if len(shapes) == 1 else name, text)
        print(f"written to {os.path.relpath(path, REPO)}")


if __name__ == "__main__":
    main()
