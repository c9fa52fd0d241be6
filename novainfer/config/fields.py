"""`setting(...)`: how a config field declares itself once, with the help text and CLI details the command
line (entrypoints/engine_args.py) and `LLM(**kwargs)` (EngineConfig.from_kwargs) derive from it."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

# metadata keys: help (the --help line), shown (the default in words), flag (the option's name when it is
# not the field's), short (an alias such as -tp), choices, type (parses the option's text), nargs, cli (False:
# keyword argument only), derived (set by the config itself, never by the user)


def setting(
    default: Any = None,
    help: str = "",
    *,
    default_factory: Callable[[], Any] | None = None,
    flag: str | None = None,
    short: str | None = None,
    choices: tuple[str, ...] | None = None,
    type: Callable[[str], Any] | None = None,
    nargs: str | None = None,
    cli: bool = True,
    shown: str | None = None,
) -> Any:
    """A user-facing config field: its default and help text, declared once (shown: the default as --help
    words it, when not the value itself)."""
    meta = {
        "help": help,
        "flag": flag,
        "short": short,
        "choices": choices,
        "type": type,
        "nargs": nargs,
        "cli": cli,
        "shown": shown,
    }
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def derived(default: Any = None, help: str = "") -> Any:
    """A field the config fills itself (normalize/resolve); refused as a keyword argument."""
    return dataclasses.field(default=default, metadata={"help": help, "derived": True, "cli": False})


def field_default(f: dataclasses.Field) -> Any:
    """The field's default value (its default_factory called)."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default
