"""The plan of every release range against what FlashInfer's own code allocated.

``release_table.txt`` holds, for one release per range R0–R10 and a fixed table of calls
(12 entry points × 5 device-fact variants × 4 shapes, and a few more for auto's choice and
mnnvl's one-shot size: ``CASES`` of tests/tools/release_table.py), what FlashInfer's real creation
code did under the conformance stand-ins (tests/conformance): raised before allocating,
failed at the FABRIC export after its first cuMemCreate, or the allocations it asked for
in order (API, bytes, handle type, held or released) and the device of its cuMemCreates.
It was made with ``tests/tools/release_table.py`` against each release's wheel (see that
file); nothing in it comes from our rules. This test asks the rules (pure Python, no
FlashInfer, milliseconds) for the same calls and compares: the fixed table stands in for
the conformance matrix in the fast layer, so a change of one byte, one handle type, one
device or one pass-through in any range fails here.

The facts mirror the conformance runner's (``runner.FACTS``) with torch's signal pad fixed
at 9216 (the table was made with the stand-in padding by the same value).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from flashinfer_safe_workspace.planning.plan import MiB, Facts, PassThrough, Request, Unplanned
from flashinfer_safe_workspace.planning.rules import plan_for

from conformance import runner

TABLE = Path(__file__).with_name("release_table.txt")
PAD = 9216

# the stand-ins' device answers the table was made with: the conformance runner's own, by name
FACTS = {name: runner.FACTS[name]
         for name in ("exact", "fabric-imex", "fabric-attr-only", "fabric-no-imex", "no-multicast")}

# what is called, (entry, backend, options): the conformance runner's own table, less the
# mnnvl-cutedsl rows (the grid's cases, kept by their labels below)
ENTRIES = {name: call for name, call in runner.ENTRIES.items() if call[1] != "mnnvl-cutedsl"}


CUTEDSL = "mnnvl-cutedsl-accepted"  # rows named by the conformance grid's label


def _rows(cutedsl: bool) -> dict:
    rows: dict = {}
    for line in TABLE.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        version, case, what = (part.strip() for part in line.split("|"))
        if case.startswith(CUTEDSL) is cutedsl:
            rows.setdefault(version, []).append((case, what))
    return rows


ROWS = _rows(cutedsl=False)
CUTEDSL_ROWS = _rows(cutedsl=True)


def _call(case: str, comm: bool):
    entry_name, facts_name, shape = case.split()
    ws, rank, tokens, hidden, dtype = shape.split(",")
    ws, rank, tokens, hidden = int(ws), int(rank), int(tokens), int(hidden)
    entry, backend, opts = ENTRIES[entry_name]
    raw = dict(FACTS[facts_name])
    multicast = raw.get("multicast_supported", True)
    peers = opts.get("peers")
    facts = Facts(**raw, multicast_all_ranks=multicast and (peers if peers is not None else True),
                  confidential_compute=bool(opts.get("cc")), current_device=0, device_count=8,
                  torch_signal_pad=PAD)
    if entry == "unified":
        req = Request("unified", backend, ws, rank, tokens, hidden, dtype,
                      force_oneshot_support=bool(opts.get("force_oneshot_support")),
                      has_comm_backend=comm)
    else:
        req = Request("legacy", "trtllm", ws, rank, tokens, hidden, None,
                      use_fp32_lamport=dtype == "float32",
                      use_symm_dev_mem=bool(opts.get("use_symm_dev_mem")),
                      create_metadata=bool(opts.get("create_metadata")), has_comm_backend=comm)
    return req, facts


API = {"cuMemCreate": "C", "cuMemAlloc": "A", "cudaMalloc": "M", "torch": "T"}
HANDLE = {"posix": "p", "fabric": "f", None: ""}


def _keys(plan) -> str:
    """The plan's allocations as the table writes them (tests/tools/release_table.py):
    ``<api><handle><~ if released><bytes>``, e.g. ``Cf~2097152``."""
    return " ".join(f"{API[a.api]}{HANDLE[a.handle_type]}{'' if a.held else '~'}{a.bytes}"
                    for a in plan.allocations)


def _differs(version: str, case: str, what: str, call=None):
    """None when the plan says what FlashInfer did, else a line saying how it differs."""
    comm, status, *rest = what.split(" ", 2)
    req, facts = call if call is not None else _call(case, comm == "comm=1")
    if status == "unplanned":
        try:
            plan = plan_for(req, facts, version)
        except Unplanned:
            return None
        return f"planned {plan}; the rules had no plan for it"
    plan = plan_for(req, facts, version)
    if status == "raise":
        return None if isinstance(plan, PassThrough) else f"planned {_keys(plan)}; FlashInfer raised"
    if isinstance(plan, PassThrough):
        return f"pass-through ({plan.reason}); FlashInfer: {status} {' '.join(rest)}"
    if status == "export-fails":
        first = _keys(plan).split(" ")[0]
        fails = any("IMEX" in n and "fails" in n for n in plan.notes)
        return None if (fails and first == rest[0]) else (
            f"planned {first} (export failure noted: {fails}); FlashInfer: export fails "
            f"after {rest[0]}")
    if "IMEX" in " ".join(plan.notes) and "fails" in " ".join(plan.notes):
        return f"plan notes an export failure; FlashInfer created {rest}"
    dev, got = rest[0].split(" ", 1) if " " in rest[0] else (rest[0], "")
    dev = dev[len("dev="):]
    want_dev = plan.device if plan.device is not None else facts.current_device
    if _keys(plan) != got:
        return f"planned  {_keys(plan)}\n    FlashInfer {got}"
    if dev != "-" and dev != str(want_dev):
        return f"planned cuda:{want_dev}; FlashInfer allocated on cuda:{dev}"
    return None


def test_the_table_covers_every_range():
    from flashinfer_safe_workspace.planning import rules

    assert sorted(rules.range_of(v) for v in ROWS) == sorted(f"R{i}" for i in range(11))
    counts = {len(cases) for cases in ROWS.values()}
    assert len(counts) == 1 and counts.pop() >= len(ENTRIES) * len(FACTS) * 4


@pytest.mark.parametrize("version", list(ROWS))
def test_the_plan_is_what_flashinfer_allocated(version):
    bad = [(case, why) for case, what in ROWS[version]
           if (why := _differs(version, case, what)) is not None]
    assert not bad, f"{len(bad)} of {len(ROWS[version])} calls differ, e.g.\n" + "\n".join(
        f"  {case}: {why}" for case, why in bad[:6])


@pytest.fixture(scope="module")
def cutedsl_grid():
    """The conformance grid's mnnvl-cutedsl cases by label (they hold FlashInfer's own
    config objects, so they are made from the installed FlashInfer's tables)."""
    pytest.importorskip("flashinfer.comm.mnnvl_cutedsl")

    return {spec.label(): spec for spec in runner.cutedsl_grid()}


def _cutedsl_call(spec):
    """The request and facts of one grid case, as the conformance runner builds them
    (runner.call_flashinfer, runner._case_and_facts), with torch's pad fixed at PAD."""

    raw = dict(runner.FACTS[spec.facts_name])
    facts = Facts(granularity=raw.get("granularity", 2 * MiB),
                  multicast_granularity=raw.get("multicast_granularity", 512 * MiB),
                  multicast_all_ranks=True, current_device=0, device_count=8,
                  torch_signal_pad=PAD, compute_capability=tuple(spec.cc))
    req = Request("unified", "mnnvl-cutedsl", spec.world_size, spec.rank, spec.tokens,
                  spec.hidden, spec.dtype, has_comm_backend=False,
                  cutedsl_options=tuple(sorted((n, repr(v)) for n, v in spec.options)),
                  cutedsl_values=tuple(sorted(spec.options, key=lambda item: item[0])))
    return req, facts


@pytest.mark.parametrize("version", list(CUTEDSL_ROWS))
def test_mnnvl_cutedsl_plans_are_what_flashinfer_allocated(version, cutedsl_grid):
    """0.7.4 plans allocator D for every shape FlashInfer's profile tables accept (its
    Blackwell path under the stand-ins); 0.7.2.post1, whose tables are another draft,
    has no plan for them (the shim vetoes)."""
    rows = CUTEDSL_ROWS[version]
    missing = [case for case, _ in rows if case not in cutedsl_grid]
    if missing:
        pytest.skip(f"the installed FlashInfer's grid lacks {len(missing)} of these cases")
    bad = [(case, why) for case, what in rows
           if (why := _differs(version, case, what, _cutedsl_call(cutedsl_grid[case])))
           is not None]
    assert not bad, f"{len(bad)} of {len(rows)} calls differ, e.g.\n" + "\n".join(
        f"  {case}: {why}" for case, why in bad[:6])
