"""mlx-lm's own test suite with and without the plugin: every test must end the same way. A check before a release.

``python benchmarks/upstream_suite.py [--model DIR ...] [--sdist FILE] [--workdir DIR] [-- PYTEST ARGS]`` gets the sdist
of the installed mlx-lm (its ``tests/``: downloaded with pip, or ``--sdist``, a file downloaded beforehand), and for
each model saves it under the hub repo id the suite downloads (``mlx-community/Qwen1.5-0.5B-Chat-4bit``) in a private,
offline Hugging Face cache (``HF_HOME``), runs the suite twice, with ``MTP_PLUGIN_DISABLE=1`` (stock) and with the
plugin active, and lists every test whose outcome differs. Tests that need other hub models fail (offline) the same
way in both runs. A test's changes to its class's shared model are undone after it (``ISOLATION_CODE``: two tests
leave rotating KV caches on it, which a hybrid model's later tests cannot run with).

Models (``--model``, repeatable), each a checkpoint with an MTP head, so that the plugin's runs decode with MTP; by
default two: the bundled tiny checkpoint (trained, 4-bit, head as a sidecar) and a user's own kind of checkpoint, a
random tiny Qwen3.5 quantized to 4 bits by mlx-lm with a 4-bit sidecar head (``tests/helpers/builders.py``'s
``quantized_sidecar_checkpoint``, written into the work directory). Where the last cycle of a generation falls
depends on the model, so both are run.

A test of a release with the norm-shift bug that asserts the bug itself is listed as intended (``INTENDED``, with the
reason), not as a difference.

Exit status: 0 when every outcome is the same for every model (intended differences apart); 1 when some differ or a
step fails (pytest or mlx-lm not installed in this Python, the sdist not downloadable, a suite run that wrote no
report), with a message naming what is missing; 2 on usage errors (a ``--model`` that is no model directory, an
``--sdist`` that is not the installed mlx-lm's).
"""

from __future__ import annotations

import argparse
import importlib.util
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
BUNDLED = ROOT / "examples" / "tiny-qwen3_5" / "mlx-4bit"
REPO_ID = "mlx-community/Qwen1.5-0.5B-Chat-4bit"
SNAPSHOT = "0" * 40
ISOLATION = "mtp_upstream_isolation"  # a pytest plugin module written into the work directory (``ISOLATION_CODE``)
ISOLATION_CODE = '''"""Loaded into mlx-lm's suite by upstream_suite.py (-p): after each test, the attributes it set on
its class's shared model are removed. Two TestGenerate tests set ``self.model.make_cache`` to rotating KV caches for
every layer and never undo it; the suite's Qwen1.5 takes that, but a hybrid model's GatedDeltaNet layers cannot, and
every later test of the class would fail in both runs, comparing nothing."""

import pytest


@pytest.fixture(autouse=True)
def _shared_model_as_loaded(request):
    model = getattr(request.cls, "model", None) if request.cls is not None else None
    before = set(vars(model)) if model is not None else set()
    yield
    for name in set(vars(model)) - before if model is not None else ():
        delattr(model, name)
'''


class Missing(Exception):
    """Something the suite needs is not there (a package, the sdist, a report); the message names it and the fix."""


def check_pytest() -> None:
    """Raise ``Missing`` when this Python cannot run pytest (the suite runs with ``sys.executable -m pytest``)."""
    if importlib.util.find_spec("pytest") is None:
        raise Missing(f"pytest is not installed in this Python ({sys.executable}): "
                      f"{sys.executable} -m pip install pytest, then run again")


def download_sdist(version: str, workdir: Path) -> Path:
    """The mlx-lm ``version`` sdist, downloaded with pip into ``workdir``.

    Raises:
        Missing: pip could not download it (offline, no pip); the message gives pip's last line and the way round.
    """
    run = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                          f"mlx-lm=={version}", "-d", str(workdir)], capture_output=True, text=True)
    found = sorted(workdir.glob(f"mlx_lm-{version}.tar.gz"))
    if run.returncode or not found:
        reason = (run.stderr.strip().splitlines() or ["pip wrote no sdist"])[-1]
        raise Missing(f"the sdist of mlx-lm {version} (mlx_lm-{version}.tar.gz, with the tests/ the suite runs) could "
                      f"not be downloaded with pip: {reason}. Download it where a package index is reachable "
                      f"(pip download --no-deps --no-binary :all: mlx-lm=={version}) and pass --sdist FILE")
    return found[0]


def extract_tests(sdist: Path, version: str, workdir: Path) -> Path:
    """``tests/`` of ``sdist`` (the mlx-lm ``version`` sdist), copied to ``workdir/tests``.

    Raises:
        ValueError: ``sdist`` is not a readable tar archive holding ``mlx_lm-VERSION/tests``.
    """
    top = f"mlx_lm-{version}"
    try:
        with tarfile.open(sdist) as archive:
            if not any(name == f"{top}/tests" or name.startswith(f"{top}/tests/") for name in archive.getnames()):
                raise ValueError(f"{sdist} is not the sdist of mlx-lm {version}, the installed version: it has no "
                                 f"{top}/tests/ (pass the sdist of mlx-lm {version})")
            archive.extractall(workdir / "sdist", filter="data")
    except (tarfile.TarError, OSError) as error:
        raise ValueError(f"{sdist} cannot be read as an sdist ({error}); pass mlx_lm-{version}.tar.gz") from error
    tests = workdir / "tests"
    shutil.rmtree(tests, ignore_errors=True)
    shutil.copytree(workdir / "sdist" / top / "tests", tests)
    return tests


def build_random_4bit(workdir: Path) -> Path:
    """A random tiny 4-bit checkpoint with a 4-bit sidecar head, built with the tests' builders in ``workdir``."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from helpers.builders import quantized_sidecar_checkpoint
    finally:
        sys.path.remove(str(ROOT / "tests"))
    path = workdir / "random-4bit"
    shutil.rmtree(path, ignore_errors=True)
    return quantized_sidecar_checkpoint(path, BUNDLED)


def private_hub(model: Path, home: Path) -> None:
    """A Hugging Face cache under ``home`` holding ``model``'s files as the snapshot of ``REPO_ID``."""
    repo = home / "hub" / f"models--{REPO_ID.replace('/', '--')}"
    shutil.rmtree(repo, ignore_errors=True)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SNAPSHOT)
    shutil.copytree(model, repo / "snapshots" / SNAPSHOT)


def outcomes(report: Path) -> dict[str, str]:
    """``{test id: passed | failed | error | skipped}`` from a JUnit XML report."""
    found = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        found[f"{case.get('classname')}::{case.get('name')}"] = {"failure": "failed"}.get(kinds[0], kinds[0]) \
            if kinds else "passed"
    return found


def run_suite(tests: Path, home: Path, report: Path, disabled: bool, pytest_args: list[str]) -> dict[str, str]:
    """One run of the suite (``disabled``: the plugin off), its outcomes; pytest's output goes to ``REPORT.log``.

    Raises:
        Missing: pytest wrote no report (it could not start, or crashed); the message names its log.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MTP_PLUGIN_DISABLE")}
    env.update(HF_HOME=str(home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if disabled:
        env["MTP_PLUGIN_DISABLE"] = "1"
    report.unlink(missing_ok=True)
    log = report.with_suffix(".log")
    (report.parent / f"{ISOLATION}.py").write_text(ISOLATION_CODE)
    # From a directory without the sdist's own mlx_lm/ source, so that the installed mlx-lm is the one tested (and
    # ISOLATION is importable); modules needing optional packages (lm_eval, …) fail to collect alike in both runs.
    with log.open("w") as out:
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", ISOLATION,
                              "--continue-on-collection-errors", f"--junitxml={report}", *pytest_args, str(tests)],
                             cwd=report.parent, env=env, stdout=out, stderr=subprocess.STDOUT)
    if not report.exists():
        raise Missing(f"pytest wrote no report {report.name} (exit status {run.returncode}); its output is in {log}")
    return outcomes(report)


# Tests of mlx-lm releases with the norm-shift bug that assert the bug itself: (releases [from, below), the outcome
# stock and the plugin have there, why). They are listed as intended, not counted as differences.
INTENDED = {
    "tests.test_models.TestModels::test_qwen3_5_family_convert_then_load_norm_not_shift_twice": (
        (0, 30, 7), (0, 32), ("passed", "failed"),
        "it asserts that mtp.* keys alone make sanitize add 1 to the norms: the double shift the plugin exists to "
        "prevent (an MLX conversion that keeps its head). mlx-lm 0.32 fixed sanitize the same way (only unsanitized "
        "conv1d weights mark an original checkpoint) and changed this test to match"),
}


def intended(test: str, version: str, stock: str | None, plugin: str | None) -> str | None:
    """Why ``test`` is meant to end differently under the plugin on mlx-lm ``version`` (``INTENDED``), else None."""
    if test not in INTENDED:
        return None
    lowest, below, outcome, why = INTENDED[test]
    release = tuple(int(p) for p in version.split(".")[:3] if p.isdigit())
    return why if lowest <= release < below and (stock, plugin) == outcome else None


def compare(name: str, runs: dict[str, dict[str, str]], version: str) -> int:
    """Print one model's counts and every test that ends differently (those ``INTENDED`` apart); the number of
    differences that are not intended."""
    stock, plugin = runs["stock"], runs["plugin"]
    differ = []
    for test in sorted(t for t in stock.keys() | plugin.keys() if stock.get(t) != plugin.get(t)):
        why = intended(test, version, stock.get(test), plugin.get(test))
        if why is None:
            differ.append(test)
        else:
            print(f"{name}: INTENDED {test}: stock {stock[test]}, plugin {plugin[test]}: {why}")
    for run, found in runs.items():
        counts = {k: list(found.values()).count(k) for k in ("passed", "failed", "error", "skipped")}
        print(f"{name}: {run:7s} " + ", ".join(f"{n} {k}" for k, n in counts.items()))
    for test in differ:
        print(f"{name}: DIFFERS {test}: stock {stock.get(test, 'absent')}, plugin {plugin.get(test, 'absent')}")
    print(f"{name}: {len(differ)} of {len(stock.keys() | plugin.keys())} tests end differently")
    return len(differ)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, action="append",
                        help=f"model directory with an MTP head, saved as {REPO_ID}; repeat for several (default: the "
                             "bundled tiny checkpoint and a random 4-bit one with a sidecar head, built here)")
    parser.add_argument("--sdist", type=Path,
                        help="the installed mlx-lm's sdist (mlx_lm-VERSION.tar.gz), for a machine where pip cannot "
                             "download it")
    parser.add_argument("--workdir", type=Path, help="where to download and run (default: a temporary directory)")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --), e.g. -k server")
    args = parser.parse_args(argv)
    for model in args.model or []:
        if not (model / "config.json").exists():
            parser.error(f"--model {model} is not a model directory (no config.json)")
    if args.sdist is not None and not args.sdist.is_file():
        parser.error(f"--sdist {args.sdist}: no such file")
    try:
        version = metadata.version("mlx-lm")
    except metadata.PackageNotFoundError:
        print(f"upstream_suite: mlx-lm is not installed in this Python ({sys.executable}): the suite tests the "
              "installed mlx-lm with and without the plugin", file=sys.stderr)
        return 1
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="mlx-lm-upstream-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        check_pytest()
        try:
            tests = extract_tests(args.sdist or download_sdist(version, workdir), version, workdir)
        except ValueError as error:
            parser.error(str(error))
        models = args.model or [BUNDLED, build_random_4bit(workdir)]
        differ, names = 0, [f"{i}-{model.resolve().name}" for i, model in enumerate(models, 1)]
        with tqdm(total=2 * len(models), desc=f"mlx-lm {version} suite", unit="run") as progress:
            results = {}
            for name, model in zip(names, models, strict=True):
                home = workdir / f"hf-home-{name}"
                private_hub(model, home)
                results[name] = {}
                for run in ("stock", "plugin"):
                    progress.set_postfix_str(f"{name}, {run}")
                    results[name][run] = run_suite(tests, home, workdir / f"{name}-{run}.xml", run == "stock",
                                                   args.pytest_args)
                    progress.update()
        for name, model in zip(names, models, strict=True):
            print(f"{name}: {model}")
            differ += compare(name, results[name], version)
    except Missing as error:
        print(f"upstream_suite: {error}", file=sys.stderr)
        return 1
    print(f"{differ} differences over {len(models)} models, mlx-lm {version} (reports in {workdir})")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
