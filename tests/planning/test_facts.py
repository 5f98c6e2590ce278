"""Runtime facts (``_facts``): torch's signal pad, the per-size multicast rule, H200."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch.distributed._symmetric_memory as symm

from flashinfer_safe_workspace.planning import facts as _facts
from flashinfer_safe_workspace.planning.simulated import SimulatedDevice
from flashinfer_safe_workspace.planning.plan import MiB

ROOT = Path(__file__).resolve().parents[2]


def test_signal_pad_is_the_installed_torch_pad():
    pad, source = _facts.signal_pad()
    assert pad == symm.get_signal_pad_size()
    assert "get_signal_pad_size()" in source and "fallback" not in source


def test_signal_pad_follows_torch_when_changed(monkeypatch):
    monkeypatch.setattr(symm, "get_signal_pad_size", lambda: 4096)
    assert _facts.signal_pad()[0] == 4096


def test_a_torch_without_the_query_falls_back_to_2048_logged_once(monkeypatch, caplog):
    monkeypatch.delattr(symm, "get_signal_pad_size")
    monkeypatch.setattr(_facts, "_fallback_logged", False)
    with caplog.at_level(logging.WARNING, logger="flashinfer_safe_workspace"):
        first = _facts.signal_pad()
        second = _facts.signal_pad()
    assert first[0] == second[0] == 2048
    assert first[1].startswith("fallback 2048") and "no get_signal_pad_size()" in first[1]
    warnings = [r for r in caplog.records if "signal pad" in r.getMessage()]
    assert len(warnings) == 1


class CountingDevice(SimulatedDevice):
    """The simulated device, counting and recording the multicast questions."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.asked = []

    def multicast_granularity(self, device, world_size, size, handle):
        self.asked.append((device, world_size, size, handle))
        return super().multicast_granularity(device, world_size, size, handle)


def test_runtime_facts_asks_the_prober_per_object_size_once():
    dev = CountingDevice(1 << 40, mc_granularity=_facts.h200_multicast_granularity)
    facts = _facts.runtime_facts(dev, device=3, confidential_compute=True, world_size=4)
    assert facts.torch_signal_pad == symm.get_signal_pad_size()
    assert facts.confidential_compute is True and facts.current_device == 3
    assert facts.gmc(2 * MiB) == 2 * MiB
    assert facts.gmc(34 * MiB) == 512 * MiB
    assert facts.gmc(2 * MiB) == 2 * MiB
    assert dev.asked == [(3, 4, 2 * MiB, "posix"), (3, 4, 34 * MiB, "posix")]
    described = _facts.describe(facts, pad_source="x")
    assert described["multicast_granularity_by_size"] == {str(2 * MiB): 2 * MiB,
                                                          str(34 * MiB): 512 * MiB}


def test_a_prober_without_an_answer_leaves_the_fixed_granularity():
    facts = _facts.runtime_facts(SimulatedDevice(1 << 30), confidential_compute=False,
                                 world_size=2)
    assert facts.gmc(2 * MiB) == facts.multicast_granularity == 512 * MiB


def _measured_rows():
    for path in sorted((ROOT / "docs" / "gpu").glob("mc-granularity-*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                yield path.name, json.loads(line)


def test_h200_rule_is_what_the_h200_measured():
    rows = list(_measured_rows())
    assert len(rows) >= 6
    for name, row in rows:
        size = int(row["size_mib"] * MiB)
        for key in ("posix_recommended_mib", "fabric_recommended_mib"):
            assert _facts.h200_multicast_granularity(size) == row[key] * MiB, (name, row)


def test_h200_facts():
    facts = _facts.h200_facts(4)
    assert facts.granularity == 2 * MiB
    assert facts.torch_signal_pad == symm.get_signal_pad_size()
    assert [facts.gmc(n * MiB) for n in (2, 4, 98)] == [2 * MiB, 512 * MiB, 512 * MiB]
    assert _facts.h200_facts(4, torch_signal_pad=2048).torch_signal_pad == 2048


@pytest.mark.parametrize("fabric,imex,handle", [(True, True, "fabric"), (True, False, "posix"),
                                                (False, False, "posix")])
def test_multicast_question_uses_the_handle_type_flashinfer_uses(fabric, imex, handle):
    import dataclasses

    dev = CountingDevice(1 << 40, mc_granularity=_facts.h200_multicast_granularity)
    base = dataclasses.replace(dev.facts(None, False, 2), fabric_supported=fabric,
                               imex_channel=imex)
    _facts.size_aware_multicast(base, dev, 2).gmc(2 * MiB)
    assert dev.asked[-1][3] == handle
