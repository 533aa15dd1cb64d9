"""The ``mtp-plugin`` commands, one module each (``cli``: the command line; ``measure``: shared by tune and bench).
Nothing in the engine imports from here. Usage: docs/commands.md."""
