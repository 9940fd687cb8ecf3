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
* any other message <-> a dataclass with the same field names, mapped by these same rules
  (``SequenceId``, ``TokenLogprobs``); unset <-> ``None`` or the field's default; a ``repeated`` one
  whose dataclass items are dataclasses <-> a tuple of them (``SampledToken.accepted``);

and ``enum_to_pb``/``enum_from_pb`` map a Python enum to a protobuf enum whose value names are the
enum's names behind the enum type's prefix (``FinishReason.STOP`` <-> ``FINISH_REASON_STOP``).

How each field of a (dataclass, message) pair travels is worked out once per pair (``_fields``):
plans and step results go through here on every step.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from google.protobuf import descriptor_pb2, message_factory
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor
from google.protobuf.message import Message

T = TypeVar("T")
E = TypeVar("E", bound=enum.Enum)


def same_fields(cls: type, descriptor: Descriptor) -> tuple[set[str], set[str]]:
    """Names only on the dataclass ``cls`` and names only on the message ``descriptor``."""
    ours = {f.name for f in dataclasses.fields(cls)}
    theirs = set(descriptor.fields_by_name)
    return ours - theirs, theirs - ours


@dataclass(frozen=True)
class _Field:
    """How one field of a (dataclass, message) pair travels, worked out once per pair.

    Attributes:
        name: the field's name on both sides.
        has_presence: the message knows whether it is set (``optional`` scalars, messages): unset
            reads as the dataclass default.
        write: dataclass value -> what the message's constructor takes; ``None``: the value itself.
        read: message value -> dataclass value; ``None``: the value itself (a scalar).
        empty_is_default: an empty ``repeated`` or ``map`` field reads as the dataclass default
            (the dataclass field has one: ``None`` or an empty tuple).
    """

    name: str
    has_presence: bool
    write: Callable[[Any], Any] | None
    read: Callable[[Any], Any] | None
    empty_is_default: bool = False


@functools.cache
def _fields(cls: type, descriptor: Descriptor) -> tuple[_Field, ...]:
    """How each field of ``cls`` travels as a field of ``descriptor``.

    Raises:
        TypeError: a field exists on one side only.
    """
    only_ours, only_theirs = same_fields(cls, descriptor)
    if only_ours or only_theirs:
        raise TypeError(f"{cls.__name__} and {descriptor.full_name} differ: only in the dataclass "
                        f"{sorted(only_ours)}, only in the message {sorted(only_theirs)}")
    hints = _type_hints(cls)
    return tuple(_field(f, descriptor.fields_by_name[f.name], hints[f.name]) for f in dataclasses.fields(cls))


def _field(f: dataclasses.Field, pf: FieldDescriptor, hint: Any) -> _Field:
    """The mapping of dataclass field ``f`` (annotated ``hint``) onto message field ``pf`` (the rules
    of the module docstring)."""
    message = pf.message_type
    has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    if message is not None and message.GetOptions().map_entry:
        pairs = isinstance(_default(f), tuple)
        return _Field(f.name, False, dict, (lambda v: tuple(sorted(v.items()))) if pairs else dict, has_default)
    if message is None:
        return _Field(f.name, pf.has_presence, None, tuple if pf.is_repeated else None, pf.is_repeated and has_default)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    (item, *_) = typing.get_args(hint) or (None,)
    if pf.is_repeated and not dataclasses.is_dataclass(item):  # a wrapper: tuples of its one field
        (inner,) = message.fields
        return _Field(f.name, False, lambda v: [{inner.name: i} for i in v],
                      lambda v: tuple(tuple(getattr(i, inner.name)) for i in v), has_default)
    message_type = message_factory.GetMessageClass(message)
    if pf.is_repeated:
        return _Field(f.name, False, lambda v: [to_pb(i, message_type) for i in v],
                      lambda v: tuple(from_pb(i, item) for i in v), has_default)
    if _is_union(message):
        return _Field(f.name, True, lambda v: union_to_pb(v, message_type), lambda v: union_from_pb(v, hint))
    return _Field(f.name, True, lambda v: to_pb(v, message_type), lambda v: from_pb(v, hint))


def _is_union(descriptor: Descriptor) -> bool:
    """Whether the message is one ``oneof`` (a tagged union): every field in the same real oneof
    (not the hidden oneof of a proto3 ``optional`` field)."""
    proto = descriptor_pb2.DescriptorProto()
    descriptor.CopyToProto(proto)
    real = [f.oneof_index if f.HasField("oneof_index") and not f.proto3_optional else None for f in proto.field]
    return len(set(real)) == 1 and real[0] is not None


def to_pb(obj: Any, message_type: type[Message]) -> Message:
    """The dataclass instance ``obj`` as a ``message_type`` message (``None`` fields left unset).

    Raises:
        TypeError: the two have different field names.
        ValueError: a value outside the field's protobuf type (int32, uint64...).
    """
    values = {}
    for f in _fields(type(obj), message_type.DESCRIPTOR):
        value = getattr(obj, f.name)
        if value is not None:
            values[f.name] = value if f.write is None else f.write(value)
    return message_type(**values)


def from_pb(msg: Message, cls: type[T]) -> T:
    """The message ``msg`` as an instance of the dataclass ``cls`` (unset fields: its defaults).

    Raises:
        TypeError: the two have different field names.
        Whatever ``cls`` raises for the values (``SamplingParams`` validates them).
    """
    values = {}
    for f in _fields(cls, msg.DESCRIPTOR):
        if f.has_presence and not msg.HasField(f.name):
            continue
        value = getattr(msg, f.name)
        if f.read is not None:
            if f.empty_is_default and not value:
                continue
            value = f.read(value)
        values[f.name] = value
    return cls(**values)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


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


def _wrapped(pf: FieldDescriptor) -> str:
    """The one field of a wrapper message (``TokenIds.ids``)."""
    (inner,) = pf.message_type.fields
    return inner.name


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
