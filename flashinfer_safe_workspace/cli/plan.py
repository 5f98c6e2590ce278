"""``plan``: the allocations a FlashInfer release makes for given arguments, from the
shared rules (``rules.plan_for``). No GPU needed.

Facts, by default as the shim has them: torch's signal pad from the installed torch;
the granularity and the per-object-size multicast granularity from the CUDA driver
when it answers (``--facts auto``/``driver``), else H200's measured values (2 MiB;
multicast 2 MiB for a 2 MiB object, 512 MiB from 4 MiB up). ``--granularity``,
``--multicast-granularity`` (one value for every object) and ``--signal-pad`` override.
"""

from __future__ import annotations

import dataclasses
import json
import sys


def plan_facts(args):
    """(Facts, pad source, facts source) for the ``plan`` arguments; raises
    ``_probe.ProbeUnavailable`` for ``--facts driver`` without a usable driver."""
    from ..planning import facts as _facts, plan as _plan, probe as _probe

    fabric = args.handle_type == "fabric"
    base = _facts.h200_facts(args.world_size)
    source = "H200 values"
    prober = None
    if args.facts in ("auto", "driver"):
        try:
            prober = _probe.CudaProber()
            driver = prober.facts(args.device, args.confidential_compute, args.world_size)
            base = dataclasses.replace(base, granularity=driver.granularity)
            source = f"cuda:{args.device}, driver"
        except Exception as exc:  # noqa: BLE001 - no driver, no device: H200 unless asked
            if args.facts == "driver":
                raise _probe.ProbeUnavailable(f"--facts driver: {exc}") from None
            prober, source = None, f"H200 values (no CUDA driver: {type(exc).__name__})"
    facts = _plan.Facts(
        granularity=base.granularity,
        multicast_granularity=base.multicast_granularity,
        fabric_supported=fabric, fabric_nvml_ok=fabric, imex_channel=fabric,
        multicast_supported=not args.no_multicast, multicast_all_ranks=not args.no_multicast,
        confidential_compute=args.confidential_compute, current_device=args.rank,
        torch_signal_pad=base.torch_signal_pad,
        multicast_granularity_for=base.multicast_granularity_for)
    if prober is not None:  # the driver's answer per object size, as the shim asks it
        facts = _facts.size_aware_multicast(facts, prober, args.world_size, args.device)
    pad_source = _facts.signal_pad()[1]
    if args.granularity is not None:
        facts = dataclasses.replace(facts, granularity=args.granularity)
    if args.multicast_granularity is not None:
        facts = dataclasses.replace(facts, multicast_granularity=args.multicast_granularity,
                                    multicast_granularity_for=None)
    if args.signal_pad is not None:
        facts = dataclasses.replace(facts, torch_signal_pad=args.signal_pad)
        pad_source = "--signal-pad"
    return facts, pad_source, source


def run_plan(args) -> int:
    """Print the plan; exit 0 when there is one, 2 when there is none (no FlashInfer, no rule
    for this release, arguments FlashInfer rejects before allocating, no driver facts)."""
    from ..planning import facts as _facts, plan as _plan, probe as _probe, rules

    version = args.flashinfer_version or rules.flashinfer_version()
    if version is None:
        print("no plan: FlashInfer is not installed here; pass --flashinfer-version",
              file=sys.stderr)
        return 2
    try:
        verified = not rules.is_unknown(version)
        facts, pad_source, source = plan_facts(args)
        result = rules.plan_for(_request(args), facts, version)
    except (_probe.ProbeUnavailable, _plan.Unplanned) as exc:
        print(f"no plan: {exc}", file=sys.stderr)
        return 2
    if not verified:  # said on stderr so that --json stays one document
        print(f"warning: FlashInfer {version} is {rules.unverified_why(version)}: planned "
              f"with the rules of {rules.range_of(version)}, not verified against this "
              "release (at run time FLASHINFER_SAFE_WORKSPACE_UNKNOWN_VERSION decides)",
              file=sys.stderr)
    used = _facts.describe(facts, pad_source=pad_source, source=source)
    shape, defaulted = shape_of(args)
    if isinstance(result, _plan.PassThrough):
        if args.json:
            print(json.dumps({"flashinfer_version": version, "verified": verified,
                              "pass_through": result.reason, "shape": shape,
                              "defaults": defaulted, "facts": used}))
        else:
            print(f"no plan: FlashInfer {version} rejects this call before allocating: "
                  f"{result.reason}")
            print("  " + format_shape(shape, defaulted))
        return 2
    if args.json:
        print(json.dumps({**result.to_json(), "verified": verified, "shape": shape,
                          "defaults": defaulted, "facts": used}, indent=2))
    else:
        head, _, rest = result.describe().partition("\n")
        print(head)
        print("  " + format_shape(shape, defaulted))
        if rest:
            print(rest)
        print("  " + _facts.format_facts(used))
        if not verified:
            print(f"  not verified: FlashInfer {version} is {rules.unverified_why(version)}")
    return 0


SHAPE = (("world_size", "world size ws="), ("rank", "rank "),
         ("max_token_num", "max_token_num T="), ("hidden_dim", "hidden_dim H="),
         ("dtype", "dtype "))  # (argument, its words; ws, T and H: the formulas' letters)


def shape_of(args) -> tuple:
    """({argument: value} of the shape planned, [the options not given, so defaulted])."""
    return ({name: getattr(args, name) for name, _ in SHAPE},
            list(getattr(args, "defaulted", [])))


def format_shape(shape: dict, defaulted: list) -> str:
    """``shape: world size ws=2, ...``, then the options that were defaults."""
    said = ", ".join(f"{words}{shape[name]}" for name, words in SHAPE)
    return f"shape: {said}" + (f" (defaults, not given: {', '.join(defaulted)})"
                               if defaulted else "")


def _request(args):
    from ..planning import plan as _plan

    return _plan.Request(
        entry=args.entry, backend=args.backend if args.entry == "unified" else "trtllm",
        world_size=args.world_size, rank=args.rank, max_token_num=args.max_token_num,
        hidden_dim=args.hidden_dim, dtype=args.dtype,
        force_oneshot_support=args.force_oneshot_support,
        use_fp32_lamport=args.dtype == "float32", use_symm_dev_mem=args.use_symm_dev_mem,
        create_metadata=True)
