"""Command line: ``python -m flashinfer_safe_workspace {demo,plan,check,doctor}``.

The parser and the dispatch only; each command lives in its own module of this
package and is imported when it runs.
"""

from __future__ import annotations

import argparse
import sys


def _add_shape(p, *, need_rank: bool = False) -> None:
    p.add_argument("--backend", default="trtllm", choices=["trtllm", "mnnvl", "mnnvl-cutedsl", "auto"])
    p.add_argument("--world-size", type=int, default=2)
    if need_rank:
        p.add_argument("--rank", type=int, default=0)
    p.add_argument("--max-token-num", type=int, default=2048)
    p.add_argument("--hidden-dim", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m flashinfer_safe_workspace")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="start local ranks and show plan, probe, vote, decision")
    _add_shape(demo)
    demo.add_argument("--starve-rank", type=int, default=None)
    demo.add_argument("--short-mb", type=int, default=64,
                      help="how far below plan+headroom the starved rank is left (MiB)")
    demo.add_argument("--die-rank", type=int, default=None, help="this rank exits before the vote")
    demo.add_argument("--slow-rank", type=int, default=None,
                      help="this rank arrives after the vote timeout")
    demo.add_argument("--vote-timeout", type=float, default=10.0)
    demo.add_argument("--on-veto", default="none", choices=["none", "raise"])
    demo.add_argument("--mode", default="auto", choices=["auto", "gpu", "simulated"],
                      help="auto: real GPUs when there are enough, else a simulated device")
    demo.add_argument("--json", action="store_true", help="one JSON object per rank")

    rank = sub.add_parser("_demo-rank")  # internal: one rank of the demo
    _add_shape(rank, need_rank=True)
    for flag in ("--starve-rank", "--die-rank", "--slow-rank"):
        rank.add_argument(flag, type=int, default=None)
    rank.add_argument("--short-mb", type=int, default=64)
    rank.add_argument("--vote-timeout", type=float, default=10.0)
    rank.add_argument("--on-veto", default="none")
    rank.add_argument("--mode", default="auto")

    plan = sub.add_parser("plan", help="print the allocations a FlashInfer release makes (no GPU)")
    plan.add_argument("--flashinfer-version", default=None,
                      help="default: the installed FlashInfer")
    plan.add_argument("--entry", default="unified", choices=["unified", "legacy"])
    _add_shape(plan, need_rank=True)
    plan.add_argument("--force-oneshot-support", action="store_true")
    plan.add_argument("--use-symm-dev-mem", action="store_true", help="legacy entry only")
    plan.add_argument("--facts", choices=["auto", "h200", "driver"], default="auto",
                      help="device facts: the CUDA driver's (driver), H200's measured values "
                      "(h200), or the driver's when it answers and H200's otherwise (auto)")
    plan.add_argument("--device", type=int, default=0,
                      help="CUDA ordinal asked for the driver's facts")
    plan.add_argument("--granularity", type=int, default=None,
                      help="allocation granularity in bytes (default: from --facts)")
    plan.add_argument("--multicast-granularity", type=int, default=None,
                      help="one multicast granularity in bytes for every object (default: "
                      "asked per object size, as the shim asks the driver)")
    plan.add_argument("--signal-pad", type=int, default=None,
                      help="torch symmetric memory's signal pad in bytes (default: the "
                      "installed torch's get_signal_pad_size())")
    plan.add_argument("--handle-type", choices=["posix", "fabric"], default="posix")
    plan.add_argument("--confidential-compute", action="store_true")
    plan.add_argument("--no-multicast", action="store_true",
                      help="a GPU without multicast (decides backend=auto from 0.6.16)")
    plan.add_argument("--json", action="store_true")

    doctor = sub.add_parser("doctor", help="is the shim active in this interpreter, and why "
                            "(exit 0 active, 1 not)")
    doctor.add_argument("--json", action="store_true")
    doctor.add_argument("--no-import", action="store_true",
                        help="do not import flashinfer.comm (then nothing shows as wrapped)")

    check = sub.add_parser("check", help="does this workspace fit on this GPU now? "
                           "(exit 0 fits, 1 does not, 2 cannot tell)")
    _add_shape(check, need_rank=True)
    check.add_argument("--headroom-mb", type=int, default=None,
                       help="default: FLASHINFER_SAFE_WORKSPACE_HEADROOM_MB")
    check.add_argument("--device", type=int, default=0, help="CUDA ordinal to probe")
    check.add_argument("--flashinfer-version", default=None,
                       help="default: the installed FlashInfer")
    check.add_argument("--json", action="store_true")
    # tests and CPU-only demos: a simulated GPU with this many free MiB
    check.add_argument("--simulate-free-mb", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from . import demo
        return demo.run(args)
    if args.command == "_demo-rank":
        from . import demo
        return demo.rank_main(args)
    if args.command == "plan":
        from . import plan
        return plan.run_plan(args)
    if args.command == "doctor":
        from . import doctor
        return doctor.run_doctor(args)
    if args.command == "check":
        from . import check
        return check.run_check(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
