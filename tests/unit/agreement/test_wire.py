"""``agreement/record.py``: the typed, versioned records that cross the wire. Round trips
keep every field; another wire version, a value that is not JSON or not an object, and a
record with unknown or missing fields read as unreadable (a "no" for a record, an abort
for a register), never as an exception in the round."""

from __future__ import annotations

import json

import pytest

from flashinfer_safe_workspace import _reasons as R
from flashinfer_safe_workspace.agreement import record as W
from flashinfer_safe_workspace.agreement.record import (ABORT, COMMIT, NO, PASS, PASS_STATE,
                                                        WIRE, YES, Candidate, CheckResult,
                                                        Record, Register, Unreadable, read_record)
from unit.facts import record, with_check

FULL = Record(rank=3, pid=77, position=1, call="c1", args={"n": 1, "dtype": "bfloat16"},
              candidates={"nomc": Candidate(YES, R.OK, "", "dg", 10, 20, "trtllm", 0, 30, 0,
                                            False, 0, "", 1.5),
                          "mc": Candidate(NO, R.OUT_OF_MEMORY, "short", "dm", 11, 21, "mnnvl",
                                          1, 31, 41, True, 2, "CUDA_ERROR_OUT_OF_MEMORY", 2.5)},
              auto=True, multicast=True,
              checks={"hosts": CheckResult(True, R.OK, "host=a", "", True),
                      "fabric": CheckResult(False, R.FABRIC_NOT_READY, "state=1", "n", True),
                      "device": CheckResult(True, R.OK, "", "", False)})


def test_constants_of_the_wire():
    assert (YES, NO, PASS_STATE) == ("ok", "no", "pass")
    assert (COMMIT, ABORT, PASS) == ("commit", "abort", "pass")
    assert WIRE == 8


def test_record_round_trip_keeps_every_field():
    text = FULL.to_json()
    assert json.loads(text)["wire"] == WIRE
    assert Record.from_json(text) == FULL
    assert Record.from_json(text.encode()) == FULL
    assert Record.from_json(bytearray(text.encode())) == FULL
    assert read_record(text) == FULL


@pytest.mark.parametrize("raw,match", [
    ("not json", "record: not JSON"),
    (None, "record: not JSON"),
    ("[1, 2]", "record: not an object"),
    (json.dumps({"wire": WIRE - 1}), f"record: wire version {WIRE - 1}, expected {WIRE}"),
    (json.dumps({"rank": 0}), f"record: wire version None, expected {WIRE}"),
])
def test_unreadable_records(raw, match):
    with pytest.raises(Unreadable, match=f"^{match}"):
        Record.from_json(raw)
    assert read_record(raw) is None


def body(**change):
    out = json.loads(FULL.to_json())
    out.update(change)
    return json.dumps(out)


@pytest.mark.parametrize("raw", [
    body(surprise=1),  # an unknown field
    body(candidates={"-": {"state": "ok", "bogus": 1}}),
    body(checks={"x": {"ok": True, "bogus": 1}}),
    body(candidates=[1]),  # not a mapping
    json.dumps({"wire": WIRE, "rank": 0}),  # no candidates
    body(checks=[1]),
])
def test_records_with_bad_fields_are_unreadable(raw):
    with pytest.raises(Unreadable, match="^record: "):
        Record.from_json(raw)
    assert read_record(raw) is None


def test_a_record_without_checks_reads_with_none():
    raw = json.loads(FULL.to_json())
    del raw["checks"]
    assert Record.from_json(json.dumps(raw)).checks == {}


def test_is_yes_all_for_one_candidate_any_for_auto():
    assert record(0).is_yes() and record(0, state=PASS_STATE).is_yes()
    assert not record(0, state=NO).is_yes()
    assert not record(0, cands={}).is_yes() and not record(0, cands={}, auto=True).is_yes()
    two = {"a": Candidate(YES), "b": Candidate(NO)}
    assert record(0, cands=two, auto=True).is_yes()
    assert not record(0, cands=two, auto=False).is_yes()
    assert not record(0, cands={"a": Candidate(NO), "b": Candidate(NO)}, auto=True).is_yes()


def test_candidate_and_check_result_texts():
    assert Candidate(YES).usable and Candidate(PASS_STATE).usable and not Candidate(NO).usable
    assert Candidate(NO, R.OUT_OF_MEMORY).text() == "out of memory"
    assert Candidate(NO, R.OUT_OF_MEMORY, "out of memory").text() == "out of memory"
    assert Candidate(NO, R.OUT_OF_MEMORY, "trtllm.buffer").text() == "out of memory: trtllm.buffer"
    assert Candidate(NO, 999, "x").text() == "no: x"
    assert CheckResult(False, R.NO_IMEX, "handle=fabric", "why").text() == (
        "FABRIC handles chosen without an IMEX channel (handle=fabric): why")
    assert CheckResult(True, R.OK, "v").text() == "ok (v)"
    assert CheckResult(False, 999, "v").text() == "no (v)"
    assert CheckResult() == CheckResult(True, R.OK, "", "", True)


def test_failed_check_and_no_text():
    rec = record(0, checks_={**with_check("a", "1"), **with_check("b", "2", ok=False),
                             **with_check("c", "3", ok=False)})
    assert rec.failed_check() == "b"
    assert record(0).failed_check() == ""
    two = record(0, cands={"x": Candidate(NO, R.OUT_OF_MEMORY, "buf"), "y": Candidate(NO, R.CAPTURING)})
    assert two.no_text() == "out of memory: buf; called during CUDA graph capture"
    assert record(0, cands={}).no_text() == "no"
    long = record(0, cands={"x": Candidate(NO, R.OUT_OF_MEMORY, "z" * 500)})
    assert len(long.no_text()) == 400


def test_register_round_trip():
    reg = Register(ABORT, 2, "why", check="hosts", reasons=(R.HOSTS_SPAN, R.ARG_MISMATCH),
                   details=("rank 1: hosts differ",), named=(1, 2), short=((1, 0, 5),),
                   call="c1", complete=True)
    text = reg.to_json()
    assert json.loads(text)["wire"] == WIRE
    assert Register.from_json(text) == reg
    assert Register.from_json(text.encode()) == reg
    assert Register.from_text(reg.to_text()) == reg
    assert reg.to_text().startswith("abort|{")  # the outcome first: the core reads it alone
    assert Register.from_json(Register(COMMIT).to_json()) == Register(COMMIT)
    assert Register(COMMIT).commit and not Register(ABORT).commit and not Register(PASS).commit
    assert Register(PASS) == Register(PASS, None, "", "", (), (), (), (), "", False, WIRE)


def test_register_why_and_details_are_cut():
    assert len(json.loads(Register(ABORT, 0, "w" * 900).to_json())["why"]) == 500
    assert Register.from_json(Register(ABORT, 0, "w" * 900).to_json()).why == "w" * 500
    long = Register(ABORT, 0, details=tuple("d" * 700 for _ in range(20)))
    back = Register.from_json(long.to_json())
    assert len(back.details) == 16 and {len(d) for d in back.details} == {600}


@pytest.mark.parametrize("raw,why", [
    ("nope", "unreadable register (register: not JSON)"),
    ("[]", "unreadable register (register: not an object)"),
    (json.dumps({"wire": WIRE - 1, "outcome": "commit"}),
     f"unreadable register (register: wire version {WIRE - 1}, expected {WIRE})"),
    (json.dumps({"wire": WIRE, "outcome": "commit", "bogus": 1}), "unreadable register ("),
    (json.dumps({"wire": WIRE, "outcome": "commit", "reasons": ["x"]}), "unreadable register ("),
    (json.dumps({"wire": WIRE, "outcome": "commit", "short": [["a"]]}), "unreadable register ("),
    (json.dumps({"wire": WIRE, "outcome": "maybe"}), "unreadable register outcome 'maybe'"),
    (json.dumps({"wire": WIRE}), "unreadable register ("),
])
def test_an_unreadable_register_is_an_abort(raw, why):
    reg = Register.from_json(raw)
    assert reg.outcome == ABORT and not reg.commit
    assert reg.why.startswith(why), reg.why
    assert (reg.by, reg.check, reg.reasons, reg.complete) == (None, "", (), False)


@pytest.mark.parametrize("raw", [
    "commit", "commit|", "commit|nope", "abort" + Register(COMMIT).to_text()[6:],
    "commit|" + Register(ABORT).to_json(), b"\xffcommit|{}",
])
def test_a_register_text_that_does_not_read_is_an_abort(raw):
    """Whatever its head says: an outcome is read from the whole value or not at all."""
    assert Register.from_text(raw).outcome == ABORT


def test_the_record_text_is_stable_and_carries_any_argument():
    from pathlib import PurePosixPath

    text = FULL.to_json()
    assert text == json.dumps(json.loads(text), sort_keys=True)  # the same text on every rank
    odd = record(0, args={"group": PurePosixPath("g/1")})
    assert Record.from_json(odd.to_json()).args == {"group": "g/1"}  # repr'd, never an error
    reg = Register(ABORT, 1, "w", details=("x",))
    assert reg.to_json() == json.dumps(json.loads(reg.to_json()), sort_keys=True)


def test_undecodable_bytes_are_unreadable():
    with pytest.raises(Unreadable, match="^record: not JSON"):
        Record.from_json(b"\xff\xfe")
    assert read_record(bytearray(b"\xff")) is None
    assert Register.from_json(b"\xff").outcome == ABORT


def test_a_register_without_optional_fields_reads():
    reg = Register.from_json(json.dumps({"wire": WIRE, "outcome": "abort", "by": 1}))
    assert reg == Register(ABORT, 1)
