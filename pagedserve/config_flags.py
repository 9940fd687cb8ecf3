"""Command-line flags made from config dataclasses, and configs made back from the parsed flags or
turned back into argv: the one place where a config field meets argparse. A flag's value is kept
under its field's name in the parsed namespace, or under the flag's own name when the field names
its flag (``--lease-ttl`` in ``args.lease_ttl``): fields of one name in two nested configs (a worker's
``--model`` and its speculative config's ``model``, ``--speculative-model``) keep their own values,
and a second flag with the same destination is refused when the parser is built.

Which fields are flags, their names and help: ``pagedserve/options.py``. A flag's type and
default are its field's (a nested config's default instance gives its fields' defaults); a
field's environment variable, when set, is read here, when the parser is built.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import os
import re
import types
import typing
from typing import Any

from pagedserve.options import Option, group_of, option_of

_Parser = argparse.ArgumentParser | argparse._ArgumentGroup


@functools.cache
def _types_of(cls: type) -> dict[str, Any]:
    """The fields' types of dataclass ``cls``, resolved (annotations may be strings)."""
    return typing.get_type_hints(cls)


def _value_type(cls: type, name: str) -> Any:
    """The type of field ``name`` without ``| None``."""
    hint = _types_of(cls)[name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def flag_name(field: dataclasses.Field, opt: Option) -> str:
    """The flag, without ``--``, made from ``field`` (see ``pagedserve/options.py``)."""
    if opt.flag:
        return opt.flag
    if field.default is True and field.name.startswith("enable_"):
        return "no-" + field.name.removeprefix("enable_").replace("_", "-")
    return field.name.replace("_", "-")


def dest_of(field: dataclasses.Field, opt: Option) -> str:
    """Where the parsed namespace keeps the flag's value: the flag's own name when the field names its
    flag (``-`` as ``_``), else the field's name."""
    return opt.flag.replace("-", "_") if opt.flag else field.name


def _shown(value: Any, opt: Option) -> str:
    """``value`` written as on the command line."""
    if opt.show is not None:
        return opt.show(value)
    if isinstance(value, enum.Enum):
        return str(value.value)
    return repr(value) if isinstance(value, float) else str(value)


def _help(opt: Option, default: Any, own_default: bool, turns_off: bool = False) -> str:
    """The flag's help; ``own_default``: ``default`` is the field's own (``default_help`` tells it)."""
    text = ("turns this off (on by default): " if turns_off else "") + opt.help.replace("%", "%%")
    notes = [f"env {opt.env}"] if opt.env else []
    if opt.default_help and own_default:
        notes.append(f"default: {opt.default_help}")
    elif (opt.secret is None or opt.show is not None) and default is not None and default != "" and not isinstance(default, bool):
        notes.append(f"default {_shown(default, opt)}".replace("%", "%%"))
    return f"{text} ({'; '.join(notes)})" if notes else text


def _add_option(parser: _Parser, cls: type, field: dataclasses.Field, opt: Option, default: Any) -> None:
    """Adds the flag of one field (two for a secret: the value and a file holding it)."""
    flag, dest = "--" + flag_name(field, opt), dest_of(field, opt)
    if any(action.dest == dest for action in parser._actions):
        raise ValueError(f"{flag}: its value would share args.{dest} with another flag (name the field's flag)")
    if opt.env and os.environ.get(opt.env):
        default = os.environ[opt.env]
    own_default = default in (None, "") or default == field.default
    kind = _value_type(cls, field.name)
    if kind is bool:
        action = "store_false" if field.default is True else "store_true"
        parser.add_argument(flag, dest=dest, action=action, help=_help(opt, None, True, action == "store_false"))
        return
    # a value with its own parser stays as written until config_from_args reads it
    extra: dict[str, Any] = {"type": str if opt.parse else kind, "metavar": opt.metavar, "choices": opt.choices or None}
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        extra = {"choices": [m.value for m in kind], "type": str}
        default = default.value if isinstance(default, enum.Enum) else default
    elif opt.secret is not None:
        extra["type"] = str
    parser.add_argument(flag, dest=dest, default=default, help=_help(opt, default, own_default), **extra)
    if opt.secret is not None:
        parser.add_argument(f"{flag}-file", dest=f"{dest}_file", default="",
                            help=f"file holding {opt.secret.what} (takes precedence over {flag})")


def fields_except(cls: type, keep: frozenset[str]) -> frozenset[str]:
    """The names of ``cls``'s fields not in ``keep`` (to add the flags of ``keep`` alone)."""
    return frozenset(f.name for f in dataclasses.fields(cls)) - keep


def add_config_arguments(parser: _Parser, cls: type, base: Any = None, exclude: frozenset[str] = frozenset()) -> None:
    """Adds a flag for every option field of dataclass ``cls``, and those of its nested configs (each
    in an argument group titled as its field says).

    Args:
        parser: the parser or argument group to add to.
        cls: the config dataclass.
        base: an instance whose values are the defaults (default: the fields' own defaults).
        exclude: names of fields to add no flag for (they keep ``base``'s values).
    """
    for field in dataclasses.fields(cls):
        if field.name in exclude:
            continue
        default = getattr(base, field.name) if base is not None else field.default
        if default is dataclasses.MISSING and field.default_factory is not dataclasses.MISSING:
            default = ""  # not given: the factory makes the value
        group = group_of(field)
        if group is not None:
            sub = parser.add_argument_group(group.title) if isinstance(parser, argparse.ArgumentParser) else parser
            add_config_arguments(sub, _value_type(cls, field.name), default, group.exclude)
            continue
        opt = option_of(field)
        if opt is not None:
            _add_option(parser, cls, field, opt, None if default is dataclasses.MISSING else default)


def config_from_args(cls: type, args: argparse.Namespace, base: Any = None, **given: Any) -> Any:
    """The config ``cls`` that ``args`` (parsed from flags of ``add_config_arguments``) describes.

    Args:
        base: an instance whose values fields without a flag in ``args`` keep.
        given: values of fields taken as they are, not from ``args`` (resolved elsewhere).

    Raises:
        ValueError: an invalid value (the config's own validation), an unreadable secret.
        OSError: a secret's file cannot be read.
    """
    values = dict(given)
    for field in dataclasses.fields(cls):
        if field.name in values:
            continue
        if group_of(field) is not None:
            default = getattr(base, field.name) if base is not None else field.default
            values[field.name] = config_from_args(_value_type(cls, field.name), args, default)
            continue
        opt = option_of(field)
        if opt is None or not hasattr(args, dest_of(field, opt)):
            continue
        value = getattr(args, dest_of(field, opt))
        if value in (None, "") and field.default_factory is not dataclasses.MISSING:
            continue  # not given: the factory makes it
        if opt.parse is not None and isinstance(value, str):
            value = opt.parse(value)
        if opt.secret is not None:
            value = opt.secret.read(value or "", getattr(args, dest_of(field, opt) + "_file") or "")
        values[field.name] = value
    try:
        return dataclasses.replace(base, **values) if base is not None else cls(**values)
    except ValueError as exc:
        raise ValueError(_with_flags(str(exc), cls)) from exc


def _with_flags(message: str, cls: type) -> str:
    """``message`` (a config's validation error, which names fields: the config is built in-process too)
    with each of ``cls``'s option fields whose name has an ``_`` written as its flag, as the user typed it."""
    for field in dataclasses.fields(cls):
        opt = option_of(field)
        if opt is not None and "_" in field.name:
            message = re.sub(rf"(?<![\w-]){field.name}(?!\w)", "--" + flag_name(field, opt), message)
    return message


def config_to_argv(config: Any) -> list[str]:
    """The flags that ``config_from_args`` reads back into ``config``'s option fields (for starting a
    service process): secrets and fields set to None are left out (secrets travel in the
    environment), a ``bool`` appears only where it differs from its field's default."""
    argv: list[str] = []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if group_of(field) is not None:
            argv += config_to_argv(value)
            continue
        opt = option_of(field)
        if opt is None or opt.secret is not None or value is None:
            continue
        if isinstance(value, bool):
            argv += [] if value == field.default else ["--" + flag_name(field, opt)]
        else:
            argv += ["--" + flag_name(field, opt), _shown(value, opt)]
    return argv
