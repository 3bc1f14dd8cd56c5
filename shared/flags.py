"""Frozen config dataclasses as command lines: one `--flag` and one `RS_*` environment variable per field.

A field `metrics_port: int | None = _help("...", 9402)` becomes `--metrics-port` and `RS_METRICS_PORT`;
a flag beats the variable, the variable beats the default. `none` spells None for optional fields;
booleans take `--flag/--no-flag` on the command line and 1/0, true/false, yes/no in the environment.
Help text comes from the field's `metadata["help"]`, so a default and its explanation sit together.
A field may have other spellings (`metadata["aliases"]`: `namespace` for `subject_prefix` gives
`--namespace` and `RS_NAMESPACE` too); two spellings given with different values are a ValueError.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")
ENV_PREFIX = "RS_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _base_type(hint: Any) -> tuple[type, bool]:
    """(int/float/str/bool, optional?) from a field's type hint."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"unsupported config field type {hint!r}")
        return inner[0], True
    return hint, False


def parse_value(text: str, hint: Any, name: str) -> Any:
    """One field's value from its command-line or environment spelling; ValueError names the field."""
    base, optional = _base_type(hint)
    if optional and text.strip().lower() == "none":
        return None
    try:
        if base is bool:
            lowered = text.strip().lower()
            if lowered in _TRUE | _FALSE:
                return lowered in _TRUE
            raise ValueError(text)
        return base(text)
    except ValueError:
        raise ValueError(f"{name}: cannot read {text!r} as {base.__name__}") from None


def _spellings(f: dataclasses.Field[Any]) -> tuple[str, ...]:
    """A field's name and then its aliases (each one a flag and a variable)."""
    return (f.name, *f.metadata.get("aliases", ()))


def alias_env_names(cls: type) -> set[str]:
    """The RS_* variables of every alias of `cls`'s fields (not their own names)."""
    return {env_name(alias) for f in dataclasses.fields(cls) for alias in f.metadata.get("aliases", ())}


def add_arguments(parser: argparse.ArgumentParser, cls: type, exclude: Iterable[str] = ()) -> None:
    """One flag per field of dataclass `cls` (and one per alias); unset flags stay absent from the namespace."""
    hints = typing.get_type_hints(cls)
    skip = set(exclude)
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        hint = hints[f.name]
        base, _ = _base_type(hint)
        default = f.default if f.default is not dataclasses.MISSING else None
        for spelling in _spellings(f):
            text = f.metadata.get("help", "") if spelling == f.name else f"alias of {flag_name(f.name)}"
            help_text = f"{text} (env {env_name(spelling)}; default {default!r})"
            if base is bool:
                parser.add_argument(
                    flag_name(spelling), dest=spelling, action=argparse.BooleanOptionalAction,
                    default=argparse.SUPPRESS, help=help_text,
                )
            else:
                parser.add_argument(
                    flag_name(spelling), dest=spelling, default=argparse.SUPPRESS, help=help_text,
                    type=lambda text, hint=hint, name=spelling: parse_value(text, hint, flag_name(name)),
                    metavar=base.__name__.upper(),
                )


def _one_of(given: dict[str, Any]) -> Any:
    """The value of a field given under one or more spellings; ValueError when they disagree."""
    values = list(given.values())
    if any(value != values[0] for value in values[1:]):
        spelled = " and ".join(f"{name} {value!r}" for name, value in given.items())
        raise ValueError(f"{spelled} are two spellings of one setting with different values: give one")
    return values[0]


def values_from(
    cls: type,
    args: argparse.Namespace | None = None,
    env: Mapping[str, str] | None = None,
    exclude: Iterable[str] = (),
) -> dict[str, Any]:
    """The fields of `cls` given as flags (in `args`) or as RS_* variables (in `env`), under any of
    their spellings."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    skip = set(exclude)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        spellings = _spellings(f)
        given = {flag_name(s): getattr(args, s) for s in spellings if args is not None and hasattr(args, s)}
        if not given:
            given = {env_name(s): parse_value(env[env_name(s)], hints[f.name], env_name(s))
                     for s in spellings if env.get(env_name(s), "") != ""}
        if given:
            values[f.name] = _one_of(given)
    return values


def build(cls: type[T], args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None, **fixed: Any) -> T:
    """An instance of dataclass `cls` from flags, then RS_* variables, then defaults; `fixed` wins."""
    return cls(**{**values_from(cls, args, env), **fixed})
