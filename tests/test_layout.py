"""The source tree matches docs/development.md's layout, and no module imports one from a layer above its own."""

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAYERS = {  # bottom up; modules of one layer may import each other only within their own folder
    "mtp_plugin": 0,  # the top-level modules
    "mtp_plugin.head": 1,
    "mtp_plugin.loading": 2,
    "mtp_plugin.decoding": 2,
    "mtp_plugin.hub": 3,
    "mtp_plugin.families": 4,
    "mtp_plugin.commands": 4,
    "mtp_plugin.adapters": 5,  # runtime glue: may use the commands (bench's reference decoders)
}
ENTRY = {"mtp_plugin/__init__.py", "mtp_plugin/__main__.py"}  # the entry points import lazily, from any layer


def sources() -> dict[str, Path]:
    """Every module of the package, by dotted name (``adapters/`` installs as ``mtp_plugin.adapters``)."""
    found = {}
    for path in [*(REPO / "mtp_plugin").rglob("*.py"), *(REPO / "adapters").glob("*.py")]:
        rel = path.relative_to(REPO)
        parts = ["mtp_plugin", *rel.with_suffix("").parts] if rel.parts[0] == "adapters" else \
            list(rel.with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def layer(module: str) -> str:
    """The layer (a key of ``LAYERS``) of a dotted module name."""
    if module in LAYERS:
        return module
    package = module.rsplit(".", 1)[0]
    return package if package in LAYERS else "mtp_plugin"


def imports(module: str, path: Path) -> set[str]:
    """The package's modules ``path`` imports (relative imports resolved), outside ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(node)}
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found, bases = set(), set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if base.startswith("mtp_plugin"):
                found.update(f"{base}.{a.name}" for a in node.names)
                found.add(base)
                bases.add(base)
        elif isinstance(node, ast.Import):
            names = {a.name for a in node.names if a.name.startswith("mtp_plugin")}
            found.update(names)
            bases.update(names)
    missing = {b for b in bases if b not in sources() and b != "mtp_plugin"}
    assert not missing, f"{path.relative_to(REPO)} imports modules that do not exist: {sorted(missing)}"
    return found


def test_no_module_imports_a_layer_above_its_own():
    modules = sources()
    wrong = []
    for module, path in modules.items():
        if str(path.relative_to(REPO)) in ENTRY:
            continue
        for target in imports(module, path):
            if target not in modules or target in ("mtp_plugin", module):
                continue
            mine, theirs = layer(module), layer(target)
            if LAYERS[theirs] > LAYERS[mine] or (LAYERS[theirs] == LAYERS[mine] and theirs != mine):
                wrong.append(f"{module} ({mine}) imports {target} ({theirs})")
    assert not wrong, "\n".join(wrong)


def layout_block() -> dict[str, set[str]]:
    """docs/development.md's layout block: the ``.py`` files it names under each folder label."""
    text = (REPO / "docs" / "development.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    named, folder = {}, None
    for line in block.splitlines():
        label = re.match(r"^(\S+/)\s", line)
        if label:
            folder = label.group(1)
        if folder:
            named.setdefault(folder, set()).update(re.findall(r"\b(\w+\.py)\b", line[len(label.group(1)):]
                                                              if label else line))
    return named


@pytest.mark.parametrize("folder", ["mtp_plugin/", "mtp_plugin/head/", "mtp_plugin/loading/", "mtp_plugin/decoding/",
                                    "mtp_plugin/families/", "mtp_plugin/hub/", "mtp_plugin/commands/", "adapters/"])
def test_the_layout_names_every_module(folder):
    tree = {p.name for p in (REPO / folder).glob("*.py")} - {"__init__.py"} | (
        {"__init__.py"} if folder == "mtp_plugin/" else set())
    assert layout_block().get(folder, set()) == tree


def test_the_package_keeps_few_modules_flat():
    assert len(list((REPO / "mtp_plugin").glob("*.py"))) <= 25


def docstring_lines(path: Path) -> int:
    """Lines of the module's, classes' and functions' docstrings in ``path``."""
    count = 0
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value,
                                                                                                    str):
                count += first.end_lineno - first.lineno + 1
    return count


def test_docstrings_state_contracts_not_essays():
    """Docstrings at most 20 % of the package's lines (design rationale belongs in docs/)."""
    paths = list(sources().values())
    share = sum(map(docstring_lines, paths)) / sum(len(p.read_text().splitlines()) for p in paths)
    assert share <= 0.20, f"docstrings are {share:.0%} of the package's lines"
