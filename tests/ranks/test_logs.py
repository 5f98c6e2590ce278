"""The grep-able decision line: one INFO line per fresh decision, parsed by the
documented regex ``flashinfer_safe_workspace._log.DECISION_LINE``.

Real processes (one rank alone, then two ranks voting over a real gloo group); the
SimulatedDevice stands in for the GPU. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

from pathlib import Path

from flashinfer_safe_workspace._log import DECISION_FIELDS, DECISION_LINE, parse_decision_lines

LOGS_DOC = Path(__file__).resolve().parents[2] / "docs" / "logs.md"

TIMEOUT = 180
MiB = 1 << 20

PRELUDE = textwrap.dedent("""
    import json, logging, os, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s %(message)s")
    import torch
    import flashinfer_safe_workspace as fiws
    from flashinfer_safe_workspace.planning import probe as _probe
    from flashinfer_safe_workspace.planning.simulated import SimulatedDevice
    fiws.install(on_veto="none", vote_timeout=60)
    import flashinfer.comm as comm
    MiB = 1 << 20

    def create(**kw):
        args = dict(backend="trtllm", world_size=1, rank=0, max_token_num=1024,
                    hidden_dim=4096, dtype=torch.bfloat16)
        args.update(kw)
        try:
            return repr(comm.create_allreduce_fusion_workspace(**args))
        except Exception as exc:  # FlashInfer itself, after a pass: no CUDA here
            return "raised " + type(exc).__name__
""")


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHINFER_SAFE_WORKSPACE")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _readme_example() -> str:
    """The decision line docs/logs.md documents, read from that page."""
    lines = [l.strip() for l in LOGS_DOC.read_text().splitlines()
             if l.strip().startswith("fiws decision ")]
    assert len(lines) == 1, lines
    return lines[0]


def test_regex_matches_the_readme_example():
    line = _readme_example()
    (d,) = parse_decision_lines("INFO flashinfer_safe_workspace " + line)
    assert list(d) == list(DECISION_FIELDS)  # every documented field, in the documented order
    assert d["rank"] == 0 and d["ranks"] == [0, 1] and d["outcome"] == "veto"
    assert d["answer"] == "raise" and d["caller"].startswith("sglang.")
    assert d["headroom"] == "nccl-cold" and d["headroom_bytes"] == 512 << 20
    assert isinstance(d["elapsed_ms"], float) and isinstance(d["plan_bytes"], int)
    assert DECISION_LINE.search(line.replace("outcome=veto", "outcome=maybe")) is None
    assert DECISION_LINE.search(line + " extra=1") is None  # a new field needs a new regex
    # the page names every field in its field list too
    text = LOGS_DOC.read_text()
    for name in DECISION_FIELDS:
        assert f"`{name}`" in text, name


def test_one_line_per_decision_single_rank():
    script = PRELUDE + textwrap.dedent("""
        _probe.set_prober(SimulatedDevice(256 * MiB))
        out = [create(), create()]            # a veto, then the cached veto
        _probe.set_prober(SimulatedDevice(80 << 30))
        out.append(create(max_token_num=512))  # another shape: a fresh decision, passes
        out.append(create(max_token_num=0))  # FlashInfer rejects it itself: no decision
        print(json.dumps({"pid": os.getpid(), "out": out}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=_env(), capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["out"][:2] == ["None", "None"]
    assert result["out"][2].startswith("raised")  # FlashInfer was called (no CUDA here)

    raw = [l for l in proc.stderr.splitlines() if "fiws decision" in l]
    lines = parse_decision_lines(proc.stderr)
    assert len(raw) == len(lines) == 2, proc.stderr[-2000:]  # every line parses (the
    # cached veto logs at DEBUG, the pass-through logs nothing)
    assert all(l.startswith("INFO flashinfer_safe_workspace ") for l in raw)
    veto, passed = lines
    assert veto["outcome"] == "veto" and veto["probe"] == "no" and veto["answer"] == "none"
    assert passed["outcome"] == "pass" and passed["probe"] == "ok" and passed["answer"] == "create"
    assert passed["audit"] == "raised"  # FlashInfer itself raised (no CUDA here)
    for d in lines:
        assert d["pid"] == result["pid"]
        assert d["rank"] is None  # torch.distributed not initialised: rank=-
        assert d["ranks"] == [0] and d["entry"] == "unified" and d["backend"] == "trtllm"
        assert d["plan_bytes"] > 0 and d["elapsed_ms"] >= 0
    assert veto["free_bytes"] == 256 * MiB and passed["free_bytes"] == 80 << 30
    assert veto["plan_bytes"] > passed["plan_bytes"]  # 1024 vs 512 tokens


RANK = PRELUDE + textwrap.dedent("""
    import torch.distributed as dist
    rank, port, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]

    class Json(logging.Formatter):  # what a JSON formatter sees: the record's fiws_ fields
        def format(self, record):
            out = {k: v for k, v in vars(record).items() if k.startswith("fiws_")}
            return json.dumps(dict(out, level=record.levelname, message=record.getMessage()))

    seen = []
    collect = logging.Handler()
    collect.setFormatter(Json())
    collect.emit = lambda record: seen.append(json.loads(collect.format(record)))
    logging.getLogger("flashinfer_safe_workspace").addHandler(collect)
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            init_method=f"tcp://127.0.0.1:{port}")
    import datetime
    store = dist.distributed_c10d._get_default_store()

    class Ordered(SimulatedDevice):
        # rank 1 probes only once rank 0 has probed: a "no" that arrives first decides
        # the call, and a rank that opens the round after that follows without probing

        def probe(self, plan, headroom_bytes, device=None):
            if rank == 1:
                store.wait(["probed/0"], datetime.timedelta(seconds=30))
            result = super().probe(plan, headroom_bytes, device)
            if rank == 0:
                store.set("probed/0", "1")
            return result

    if mode == "short":
        # rank 1 cannot hold the plan (about 70 MiB) plus the gloo group's small headroom (64 MiB)
        _probe.set_prober(Ordered(100 * MiB if rank == 1 else 80 << 30))
        out = create(world_size=2, rank=rank)
    else:  # room on both, but rank 1 asks for twice the tokens
        _probe.set_prober(SimulatedDevice(80 << 30))
        out = create(world_size=2, rank=rank, max_token_num=1024 * (rank + 1))
    print(json.dumps({"pid": os.getpid(), "out": out, "json": seen}), flush=True)
    store.set(f"done/{rank}", "1")  # rank 0 hosts the store: it waits for rank 1
    if rank == 0:
        store.wait(["done/0", "done/1"], datetime.timedelta(seconds=30))
    os._exit(0)
""")


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ranks(tmp_path, mode: str) -> list:
    """(result, stderr) of each of two real ranks running ``RANK`` in ``mode``."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    port = str(_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port, mode], env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=TIMEOUT)
            assert p.returncode == 0, err[-2000:]
            results.append((json.loads(out.strip().splitlines()[-1]), err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return results


VETO_END = "What to do: docs/when-it-vetoes.md"


def test_two_ranks_each_log_their_own_line(tmp_path):
    results = _two_ranks(tmp_path, "short")
    for rank, (res, err) in enumerate(results):
        assert res["out"] == "None"
        (d,) = parse_decision_lines(err)
        assert d["rank"] == rank and d["pid"] == res["pid"]
        assert d["ranks"] == [0, 1]
        assert d["outcome"] == "veto"  # the same outcome on every rank
        assert d["probe"] == ("no" if rank == 1 else "ok")  # but each rank's own probe
        assert d["free_bytes"] == (100 * MiB if rank == 1 else 80 << 30)
        assert d["headroom"] == "gloo" and d["headroom_bytes"] == 64 * MiB

    # every rank's veto WARNING: the first sentence names rank 1, its device and how short it
    # was, from rank 1's own line (plan + headroom - free); the fields follow; it ends with
    # the page. Rank 0 says the same whether it read rank 1's record or only the decided
    # abort: the register carries the figure and the ranks it names.
    (short_line,) = parse_decision_lines(results[1][1])
    short = short_line["plan_bytes"] + short_line["headroom_bytes"] - short_line["free_bytes"]
    then = (", so no rank created FlashInfer's all-reduce workspace; every rank takes the "
            "non-fused all-reduce path.")
    figure = f"rank 1 was {short / MiB:.0f} MiB short on {short_line['device']}" + then
    for rank, (res, err) in enumerate(results):
        (warning,) = [l for l in err.splitlines()
                      if l.startswith("WARNING flashinfer_safe_workspace ")]
        assert warning == "WARNING flashinfer_safe_workspace " + res["json"][1]["message"]
        first = res["json"][1]["fiws_summary"]
        assert first == figure, (rank, first)
        assert warning.startswith(f"WARNING flashinfer_safe_workspace flashinfer_safe_workspace: "
                                  f"{first} Fields: rank={rank} pid={res['pid']} "), warning
        assert warning.endswith(VETO_END)
        # the same fields on the records, as a JSON formatter reads them
        decision, veto = res["json"]
        (line,) = parse_decision_lines(err)
        assert decision["fiws_event"] == "decision" and veto["fiws_event"] == "veto"
        for name in DECISION_FIELDS:
            assert decision["fiws_" + name] == veto["fiws_" + name] == line[name], name
        assert veto["fiws_named"] == [1]


def test_two_ranks_with_different_arguments_say_which(tmp_path):
    for rank, (res, err) in enumerate(_two_ranks(tmp_path, "mismatch")):
        assert res["out"] == "None"
        (warning,) = [l for l in err.splitlines()
                      if l.startswith("WARNING flashinfer_safe_workspace ")]
        assert warning.startswith(
            "WARNING flashinfer_safe_workspace flashinfer_safe_workspace: ranks 0 and 1 called "
            "with different arguments (max_token_num), so no rank created FlashInfer's "
            "all-reduce workspace; every rank takes the non-fused all-reduce path. Fields: "
            f"rank={rank} pid={res['pid']} "), warning
        assert "max_token_num differs: 1024 on rank 0; 2048 on rank 1" in warning
        assert warning.endswith(VETO_END)
        (line,) = parse_decision_lines(err)
        assert line["reasons"] == ["ARG_MISMATCH"]
        assert res["json"][0]["fiws_reasons"] == ["ARG_MISMATCH"]
