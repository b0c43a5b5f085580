"""``fxpipe compile | simulate | run | inspect | models``: tables on stdout, progress on stderr, one-line errors.

The typer app and the entry point (``fxpipe = fxpipe.cli.main:main``). Each command lives in its own
module (``compile_cmd``, ``simulate_cmd``, ``run_cmd``, ``inspect_cmd``), what they share in ``common``
(an error is one line on stderr and exit code 2). Nothing in ``cli/`` imports torch at module level,
so ``fxpipe --help`` answers at once.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence
from typing import Any

try:  # a Ctrl-C before a command takes over (common.one_line_errors) has nothing to clean up: no traceback
    import typer
    import typer.core

    from fxpipe.cli.common import run_epilog
    from fxpipe.cli.compile_cmd import compile_cmd
    from fxpipe.cli.export_cmd import export_cmd
    from fxpipe.cli.inspect_cmd import inspect_cmd, models_cmd
    from fxpipe.cli.run_cmd import run_cmd
    from fxpipe.cli.simulate_cmd import simulate_cmd
    from fxpipe.cli.strategy_cmd import strategy_cmd
except KeyboardInterrupt:
    sys.stderr.write("interrupted\n")
    raise SystemExit(128 + signal.SIGINT) from None

class OneLineGroup(typer.core.TyperGroup):
    """fxpipe's command group: a usage error (an unknown option, a value out of range or not one of the choices) is
    one line on stderr and exit code 2, as every other refusal is, not a usage box."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, windows_expand_args: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, windows_expand_args, **extra)
        # typer's public names: BadParameter's base (UsageError) and Abort; the help for a bare `fxpipe` is a
        # UsageError too, and keeps typer's rendering
        usage_error: type[typer.BadParameter] = typer.BadParameter.__mro__[1]

        try:
            rv = super().main(args, prog_name, complete_var, False, windows_expand_args, **extra)
        except usage_error as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":  # `fxpipe` alone: the help
                from typer import rich_utils

                rich_utils.rich_format_error(exc)
                sys.exit(exc.exit_code)
            message = " ".join(exc.format_message().replace("Value error, ", "").split()).rstrip(".")
            hint = f"; see {exc.ctx.command_path} --help" if exc.ctx is not None else ""
            sys.stderr.write(f"error: {message}{hint}\n")
            sys.exit(exc.exit_code)
        except typer.Abort:
            sys.stderr.write("error: aborted\n")
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


app = typer.Typer(
    name="fxpipe",
    cls=OneLineGroup,
    help="Turn a PyTorch model into pipeline stages, and show every decision as a table.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"fxpipe {version('fxpipe')}")
        except PackageNotFoundError:  # run from a source tree that was never installed
            print("fxpipe (not installed)")
        raise typer.Exit()


@app.callback()
def _root(show_version: bool = typer.Option(False, "--version", help="Print fxpipe's version and exit.",
                                            is_eager=True, callback=_version)) -> None:
    """Turn a PyTorch model into pipeline stages, and show every decision as a table."""


app.command("compile")(compile_cmd)
app.command("simulate")(simulate_cmd)
app.command("run", epilog=run_epilog())(run_cmd)
app.command("strategy")(strategy_cmd)
app.command("inspect")(inspect_cmd)
app.command("models")(models_cmd)
app.command("export")(export_cmd)


def _old_resume_flag(argv: list[str]) -> bool:
    """``fxpipe run ... --resume`` with no value (the flag it once was): click would take the next option as the
    value, or print a usage box."""
    if "run" not in argv or "--resume" not in argv:
        return False
    i = argv.index("--resume")
    return i + 1 == len(argv) or argv[i + 1].startswith("-")


def show_notes() -> None:
    """fxpipe's module loggers (``logging.getLogger("fxpipe")``: the calibration measuring, a compiler missing, a W
    run per microbatch) on stderr, one line each, at INFO; the library itself configures no handler."""
    import logging

    logger = logging.getLogger("fxpipe")
    if logger.handlers:
        return
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(console=Console(stderr=True), show_time=False, show_path=False,
                                               markup=False)
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("note: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def main() -> None:
    show_notes()
    if _old_resume_flag(sys.argv[1:]):
        sys.stderr.write("error: --resume takes never, auto or always; the old flag --resume is --resume always\n")
        raise SystemExit(2)
    try:
        app()
    except KeyboardInterrupt:  # between the command line's parsing and the command's own handling
        sys.stderr.write("interrupted\n")
        raise SystemExit(128 + signal.SIGINT) from None


if __name__ == "__main__":
    main()
