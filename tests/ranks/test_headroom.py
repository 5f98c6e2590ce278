"""HEADROOM_MB=auto: the reserve follows the group FlashInfer's collectives run on.

Real two-rank gloo groups (tests/harness.py) and FlashInfer 0.7.4's own
``TorchDistBackend``. This CPU build of torch has no ``ProcessGroupNCCL`` class, so the
NCCL branches use the narrowest stand-in: a group object whose ``_get_backend(cuda)``
returns a backend with (or without) ``_is_initialized``, with ``dist.get_backend``
answering "nccl" for it alone. The GPU run (issue 11, part 4) covers the real class.
"""

from __future__ import annotations

import pytest

from flashinfer_safe_workspace.planning import headroom as _headroom
from flashinfer_safe_workspace import _config
from flashinfer_safe_workspace._config import ParseError
from harness import results, run_ranks

MiB = 1 << 20
SMALL = _headroom.SMALL_RESERVE_MB * MiB
NCCL = _headroom.NCCL_RESERVE_MB * MiB


def _headroom_var():
    return next(v for v in _config.VARIABLES if v.field == "headroom_mb")


@pytest.mark.parametrize("text,value", [("auto", "auto"), (" AUTO ", "auto"), ("0", 0),
                                        ("512", 512), (" 64 ", 64), ("1048576", 1 << 20)])
def test_parse(text, value):
    """The one parser of HEADROOM_MB: the config table's."""
    assert _headroom_var().parse(text) == value


@pytest.mark.parametrize("text", ["-1", "1.5", "lots", "", "auto512", "1048577"])
def test_parse_rejects(text):
    with pytest.raises(ParseError):
        _headroom_var().parse(text)


def test_a_number_is_that_many_mib(monkeypatch):
    for text, mib in (("256", 256), ("0", 0)):
        monkeypatch.setenv("FLASHINFER_SAFE_WORKSPACE_HEADROOM_MB", text)
        setting = _config.reload().headroom_mb
        got = _headroom.resolve(setting, entry="unified", backend="trtllm", group=None,
                                comm_backend=None)
        assert got == (mib * MiB, "set")


def test_no_process_group_cannot_be_told():
    got = _headroom.resolve("auto", entry="unified", backend="trtllm", group=None,
                            comm_backend=None)
    assert got == (NCCL, "unknown")


BODY = """
import torch.distributed as dist
from flashinfer.comm.mnnvl import TorchDistBackend
from flashinfer_safe_workspace.planning import headroom as _headroom

def r(**kw):
    kw.setdefault("entry", "unified"); kw.setdefault("backend", "trtllm")
    kw.setdefault("group", None); kw.setdefault("comm_backend", None)
    return list(_headroom.resolve("auto", **kw))

sub = dist.new_group([0, 1], backend="gloo")
result["world"] = r()
result["subgroup"] = r(group=sub)
result["auto_subgroup"] = r(backend="auto", group=sub)
result["legacy_world"] = r(entry="legacy")
result["comm_gloo_sub"] = r(comm_backend=TorchDistBackend(group=sub))
result["comm_gloo_world"] = r(comm_backend=TorchDistBackend())
result["legacy_symm_comm"] = r(entry="legacy", use_symm_dev_mem=True,
                               comm_backend=TorchDistBackend(group=sub))
result["mnnvl_no_comm"] = r(backend="mnnvl")
result["number"] = list(_headroom.resolve(100, entry="unified", backend="trtllm", group=sub,
                                          comm_backend=None))

class Custom:  # a comm backend with no torch group: cannot be told
    def Get_rank(self): return RANK
    def Get_size(self): return WORLD
result["custom_comm"] = r(comm_backend=Custom())
result["cutedsl_ignores_comm"] = r(backend="mnnvl-cutedsl", group=sub, comm_backend=Custom())

# ---- NCCL branches: narrowest stand-in (no ProcessGroupNCCL in a CPU build)
class Backend:
    def __init__(self, ready): self.ready, self.asked = ready, 0
    def _is_initialized(self):
        self.asked += 1
        return self.ready
class OldBackend:  # a torch without the query
    pass
class NcclGroup:
    bound_device_id = None
    def __init__(self, backend, name="nccl"): self.backend, self.name = backend, name
    def _get_backend(self, device):
        assert str(device) == "cuda"
        return self.backend
real_get_backend = dist.get_backend
dist.get_backend = lambda g=None: g.name if isinstance(g, NcclGroup) else real_get_backend(g)
warm, cold = Backend(True), Backend(False)
result["nccl_warm"] = r(group=NcclGroup(warm))
result["nccl_cold"] = r(group=NcclGroup(cold))
result["nccl_old_torch"] = r(group=NcclGroup(OldBackend()))
result["mixed_cold"] = r(group=NcclGroup(Backend(False), "cpu:gloo,cuda:nccl"))
result["mixed_warm"] = r(group=NcclGroup(Backend(True), "cpu:gloo,cuda:nccl"))
result["queried"] = [warm.asked, cold.asked]
result["torchdist_over_nccl_warm"] = r(comm_backend=TorchDistBackend(group=NcclGroup(warm)))
class Fixed(TorchDistBackend):  # SGLang's shape: allgather on the NCCL group, bcast on gloo
    def __init__(self, device_group, cpu_group):
        super().__init__(group=device_group); self._cpu_group = cpu_group
result["sglang_cold"] = r(comm_backend=Fixed(NcclGroup(cold), sub))
result["sglang_warm"] = r(comm_backend=Fixed(NcclGroup(warm), sub))
class Broken:
    bound_device_id = None
    name = "nccl"
    def _get_backend(self, device): raise RuntimeError("no backend for cuda")
dist.get_backend = lambda g=None: "nccl" if isinstance(g, Broken) else real_get_backend(g)
result["nccl_lookup_fails"] = r(group=Broken())
dist.get_backend = real_get_backend
"""


def test_auto_headroom_over_real_groups():
    runs = run_ranks(2, BODY, timeout=120)
    for res in results(runs):
        small = lambda why: [SMALL, why]  # noqa: E731
        nccl = lambda why: [NCCL, why]  # noqa: E731
        assert res["world"] == small("gloo"), res
        assert res["subgroup"] == small("gloo")
        assert res["auto_subgroup"] == small("gloo")
        assert res["legacy_world"] == small("gloo")
        assert res["comm_gloo_sub"] == small("cpu-comm-backend")
        assert res["comm_gloo_world"] == small("cpu-comm-backend")
        assert res["legacy_symm_comm"] == small("cpu-comm-backend")
        assert res["mnnvl_no_comm"] == small("cpu-comm-backend")
        assert res["number"] == [100 * MiB, "set"]
        assert res["custom_comm"] == nccl("unknown")
        assert res["cutedsl_ignores_comm"] == small("gloo")
        assert res["nccl_warm"] == small("nccl-warm")
        assert res["nccl_cold"] == nccl("nccl-cold")
        assert res["nccl_old_torch"] == nccl("unknown")
        assert res["mixed_cold"] == nccl("nccl-cold")
        assert res["mixed_warm"] == small("nccl-warm")
        assert res["queried"] == [1, 1]
        assert res["torchdist_over_nccl_warm"] == small("nccl-warm")
        assert res["sglang_cold"] == nccl("nccl-cold")
        assert res["sglang_warm"] == small("nccl-warm")
        assert res["nccl_lookup_fails"] == nccl("unknown")


def test_why_values_are_the_documented_ones():
    assert set(_headroom.WHY) == {"set", "gloo", "cpu-comm-backend", "nccl-warm", "nccl-cold",
                                  "unknown"}
    assert _headroom.SMALL_RESERVE_MB < _headroom.NCCL_RESERVE_MB == 512
