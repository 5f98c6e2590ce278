"""The wire: a register carries the deciding cause's reason codes to the ranks that follow it."""

import json

from flashinfer_safe_workspace import _reasons as R
from flashinfer_safe_workspace import _veto as explain
from flashinfer_safe_workspace.agreement import vote
from flashinfer_safe_workspace.agreement.record import ABORT, COMMIT, WIRE, Register


def test_register_round_trip_keeps_reasons_and_check():
    reg = Register(ABORT, 1, "rank 1 said no", check="multicast",
                   reasons=(R.NO_MULTICAST,))
    back = Register.from_json(reg.to_json())
    assert back == reg and back.reasons == (R.NO_MULTICAST,)


def test_register_with_unreadable_reasons_reads_as_abort():
    body = json.loads(Register(COMMIT, 0, "ok").to_json())
    body["reasons"] = ["not a code"]
    reg = Register.from_json(json.dumps(body))
    assert reg.outcome == ABORT and "unreadable" in reg.why
    body["wire"] = WIRE - 1  # a peer of another wire version: never a commit
    assert Register.from_json(json.dumps(body)).outcome == ABORT


def test_a_follower_names_the_deciding_cause():
    """A rank that arrived after the register was decided reports the register's codes,
    and ABORTED only where the register names none (a timeout, an interrupt)."""
    told = vote.Outcome(False, register=Register(ABORT, 0, "rank 0 said no: out of memory",
                                                 reasons=(R.OUT_OF_MEMORY,)), followed=True)
    assert explain.veto(told, None, None, None).reasons == (R.OUT_OF_MEMORY,)
    silent = vote.Outcome(False, register=Register(ABORT, 0, "rank 0 timed out"), followed=True)
    assert explain.veto(silent, None, None, None).reasons == (R.ABORTED,)
