"""Each command's configuration, declared once: a frozen dataclass of sections whose fields are its options.

A field's type (``Literal`` for a choice), default and :func:`option` metadata (help, bounds, flag names) are the
one declaration of an option. From it come the typer options (:func:`command` builds the command's signature),
the ``--config`` TOML keys (a flag's name without its dashes, at the top level or in its section's table),
``--print-config`` (the resolved values as TOML, which ``--config`` reads back), what the ranks of ``fxpipe run``
receive (the config itself, one JSON file) and the runtime's options. A config checks itself when it is made
(:meth:`Config.__post_init__`), so the CLI, the Python API and the ranks refuse the same values with the same line.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import sys
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from fxpipe.errors import OptionError

C = TypeVar("C", bound="Config")

MARK = "# written by fxpipe"  # the first line of every config file fxpipe writes (one it may replace)
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_LINE = 4096  # tomllib is quadratic in a dotted key's length: 100 KB of one took 4 GB
MAX_CONFIG_DEPTH = 32  # nested arrays and inline tables: tomllib recurses once per level


def option(default: Any, help: str, *, min: float | None = None, max: float | None = None,  # noqa: A002
           flags: tuple[str, ...] = (), panel: str | None = None, hidden: bool = False, show_default: bool = True,
           argument: bool = False, toml: bool = True) -> Any:
    """A config field: its default and how the command line shows it (``flags``: typer's declarations, e.g.
    ``("--json",)``; ``argument``: positional; ``toml``: a key of --config files)."""
    meta = {"help": help, "min": min, "max": max, "flags": flags, "panel": panel, "hidden": hidden,
            "show_default": show_default, "argument": argument, "toml": toml}
    return field(default=default, metadata=meta)


def section(cls: type[Any]) -> Any:
    """A config's section: a field whose value is the frozen dataclass ``cls`` with its defaults."""
    return field(default_factory=cls)


@dataclass(frozen=True)
class Leaf:
    """One option of a config: the section it is in (None: the top level), its name, type and declaration."""

    section: str | None
    name: str
    type: Any
    default: Any
    meta: dict[str, Any]

    @property
    def key(self) -> str:
        """Its TOML key and long flag: the name with dashes."""
        flags = [f for f in self.meta["flags"] if f.startswith("--")]
        return flags[0][2:].split("/")[0] if flags else self.name.replace("_", "-")

    @property
    def choices(self) -> tuple[Any, ...] | None:
        base = _plain_type(self.type)
        return typing.get_args(base) if typing.get_origin(base) is Literal else None


def _plain_type(tp: Any) -> Any:
    """``X | None`` -> X."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", None)) and len(args) == 1:
        return args[0]
    return tp


def _hints(cls: type[Any]) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def leaves(cls: type[Any]) -> list[Leaf]:
    """Every option of the config class ``cls``, in declaration order (sections' options in their place)."""
    hints = _hints(cls)
    found: list[Leaf] = []
    for f in fields(cls):
        tp = hints[f.name]
        if isinstance(tp, type) and is_dataclass(tp):
            sub = _hints(tp)
            found += [Leaf(f.name, g.name, sub[g.name], g.default, dict(g.metadata)) for g in fields(tp)]
        else:
            found.append(Leaf(None, f.name, tp, f.default, dict(f.metadata)))
    return found


class Config:
    """What every command's config shares: its options flat and back, TOML, JSON, and its checks."""

    def __post_init__(self) -> None:
        for leaf in leaves(type(self)):
            _check(leaf, self.flat()[leaf.name])
        self.check()

    def check(self) -> None:
        """Checks across options (a subclass's); each refusal is one OptionError line."""

    def flat(self) -> dict[str, Any]:
        """Option name -> value, over every section."""
        out: dict[str, Any] = {}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if is_dataclass(value):
                out.update({g.name: getattr(value, g.name) for g in fields(value)})
            else:
                out[f.name] = value
        return out

    @classmethod
    def from_flat(cls: type[C], values: dict[str, Any]) -> C:
        """The config of option name -> value (missing ones at their defaults); TypeError for an unknown name."""
        hints = _hints(cls)
        known = {leaf.name for leaf in leaves(cls)}
        top_fields: tuple[Any, ...] = fields(cls)  # type: ignore[arg-type]  # a Config subclass is a dataclass
        unknown = sorted(set(values) - known)
        if unknown:
            raise TypeError(f"{cls.__name__} has no option {unknown[0]!r}")
        top: dict[str, Any] = {}
        for f in top_fields:
            tp = hints[f.name]
            if isinstance(tp, type) and is_dataclass(tp):
                top[f.name] = tp(**{g.name: values[g.name] for g in fields(tp) if g.name in values})
            elif f.name in values:
                top[f.name] = values[f.name]
        return cls(**top)

    def replace(self: C, **changes: Any) -> C:
        """A copy with some options (by name, in any section) changed, checked again."""
        return type(self).from_flat({**self.flat(), **changes})

    def to_json(self) -> dict[str, Any]:
        """Plain JSON values by option name (paths as text), for the ranks' configuration file."""
        return {k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in self.flat().items()}

    @classmethod
    def from_json(cls: type[C], doc: dict[str, Any]) -> C:
        """:meth:`to_json`'s values back, paths as paths."""
        types = {leaf.name: leaf.type for leaf in leaves(cls)}
        return cls.from_flat({k: Path(v) if v is not None and _plain_type(types.get(k)) is Path else v
                              for k, v in doc.items()})

    def to_toml(self, comment: str) -> str:
        """The options as TOML, one table per section (``--print-config``; ``--config`` reads it back): a None
        value is a comment (TOML has no null)."""
        lines = [f"{MARK}: {comment}"]
        values = self.flat()
        current: str | None = None
        for leaf in leaves(type(self)):
            if not leaf.meta["toml"] or leaf.meta["hidden"]:
                continue
            if leaf.section != current and leaf.section is not None:
                lines += ["", f"[{leaf.section}]"]
                current = leaf.section
            value = values[leaf.name]
            lines.append(f"# {leaf.key}: not set (its default)" if value is None else
                         f"{leaf.key} = {toml_value(value)}")
        return "\n".join(lines) + "\n"


def _check(leaf: Leaf, value: Any) -> None:
    """One option's value against its type, choices and bounds (what typer checks on the command line, for the
    API and the ranks too)."""
    flag = f"--{leaf.key}"
    if value is None:
        if type(None) not in typing.get_args(leaf.type):
            raise OptionError(f"{flag} needs a value")
        return
    choices = leaf.choices
    if choices is not None and value not in choices:
        raise OptionError(f"{flag} {value!r} is not one of {', '.join(map(str, choices))}")
    meta = leaf.meta
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and math.isnan(value):
            raise OptionError(f"{flag} is nan; give a number")
        if meta["min"] is not None and value < meta["min"]:
            raise OptionError(f"{flag} is at least {meta['min']:g} (got {value:g})")
        if meta["max"] is not None and value > meta["max"]:
            raise OptionError(f"{flag} is at most {meta['max']:g} (got {value:g})")


# -- the command line ------------------------------------------------------------------------------------------


def _typer_param(leaf: Leaf) -> inspect.Parameter:
    import typer

    meta = leaf.meta
    if meta["argument"]:
        info: Any = typer.Argument(help=meta["help"], show_default=meta["show_default"])
    else:
        info = typer.Option(*meta["flags"], help=meta["help"], min=meta["min"], max=meta["max"],
                            rich_help_panel=meta["panel"], hidden=meta["hidden"], show_default=meta["show_default"])
    required = meta["argument"] and meta["show_default"] is False  # a positional the command line (or --config) gives
    return inspect.Parameter(leaf.name, inspect.Parameter.KEYWORD_ONLY,
                             default=inspect.Parameter.empty if required else leaf.default,
                             annotation=Annotated[leaf.type, info])


CONFIG_FILE = "fxpipe.config_file"  # ctx.meta's key for the --config file's path (None: none given)
CONFIG_HELP = ("A TOML file of options: keys are the flags without their dashes (steps = 3), at the top or in their "
               "section's table; flags on the command line override it. --print-config writes one.")


def command(cls: type[C], body: Callable[[Any, C], None], name: str) -> Callable[..., None]:
    """A typer command whose options are ``cls``'s fields, plus ``--config FILE`` (read first: its values become the
    options' defaults) and ``--print-config`` (print the resolved config as TOML and exit). It makes the config,
    which checks itself (one line, exit 2), and hands it to ``body(ctx, config)``."""
    import typer

    from fxpipe.cli.common import one_line_errors

    def run(ctx: typer.Context, **values: Any) -> None:
        ctx.meta[CONFIG_FILE] = values.pop("config")  # the --config file, for a command that asks (fxpipe run)
        show = values.pop("print_config")
        from fxpipe.cli.ranks import signals_held

        with signals_held():  # a config's checks may import torch: a Ctrl-C in its C++ initialisation comes after
            import torch  # noqa: F401
        with one_line_errors():
            config = cls.from_flat(values)
        if show:
            sys.stdout.write(config.to_toml(f"fxpipe {name} --config FILE reads it"))
            return
        body(ctx, config)

    params = [inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)]
    params += [_typer_param(leaf) for leaf in leaves(cls)]
    params += [inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
                   Path | None, typer.Option(help=CONFIG_HELP, is_eager=True, callback=load_config)]),
               inspect.Parameter("print_config", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=Annotated[
                   bool, typer.Option("--print-config", help="Print every option's resolved value as TOML (for "
                                      "--config) and exit.")])]
    run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    run.__annotations__ = {}
    run.__doc__ = body.__doc__
    run.__name__ = f"{name}_cmd"
    run.sections = {leaf.key: leaf.section for leaf in leaves(cls)}  # type: ignore[attr-defined]
    return run


# -- TOML ------------------------------------------------------------------------------------------------------


def toml_value(value: Any) -> str:
    """One TOML value: a bool, an int, a float (inf and nan included) or a string (paths as text)."""
    import tomli_w

    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        value = list(value)  # a repeatable option (compile --print-after)
    elif not isinstance(value, (bool, int, float, str)):
        raise TypeError(f"no TOML form for {type(value).__name__} (options are bools, numbers, strings, paths and "
                        "lists of strings)")
    return tomli_w.dumps({"v": value})[len("v = "):].rstrip("\n")


def _tomllib() -> Any:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover  (Python 3.10: the tomli backport, a dependency there)
        import tomli as tomllib
    return tomllib


def keyed_params(command: Any) -> dict[str, Any]:
    """key -> click parameter, for every parameter a config file may set (not --help, hidden ones, --config or
    --print-config)."""
    return {option_key(p): p for p in command.params
            if p.name not in ("config", "print_config") and not getattr(p, "hidden", False) and p.expose_value}


def option_key(param: Any) -> str:
    """The config key of a click parameter: its first long flag without dashes, or an argument's name with dashes."""
    longs = [o for o in getattr(param, "opts", ()) if o.startswith("--")]
    return longs[0][2:] if longs and param.param_type_name == "option" else param.name.replace("_", "-")


def _kind(param: Any) -> str:
    """bool, int, float, str or list (of strings): what TOML value a parameter takes (typer records its
    annotation)."""
    if getattr(param, "is_flag", False):
        return "bool"
    if getattr(param, "multiple", False):
        return "list"
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    if annotation is None:  # a click-built parameter
        annotation = {"boolean": bool, "integer": int, "float": float}.get(getattr(param.type, "name", ""), str)
        annotation = int if "range" in getattr(param.type, "name", "") and "integer" in str(param.type) else annotation
    return {bool: "bool", int: "int", float: "float"}.get(annotation, "str")


def _convert(param: Any, value: Any, ctx: Any) -> Any:
    """``value`` as the flag's own parsing would make it (its range and choices checked)."""
    if hasattr(param, "get_runtime_param"):
        return param.get_runtime_param().coerce(value, param=param, ctx=ctx)
    return param.type.convert(value, param, ctx)


_NAMES = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string",
          "list": "a list of strings"}


def _items(doc: dict[str, Any], sections: dict[str, str | None], path: Path) -> Iterator[tuple[str, Any]]:
    """(key, value) of a config document: top-level keys, and the keys of its sections' tables (each table holds
    its own section's keys only; OptionError, one line, for a key in another's)."""
    tables = {s for s in sections.values() if s}
    for key, value in doc.items():
        if not (isinstance(value, dict) and key in tables):
            yield key, value
            continue
        for inner, v in value.items():
            home = sections.get(inner, sections.get(inner.replace("_", "-")))
            if home is not None and home != key:
                raise OptionError(f"--config {str(path)!r}: unknown key [{key}] {inner!r}; {inner} is in [{home}]")
            yield inner, v


def read_config(path: Path, command: Any, ctx: Any) -> dict[str, Any]:
    """``path``'s values by parameter name, each checked and converted as its flag would be; OptionError (one line)
    for an unreadable file, an unknown key or a wrong type or value."""
    import typer

    tomllib = _tomllib()
    try:
        doc = tomllib.loads(_bounded_toml(Path(path)))
    except OSError as exc:
        raise OptionError(f"--config {str(path)!r} cannot be read ({exc.strerror or exc}); give a TOML file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise OptionError(f"--config {str(path)!r} is not TOML ({exc}); write one key = value per line") from None
    params = keyed_params(command)
    sections = getattr(getattr(command, "callback", None), "sections", None) or {}
    values: dict[str, Any] = {}
    for key, value in _items(doc, sections, path):
        param = params.get(key) or params.get(key.replace("_", "-"))
        if param is None or key not in params:
            hint = (f"write it {key.replace('_', '-')}" if param is not None else
                    f"the keys are fxpipe {ctx.info_name}'s flags without the dashes (--print-config shows them)")
            raise OptionError(f"--config {str(path)!r}: unknown key {key!r}; {hint}")
        kind = _kind(param)
        if kind == "str" and isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # stages = 3 for a flag that takes a count or a word (--stages auto)
        ok = (isinstance(value, bool) if kind == "bool" else
              isinstance(value, list) and all(isinstance(v, str) for v in value) if kind == "list" else
              isinstance(value, int) and not isinstance(value, bool) if kind == "int" else
              isinstance(value, (int, float)) and not isinstance(value, bool) if kind == "float" else
              isinstance(value, str))
        if not ok:
            shown = toml_value(value) if isinstance(value, (bool, int, float, str)) else repr(value)
            what = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
                type(value), f"a TOML {type(value).__name__}")
            raise OptionError(f"--config {str(path)!r}: {key} = {shown} is {what}; {key} takes {_NAMES[kind]}")
        try:
            values[param.name] = value if kind in ("bool", "list") else _convert(param, value, ctx)
        except typer.BadParameter as exc:
            raise OptionError(f"--config {str(path)!r}: {key} = {toml_value(value)}: {exc.message}") from None
    return values


def load_config(ctx: Any, param: Any, value: Path | None) -> Path | None:
    """The eager ``--config`` option's callback: the file's values become the defaults of every other option, so
    the command line's flags override them. An error is one line and exit code 2."""
    if value is None or ctx.resilient_parsing:
        return value
    from fxpipe.cli.common import one_line_errors

    with one_line_errors():
        values = read_config(value, ctx.command, ctx)
    ctx.default_map = {**(ctx.default_map or {}), **values}
    return value


def _bounded_toml(path: Path) -> str:
    """A config file's text, checked before TOML parses it: a regular file of at most ``MAX_CONFIG_BYTES``, lines
    of at most ``MAX_CONFIG_LINE`` characters and brackets nested at most ``MAX_CONFIG_DEPTH`` deep (counted
    outside quotes); OptionError (one line) otherwise."""
    from fxpipe.data import regular_file

    regular_file(path, f"--config {str(path)!r}", MAX_CONFIG_BYTES)
    text = path.read_text()
    for number, line in enumerate(text.splitlines(), 1):
        if len(line) > MAX_CONFIG_LINE:
            raise OptionError(f"--config {str(path)!r} line {number} is {len(line):,} characters, more than "
                              f"{MAX_CONFIG_LINE:,}; write one key = value per line")
    depth, deepest, quote = 0, 0, ""
    for char in text:
        if char == "\n":
            quote = ""  # a quote left open in a comment (don't) ends with its line
        elif quote:
            quote = "" if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth = max(0, depth - 1)
    if deepest > MAX_CONFIG_DEPTH:
        raise OptionError(f"--config {str(path)!r} nests brackets {deepest} deep, more than {MAX_CONFIG_DEPTH}; "
                          "fxpipe's options are plain values")
    return text


def write_json(config: Config, path: Path, **extra: Any) -> Path:
    """``config`` (and ``extra``, what the launcher resolved) as one JSON file: what each rank of fxpipe run reads."""
    from fxpipe.files import write_file

    return write_file(path, json.dumps({"config": config.to_json(), **extra}), what="the ranks' configuration")


def read_json(cls: type[C], path: Path) -> tuple[C, dict[str, Any]]:
    """:func:`write_json`'s file back: the config (checked again) and the extra values."""
    doc = json.loads(Path(path).read_text())
    return cls.from_json(doc.pop("config")), doc


__all__ = ["Config", "Leaf", "command", "leaves", "option", "section"]
