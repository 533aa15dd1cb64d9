"""The ``mtp-plugin`` commands, one module each, over the engine in ``mtp_plugin``: ``cli`` (the command line),
``report`` (inspect), ``verify``, ``graft``, ``extract``, ``tune``, ``bench`` and ``measure`` (what tune and bench
measure). Nothing in the engine imports from here."""
