"""Test helpers: checkpoint builders, the Hub stand-in, console-script and distributed runs (not tests)."""
