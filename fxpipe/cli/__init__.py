"""The ``fxpipe`` command line (typer + rich)."""
