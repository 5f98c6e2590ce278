"""The allocators' rounding rules, shared by the trtllm, mnnvl and cutedsl rules.

A: cudaMalloc + IPC (plain sizes). B1–B4: FlashInfer's SymmDeviceMemory (cuMemCreate
of RU(size + FlashInfer's 2048-byte signal pad, G), multicast-rounded where it applies;
handle type per release). C: torch symmetric memory (one cuMemCreate block of
RU(RU(size, 16) + torch's signal pad, G), then the rendezvous' pointer arrays).
"""

from __future__ import annotations

from ..plan import MiB, Allocation, Facts, round_up

SIGNAL_PAD = 2048  # flashinfer.comm.mnnvl SIGNAL_PAD_SIZE, every release
A_ROUNDING = 2 * MiB  # trtllm buffers before SymmDeviceMemory/cudaMalloc, 0.5.0–0.6.9


def _b_handle_type(allocator: str, facts: Facts) -> str:
    """Handle type SymmDeviceMemory asks for first."""
    if allocator == "B4":
        # 0.7.4 votes: on one host FABRIC iff every rank's driver attribute says so.
        return "fabric" if facts.fabric_supported else "posix"
    # B1–B3 decide locally and also need the NVML fabric state (is_mnnvl_fabric_supported)
    return "fabric" if (facts.fabric_supported and facts.fabric_nvml_ok) else "posix"


def b_alloc(allocator: str, name: str, buf: int, buf_formula: str, facts: Facts,
             multicast: bool) -> tuple:
    """The cuMemCreate(s) of one SymmDeviceMemory of ``buf`` bytes.

    Returns (allocations, handle type held, notes)."""
    g = facts.granularity
    size = round_up(buf + SIGNAL_PAD, g)
    text = f"RU({buf_formula} + 2048, G={g})"
    if allocator == "B1" or multicast:  # B1 applies Gmc always; B2+ only with multicast
        gmc = facts.gmc(size)  # asked for this object's size, as FlashInfer asks
        size = round_up(size, gmc)
        text = f"RU({text}, Gmc={gmc})"
    handle = _b_handle_type(allocator, facts)
    notes = []
    out = []
    if handle == "fabric" and not facts.imex_channel:
        if allocator == "B4":
            # One host: the FABRIC allocation is created, its export fails without an
            # IMEX channel, every rank releases it, and the same size is created again
            # with POSIX file descriptors.
            out.append(Allocation(name, size, "cuMemCreate", "fabric", held=False,
                                  formula=text + " (FABRIC attempt, released)"))
            handle = "posix"
            notes.append("FABRIC attempted first; no IMEX channel, so each buffer is "
                         "created again with POSIX fds (same size)")
        else:
            notes.append("FABRIC handles without an IMEX channel: FlashInfer's export "
                         "fails after the first cuMemCreate (RuntimeError on every rank)")
    out.append(Allocation(name, size, "cuMemCreate", handle, True, text))
    return out, handle, notes


def c_alloc(name: str, request: int, req_formula: str, facts: Facts, ws: int) -> list:
    """torch symmetric memory: one cuMemCreate block, then the rendezvous' two
    pointer arrays from the caching allocator."""
    block = round_up(round_up(request, 16) + facts.torch_signal_pad, facts.granularity)
    return [
        Allocation(name, block, "cuMemCreate", "posix", True,
                   f"RU(RU({req_formula}, 16) + P_t={facts.torch_signal_pad}, "
                   f"G={facts.granularity})"),
        Allocation(name + ".buffer_ptrs", 8 * ws, "torch", formula="raw_alloc(8*ws)"),
        Allocation(name + ".signal_pad_ptrs", 8 * ws, "torch", formula="raw_alloc(8*ws)"),
    ]

