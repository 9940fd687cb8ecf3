"""The generic dataclass <-> protobuf mapper: every pair the services map has the same fields on
both sides, and each kind of field survives the trip."""

from __future__ import annotations

import dataclasses

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from pagedserve.engine.messages import (AcceptedDraft, CachedRequestData, SampledToken, SequenceId,
                                        TokenLogprobs)
from pagedserve.engine.sampling_params import EngineSamplingParams, SamplingParams
from pagedserve.engine.structured_output import StructuredOutput, StructureKind
from pagedserve.services.common.pb import engine_pb2, generate_pb2
from pagedserve.services.common.pb_fields import from_pb, same_fields, to_pb

MAPPED = [(EngineSamplingParams, engine_pb2.EngineSamplingParams), (SamplingParams, generate_pb2.SamplingParams),
          (CachedRequestData, engine_pb2.CachedRequest), (SampledToken, engine_pb2.SampledToken),
          (AcceptedDraft, engine_pb2.AcceptedDraft), (SequenceId, engine_pb2.SequenceId),
          (TokenLogprobs, engine_pb2.TokenLogprobs)]
"""Every dataclass the services send as a message of the same fields."""


@pytest.mark.parametrize("cls, message", MAPPED, ids=lambda x: x.__name__ if isinstance(x, type) else "")
def test_each_field_exists_on_both_sides(cls, message):
    assert same_fields(cls, message.DESCRIPTOR) == (set(), set())


def _synthetic() -> type:
    """A message ``Holder { repeated Ids words; optional int32 k; map<int64, float> bias; int32 plain }``
    with ``Ids { repeated int64 ids }``, built at run time."""
    f = descriptor_pb2.FileDescriptorProto(name="pb_fields_test.proto", package="t", syntax="proto3")
    f.message_type.add(name="Ids").field.add(name="ids", number=1, type=3, label=3)
    holder = f.message_type.add(name="Holder")
    holder.field.add(name="words", number=1, type=11, label=3, type_name=".t.Ids")
    holder.field.add(name="k", number=2, type=5, label=1, proto3_optional=True, oneof_index=0)
    holder.oneof_decl.add(name="_k")
    entry = holder.nested_type.add(name="BiasEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=3, label=1)
    entry.field.add(name="value", number=2, type=2, label=1)
    holder.field.add(name="bias", number=3, type=11, label=3, type_name=".t.Holder.BiasEntry")
    holder.field.add(name="plain", number=4, type=5, label=1)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("t.Holder"))


@dataclasses.dataclass(frozen=True)
class Holder:
    words: tuple[tuple[int, ...], ...] = ()
    k: int | None = None
    bias: tuple[tuple[int, float], ...] = ()
    plain: int = 7


def test_each_kind_of_field_survives_the_trip():
    message = _synthetic()
    full = Holder(words=((1, 2), (3,)), k=0, bias=((2, 0.5), (9, -1.0)), plain=3)
    assert from_pb(to_pb(full, message), Holder) == full
    assert from_pb(message(), Holder) == Holder(plain=0)  # unset optional and lists: the defaults
    assert from_pb(to_pb(Holder(), message), Holder) == Holder()


def test_a_field_on_one_side_only_is_refused():
    message = _synthetic()
    extra = dataclasses.make_dataclass("Extra", [("plain", int, 0), ("missing", int, 0)], frozen=True)
    with pytest.raises(TypeError, match=r"only in the dataclass \['missing'\]"):
        to_pb(extra(), message)
    fewer = dataclasses.make_dataclass("Fewer", [("plain", int, 0)], frozen=True)
    with pytest.raises(TypeError, match=r"only in the message \['bias', 'k', 'words'\]"):
        from_pb(message(), fewer)


def test_client_sampling_params_survive_the_trip_with_every_field_set():
    params = SamplingParams(
        max_tokens=9, temperature=0.5, top_p=0.75, top_k=7, min_p=0.125, seed=42, min_tokens=2, stop=("x", "y"),
        stop_token_ids=(5, 6), ignore_eos=True, include_stop_str_in_output=True, skip_special_tokens=False, n=3,
        logprobs=2, prompt_logprobs=1, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.25,
        logit_bias={3: 2.5}, best_of=4, spaces_between_special_tokens=False, allowed_token_ids=(1, 2), bad_words=("w",))
    defaults = SamplingParams()
    # a structured output cannot go with allowed_token_ids or bad_words: the test below carries it
    assert [f.name for f in dataclasses.fields(params)
            if getattr(params, f.name) == getattr(defaults, f.name)] == ["structured_output"]
    assert from_pb(to_pb(params, generate_pb2.SamplingParams), SamplingParams) == params
    assert from_pb(generate_pb2.SamplingParams(), SamplingParams) == defaults


@pytest.mark.parametrize("structure", [
    StructuredOutput(StructureKind.JSON, '{"type": "object"}'), StructuredOutput(StructureKind.JSON_OBJECT),
    StructuredOutput(StructureKind.REGEX, "[0-9]+"), StructuredOutput(StructureKind.CHOICE, choices=("yes", "no")),
    StructuredOutput(StructureKind.GRAMMAR, 'root ::= "a" | "b"')], ids=lambda s: s.kind.name)
def test_each_structured_output_kind_survives_both_messages(structure):
    client = SamplingParams(structured_output=structure)
    message = to_pb(client, generate_pb2.SamplingParams)
    assert message.structured_output.WhichOneof("kind") == structure.kind.name.lower()
    assert from_pb(message, SamplingParams) == client
    engine = EngineSamplingParams(max_tokens=4, structured_output=structure)
    assert from_pb(to_pb(engine, engine_pb2.EngineSamplingParams), EngineSamplingParams) == engine
    assert from_pb(engine_pb2.EngineSamplingParams(), EngineSamplingParams).structured_output is None


def test_nested_messages_survive_set_unset_and_repeated():
    """A message field (seq_id, always set even when each of its fields is a default), an unset one
    (logprobs: None), and a repeated message of dataclasses (accepted drafts)."""
    bare = SampledToken(SequenceId(""), 0, 0.0)
    message = to_pb(bare, engine_pb2.SampledToken)
    assert message.HasField("seq_id") and not message.HasField("logprobs") and not message.accepted
    assert from_pb(message, SampledToken) == bare
    entry = TokenLogprobs(3, -1.5, 2)
    drafts = (AcceptedDraft(1, -0.25, entry), AcceptedDraft(2, 0.0))
    full = SampledToken(SequenceId("r", 2), 4, -0.5, 2, entry, "bad", drafts, 5)
    assert from_pb(to_pb(full, engine_pb2.SampledToken), SampledToken) == full
