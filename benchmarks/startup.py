"""Interpreter start-up time added by mtp_plugin's ``.pth`` post-import hook (issue 4's target: <= 2 ms).

Two figures, each a median over ``--runs`` runs of ``python -c pass`` (after warm-up runs):

* wall clock, A/B: two bare virtual environments of this interpreter, identical except that one holds a
  copy of the installed ``mtp_plugin`` package and its ``mtp_plugin.pth``; the figure is the median of
  the paired differences (with - without) of back-to-back runs, in milliseconds;
* import time: ``python -X importtime -c pass`` in this environment, the cumulative time CPython reports
  for importing the plugin's start-up modules (what the ``.pth`` line costs, without process noise).

Usage (the plugin installed in this environment, ``pip install .``)::

    python benchmarks/startup.py [--runs 30]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path

PTH = "mtp_plugin.pth"
WARM_UP = 3
IMPORT_LINE = re.compile(r"^import time:\s+\d+ \|\s+(\d+) \|( +)(mtp_plugin\S*)$", re.M)


def installed_plugin() -> tuple[Path, Path]:
    """The installed package directory and its ``.pth`` file; SystemExit when the plugin is not installed."""
    spec = importlib.util.find_spec("mtp_plugin")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("mtp_plugin is not installed here: pip install . first")
    package = Path(next(iter(spec.submodule_search_locations)))
    pth = package.parent / PTH
    if not pth.exists() or not (package / "adapters" / "autopatch.py").exists():
        sys.exit(f"{package} is not an installed mtp_plugin (no {PTH} or adapters): pip install . first")
    return package, pth


def bare_environment(path: Path, package: Path | None = None, pth: Path | None = None) -> Path:
    """A virtual environment without pip at ``path`` (optionally holding ``package`` and ``pth``); its python."""
    venv.create(path, with_pip=False)
    python = path / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site_packages = Path(subprocess.run([str(python), "-c", purelib], check=True, capture_output=True,
                                        text=True).stdout.strip())
    if package is not None:
        shutil.copytree(package, site_packages / package.name)
        shutil.copy2(pth, site_packages / pth.name)
    return python


def clean_environment() -> dict[str, str]:
    """This process's environment without anything that changes what start-up imports."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP", "MTP_PLUGIN_DISABLE")}


def seconds(python: Path, env: dict[str, str]) -> float:
    """Wall-clock seconds of one ``python -c pass``."""
    start = time.perf_counter()
    subprocess.run([str(python), "-c", "pass"], check=True, env=env)
    return time.perf_counter() - start


def wall_clock_ms(runs: int) -> tuple[float, float]:
    """Median start-up (ms) without the plugin, and median of the paired differences with - without.

    Each pair runs both environments back to back, in alternating order, so that load changes on a
    shared machine cancel in the difference.
    """
    package, pth = installed_plugin()
    env = clean_environment()
    with tempfile.TemporaryDirectory() as tmp:
        without = bare_environment(Path(tmp) / "without")
        with_plugin = bare_environment(Path(tmp) / "with", package, pth)
        for _ in range(WARM_UP):
            seconds(without, env), seconds(with_plugin, env)
        baseline, added = [], []
        for run in range(runs):
            if run % 2:
                plain, plugged = seconds(without, env), seconds(with_plugin, env)
            else:
                plugged, plain = seconds(with_plugin, env), seconds(without, env)
            baseline.append(plain)
            added.append(plugged - plain)
    return statistics.median(baseline) * 1e3, statistics.median(added) * 1e3


def import_time_ms(runs: int) -> float:
    """Median cumulative import time (ms) of the plugin's top-level start-up imports in this environment."""
    env = clean_environment()
    totals = []
    for run in range(WARM_UP + runs):
        err = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], check=True, env=env,
                             capture_output=True, text=True).stderr
        lines = [(len(indent), int(cumulative)) for cumulative, indent, _ in IMPORT_LINE.findall(err)]
        if not lines:
            sys.exit("python -X importtime shows no mtp_plugin import: is the .pth file active?")
        top = min(depth for depth, _ in lines)
        if run >= WARM_UP:
            totals.append(sum(us for depth, us in lines if depth == top) / 1e3)
    return statistics.median(totals)


def main() -> None:
    """Print both figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="measured runs per figure (default 30)")
    runs = parser.parse_args().runs
    baseline, added = wall_clock_ms(runs)
    imports = import_time_ms(runs)
    print(f"python -c pass, {runs} pairs: median {baseline:.2f} ms without the plugin; "
          f"median paired difference {added:+.2f} ms added by it")
    print(f"python -X importtime, median of {runs}: {imports:.2f} ms importing the .pth hook's modules")


if __name__ == "__main__":
    main()
