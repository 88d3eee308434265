"""Subcommands of the ``nexrl`` command line, one module per command group."""
