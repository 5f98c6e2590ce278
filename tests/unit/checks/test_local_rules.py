"""Every check's local rule, table-driven from docs/failure-modes.md: the positive case
(the check fails with its own name and reason code), the negative case (it passes), and
its exemptions (paths FlashInfer handles itself, releases the mode does not apply to:
``applies`` is False and ``run_one`` says so). Each row asserts the exact code and value,
so removing or loosening a check fails a row even where another check would still veto.
"""

from __future__ import annotations

import pytest

from flashinfer_safe_workspace import _reasons as R, checks
from flashinfer_safe_workspace.checks import (capture, device, fabric, gpus, handles, hosts,
                                              multicast, packages)
from unit.facts import CLUSTER, ctx, fabric as fab, rank_facts

OFF = "not applied"  # the check does not apply: run_one's (True, OK, "", applies=False)


def outcome(check, c):
    """``(code, value)`` of the check on ``c`` through ``run_one`` (OFF when it does not
    apply); the answer's ``ok`` must agree with its code."""
    res = checks.run_one(check, c)
    if not res.applies:
        assert (res.ok, res.code, res.value, res.note) == (True, R.OK, "", "")
        return OFF
    assert res.ok is (res.code == R.OK), res
    assert bool(res.note) is (not res.ok), res
    return res.code, res.value


# ----------------------------------------------------------------- mode 10: capture
@pytest.mark.parametrize("version", ["0.5.0", "0.6.10", "0.7.4", "0.9.0"])
def test_mode10_capture_on_every_release(version):
    assert outcome(capture, ctx(version=version, capturing=True)) == (R.CAPTURING, "capturing=1")
    assert outcome(capture, ctx(version=version)) == (R.OK, "capturing=0")
    assert outcome(capture, ctx(backend="mnnvl", version=version, capturing=True))[0] == R.CAPTURING
    assert checks.run_one(capture, ctx(version=version, capturing=True)).note == (
        "creation during CUDA graph capture breaks the capture (cudaMalloc, synchronize and "
        "object collectives are not capturable); create the workspace before capture")


# ----------------------------------------------------------------- mode 2: device
DEVICE = [  # (version, backend, entry, symm, rank, current, gpus_per_node, device_count) -> outcome
    ("0.6.0", "trtllm", "unified", False, 1, 0, None, 8, (R.DEVICE_MISMATCH, "planned=cuda:1 current=cuda:0")),
    ("0.6.6", "trtllm", "unified", False, 1, 1, None, 8, (R.OK, "planned=cuda:1 current=cuda:1")),
    ("0.6.7", "trtllm", "unified", False, 1, 0, None, 8, OFF),  # fixed in 0.6.7
    ("0.5.0", "trtllm", "legacy", True, 1, 0, None, 8, OFF),  # no such release path
    ("0.6.6", "trtllm", "legacy", True, 1, 0, None, 8, (R.DEVICE_MISMATCH, "planned=cuda:1 current=cuda:0")),
    ("0.6.6", "trtllm", "legacy", False, 1, 0, None, 8, OFF),  # legacy non-symm: current device
    ("0.6.7", "trtllm", "legacy", True, 1, 0, None, 8, OFF),
    # mnnvl / auto: rank % gpus_per_node (given, else min(device_count, world_size))
    ("0.6.6", "mnnvl", "unified", False, 3, 0, 2, 8, (R.DEVICE_MISMATCH, "planned=cuda:1 current=cuda:0")),
    ("0.6.6", "mnnvl", "unified", False, 3, 1, 2, 8, (R.OK, "planned=cuda:1 current=cuda:1")),
    ("0.6.6", "auto", "unified", False, 3, 1, None, 2, (R.OK, "planned=cuda:1 current=cuda:1")),
    ("0.6.6", "auto", "unified", False, 3, 3, None, 8, (R.OK, "planned=cuda:3 current=cuda:3")),
    ("0.6.6", "mnnvl", "unified", False, 3, 0, 0, 8, (R.DEVICE_MISMATCH, "planned=cuda:3 current=cuda:0")),
    ("0.6.6", "mnnvl", "unified", False, 3, 0, None, 0, (R.OK, "planned=cuda:0 current=cuda:0")),  # no GPU count: one per node
    ("0.6.7", "mnnvl", "unified", False, 3, 0, 2, 8, OFF),
    ("0.6.6", "mnnvl-cutedsl", "unified", False, 3, 0, 2, 8, OFF),
]


@pytest.mark.parametrize("version,backend,entry,symm,rank,current,gpn,count,expected", DEVICE)
def test_mode2_planned_device(version, backend, entry, symm, rank, current, gpn, count, expected):
    c = ctx(backend, version, entry=entry, symm=symm, rank=rank, world=4, gpus_per_node=gpn,
            device=current, device_count=count)
    assert outcome(device, c) == expected


def test_mode2_device_without_a_world_size_plans_one_gpu_per_node():
    c = ctx("mnnvl", "0.6.6", rank=3, world=None, size=4, device=0, device_count=8)
    assert outcome(device, c) == (R.OK, "planned=cuda:0 current=cuda:0")


def test_mode2_device_needs_an_int_rank_and_known_release():
    assert outcome(device, ctx("trtllm", "0.6.0", rank="1", device=0)) == OFF
    assert outcome(device, ctx("trtllm", "0.4.0", rank=1, device=0)) == OFF
    res = checks.run_one(device, ctx("trtllm", "0.6.0", rank=1, device=0))
    assert "FlashInfer 0.6.0 allocates on cuda:1, not on the current device cuda:0" in res.note


# ----------------------------------------------------------------- mode 2b: gpus (local half)
@pytest.mark.parametrize("version,backend,applies", [
    ("0.7.4", "mnnvl", True), ("0.7.2.post1", "mnnvl-cutedsl", True), ("0.6.15", "auto", True),
    ("0.6.16", "auto", False), ("0.7.4", "trtllm", False), ("0.6.0", "trtllm", False)])
def test_mode2b_gpus_applies_only_where_a_multicast_object_is_made(version, backend, applies):
    got = outcome(gpus, ctx(backend, version, host="hA", gpu_uuid="GPU-7"))
    assert got == ((R.OK, "gpu=hA|GPU-7") if applies else OFF)


# ----------------------------------------------------------------- modes 3, 4: multicast
MULTICAST = [  # (version, backend, multicast supported, cc) -> outcome
    ("0.7.4", "mnnvl", False, False, (R.NO_MULTICAST, "multicast=0 cc=0")),
    ("0.6.0", "mnnvl", False, False, (R.NO_MULTICAST, "multicast=0 cc=0")),
    ("0.7.4", "mnnvl", True, False, (R.OK, "multicast=1 cc=0")),
    ("0.7.4", "mnnvl", True, True, (R.CONFIDENTIAL_COMPUTE, "multicast=1 cc=1")),
    ("0.7.4", "mnnvl", False, True, (R.CONFIDENTIAL_COMPUTE, "multicast=0 cc=1")),
    ("0.7.2.post1", "mnnvl-cutedsl", False, False, (R.NO_MULTICAST, "multicast=0 cc=0")),
    ("0.6.15", "auto", False, False, (R.NO_MULTICAST, "multicast=0 cc=0")),
    ("0.6.15", "trtllm", False, False, OFF),  # no multicast object, CC not consulted
    ("0.6.16", "auto", False, False, (R.OK, "multicast=0 cc=0")),  # auto votes itself
    ("0.6.16", "trtllm", False, True, (R.OK, "multicast=0 cc=1")),  # compared across ranks
    ("0.7.4", "trtllm", False, False, (R.OK, "multicast=0 cc=0")),
    ("0.6.10", "trtllm", False, True, OFF),
]


@pytest.mark.parametrize("version,backend,mc,cc,expected", MULTICAST)
def test_modes3_4_multicast_and_confidential_compute(version, backend, mc, cc, expected):
    assert outcome(multicast, ctx(backend, version, multicast=mc, cc=cc)) == expected


def test_mode3_4_notes_name_the_backend():
    assert checks.run_one(multicast, ctx("mnnvl", multicast=False)).note == (
        "this GPU reports no NVLink multicast; backend=mnnvl creates a multicast object "
        "(use trtllm)")
    assert checks.run_one(multicast, ctx("mnnvl", cc=True)).note == (
        "confidential computing disables NVLink multicast; backend=mnnvl creates a multicast "
        "object (use trtllm)")


# ----------------------------------------------------------------- mode 5: fabric
FABRIC = [  # (version, backend, FABRIC handles, NVML fabric) -> outcome
    ("0.7.4", "mnnvl", False, None, (R.OK, "fabric=none")),
    ("0.7.4", "mnnvl", False, fab(state=1), (R.FABRIC_NOT_READY, f"state=1 status=0 cluster={CLUSTER}")),
    ("0.7.4", "mnnvl", False, fab(state=2), (R.FABRIC_NOT_READY, f"state=2 status=0 cluster={CLUSTER}")),
    ("0.7.4", "mnnvl", False, fab(state=3, status=1), (R.FABRIC_NOT_READY, f"state=3 status=1 cluster={CLUSTER}")),
    ("0.7.4", "mnnvl", False, fab(state=3), (R.OK, f"state=3 status=0 cluster={CLUSTER}")),
    ("0.7.4", "mnnvl", False, fab(cluster=""), (R.OK, "state=3 status=0 cluster=-")),
    # the FABRIC-handle choice of B1–B3 (trtllm), only where the driver offers FABRIC
    ("0.6.0", "trtllm", True, fab(state=2), (R.FABRIC_NOT_READY, f"state=2 status=0 cluster={CLUSTER}")),
    ("0.6.15", "trtllm", True, fab(status=3), (R.FABRIC_NOT_READY, f"state=3 status=3 cluster={CLUSTER}")),
    ("0.7.2.post1", "trtllm", True, fab(state=1), (R.FABRIC_NOT_READY, f"state=1 status=0 cluster={CLUSTER}")),
    ("0.7.2", "trtllm", False, fab(state=1), OFF),  # no FABRIC handles: POSIX, no fabric
    ("0.7.4", "trtllm", True, fab(state=1), OFF),  # B4: 0.7.4 falls back itself
    ("0.6.10", "trtllm", True, fab(state=1), OFF),  # C: torch symmetric memory
    ("0.6.16", "auto", True, fab(state=1), (R.FABRIC_NOT_READY, f"state=1 status=0 cluster={CLUSTER}")),
    ("0.6.16", "auto", False, fab(state=1), OFF),  # auto votes; B3 without FABRIC handles
]


@pytest.mark.parametrize("version,backend,fh,fabric_info,expected", FABRIC)
def test_mode5_fabric_not_ready(version, backend, fh, fabric_info, expected):
    assert outcome(fabric, ctx(backend, version, fabric_handles=fh, fabric=fabric_info)) == expected


def test_mode5_notes():
    forming = checks.run_one(fabric, ctx("mnnvl", fabric=fab(state=2))).note
    assert forming == ("the GPU fabric is not started or still forming (Fabric Manager / "
                       "NVSwitch not ready)")
    failed = checks.run_one(fabric, ctx("mnnvl", fabric=fab(status=9))).note
    assert failed == "fabric state completed with NVML status 9 (not success)"


# ----------------------------------------------------------------- mode 6: hosts (local half)
HOSTS = [  # (version, backend, world, fabric handles, fabric) -> outcome
    ("0.7.2", "trtllm", 2, False, None, (R.OK, "host=hA handle=posix cluster=-")),
    ("0.7.2", "trtllm", 2, True, fab(), (R.OK, f"host=hA handle=fabric cluster={CLUSTER}")),
    ("0.7.2", "trtllm", 2, True, fab(cluster="0" * 32), (R.OK, "host=hA handle=posix cluster=-")),
    ("0.6.9", "trtllm", 2, False, None, (R.OK, "host=hA handle=cudaipc cluster=-")),
    ("0.6.10", "mnnvl", 2, False, None, (R.OK, "host=hA handle=torch cluster=-")),
    ("0.7.4", "trtllm", 2, False, None, OFF),  # B4 raises on every rank itself
    ("0.7.4", "mnnvl", 2, False, None, OFF),
    ("0.4.0", "trtllm", 2, False, None, OFF),  # no rules
    ("0.7.2", "trtllm", 1, False, None, OFF),  # one rank spans nothing
]


@pytest.mark.parametrize("version,backend,world,fh,fabric_info,expected", HOSTS)
def test_mode6_hosts_local_value(version, backend, world, fh, fabric_info, expected):
    entry = "legacy" if version == "0.6.9" else "unified"
    c = ctx(backend, version, entry=entry, world=world, host="hA", fabric_handles=fh,
            fabric=fabric_info)
    assert outcome(hosts, c) == expected


# ----------------------------------------------------------------- mode 7: handles (local half)
HANDLES = [  # (version, backend, FABRIC handles, fabric, imex) -> outcome
    ("0.7.2", "trtllm", True, fab(), False, (R.NO_IMEX, "handle=fabric imex=0")),
    ("0.7.2", "trtllm", True, fab(), True, (R.OK, "handle=fabric imex=1")),
    ("0.7.2", "trtllm", False, fab(), False, (R.OK, "handle=posix imex=0")),
    ("0.6.0", "trtllm", True, fab(), False, (R.NO_IMEX, "handle=fabric imex=0")),
    ("0.6.15", "mnnvl", True, fab(), False, (R.NO_IMEX, "handle=fabric imex=0")),
    ("0.7.2.post1", "auto", False, None, True, (R.OK, "handle=posix imex=1")),
    ("0.7.4", "trtllm", True, fab(), False, OFF),  # 0.7.4 votes and falls back itself
    ("0.6.10", "trtllm", True, fab(), False, OFF),  # torch symmetric memory
    ("0.6.9", "trtllm", True, fab(), False, (R.NO_IMEX, "handle=fabric imex=0")),  # unified: B1
]


@pytest.mark.parametrize("version,backend,fh,fabric_info,imex,expected", HANDLES)
def test_mode7_handles_local(version, backend, fh, fabric_info, imex, expected):
    c = ctx(backend, version, fabric_handles=fh, fabric=fabric_info, imex_channel=imex)
    assert outcome(handles, c) == expected


def test_mode7_handles_off_on_the_legacy_cudaipc_path():
    assert outcome(handles, ctx("trtllm", "0.6.9", entry="legacy", fabric_handles=True,
                                fabric=fab())) == OFF
    note = checks.run_one(handles, ctx("trtllm", "0.7.2", fabric_handles=True, fabric=fab())).note
    assert note == ("FlashInfer picks FABRIC handles here but no IMEX channel is accessible "
                    "(/dev/nvidia-caps-imex-channels/channel0): the export fails with "
                    "CUDA_ERROR_NOT_PERMITTED")


# ----------------------------------------------------------------- mode 11: packages
P, C, J = "flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache"
PACKAGES = [  # (python, cubin, jit) -> outcome
    ("0.7.4", "", "", (R.OK, "python=0.7.4 cubin=- jit=-")),
    ("0.7.4", "0.7.4", "0.7.4+cu129", (R.OK, "python=0.7.4 cubin=0.7.4 jit=0.7.4+cu129")),
    ("0.7.4", "0.7.4+cu129", "0.7.4", (R.OK, "python=0.7.4 cubin=0.7.4+cu129 jit=0.7.4")),
    ("0.7.4+local", "0.7.4", "0.7.4", (R.OK, "python=0.7.4+local cubin=0.7.4 jit=0.7.4")),
    ("0.7.4+a", "0.7.4", "0.7.4+a", (R.OK, "python=0.7.4+a cubin=0.7.4 jit=0.7.4+a")),
    ("0.7.4", "0.7.3", "", (R.PACKAGE_MISMATCH, "python=0.7.4 cubin=0.7.3 jit=-")),
    ("0.7.4", "", "0.7.2", (R.PACKAGE_MISMATCH, "python=0.7.4 cubin=- jit=0.7.2")),
    ("0.7.4", "0.7.40", "", (R.PACKAGE_MISMATCH, "python=0.7.4 cubin=0.7.40 jit=-")),
    ("0.7.4", "", "0.7.40", (R.PACKAGE_MISMATCH, "python=0.7.4 cubin=- jit=0.7.40")),
    ("0.7.4", "", "0.7.4.post1", (R.PACKAGE_MISMATCH, "python=0.7.4 cubin=- jit=0.7.4.post1")),
]


@pytest.mark.parametrize("python,cubin,jit,expected", PACKAGES)
def test_mode11_package_versions(python, cubin, jit, expected):
    c = ctx(packages=((P, python), (C, cubin), (J, jit)))
    assert outcome(packages, c) == expected


def test_mode11_note_and_the_call_version_stands_in_for_a_missing_python():
    res = checks.run_one(packages, ctx(packages=((P, "0.7.4"), (C, "0.7.3"), (J, "0.7.2"))))
    assert res.note == ("flashinfer-cubin 0.7.3, flashinfer-jit-cache 0.7.2 does not match "
                        "flashinfer-python 0.7.4: install matching versions")
    # no flashinfer-python metadata: the version FlashInfer reports stands in for it
    assert outcome(packages, ctx(version="0.7.2", packages=((C, "0.7.4"),))) == (
        R.PACKAGE_MISMATCH, "python=- cubin=0.7.4 jit=-")
    assert outcome(packages, ctx(version="0.7.4", packages=((C, "0.7.4"),))) == (
        R.OK, "python=- cubin=0.7.4 jit=-")
    assert outcome(packages, ctx(version="", packages=((C, "0.7.4"),))) == (
        R.OK, "python=- cubin=0.7.4 jit=-")
    # the installed flashinfer-python's metadata wins over the version FlashInfer reports
    assert outcome(packages, ctx(version="0.7.2", packages=((P, "0.7.4"), (C, "0.7.4")))) == (
        R.OK, "python=0.7.4 cubin=0.7.4 jit=-")


# ----------------------------------------------------------------- facts unreadable
@pytest.mark.parametrize("check", [capture, packages, gpus, multicast, fabric, hosts, handles],
                         ids=lambda c: c.NAME)
def test_a_check_needing_unreadable_facts_fails_closed(check):
    c = ctx("mnnvl", "0.7.2", facts=False)
    res = checks.run_one(check, c)
    assert (res.ok, res.code, res.value) == (False, R.CHECK_ERROR, f"check={check.NAME}")
