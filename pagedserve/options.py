"""Documented configuration fields: a dataclass field that also describes the command-line flag made
from it (``pagedserve/config_flags.py`` builds the flags; this module imports no argparse).

A config's fields declared with :func:`option` are its flags, and each field's ``help`` is its only
documentation. The flag is ``--`` and the field name with ``-`` for ``_``; a ``bool`` field whose
default is True and whose name starts with ``enable_`` becomes ``--no-<rest>`` (it turns the
feature off). A field whose type is a dataclass holding options is a nested config: its flags are
added beside the outer ones (in a group of their own).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

OPTION_KEY = "pagedserve.option"
"""Key of an :class:`Option` in a field's ``metadata``."""

GROUP_KEY = "pagedserve.group"
"""Key of a :class:`Group` in a nested config field's ``metadata``."""


@dataclass(frozen=True)
class Secret:
    """How a secret field is read: from ``--<flag>``, its environment variable, or ``--<flag>-file``
    (the file wins). A secret never travels in argv (``config_to_argv`` leaves it out).

    Attributes:
        read: ``read(value, path)`` -> the secret: ``path`` is the file flag's value ("" when not
            given); raises ValueError or OSError for an unreadable or invalid secret.
        what: the secret's name in the file flag's help ("the cluster token").
    """

    read: Callable[[str, str], str]
    what: str


@dataclass(frozen=True)
class Option:
    """How one field becomes a flag.

    Attributes:
        help: what the field means, with its unit; ``--help`` adds the default and the variable.
        flag: the flag's name without ``--`` when it is not the field's name.
        env: environment variable whose value, when set, is the flag's default (read when the
            parser is built, never at import).
        parse: ``str`` -> value, for types argparse cannot read by themselves (sizes, CPU lists);
            raises ValueError.
        show: value -> ``str``, the inverse of ``parse`` (for ``--help`` and argv).
        metavar: the value's name in ``--help``.
        choices: the values a ``str`` field may take (an enum field's choices are its values).
        secret: when set, the field is a secret read as ``Secret`` says.
        default_help: what ``--help`` shows as the default when it is not the field's value (a
            default derived at start, such as "the host name").
    """

    help: str
    flag: str = ""
    env: str = ""
    parse: Callable[[str], Any] | None = None
    show: Callable[[Any], str] | None = None
    metavar: str | None = None
    choices: tuple[str, ...] = ()
    secret: Secret | None = None
    default_help: str = ""


@dataclass(frozen=True)
class Group:
    """How a nested config's flags are added: under ``title`` in ``--help``, without the flags of
    the fields in ``exclude`` (those keep the nested default's values)."""

    title: str
    exclude: frozenset[str] = frozenset()


def nested(title: str, default: Any, *, exclude: tuple[str, ...] = ()) -> Any:
    """A field holding a nested config (frozen, so ``default`` may be shared), whose flags join the
    outer config's; the default's values are the flags' defaults."""
    return dataclasses.field(default=default, metadata={GROUP_KEY: Group(title, frozenset(exclude))})


def option(help: str, default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING,
           repr: bool = True, **how: Any) -> Any:
    """A dataclass field that is also a flag (see :class:`Option` for ``how``); without a default
    the field is required. With ``default_factory``, the flag's default is "" and the factory
    makes the value when the flag is not given (or given empty)."""
    return dataclasses.field(default=default, default_factory=default_factory, repr=repr,
                             metadata={OPTION_KEY: Option(help, **how)})


def option_of(field: dataclasses.Field) -> Option | None:
    """The field's :class:`Option`, or None for a field that is no flag."""
    return field.metadata.get(OPTION_KEY)


def group_of(field: dataclasses.Field) -> Group | None:
    """The field's :class:`Group` when it holds a nested config, else None."""
    return field.metadata.get(GROUP_KEY)
