"""mlx-lm's own test suite with and without the plugin: every test must end the same way. A check before a release.

``python benchmarks/upstream_suite.py [--model DIR] [--workdir DIR] [-- PYTEST ARGS]`` downloads the sdist of
the installed mlx-lm (its ``tests/``) with pip, saves a small local model under the hub repo id the suite
downloads (``mlx-community/Qwen1.5-0.5B-Chat-4bit``; default: the bundled tiny checkpoint, which has an MTP
head, so the plugin's runs decode with MTP) in a private, offline Hugging Face cache (``HF_HOME``), runs the
suite twice, with ``MTP_PLUGIN_DISABLE=1`` (stock) and with the plugin active, and lists every test whose
outcome differs. Tests that need other hub models fail (offline) the same way in both runs.

Exit status: 0 when every outcome is the same, 1 when some differ or a step fails, 2 on usage errors.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
REPO_ID = "mlx-community/Qwen1.5-0.5B-Chat-4bit"
SNAPSHOT = "0" * 40


def fetch_tests(version: str, workdir: Path) -> Path:
    """``tests/`` of the mlx-lm ``version`` sdist, downloaded with pip into ``workdir``."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                    f"mlx-lm=={version}", "-d", str(workdir)], check=True)
    sdist = next(workdir.glob(f"mlx_lm-{version}.tar.gz"))
    with tarfile.open(sdist) as archive:
        archive.extractall(workdir / "sdist", filter="data")
    tests = workdir / "tests"
    shutil.rmtree(tests, ignore_errors=True)
    shutil.copytree(workdir / "sdist" / f"mlx_lm-{version}" / "tests", tests)
    return tests


def private_hub(model: Path, home: Path) -> None:
    """A Hugging Face cache under ``home`` holding ``model``'s files as the snapshot of ``REPO_ID``."""
    repo = home / "hub" / f"models--{REPO_ID.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(SNAPSHOT)
    shutil.copytree(model, repo / "snapshots" / SNAPSHOT, dirs_exist_ok=True)


def outcomes(report: Path) -> dict[str, str]:
    """``{test id: passed | failed | error | skipped}`` from a JUnit XML report."""
    found = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        found[f"{case.get('classname')}::{case.get('name')}"] = {"failure": "failed"}.get(kinds[0], kinds[0]) \
            if kinds else "passed"
    return found


def run_suite(tests: Path, home: Path, report: Path, disabled: bool, pytest_args: list[str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MTP_PLUGIN_DISABLE")}
    env.update(HF_HOME=str(home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if disabled:
        env["MTP_PLUGIN_DISABLE"] = "1"
    # From a directory without the sdist's own mlx_lm/ source, so that the installed mlx-lm is the one tested;
    # modules needing optional packages (lm_eval, …) fail to collect the same way in both runs.
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors",
                    f"--junitxml={report}", *pytest_args, str(tests)], cwd=report.parent, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return outcomes(report)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "examples" / "tiny-qwen3_5" / "mlx-4bit",
                        help=f"model directory saved as {REPO_ID} (default: the bundled tiny checkpoint)")
    parser.add_argument("--workdir", type=Path, help="where to download and run (default: a temporary directory)")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --), e.g. -k server")
    args = parser.parse_args(argv)
    if not (args.model / "config.json").exists():
        parser.error(f"{args.model} is not a model directory (no config.json)")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="mlx-lm-upstream-"))
    workdir.mkdir(parents=True, exist_ok=True)
    version = metadata.version("mlx-lm")
    tests = fetch_tests(version, workdir)
    home = workdir / "hf-home"
    private_hub(args.model, home)
    runs = {}
    for name in tqdm(("stock", "plugin"), desc=f"mlx-lm {version} suite"):
        runs[name] = run_suite(tests, home, workdir / f"{name}.xml", name == "stock", args.pytest_args)
    stock, plugin = runs["stock"], runs["plugin"]
    differ = sorted(t for t in stock.keys() | plugin.keys() if stock.get(t) != plugin.get(t))
    for name, found in runs.items():
        counts = {k: list(found.values()).count(k) for k in ("passed", "failed", "error", "skipped")}
        print(f"{name:7s} " + ", ".join(f"{n} {k}" for k, n in counts.items()))
    for test in differ:
        print(f"DIFFERS {test}: stock {stock.get(test, 'absent')}, plugin {plugin.get(test, 'absent')}")
    print(f"{len(differ)} of {len(stock.keys() | plugin.keys())} tests end differently (reports in {workdir})")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
