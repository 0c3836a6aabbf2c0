"""Command-line flags derived from the options dataclasses of ``pagedserve/settings.py``.

A field with a ``help`` in its metadata is a flag; its type, default and help come from the
field, so a knob is defined once. Every flag can also be set by a ``PAGEDSERVE_*``
environment variable named after it (``--max-num-seqs``: ``PAGEDSERVE_MAX_NUM_SEQS``), as
container deployments expect; a flag on the command line wins over the environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

ENV_PREFIX = "PAGEDSERVE_"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

T = TypeVar("T")


def add_flags(parser: argparse.ArgumentParser, options: type, skip: Iterable[str] = ()) -> None:
    """A flag for each field of the ``options`` dataclass that has a help, but ``skip``."""
    hints = typing.get_type_hints(options)
    for f in dataclasses.fields(options):
        if f.name in skip or "help" not in f.metadata:
            continue
        kind = _unwrap_optional(hints[f.name])
        default = None if f.default is dataclasses.MISSING else f.default
        help_text = f.metadata["help"].replace("%", "%%")  # argparse formats help with %
        kwargs: dict[str, Any] = {"dest": f.name, "help": help_text, "default": default}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is tuple:
            kwargs.update(action="append", default=None, type=typing.get_args(kind)[0])
            kwargs["metavar"] = (f.metadata["flag"] or f.name).upper()
        elif isinstance(kind, type) and issubclass(kind, enum.Enum):
            kwargs.update(type=kind, choices=list(kind), metavar="{" + _values(kind) + "}")
        else:
            kwargs["type"] = kind
            if f.metadata["choices"]:
                kwargs["choices"] = f.metadata["choices"]
        name = f.metadata["flag"] or f.name
        if "action" not in kwargs and "choices" not in kwargs:
            kwargs["metavar"] = name.upper()
        parser.add_argument("--" + name.replace("_", "-"), **kwargs)


def to_flags(options: Any, skip: Iterable[str] = ()) -> list[str]:
    """The command line that add_flags' parser reads back as ``options`` (a dataclass
    instance): each set field under its flag's name, switches bare or negated, a tuple's
    items one flag each, an enum by its value."""
    out = []
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        if f.name in skip or "help" not in f.metadata or value is None:
            continue
        name = "--" + (f.metadata["flag"] or f.name).replace("_", "-")
        if isinstance(value, bool):
            out.append(name if value else "--no-" + name[2:])
        elif isinstance(value, tuple):
            out += [f"{name}={item}" for item in value]
        else:
            out.append(f"{name}={value.value if isinstance(value, enum.Enum) else value}")
    return out


def from_args(options: type[T], args: argparse.Namespace, **given: Any) -> T:
    """The ``options`` dataclass from parsed flags; a field that is itself an options
    dataclass is read from the same flags, and ``given`` fields win."""
    hints = typing.get_type_hints(options)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(options):
        if f.name in given:
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            values[f.name] = from_args(hints[f.name], args)
        elif getattr(args, f.name, None) is not None:  # None: the field's own default
            value = getattr(args, f.name)
            values[f.name] = tuple(value) if isinstance(value, list) else value
    return options(**values, **given)


def apply_environment(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """Take each flag's default from its environment variable, where one is set, in
    ``parser`` and its subcommands. A value that does not parse ends the program with a
    usage error naming the variable."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                apply_environment(subparser, environ)
            continue
        longs = [o for o in action.option_strings if o.startswith("--")]
        if not longs or action.dest == "help":
            continue
        name = env_name(longs[0])
        if name not in environ:
            continue
        try:
            action.default = _parse(action, environ[name])
        except (ValueError, TypeError) as e:
            parser.error(f"{name}={environ[name]!r}: {e}")
        action.required = False


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def _parse(action: argparse.Action, text: str) -> Any:
    if isinstance(action, argparse.BooleanOptionalAction | argparse._StoreTrueAction):
        if text.lower() not in _TRUE + _FALSE:
            raise ValueError(f"expected one of {', '.join(_TRUE + _FALSE)}")
        return text.lower() in _TRUE
    convert = action.type or str
    if isinstance(action, argparse._AppendAction):
        return [convert(part.strip()) for part in text.split(",") if part.strip()]
    value = convert(text)
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"expected one of {', '.join(map(str, action.choices))}")
    return value


def _unwrap_optional(hint: Any) -> Any:
    """``X | None`` -> ``X``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return inner
    return hint


def _values(kind: type[enum.Enum]) -> str:
    return ",".join(str(member.value) for member in kind)
