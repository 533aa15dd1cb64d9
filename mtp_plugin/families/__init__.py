"""Model families, one file each; every family is a built-in plugin of ``mtp_plugin.hookspecs``."""
