"""Zero-configuration activation, loaded at start-up by ``mtp_plugin.pth``: a ``sys.meta_path`` hook (no mlx, mlx-lm
or pluggy import) that runs ``mtp_plugin.patch()`` after a ``WATCHED`` package executes and runs a ``COMMANDS`` module's
main block, under ``python -m``, in the imported, patched module. ``MTP_PLUGIN_DISABLE=1`` turns it off; a patch error
is logged once and leaves every runtime stock."""

import os
import sys

WATCHED = ("mlx_lm", "mlx_lm.server", "mlx_vlm", "mlx_vlm.server")
COMMANDS = ("mlx_lm.server", "mlx_lm.generate", "mlx_vlm.server", "mlx_vlm.generate")  # run by ``python -m``
DISABLE_ENV = "MTP_PLUGIN_DISABLE"


class _PatchAfterImport:
    """Finds nothing itself: wraps the real loader of a watched package to patch after it executes."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in WATCHED and fullname not in COMMANDS:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _Loader(spec.loader)
                return spec
        return None


class _Loader:
    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        if module.__name__ in WATCHED:
            _patch_quietly(module.__name__)

    def get_code(self, fullname):
        """The code to run as ``__main__`` (runpy's question for ``python -m``): a command module's main block,
        run in the imported module (``run_main_block``); any other module's own code."""
        if fullname not in COMMANDS:
            return self._loader.get_code(fullname)
        source = f"import mtp_plugin.adapters.autopatch\nmtp_plugin.adapters.autopatch.run_main_block({fullname!r})\n"
        return compile(source, self._loader.get_filename(fullname), "exec")

    def __getattr__(self, name):
        return getattr(self._loader, name)


def run_main_block(name: str) -> None:
    """Import module ``name`` (the hook patches it) and run its ``if __name__ == "__main__":`` statements in it."""
    import ast
    import importlib
    import inspect

    module = importlib.import_module(name)
    for node in ast.parse(inspect.getsource(module)).body:
        test = node.test if isinstance(node, ast.If) else None
        if (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
                and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value == "__main__"):
            block = ast.Module(body=node.body, type_ignores=[])
            exec(compile(block, module.__file__, "exec"), module.__dict__)


_failed: list[str] = []


def _patch_quietly(runtime: str) -> None:
    """Patch ``runtime``; on any error, log once, undo every patch and stay stock for the rest of the process."""
    if _failed:
        return
    try:
        import mtp_plugin

        mtp_plugin.patch(runtime)
    except Exception:  # never break the host program
        _failed.append(runtime)
        import logging

        logging.getLogger("mtp_plugin").warning("mtp_plugin: patching %s failed; runtimes left stock.", runtime,
                                                exc_info=True)
        try:
            mtp_plugin.unpatch()
        except Exception:
            logging.getLogger("mtp_plugin").debug("mtp_plugin: unpatch after a failed patch failed", exc_info=True)


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once), unless disabled by the environment."""
    disabled = os.environ.get(DISABLE_ENV, "") not in ("", "0")
    if disabled or any(isinstance(f, _PatchAfterImport) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _PatchAfterImport())


install()
