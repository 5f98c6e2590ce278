"""The decision record and the veto WARNING carry the decision line's fields as ``extra=``
(``fiws_*``), read here through a JSON formatter: the ``logging.Formatter`` subclass that
docs/logs.md shows, read from that page and attached to the package's logger during real
decisions in this process (the SimulatedDevice stands in for the GPU)."""

from __future__ import annotations

import json
import logging
import textwrap
from pathlib import Path

import pytest
import torch

import flashinfer.comm as comm
import flashinfer.comm.allreduce as ar
import flashinfer_safe_workspace as fiws
from flashinfer_safe_workspace._log import DECISION_FIELDS, parse_decision_lines
from flashinfer_safe_workspace.planning import probe as _probe
from flashinfer_safe_workspace.planning.simulated import SimulatedDevice

LOGS_DOC = Path(__file__).resolve().parents[2] / "docs" / "logs.md"
MiB = 1 << 20
PAGE = "docs/when-it-vetoes.md"
ARGS = dict(backend="trtllm", world_size=1, rank=0, max_token_num=1024, hidden_dim=4096,
            dtype=torch.bfloat16)


def _doc_formatter() -> type:
    """The JSON formatter class of docs/logs.md: the indented block that defines it."""
    lines = LOGS_DOC.read_text().splitlines()
    at = next(i for i, l in enumerate(lines) if "(logging.Formatter):" in l and "class " in l)

    def in_block(line):
        return line.startswith("    ") or not line.strip()
    first, last = at, at
    while first > 0 and in_block(lines[first - 1]):
        first -= 1
    while last + 1 < len(lines) and in_block(lines[last + 1]):
        last += 1
    scope: dict = {}
    exec(textwrap.dedent("\n".join(lines[first:last + 1])), scope)  # noqa: S102 - our own page
    (cls,) = [v for v in scope.values() if isinstance(v, type) and issubclass(v, logging.Formatter)
              and v is not logging.Formatter]
    return cls


class _JsonRecords(logging.Handler):
    """Every record of our logger, formatted by the page's formatter and read back as JSON."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.setFormatter(_doc_formatter()())
        self.out = []

    def emit(self, record):
        self.out.append(json.loads(self.format(record)))


@pytest.fixture
def records():
    log = logging.getLogger("flashinfer_safe_workspace")
    handler, level = _JsonRecords(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    yield handler.out
    log.removeHandler(handler)
    log.setLevel(level)


def _fields(rec: dict) -> dict:
    """The decision-line fields of a JSON record, without the prefix, in their order."""
    return {k[len("fiws_"):]: rec[k] for k in ("fiws_" + f for f in DECISION_FIELDS) if k in rec}


def test_a_veto_s_records_carry_the_decision_line_s_fields(records):
    free = 256 * MiB
    _probe.set_prober(SimulatedDevice(free))
    fiws.install(on_veto="none")
    assert comm.create_allreduce_fusion_workspace(**ARGS) is None
    decision, warning = records  # the decision record, then the veto WARNING; nothing else
    assert (decision["level"], warning["level"]) == ("INFO", "WARNING")
    assert decision["fiws_event"] == "decision" and warning["fiws_event"] == "veto"
    # every field of the line, with the line's own values, typed as the parser types them
    (line,) = parse_decision_lines(decision["message"])
    assert list(_fields(decision)) == list(DECISION_FIELDS)
    assert _fields(decision) == line
    assert _fields(warning) == line  # the WARNING carries the same fields
    assert decision["fiws_outcome"] == "veto" and decision["fiws_reasons"] == ["OUT_OF_MEMORY"]
    assert decision["fiws_free_bytes"] == free and decision["fiws_probe"] == "no"
    assert decision["fiws_check"] == "memory" and decision["fiws_answer"] == "none"
    assert decision["fiws_rank"] is None and decision["fiws_ranks"] == [0]  # no process group
    assert isinstance(decision["fiws_plan_bytes"], int) and decision["fiws_plan_bytes"] > 0
    assert isinstance(decision["fiws_elapsed_ms"], float)
    # the WARNING's own fields: its first sentence, the veto's message, the page
    short = line["plan_bytes"] + line["headroom_bytes"] - free
    assert short > 10 * MiB
    summary = warning["fiws_summary"]
    assert summary == (f"this rank was {short / MiB:.0f} MiB short on cuda:0, so no rank created "
                       "FlashInfer's all-reduce workspace; every rank takes the non-fused "
                       "all-reduce path.")
    assert warning["message"].startswith("flashinfer_safe_workspace: " + summary + " Fields: ")
    assert warning["fiws_message"] in warning["message"]
    assert warning["message"].endswith("What to do: " + PAGE) and warning["fiws_help"] == PAGE
    assert warning["fiws_answer_why"] == "ON_VETO=none"
    # the cached veto of the same call logs no INFO or WARNING record
    assert comm.create_allreduce_fusion_workspace(**ARGS) is None
    assert len(records) == 2


def test_a_pass_carries_its_fields_and_logs_no_warning(records, monkeypatch):
    monkeypatch.setattr(ar, "TRTLLMAllReduceFusionWorkspace", lambda **kw: "made")
    _probe.set_prober(SimulatedDevice(80 << 30))
    fiws.install()
    assert comm.create_allreduce_fusion_workspace(**ARGS) == "made"
    (decision,) = records
    assert decision["fiws_event"] == "decision"
    assert _fields(decision) == parse_decision_lines(decision["message"])[0]
    assert decision["fiws_outcome"] == "pass" and decision["fiws_answer"] == "create"
    assert decision["fiws_reasons"] == [] and decision["fiws_check"] == "-"
    assert decision["fiws_free_bytes"] == 80 << 30 and decision["fiws_probe"] == "ok"


@pytest.mark.parametrize("on_veto,legacy,ends", [
    ("raise", False, "the call raises WorkspaceVetoed (ON_VETO=raise)."),
    ("none", True, "the call raises WorkspaceVetoed (the legacy entry always raises)."),
    ("none", False, "every rank takes the non-fused all-reduce path."),
])
def test_the_first_sentence_says_what_the_call_does(records, on_veto, legacy, ends):
    _probe.set_prober(SimulatedDevice(1 * MiB))
    fiws.install(on_veto=on_veto)
    try:
        if legacy:
            comm.trtllm_create_ipc_workspace_for_all_reduce_fusion(
                tp_rank=0, tp_size=1, max_token_num=16, hidden_dim=64)
        else:
            comm.create_allreduce_fusion_workspace(**ARGS)
    except fiws.WorkspaceVetoed:
        assert on_veto == "raise" or legacy
    (warning,) = [r for r in records if r["level"] == "WARNING"]
    assert warning["fiws_summary"].startswith("this rank was ")
    assert warning["fiws_summary"].endswith(ends), warning["fiws_summary"]
    assert warning["message"].endswith("What to do: " + PAGE)
