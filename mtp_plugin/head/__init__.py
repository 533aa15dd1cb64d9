"""The head: its module, norm conventions and their settling, health, draft vocabulary."""
