"""Command line: ``flashinfer-safe-workspace {demo,plan,check,doctor}`` (the console script)
or ``python -m flashinfer_safe_workspace …``; messages name the one that was run.

The parser, the checks on argument values, and the dispatch; each command lives in its own
module of this package and is imported when it runs (doctor's, whose exit code 3 the help
names, at start). docs/cli.md is the reference.

Exit codes, the same for every command (``EXIT_CODES``):

    0  the answer is yes: a plan printed, the workspace fits, every demo rank answered,
       the shim is active and would not veto every call (doctor)
    1  the answer is no: it does not fit, a demo rank failed or hung, the shim is not
       active (doctor)
    2  refused or cannot tell: an invalid argument (one line naming it), no rule for
       this release or these arguments, no usable CUDA driver (check), an internal error
    3  doctor only: the shim is active, but every call here would be vetoed (it names why)
    130  interrupted (Ctrl-C)
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Optional

from .doctor import VETOES_ALL  # doctor only: active, but every call here would be vetoed

YES, NO, CANNOT_TELL = 0, 1, 2
INTERRUPTED = 130  # Ctrl-C (SIGINT), the shell's 128 + 2
EXIT_CODES = {YES: "yes", NO: "no", CANNOT_TELL: "refused / cannot tell",
              VETOES_ALL: "doctor: active, but every call would be vetoed",
              INTERRUPTED: "interrupted (Ctrl-C)"}
EPILOG = ("exit codes (every command): 0 yes (plan printed, fits, every rank answered, active); "
          "1 no (does not fit, a rank failed, not active); 2 refused or cannot tell (invalid "
          "argument, no rule, no driver); 3 doctor: active, but every call would be vetoed; "
          "130 interrupted (Ctrl-C)")
INT_MAX = (1 << 31) - 1  # FlashInfer's sizes are C ints
DEMO_MAX_RANKS = 64  # local processes; more would only exhaust the machine
DEFAULT_SHAPE = {"world_size": 2, "max_token_num": 2048, "hidden_dim": 4096}
# plan's shape options and their defaults, in the order its shape line says them
PLAN_DEFAULTS = {"world_size": DEFAULT_SHAPE["world_size"], "rank": 0,
                 "max_token_num": DEFAULT_SHAPE["max_token_num"],
                 "hidden_dim": DEFAULT_SHAPE["hidden_dim"], "dtype": "bfloat16"}
_WHOLE = re.compile(r"[+-]?[0-9]+")  # ASCII digits only: int() also takes '𝟠', '٨', '1_0'
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def _integer(text: str) -> int:
    value = text.strip()
    if not _WHOLE.fullmatch(value):
        raise argparse.ArgumentTypeError(f"expected a whole number in the digits 0-9, got {text!r}")
    return int(value, 10)


def _whole(low: int, high: int = INT_MAX):
    """An argparse type: a whole number in [low, high]; the message names the bound broken."""
    def parse(text: str) -> int:
        value = _integer(text)
        if value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high}, got {value}")
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    parse.__name__ = "whole number"
    return parse


MIN_GRANULARITY = 4096  # bytes: no CUDA device reports a smaller allocation granularity
MAX_GRANULARITY = 1 << 40  # bytes (1 TiB): far above any device's answer (H200: 512 MiB)


def _power_of_two(text: str) -> int:
    value = _integer(text)
    if not MIN_GRANULARITY <= value <= MAX_GRANULARITY or value & (value - 1):
        raise argparse.ArgumentTypeError(f"must be a power of two of at least {MIN_GRANULARITY}"
                                         f" and at most {MAX_GRANULARITY} bytes, got {value}")
    return value


def _seconds(text: str) -> float:
    if not _DECIMAL.fullmatch(text.strip()):  # float() also takes 'nan', '١', '1_0'
        raise argparse.ArgumentTypeError(f"expected seconds in the digits 0-9, got {text!r}")
    value = float(text)
    if not 0 < value <= 86400:  # nan fails this too
        raise argparse.ArgumentTypeError(f"must be above 0 and at most 86400, got {text}")
    return value


# PEP 440 that no FlashInfer release uses: a bare major ("1"), an epoch ("1!0.7.4")
_BARE_MAJOR = re.compile(r"v?[0-9]+", re.ASCII)
_EPOCH = re.compile(r"v?[0-9]+!(.*)", re.ASCII)


def _version(text: str) -> str:
    """A FlashInfer release as the library reads one (``versions.is_version``: PEP 440,
    ASCII digits): 0.7.4, 0.7.2.post1, 0.7.2-1, 0.7.4rc1, 0.7.4+cu129. Whether the rules
    were verified against it is ``plan``'s business, not the parser's. PEP 440's bare major
    (``1``) and epoch (``1!0.7.4``) are refused with their own reason: the parser that reads
    the installed release reads neither, and no FlashInfer release is spelled so."""
    from ..planning.rules import versions

    value = text.strip()
    epoch = _EPOCH.fullmatch(value)
    if not versions.is_version(value) and (_BARE_MAJOR.fullmatch(value) or epoch and (
            versions.is_version(epoch[1]) or _BARE_MAJOR.fullmatch(epoch[1]))):
        raise argparse.ArgumentTypeError(
            f"expected a FlashInfer release as major.minor[.micro]: {text!r} is PEP 440, but "
            "no FlashInfer release has a bare major or an epoch, and the library's version "
            "parser reads neither")
    if not versions.is_version(value):
        raise argparse.ArgumentTypeError(
            f"expected a FlashInfer release in PEP 440 spelling (such as 0.7.4, 0.7.2.post1 "
            f"or 0.7.4+cu129, digits 0-9), got {text!r}")
    return value


def _add_shape(p, *, need_rank: bool = False, required_note: str = "",
               said_defaults: bool = False) -> None:
    """The shape options. ``required_note``: the shape has no defaults (``check``);
    ``said_defaults``: the defaults are filled in after parsing (``_fill_shape``), so that
    ``plan`` can say which values it was not given."""
    def default(name: str):
        if said_defaults or (required_note and name in DEFAULT_SHAPE):
            return None
        return PLAN_DEFAULTS[name]

    def note(name: str) -> str:
        if said_defaults:
            return f" (default: {PLAN_DEFAULTS[name]})"
        return required_note if name in DEFAULT_SHAPE else ""

    p.add_argument("--backend", default="trtllm",
                   choices=["trtllm", "mnnvl", "mnnvl-cutedsl", "auto"], help="FlashInfer backend")
    p.add_argument("--world-size", type=_whole(1), default=default("world_size"),
                   help="ranks in the group" + note("world_size"))
    if need_rank:
        p.add_argument("--rank", type=_whole(0), default=default("rank"),
                       help="this rank (below --world-size)" + note("rank"))
    p.add_argument("--max-token-num", type=_whole(1), default=default("max_token_num"),
                   help="max_token_num of the call" + note("max_token_num"))
    p.add_argument("--hidden-dim", type=_whole(1), default=default("hidden_dim"),
                   help="hidden_dim of the call" + note("hidden_dim"))
    p.add_argument("--dtype", default=default("dtype"), choices=["bfloat16", "float16", "float32"],
                   help="dtype of the call" + note("dtype"))


def _fill_shape(args) -> None:
    """``plan``: the shape values not given take their defaults; ``args.defaulted`` names
    those options, in order, for the line that says which shape was planned."""
    args.defaulted = []
    for name, value in PLAN_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
            args.defaulted.append("--" + name.replace("_", "-"))


class _Parser(argparse.ArgumentParser):
    """argparse whose refusal is one line: the message and where the help is (the usage
    block it would print first hides the line that matters). Exit 2, as before."""

    see = ""  # where the help is, when not this parser's own --help

    def error(self, message):
        see = self.see or f"{self.prog} --help"
        self.exit(CANNOT_TELL, f"{self.prog}: error: {message} (see: {see})\n")


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default, said once: not where its help already says it, never None
    (nor a flag's False)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.default is False or "(default" in text:
            return text
        return super()._get_help_string(action)


def _subparser(sub, name: str, help_text: str):
    return sub.add_parser(name, help=help_text, description=help_text, epilog=EPILOG,
                          formatter_class=_Help)


def _add_demo(sub) -> None:
    demo = _subparser(sub, "demo", "start local ranks and show plan, probe, vote, decision")
    _add_shape(demo)
    rank = _whole(0, DEMO_MAX_RANKS - 1)
    demo.add_argument("--starve-rank", type=rank, default=None,
                      help="this rank is left short of memory (below --world-size)")
    demo.add_argument("--short-mb", type=_whole(0), default=64,
                      help="how far below plan+headroom the starved rank is left (MiB)")
    demo.add_argument("--die-rank", type=rank, default=None, help="this rank exits before the vote")
    demo.add_argument("--slow-rank", type=rank, default=None,
                      help="this rank arrives after the vote timeout")
    demo.add_argument("--vote-timeout", type=_seconds, default=10.0, help="seconds")
    demo.add_argument("--on-veto", default="auto", choices=["auto", "none", "raise"],
                      help="what a rank gets on a veto (auto: the library's default; the demo "
                      "is no engine, so None)")
    demo.add_argument("--mode", default="auto", choices=["auto", "gpu", "simulated"],
                      help="auto: real GPUs when there are enough, else a simulated device")
    demo.add_argument("--json", action="store_true", help="one JSON object per rank")



def _demo_rank_parser(prog: str) -> argparse.ArgumentParser:
    """``_demo-rank``: one rank of the demo, started by it; internal, so no subcommand
    (neither ``--help`` nor an unknown command's message lists it) and no help of its own."""
    hidden = _Parser(prog=f"{prog} _demo-rank", add_help=False)
    hidden.see = f"{prog} demo --help"
    _add_shape(hidden, need_rank=True)
    rank = _whole(0, DEMO_MAX_RANKS - 1)
    for flag in ("--starve-rank", "--die-rank", "--slow-rank"):
        hidden.add_argument(flag, type=rank, default=None)
    hidden.add_argument("--short-mb", type=_whole(0), default=64)
    hidden.add_argument("--vote-timeout", type=_seconds, default=10.0)
    hidden.add_argument("--on-veto", default="auto", choices=["auto", "none", "raise"])
    hidden.add_argument("--mode", default="auto", choices=["auto", "gpu", "simulated"])
    return hidden


def _demo_rank_refusal() -> str:
    """Why ``_demo-rank`` cannot run here: '' when ``demo`` started this process (its pid in
    ``DEMO_PARENT``, checked first: MASTER_ADDR and MASTER_PORT alone are any torchrun job's,
    where a hand-run rank would wait in the rendezvous) with the rendezvous it gives each
    rank (MASTER_ADDR, and MASTER_PORT a port number)."""
    from .. import _config

    why = "an internal command of demo, which starts one per rank; run demo instead"
    if _config.demo_parent() != str(os.getppid()):
        return why
    addr, port = _config.rendezvous()
    if addr and port and re.fullmatch(r"[0-9]{1,5}", port) and 0 < int(port) < 65536:
        return ""
    return why


def _add_plan(sub) -> None:
    plan = _subparser(sub, "plan", "print the allocations a FlashInfer release makes (no GPU)")
    plan.add_argument("--flashinfer-version", type=_version, default=None,
                      help="release to plan for (default: the installed FlashInfer)")
    plan.add_argument("--entry", default="unified", choices=["unified", "legacy"],
                      help="create_allreduce_fusion_workspace (unified) or the legacy function")
    _add_shape(plan, need_rank=True, said_defaults=True)
    plan.add_argument("--force-oneshot-support", action="store_true", help="FlashInfer's flag")
    plan.add_argument("--use-symm-dev-mem", action="store_true", help="legacy entry only")
    plan.add_argument("--facts", choices=["auto", "h200", "driver"], default="auto",
                      help="device facts: the CUDA driver's (driver), H200's measured values "
                      "(h200), or the driver's when it answers and H200's otherwise (auto)")
    plan.add_argument("--device", type=_whole(0), default=0,
                      help="CUDA ordinal asked for the driver's facts")
    plan.add_argument("--granularity", type=_power_of_two, default=None,
                      help="allocation granularity in bytes, a power of two (default: from --facts)")
    plan.add_argument("--multicast-granularity", type=_power_of_two, default=None,
                      help="one multicast granularity in bytes for every object, a power of two "
                      "(default: asked per object size, as the shim asks the driver)")
    plan.add_argument("--signal-pad", type=_whole(1), default=None,
                      help="torch symmetric memory's signal pad in bytes (default: the "
                      "installed torch's get_signal_pad_size())")
    plan.add_argument("--handle-type", choices=["posix", "fabric"], default="posix",
                      help="the allocation's handle type")
    plan.add_argument("--confidential-compute", action="store_true", help="a CC-mode GPU")
    plan.add_argument("--no-multicast", action="store_true",
                      help="a GPU without multicast (decides backend=auto from 0.6.16)")
    plan.add_argument("--json", action="store_true", help="the plan as JSON")


def _add_check(sub) -> None:
    check = _subparser(sub, "check", "does this workspace fit on this GPU now? "
                       "(exit 0 fits, 1 does not, 2 cannot tell)")
    shape = ", ".join(f"{k.replace('_', '-')} {v}" for k, v in DEFAULT_SHAPE.items())
    _add_shape(check, need_rank=True, required_note=" (required unless --default-shape)")
    check.add_argument("--default-shape", action="store_true",
                       help=f"use {shape} for the shape arguments not given")
    check.add_argument("--headroom-mb", type=_whole(0, 1 << 20), default=None,
                       help="MiB to hold beyond the plan (default: "
                       "FLASHINFER_SAFE_WORKSPACE_HEADROOM_MB, auto)")
    check.add_argument("--device", type=_whole(0), default=0, help="CUDA ordinal to probe")
    check.add_argument("--flashinfer-version", type=_version, default=None,
                       help="release to plan for (default: the installed FlashInfer)")
    check.add_argument("--json", action="store_true", help="the report as JSON")
    # tests and CPU-only demos: a simulated GPU with this many free MiB
    check.add_argument("--simulate-free-mb", type=_whole(0), default=None, help=argparse.SUPPRESS)


MODULE_PROG = "python -m flashinfer_safe_workspace"
COMMANDS = ("demo", "plan", "check", "doctor")  # the subcommands, as --help lists them


def prog_name(argv0: Optional[str] = None) -> str:
    """The command as it was run, for messages: the console script's name
    (``flashinfer-safe-workspace``) or ``python -m flashinfer_safe_workspace``."""
    name = os.path.basename(sys.argv[0] if argv0 is None else argv0)
    if not name or name.endswith((".py", ".pyc")) or name.startswith("-"):
        return MODULE_PROG  # python -m …: argv[0] is the module's file (or -c, -m)
    return name


def build_parser(prog: str = MODULE_PROG) -> argparse.ArgumentParser:
    from .._version import __version__

    parser = _Parser(prog=prog, epilog=EPILOG)
    parser.add_argument("--version", action="version",
                        version=f"flashinfer-safe-workspace {__version__}")
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{" + ",".join(COMMANDS) + "}")
    _add_demo(sub)
    _add_plan(sub)
    _add_check(sub)
    doctor = _subparser(sub, "doctor", "is the shim active in this interpreter, and would it "
                        f"let a workspace be created here (exit 0 yes, 1 not active, "
                        f"{VETOES_ALL} every call would be vetoed)")
    doctor.add_argument("--json", action="store_true", help="the report as JSON")
    doctor.add_argument("--no-import", action="store_true",
                        help="do not import flashinfer.comm (then nothing shows as wrapped)")
    parser.commands = sub.choices  # name -> its parser, whose errors name the subcommand
    return parser


def _parse(parser, argv: list):
    """``parser.parse_args``, but an argument no parser knows is refused by the subcommand
    it follows, so that the line names it (``… doctor: error: unrecognized arguments``)."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        command = getattr(parser, "commands", {}).get(args.command)
        at = argv.index(args.command) if args.command in argv else len(argv)
        after = extra[0] not in argv or len(argv) - 1 - argv[::-1].index(extra[0]) > at
        (command if command is not None and after else parser).error(
            "unrecognized arguments: " + " ".join(extra))
    return args


def _refusal(args) -> str:
    """Why these arguments, each valid alone, do not go together; '' when they do."""
    if args.command == "check" and not args.default_shape:
        missing = [f"--{k.replace('_', '-')}" for k in DEFAULT_SHAPE if getattr(args, k) is None]
        if missing:
            return (f"the workspace's shape is needed: {', '.join(missing)} (or --default-shape "
                    "for world size 2, max tokens 2048, hidden dim 4096)")
    if args.command == "check":
        for k, v in DEFAULT_SHAPE.items():
            if getattr(args, k) is None:
                setattr(args, k, v)
    if args.command == "plan":
        _fill_shape(args)
    if args.command == "plan" and args.entry == "legacy" and args.backend != "trtllm":
        return (f"--backend {args.backend} with --entry legacy: the legacy function has no "
                "backend (it is trtllm's)")
    if args.command == "plan" and args.use_symm_dev_mem and args.entry != "legacy":
        return "--use-symm-dev-mem is an argument of the legacy function: add --entry legacy"
    if args.command == "demo" and args.world_size > DEMO_MAX_RANKS:
        return f"--world-size {args.world_size}: the demo starts at most {DEMO_MAX_RANKS} ranks"
    ws = getattr(args, "world_size", None)
    for flag in ("rank", "starve_rank", "die_rank", "slow_rank"):
        value = getattr(args, flag, None)
        if value is not None and ws is not None and value >= ws:
            return (f"--{flag.replace('_', '-')} {value} is not a rank of --world-size {ws} "
                    f"(ranks 0 to {ws - 1})")
    return ""


def main(argv=None, prog: Optional[str] = None) -> int:
    prog = prog or prog_name()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["_demo-rank"]:  # the demo's own ranks
        parser = _demo_rank_parser(prog)
        why = _demo_rank_refusal()
        if why:  # run by hand: one line, before any argument is read
            parser.error(why)
        args = parser.parse_args(argv[1:])
        args.command = "_demo-rank"
    else:
        parser = build_parser(prog)
        args = _parse(parser, argv)  # invalid values: one line, exit 2
        why = _refusal(args)
        if why:
            parser.exit(CANNOT_TELL, f"{prog} {args.command}: error: {why} "
                        f"(see: {prog} {args.command} --help)\n")
    args.prog = prog
    try:
        return _dispatch(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - a bug of ours: one line, never a traceback
        print(f"{prog} {args.command}: internal error: {type(exc).__name__}: {exc} "
              "(please report it)", file=sys.stderr)
        return CANNOT_TELL


def _dispatch(args) -> int:
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
    from . import check
    return check.run_check(args)


if __name__ == "__main__":
    sys.exit(main())
