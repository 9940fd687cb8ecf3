"""Frozen dataclass <-> protobuf message, field by field by name: the one generic mapper.

A dataclass and the message it travels as have the same field names (``same_fields`` says which
differ; ``to_pb`` and ``from_pb`` refuse such a pair, and tests/common/test_pb_fields.py checks every pair
the services map). Per field:

* ``None`` <-> an unset ``optional`` field (or an empty ``repeated`` one): reading an unset field
  gives the dataclass default, so ``optional`` proto fields carry "not given";
* a ``repeated`` scalar <-> a tuple; a ``map`` <-> a dict, or sorted ``(key, value)`` pairs when the
  dataclass default is a tuple;
* a ``repeated`` message of one ``repeated`` field (a wrapper such as ``TokenIds``) <-> a tuple of
  tuples;
* a message made of one ``oneof`` (a tagged union such as ``StructuredOutput``) <-> a dataclass with
  an enum field ``kind`` whose member names are the oneof's member names upper-cased, a ``value``
  property (the set member's value: a scalar, or a tuple for a wrapper message) and a classmethod
  ``of(kind, value)`` that builds it back; unset <-> ``None``;

and ``enum_to_pb``/``enum_from_pb`` map a Python enum to a protobuf enum whose value names are the
enum's names behind the enum type's prefix (``FinishReason.STOP`` <-> ``FINISH_REASON_STOP``).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import re
import types
import typing
from typing import Any, TypeVar

from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor
from google.protobuf.message import Message

T = TypeVar("T")
E = TypeVar("E", bound=enum.Enum)


def same_fields(cls: type, descriptor: Descriptor) -> tuple[set[str], set[str]]:
    """Names only on the dataclass ``cls`` and names only on the message ``descriptor``."""
    ours = {f.name for f in dataclasses.fields(cls)}
    theirs = set(descriptor.fields_by_name)
    return ours - theirs, theirs - ours


@functools.cache
def _checked(cls: type, descriptor: Descriptor) -> tuple[dataclasses.Field, ...]:
    """``cls``'s fields, once it is known that the message has exactly the same names.

    Raises:
        TypeError: a field exists on one side only.
    """
    only_ours, only_theirs = same_fields(cls, descriptor)
    if only_ours or only_theirs:
        raise TypeError(f"{cls.__name__} and {descriptor.full_name} differ: only in the dataclass "
                        f"{sorted(only_ours)}, only in the message {sorted(only_theirs)}")
    return dataclasses.fields(cls)


def _is_map(pf: FieldDescriptor) -> bool:
    return pf.message_type is not None and pf.message_type.GetOptions().map_entry


def _is_repeated(pf: FieldDescriptor) -> bool:
    return pf.is_repeated


def _wrapped(pf: FieldDescriptor) -> str:
    """The one field of a wrapper message (``TokenIds.ids``)."""
    (inner,) = pf.message_type.fields
    return inner.name


def to_pb(obj: Any, message_type: type[Message]) -> Message:
    """The dataclass instance ``obj`` as a ``message_type`` message (``None`` fields left unset).

    Raises:
        TypeError: the two have different field names.
        ValueError: a value outside the field's protobuf type (int32, uint64...).
    """
    descriptor = message_type.DESCRIPTOR
    msg = message_type()
    for f in _checked(type(obj), descriptor):
        value, pf = getattr(obj, f.name), descriptor.fields_by_name[f.name]
        if value is None:
            continue
        if _is_map(pf):
            getattr(msg, f.name).update(dict(value))
        elif _is_repeated(pf) and pf.message_type is not None:
            inner, items = _wrapped(pf), getattr(msg, f.name)
            for item in value:
                items.add(**{inner: item})
        elif _is_repeated(pf):
            getattr(msg, f.name).extend(value)
        elif pf.message_type is not None:
            _union_to_pb(value, getattr(msg, f.name))
        else:
            setattr(msg, f.name, value)
    return msg


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def _read(msg: Message, f: dataclasses.Field, pf: FieldDescriptor, owner: type) -> Any:
    """The dataclass value of one message field of ``owner`` (``dataclasses.MISSING``: take the default)."""
    value, default = getattr(msg, f.name), _default(f)
    if _is_map(pf):
        if not value:
            return dataclasses.MISSING
        return tuple(sorted(value.items())) if isinstance(default, tuple) else dict(value)
    if _is_repeated(pf):
        if not value:
            return dataclasses.MISSING
        if pf.message_type is not None:
            inner = _wrapped(pf)
            return tuple(tuple(getattr(item, inner)) for item in value)
        return tuple(value)
    if pf.has_presence and not msg.HasField(f.name):
        return dataclasses.MISSING
    if pf.message_type is not None:
        return union_from_pb(value, _field_class(owner, f))
    return value


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """``typing.get_type_hints(cls)``, evaluated once per class (it parses the annotations)."""
    return typing.get_type_hints(cls)


def union_to_pb(value: Any, message_type: type[Message]) -> Message:
    """A tagged-union dataclass (e.g. ``StructuredOutput``) as a message of one ``oneof``."""
    msg = message_type()
    _union_to_pb(value, msg)
    return msg


def _union_to_pb(value: Any, msg: Message) -> None:
    """Sets the member of ``msg``'s one oneof that ``value.kind`` names to ``value.value``."""
    member = msg.DESCRIPTOR.fields_by_name[value.kind.name.lower()]
    if member.message_type is not None:  # a wrapper of one repeated field
        getattr(getattr(msg, member.name), _wrapped(member)).extend(value.value)
    else:
        setattr(msg, member.name, value.value)


def union_from_pb(msg: Message, cls: type) -> Any:
    """The tagged-union dataclass ``cls`` of a message of one oneof (``None`` when no member is set)."""
    (oneof,) = msg.DESCRIPTOR.oneofs
    name = msg.WhichOneof(oneof.name)
    if name is None:
        return None
    member = msg.DESCRIPTOR.fields_by_name[name]
    value = getattr(msg, name)
    if member.message_type is not None:
        value = tuple(getattr(value, _wrapped(member)))
    kind_type = _type_hints(cls)["kind"]
    return cls.of(kind_type[name.upper()], value)


def _field_class(owner: type, f: dataclasses.Field) -> type:
    """The dataclass type of the field ``f`` of ``owner`` (``X | None`` -> ``X``)."""
    hint = _type_hints(owner)[f.name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    return hint


def from_pb(msg: Message, cls: type[T]) -> T:
    """The message ``msg`` as an instance of the dataclass ``cls`` (unset fields: its defaults).

    Raises:
        TypeError: the two have different field names.
        Whatever ``cls`` raises for the values (``SamplingParams`` validates them).
    """
    descriptor = msg.DESCRIPTOR
    values = {f.name: _read(msg, f, descriptor.fields_by_name[f.name], cls) for f in _checked(cls, descriptor)}
    return cls(**{name: value for name, value in values.items() if value is not dataclasses.MISSING})


def _enum_prefix(pb_enum: EnumDescriptor) -> str:
    """``FINISH_REASON_`` for ``FinishReason``."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", pb_enum.name).upper() + "_"


def enum_to_pb(value: enum.Enum, pb_enum: EnumDescriptor) -> int:
    """The number of the protobuf enum value named ``<PREFIX>_<value.name>``.

    Raises:
        KeyError: the protobuf enum has no such value.
    """
    return pb_enum.values_by_name[_enum_prefix(pb_enum) + value.name].number


def enum_from_pb(number: int, pb_enum: EnumDescriptor, py_enum: type[E]) -> E | None:
    """The ``py_enum`` member named as protobuf value ``number`` is behind its prefix; ``None`` for
    0 (``*_UNSPECIFIED``) or a number this side does not know (sent by a newer peer)."""
    value = pb_enum.values_by_number.get(number)
    if number == 0 or value is None:
        return None
    return py_enum.__members__.get(value.name.removeprefix(_enum_prefix(pb_enum)))
