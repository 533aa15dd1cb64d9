"""README.md and docs/*.md stay true: every relative link resolves (the file, and a ``#anchor`` as GitHub slugs the
target's headings), and every fenced shell command and Python snippet that names the bundled checkpoint runs.

Commands run as a user runs them, from a working directory holding a copy of ``examples/`` (so a command that writes,
e.g. ``--write`` or an output under ``build/``, never touches the repository), with this environment's console
scripts first on ``PATH``. A server command (``mlx_lm.server``, ``mlx_vlm.server``) is started on a free loopback
port, the block's later commands (its ``curl`` request) run against it, and it is stopped. A ``text`` block right
after a command block is its expected output: its ``lossless:`` and ``can_run:`` lines must appear verbatim.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from helpers.console_runs import BIN, REPO, environment

CHECKPOINT = "examples/tiny-qwen3_5"
PAGES = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
SHELL, PYTHON = ("bash", "sh", "shell", "console"), ("python", "py")
SERVERS = ("mlx_lm.server", "mlx_vlm.server")
KEY_LINES = re.compile(r"^\s*(lossless:|can_run:)")
TIMEOUT = 120


def blocks(text: str) -> list[tuple[str, str]]:
    """The fenced blocks of Markdown ``text``, in order: (language, body)."""
    return [(m[1].lower(), m[2]) for m in FENCE.finditer(text)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text without Markdown marks, lower case, punctuation dropped, spaces to
    hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of Markdown file ``path`` (repeated headings get ``-1``, ``-2``… as on GitHub)."""
    text = FENCE.sub("", path.read_text())
    seen: dict[str, int] = {}
    result = set()
    for heading in HEADING.findall(text):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        result.add(base if n == 0 else f"{base}-{n}")
    return result


def broken_links(path: Path) -> list[str]:
    """The relative links of Markdown file ``path`` whose file or anchor does not exist, one line each."""
    text = re.sub(r"`[^`\n]*`", "", FENCE.sub("", path.read_text()))
    problems = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            problems.append(f"{path.name}: {target}: no file {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{path.name}: {target}: no heading #{anchor} in {resolved.name}")
    return problems


def runnable() -> list:
    """pytest params: each fenced shell or Python block of the docs that names the bundled checkpoint, with the
    ``text`` block after it (its expected output) or None."""
    params = []
    for page in PAGES:
        found = blocks(page.read_text())
        for i, (language, body) in enumerate(found):
            if CHECKPOINT in body and language in SHELL + PYTHON:
                expected = found[i + 1][1] if i + 1 < len(found) and found[i + 1][0] == "text" else None
                params.append(pytest.param(language, body, expected, id=f"{page.name}-{i}"))
    return params


def commands(body: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, ``$`` prompts and trailing comments dropped."""
    lines = body.replace("\\\n", " ").splitlines()
    result = []
    for line in lines:
        line = re.sub(r"^\s*\$\s+", "", line)
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        if line:
            result.append(line)
    return result


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A working directory with a copy of ``examples/`` (scripts and the bundled checkpoint), shared by the module."""
    root = tmp_path_factory.mktemp("docs")
    shutil.copytree(REPO / "examples", root / "examples")
    return root


def shell(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``command`` with bash in ``cwd``, this environment's scripts first on ``PATH``; it must exit 0."""
    env = environment(PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    out = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, f"{command}\nexit {out.returncode}\n{out.stderr[-3000:]}"
    return out


class Server:
    """A documented server command started on a free loopback port, ready for requests."""

    def __init__(self, command: str, cwd: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env = environment(PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
        self.log = cwd / f"server-{self.port}.log"
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(["bash", "-c", f"exec {command} --host 127.0.0.1 --port {self.port}"],
                                            cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + TIMEOUT
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=5)
                return
            except OSError:
                assert self.process.poll() is None and time.monotonic() < deadline, \
                    f"{command}: not serving\n{self.log.read_text()[-3000:]}"
                time.sleep(0.5)

    def local(self, command: str) -> str:
        """``command`` with the documented default address replaced by this server's."""
        return re.sub(r"(localhost|127\.0\.0\.1):8080", f"127.0.0.1:{self.port}", command)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def run_shell(body: str, cwd: Path) -> str:
    """Run a shell block's commands in order (a server command serves the commands after it); their stdout."""
    output, server = [], None
    try:
        for command in commands(body):
            if command.split()[0] in SERVERS:
                server = Server(command, cwd)
                continue
            out = shell(server.local(command) if server else command, cwd)
            if server and command.startswith("curl"):
                answer = json.loads(out.stdout)  # the request was answered, and not with an error
                assert "error" not in answer and answer.get("choices"), out.stdout[-2000:]
            output.append(out.stdout)
    finally:
        if server:
            server.stop()
    return "".join(output)


@pytest.mark.parametrize("language,body,expected", runnable())
def test_documented_commands_run(workspace, language, body, expected):
    if language in PYTHON:
        out = shell(f"{sys.executable} - <<'PYTHON_SNIPPET'\n{body}PYTHON_SNIPPET", workspace).stdout
    else:
        out = run_shell(body, workspace)
    for line in (expected or "").splitlines():
        if KEY_LINES.match(line):
            assert line in out.splitlines(), f"expected {line!r} in the output:\n{out[-3000:]}"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_relative_links_resolve(page):
    assert broken_links(page) == []


def test_every_page_is_reached_from_the_readme():
    readme = (REPO / "README.md").read_text()
    assert [p.name for p in PAGES[1:] if f"({p.relative_to(REPO)}" not in readme] == []


def test_the_checks_can_fail(tmp_path):
    """A broken file link and a broken anchor are found; a failing command fails its test."""
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading: with punctuation\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-code-heading-with-punctuation) [file](missing.md) [anchor](other.md#nowhere)\n"
                    "`[in code](missing.md)`\n")
    assert broken_links(page) == [f"page.md: missing.md: no file {tmp_path / 'missing.md'}",
                                  "page.md: other.md#nowhere: no heading #nowhere in other.md"]
    assert commands("$ a --x \\\n  --y   # note\nb '#not a comment'\n") == ["a --x    --y", "b '#not a comment'"]
    with pytest.raises(AssertionError, match="exit 2"):
        shell("mtp-plugin inspect examples/no-such-checkpoint", tmp_path)
