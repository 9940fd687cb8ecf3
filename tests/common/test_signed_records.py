"""Records trusted from Redis: signatures bind the kind of record and the identity it speaks for;
a refused record is counted each time and logged once per kind and source (issue #20)."""

from __future__ import annotations

import logging

from pagedserve.services.common.pb import engine_pb2 as pb
from pagedserve.services.common.signed_records import (
    BlockDigestKey, RecordCheck, RecordKind, SignedHash, record_is_signed, sign_record,
)

TOKEN = "t" * 32


def test_a_registration_moved_by_someone_without_the_token_fails_the_check():
    reg = pb.WorkerRegistration(worker_id="w", address="127.0.0.1:1", num_blocks=8, block_size=16, instance_id="i")
    sign_record(reg, TOKEN)
    assert record_is_signed(reg, TOKEN) and not record_is_signed(reg, "u" * 32)
    reg.address = "127.0.0.1:2"
    assert not record_is_signed(reg, TOKEN)


def test_a_signature_of_one_kind_of_record_does_not_verify_as_another():
    reg = pb.WorkerRegistration(worker_id="x")  # field 1, a string: the same bytes as the request below
    request = pb.QueuedRequest(request_id="x")
    assert reg.SerializeToString() == request.SerializeToString()
    sign_record(reg, TOKEN)
    request.signature = reg.signature
    assert not record_is_signed(request, TOKEN)


def test_a_signed_request_re_filed_under_another_request_or_gateway_id_fails_the_check():
    request = pb.QueuedRequest(request_id="victim", gateway_id="gw-1", prompt_token_ids=[1, 2, 3])
    sign_record(request, TOKEN)
    for field, value in (("request_id", "other"), ("gateway_id", "gw-2")):
        moved = pb.QueuedRequest()
        moved.CopyFrom(request)
        setattr(moved, field, value)
        assert not record_is_signed(moved, TOKEN), field
    changed = pb.QueuedRequest()
    changed.CopyFrom(request)
    changed.prompt_token_ids[0] = 9  # the attacker's prompt under the victim's ids
    assert not record_is_signed(changed, TOKEN)


def test_refused_records_are_counted_each_time_and_logged_once_per_kind_and_source(caplog):
    refused: list[RecordKind] = []
    check = RecordCheck(TOKEN, refused.append)
    with caplog.at_level(logging.WARNING, logger="pagedserve"):
        for rid in ("a", "b", "c"):
            assert not check.passes(pb.QueuedRequest(request_id=rid, gateway_id="gw-1"), "gw-1")
        assert not check.passes(pb.QueuedRequest(request_id="d", gateway_id="gw-2"), "gw-2")
        genuine = pb.QueuedRequest(request_id="e", gateway_id="gw-1")
        sign_record(genuine, TOKEN)
        assert check.passes(genuine, "gw-1")
    assert refused == [RecordKind.QUEUED_REQUEST] * 4
    assert [r.getMessage().count("'gw-") for r in caplog.records] == [1, 1]
    assert "'gw-1'" in caplog.records[0].getMessage() and "'gw-2'" in caplog.records[1].getMessage()


def test_a_forged_hash_entry_that_stays_is_refused_once_not_at_every_read(caplog):
    refused: list[RecordKind] = []
    registrations = SignedHash(pb.SchedulerRegistration, RecordCheck(TOKEN, refused.append),
                               lambda reg: reg.scheduler_id)
    genuine = pb.SchedulerRegistration(scheduler_id="s0", address="127.0.0.1:1", instance_id="i")
    sign_record(genuine, TOKEN)
    elsewhere = pb.SchedulerRegistration()
    elsewhere.CopyFrom(genuine)  # a genuine record copied under another id's field
    raw = {b"s0": genuine.SerializeToString(), b"evil": pb.SchedulerRegistration(scheduler_id="evil").SerializeToString(),
           b"s9": elsewhere.SerializeToString(), b"junk": b"\xff\xff"}
    with caplog.at_level(logging.WARNING, logger="pagedserve"):
        for _ in range(5):  # five polls of the directory
            assert list(registrations.verified(raw)) == ["s0"]
    assert refused == [RecordKind.SCHEDULER_REGISTRATION] * 3
    assert len(caplog.records) == 3 and "another id" in caplog.records[1].getMessage()
    raw[b"evil"] = pb.SchedulerRegistration(scheduler_id="evil", address="x").SerializeToString()
    registrations.verified(raw)  # a new forged value under the same field: counted, not logged again
    assert len(refused) == 4 and len(caplog.records) == 3


def test_block_digest_keys_depend_on_the_token():
    digest = b"d" * 32
    assert BlockDigestKey(TOKEN)(digest) == BlockDigestKey(TOKEN)(digest) != BlockDigestKey("u" * 32)(digest)
    assert BlockDigestKey(TOKEN)(digest) != BlockDigestKey(TOKEN)(b"e" * 32) and len(BlockDigestKey(TOKEN)(digest)) == 32
