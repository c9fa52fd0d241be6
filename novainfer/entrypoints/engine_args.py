"""The CLI's engine (and server) flags, generated from the config fields (config/fields.py): one flag per setting, its
name the field's (vLLM's: --max-num-seqs) unless the field names another, its default and help the field's."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from novainfer.config.engine import engine_arg_fields
from novainfer.config.fields import field_default

MODEL_HELP = "HF folder or .gguf file (default: SmolLM2-135M-Instruct, shipped with the install)"


def _shown(value: Any) -> str:
    """A default as --help shows it (None: 'auto', the engine decides)."""
    if value is None:
        return "auto"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _scalar_type(f: dataclasses.Field) -> type:
    """The option's parser from the field's annotation (a string under postponed evaluation)."""
    annotation = str(f.type)
    for name, kind in (("bool", bool), ("int", int), ("float", float)):
        if name in annotation.replace("|", " ").split():
            return kind
    return str


def _user_error(parse: Any) -> Any:
    """parse, its ValueError shown as the usage error's message (argparse would print only its name)."""
    if parse in (int, float, str):
        return parse

    def checked(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return checked


def add_engine_args(p: argparse.ArgumentParser, model_positional: bool = True) -> None:
    """Every engine setting as a flag (shared by each subcommand that loads a model)."""
    if model_positional:
        p.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    else:  # the positional arguments are prompts
        p.add_argument("--model", default=None, help=MODEL_HELP)
    group = p.add_argument_group("engine", "the engine's settings (LLM(...)'s keyword arguments of the same names)")
    add_field_flags(group, [f for _, f in engine_arg_fields()])


def add_field_flags(group: Any, fields: list[dataclasses.Field]) -> None:
    """Each config field as a flag: its name, default and help from the field (config/fields.py)."""
    for f in fields:
        meta = f.metadata
        if not meta.get("cli", True):
            continue
        names = ["--" + (meta.get("flag") or f.name.replace("_", "-"))] + ([meta["short"]] if meta.get("short") else [])
        default = field_default(f)
        help_ = f"{meta.get('help', '')} (default: {meta.get('shown') or _shown(default)})".replace("%", "%%")
        kind = meta.get("type") or _scalar_type(f)
        if kind is bool:
            group.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=help_)
        else:
            group.add_argument(
                *names,
                dest=f.name,
                type=_user_error(kind),
                default=default,
                choices=meta.get("choices"),
                nargs=meta.get("nargs"),
                help=help_,
            )


def field_values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The flags' values of cls's fields, as its keyword arguments."""
    return {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(cls)
        if f.metadata.get("cli", True) and hasattr(args, f.name)
    }


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags' values as LLM(...) / EngineConfig.from_kwargs keyword arguments."""
    return {
        f.name: getattr(args, f.name)
        for _, f in engine_arg_fields()
        if f.metadata.get("cli", True) and hasattr(args, f.name)
    }
