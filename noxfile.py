"""Test matrix: every test runs against a buggy and a current release of mlx-lm and mlx-vlm.

``buggy``: mlx-lm 0.31.3 and mlx-vlm 0.6.8 shift RMSNorms twice when they see ``mtp.*`` keys.
``current``: mlx-lm 0.32.2 and mlx-vlm 0.7.10, where stock loading is fixed.
"""

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
    """ruff over the whole tree."""
    session.install("ruff")
    session.run("ruff", "check", ".")
