"""One rank of scripts/gpu-checks (two ranks on cuda:0, gloo world of 2)."""
import datetime, json, os, sys, time, traceback

import torch
import torch.distributed as dist

RANK = int(os.environ["FIWS_GC_RANK"])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["FIWS_GC_PORT"],
                        rank=RANK, world_size=2, timeout=datetime.timedelta(seconds=120))
torch.cuda.set_device(0)
out = {"rank": RANK}


def step(name, fn):
    t = time.perf_counter()
    try:
        out[name] = {"value": fn()}
    except BaseException as exc:  # noqa: BLE001 - recorded, the script goes on
        out[name] = {"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()[-2000:]}
    out[name]["s"] = round(time.perf_counter() - t, 4)


import dataclasses
import flashinfer.comm as comm
import flashinfer_safe_workspace as fiws
from flashinfer_safe_workspace.planning import probe

step("rank_facts", lambda: dataclasses.asdict(probe.get_prober().rank_facts()))
fiws.install(on_veto="none", deep_probe=True, vote_timeout=60)
args = dict(world_size=2, rank=RANK, max_token_num=1024, hidden_dim=4096, dtype=torch.bfloat16)
# 1. mnnvl on a host without multicast: vetoed by the multicast check before any multicast call
step("mnnvl_vetoed", lambda: comm.create_allreduce_fusion_workspace(backend="mnnvl", **args) is None)
# 2. the deep probe's round trip (POSIX fd via pidfd_getfd) then trtllm on cuda:0 by both ranks
def trtllm():
    ws = comm.create_allreduce_fusion_workspace(backend="trtllm", **args)
    made = ws is not None
    if made:
        ws.destroy()
    return {"created": made}
step("trtllm_with_deep_probe", trtllm)
# 3. under capture: first FlashInfer itself (shim off), then the capture veto (shim on)
def under_capture(shim):
    if not shim:
        fiws.uninstall()
    g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    res = {}
    with torch.cuda.stream(s):
        try:
            with torch.cuda.graph(g, stream=s):
                try:
                    ws = comm.create_allreduce_fusion_workspace(backend="trtllm", **dict(args, max_token_num=512))
                    res["returned"] = ws is not None
                except BaseException as exc:  # noqa: BLE001
                    res["raised"] = f"{type(exc).__name__}: {exc}"[:400]
        except BaseException as exc:  # noqa: BLE001 - the capture itself broke
            res["capture_error"] = f"{type(exc).__name__}: {exc}"[:400]
    if not shim:
        fiws.install(on_veto="none", deep_probe=True, vote_timeout=60)
    return res
step("capture_shim_on", lambda: under_capture(True))
step("capture_flashinfer_alone", lambda: under_capture(False))
print(json.dumps(out, default=str), flush=True)
dist.destroy_process_group()
