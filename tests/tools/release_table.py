"""Makes ``tests/unit/planning/release_table.txt``: what FlashInfer's own creation code
allocates, per release range, for a fixed table of calls (tests/unit/planning/
test_release_table.py pins the plans to it). Not a test: run it with one FlashInfer
release importable (first on PYTHONPATH), from the repository root:

    python -P tests/tools/release_table.py >> tests/unit/planning/release_table.txt

It runs the conformance stand-ins (tests/conformance) for every case of ``CASES`` and
prints one line per case: the release, the case, and what FlashInfer did —
``raise <Error>`` before allocating, ``export-fails <first allocation>`` (the FABRIC
export without an IMEX channel: RuntimeError after the first cuMemCreate), or ``alloc``
followed by every allocation it asked for, in order (api:bytes:handle:held) and the
device of its cuMemCreates. An allocation is written ``<api><handle><~ if released><bytes>``:
api C cuMemCreate, A cuMemAlloc, M cudaMalloc, T torch's caching allocator; handle p POSIX
fd, f FABRIC, nothing for none (``Cf~2097152``: a FABRIC cuMemCreate of 2 MiB, released
again). Cases where the plan differs from FlashInfer are printed
with ``MISMATCH`` (none expected; such a line is a bug of the rules)."""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import pytest  # noqa: E402

from conformance import runner, standins  # noqa: E402

ENTRIES = ["trtllm", "trtllm-oneshot", "trtllm-cc", "mnnvl", "mnnvl-oneshot", "mnnvl-cc",
           "auto-all-multicast", "auto-peer-without-multicast", "legacy",
           "legacy-no-metadata", "legacy-symm", "legacy-symm-no-metadata"]
FACTS = ["exact", "fabric-imex", "fabric-no-imex", "fabric-attr-only", "no-multicast"]
# (world_size, rank, max_token_num, hidden_dim, dtype): odd H shows the 16/32-byte
# pre-rounding; the third clamps the Lamport buffer to MAX_COMM_SIZE and passes mnnvl's
# UINT32_MAX; rank 3 of 4 shows device choices (tp_rank / local rank as the ordinal)
SHAPES = [(2, 0, 127, 4097, "bfloat16"), (4, 3, 2048, 4097, "float32"),
          (16, 1, 16384, 12288, "float32"), (8, 2, 1, 7168, "float16")]
CASES = [(e, f, s) for e in ENTRIES for f in FACTS for s in SHAPES]
# auto with one rank (its own multicast answer decides) and with 17 (trtllm takes at most
# 16); mnnvl where the one-shot size wins over the two-shot one (t1 < T, odd H)
CASES += [(e, f, s) for e in ("auto-all-multicast", "auto-peer-without-multicast")
          for f in ("exact", "no-multicast")
          for s in ((1, 0, 127, 4097, "bfloat16"), (17, 0, 127, 4097, "bfloat16"))]
CASES += [(e, "exact", (16, 5, 8, 4097, "bfloat16")) for e in ("mnnvl", "mnnvl-oneshot")]


API = {"cuMemCreate": "C", "cuMemAlloc": "A", "cudaMalloc": "M", "torch": "T"}
HANDLE = {"posix": "p", "fabric": "f", None: ""}


def token(api: str, nbytes: int, handle, held: bool) -> str:
    return f"{API[api]}{HANDLE[handle]}{'' if held else '~'}{nbytes}"


def case_id(entry, facts, shape) -> str:
    return f"{entry} {facts} " + ",".join(map(str, shape))


PAD = 9216  # torch's symmetric-memory signal pad, fixed (torch 2.11+ pads with 9216)


def main() -> int:
    for raw in runner.FACTS.values():
        raw["torch_signal_pad"] = PAD  # the stand-in and the plan both use it
    flashinfer = standins.import_flashinfer()
    version = flashinfer.__version__
    keep: list = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLASHINFER_CONFIDENTIAL_COMPUTE", "0")
        rec = standins.Recorder()
        standins.install(mp, rec)
        specs = [(runner.Spec(entry, *shape, facts), case_id(entry, facts, shape))
                 for entry, facts, shape in CASES]
        # mnnvl-cutedsl where FlashInfer's profile tables accept the shape (0.7.2.post1+):
        # the conformance grid's cases, named by their label
        specs += [(spec, spec.label()) for spec in runner.cutedsl_grid()]
        for spec, name in specs:
            out = runner.run(flashinfer, rec, spec, keep)
            req = runner.call_flashinfer(flashinfer, spec, runner._case_and_facts(spec)[0])[0]
            head = f"{version} | {name} | comm={int(req.has_comm_backend)}"
            if out.status == "mismatch":
                print(f"{head} MISMATCH {out.detail}".replace("\n", " "))
                continue
            if out.status == "unplanned":
                print(f"{head} unplanned")
                continue
            got = " ".join(token(r.api, r.bytes, r.handle_type, r.held) for r in out.captured)
            if out.status == "passthrough":
                print(f"{head} raise {out.detail.split(':')[0]}")
            elif any("IMEX" in n and "fails" in n for n in out.plan.notes):
                print(f"{head} export-fails {got}")
            else:
                devs = sorted({r.device for r in out.captured if r.api == "cuMemCreate"})
                print(f"{head} alloc dev={','.join(map(str, devs)) or '-'} {got}")
            if len(keep) > 64:
                keep.clear()
                gc.collect()
        keep.clear()
        gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
