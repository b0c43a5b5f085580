"""``fxpipe compile | simulate | run | inspect | models``: tables on stdout, progress on stderr, one-line errors.

The typer app and the entry point (``fxpipe = fxpipe.cli.main:main``). Each command lives in its own
module (``compile_cmd``, ``simulate_cmd``, ``run_cmd``, ``inspect_cmd``), what they share in ``common``
(an error is one line on stderr and exit code 2). Nothing in ``cli/`` imports torch at module level,
so ``fxpipe --help`` answers at once.
"""

from __future__ import annotations

import signal
import sys

try:  # a Ctrl-C before a command takes over (common.one_line_errors) has nothing to clean up: no traceback
    import typer

    from fxpipe.cli.compile_cmd import compile_cmd
    from fxpipe.cli.inspect_cmd import inspect_cmd, models_cmd
    from fxpipe.cli.run_cmd import run_cmd
    from fxpipe.cli.simulate_cmd import simulate_cmd
    from fxpipe.cli.strategy_cmd import strategy_cmd
except KeyboardInterrupt:
    sys.stderr.write("interrupted\n")
    raise SystemExit(128 + signal.SIGINT) from None

app = typer.Typer(
    name="fxpipe",
    help="Turn a PyTorch model into pipeline stages, and show every decision as a table.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command("compile")(compile_cmd)
app.command("simulate")(simulate_cmd)
app.command("run")(run_cmd)
app.command("strategy")(strategy_cmd)
app.command("inspect")(inspect_cmd)
app.command("models")(models_cmd)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:  # between the command line's parsing and the command's own handling
        sys.stderr.write("interrupted\n")
        raise SystemExit(128 + signal.SIGINT) from None


if __name__ == "__main__":
    main()
