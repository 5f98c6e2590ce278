"""The report section of gpu-check's case w (the one-GPU hang, FlashInfer 0.7.2.post1,
without and with the shim): used by gpu_report.render."""

from __future__ import annotations

MiB = 1 << 20
VARIANTS = {"off": "without the shim", "on": "with the shim"}


def _esc(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: list, rows: list) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    out += ["| " + " | ".join(_esc(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def _seconds(row: dict) -> str:
    s = row.get("seconds")
    if not isinstance(s, (int, float)):
        return "n/a"
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.1f} s"


def _outcome(row: dict, bound: float) -> str:
    o = row.get("outcome") or {}
    kind = o.get("kind")
    if kind == "returned":
        return f"returned {o.get('note')}"
    if kind == "raised":
        msg = (o.get("msg") or "").strip().splitlines()
        return f"raised {str(o.get('type', '?')).rsplit('.', 1)[-1]}" + (
            f": {msg[0][:120]}" if msg else "")
    if kind == "blocked":
        return f"no answer: still inside the call at {bound:.0f} s, killed"
    return kind or "?"


def _rows(d: dict, bound: float) -> list:
    rows = []
    for variant in ("off", "on"):
        for r in [x for x in d.get("rows") or [] if x.get("variant") == variant]:
            entered = r.get("entered_flashinfer")
            alive = r.get("alive_after_answer")
            rows.append([VARIANTS[variant], r.get("rank"),
                         "starved (calls second)" if r.get("starved") else "peer (calls first)",
                         "yes" if entered else ("no" if entered is not None else "n/a"),
                         _outcome(r, bound), _seconds(r),
                         "**yes**" if r.get("blocked_at_bound") else "no",
                         "yes" if alive else ("n/a (no answer)" if alive is None else "no")])
    return rows


def _sync_lines(d: dict) -> list:
    lines = []
    for variant in ("off", "on"):
        s = ((d.get("variants") or {}).get(variant) or {}).get("sync")
        if not s:
            continue
        after = s.get("hog_after_entry_s")
        left = s.get("hog_left")
        lines.append(
            f"- {VARIANTS[variant]}: the peer entered `{s.get('peer_target')}`; the starved rank "
            f"saw its signal after waiting {_ms(s.get('waited_s'))} and took the GPU's memory "
            f"{_ms(after)} after that entry, leaving "
            f"{left / MiB:.0f} MiB free" if isinstance(left, int) else
            f"- {VARIANTS[variant]}: no memory taken (the peer's entry was not seen)")
        stack = s.get("peer_stack") or []
        if stack:
            lines.append("  (the peer's stack at that entry: `" + " > ".join(
                x.split(" (")[0] for x in stack[-8:]) + "`)")
    return lines


def _ms(seconds) -> str:
    return f"{seconds * 1000:.1f} ms" if isinstance(seconds, (int, float)) else "n/a"


def _short(frame: str) -> str:
    """'File "/x/site-packages/flashinfer/comm/a.py", line 3 in f' -> 'flashinfer/comm/a.py:3 in f'."""
    text = frame.strip()[len("File "):].strip()
    path, _, rest = text.partition('", line ')
    path = path.strip('"')
    for marker in ("site-packages/", "/site/", "/tests/gpu/"):
        if marker in path:
            path = path.rsplit(marker, 1)[1]
            break
    else:
        path = path.rsplit("/", 1)[-1]
    line, _, func = rest.partition(" in ")
    return f"{path}:{line} in {func}"


def _thread_blocks(text: str) -> list:
    blocks, cur = [], None
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith(("Thread 0x", "Current thread 0x")):
            cur = []
            blocks.append(cur)
        elif line.startswith("File ") and cur is not None:
            cur.append(line)
    return blocks


def _stack_block(d: dict) -> list:
    """The blocked rank's stack at the bound: the thread inside FlashInfer's exchange (else
    the deepest one), innermost frame first, paths shortened to the package."""
    stacks = ((d.get("variants") or {}).get("off") or {}).get("stacks") or {}
    lines = []
    for rank, text in sorted(stacks.items()):
        blocks = _thread_blocks(text)
        if not blocks:
            continue
        block = next((b for b in blocks if any("exchange_fds" in f for f in b)),
                     max(blocks, key=len))
        lines += [f"Where rank {rank} was blocked (faulthandler, 3 s before the bound; innermost "
                  "frame first):", "", "```"]
        lines += [_short(f) for f in block[:16]] + ["```", ""]
    return lines


def render_w(case: dict) -> list:
    d = case.get("data") or {}
    p = d.get("params") or {}
    bound = float(p.get("bound_s") or 75)
    shape = p.get("shape") or {}
    lines = [
        f"Two ranks share `cuda:0` over a gloo WORLD; FlashInfer {p.get('expect_flashinfer')} "
        f"(no vote of its own around `cuMemCreate`). Both call `create_allreduce_fusion_workspace("
        f"backend=\"trtllm\", world_size=2, max_token_num={shape.get('T')}, "
        f"hidden_dim={shape.get('H')}, dtype={shape.get('dtype')})`. The peer (rank 1) calls "
        "first; the starved rank (rank 0) waits until the peer has entered the creation, then "
        f"takes the GPU's memory (leaving about {p.get('leave_mb')} MiB), then calls. The peer's "
        "entry is observed, not guessed: a profile hook in the peer writes a signal file when its "
        "thread enters FlashInfer's fd exchange (without the shim: after its first `cuMemCreate`, "
        "at its first collective) or the shim's agreement (with it: after its probe and checks); "
        "rank 0 polls for that file. Each rank stays alive after its answer, as a serving engine "
        f"does; a rank still inside the call after {bound:.0f} s is reported as blocked and "
        "killed. The two runs are the same program; only `FLASHINFER_SAFE_WORKSPACE=1` differs "
        "(the installed wheel's `.pth` activates the shim).", "",
        _table(["Run", "Rank", "Role", "Entered FlashInfer", "Outcome", "Time",
                f"Still blocked at {bound:.0f} s", "Alive after its answer"], _rows(d, bound)), ""]
    lines += _sync_lines(d) + [""]
    lines += _stack_block(d)
    on = [r.get("seconds") for r in d.get("rows") or [] if r.get("variant") == "on"]
    slowest = max((s for s in on if isinstance(s, (int, float))), default=None)
    lines += ["**For a user:** without the shim, one rank that runs short of memory while its "
              "peer is already inside the creation raises at once, and the peer waits in "
              "FlashInfer's exchange for the collective's timeout (this harness gives its gloo "
              "WORLD 300 s; torch's default is 30 minutes). With the shim, both ranks learn that "
              "the workspace is not created"
              + (f" (the slower answer took {_seconds({'seconds': slowest})}, counted from that "
                 "rank's own call, the peer's wait for the starved rank included)"
                 if slowest is not None else "")
              + ", get `None`, and go on without the fused all-reduce.", ""]
    return lines
