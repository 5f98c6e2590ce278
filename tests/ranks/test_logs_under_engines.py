"""What a serving engineer sees of our log lines under each engine's logging configuration
(docs/logs.md, "Seeing the decision line under each engine"; the README's table).

Each case is a fresh interpreter that first configures logging the way the engine does
(the shapes read from vLLM 0.33.0's ``vllm/logger.py`` and SGLang 0.5.23's
``configure_logger``), then makes one real vetoed decision through the wrapped FlashInfer
function (one rank, the SimulatedDevice with 256 MiB free). Every wait is bounded.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

TIMEOUT = 180

SHAPES = {
    # vLLM: one handler, on its own "vllm" logger only; the root logger keeps none
    "vllm": """
        from logging.config import dictConfig
        dictConfig({"version": 1, "disable_existing_loggers": False,
                    "formatters": {"vllm": {"format": "VLLMFMT %(levelname)s %(message)s"}},
                    "handlers": {"vllm": {"class": "logging.StreamHandler", "formatter": "vllm",
                                          "level": "INFO", "stream": "ext://sys.stdout"}},
                    "loggers": {"vllm": {"handlers": ["vllm"], "level": "INFO",
                                         "propagate": False}}})
    """,
    # SGLang: basicConfig on the root logger, at --log-level (default info), in its format
    "sglang": """
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s TP0] %(message)s",
                            datefmt="%Y-%m-%d %H:%M:%S", force=True)
    """,
}

SCRIPT = """
import logging, os, sys
{shape}
import torch
import flashinfer_safe_workspace as fiws
from flashinfer_safe_workspace.planning import probe as _probe
from flashinfer_safe_workspace.planning.simulated import SimulatedDevice
fiws.install(on_veto="none", vote_timeout=60)
import flashinfer.comm as comm
_probe.set_prober(SimulatedDevice(256 << 20))
r = comm.create_allreduce_fusion_workspace(backend="trtllm", world_size=1, rank=0,
                                           max_token_num=1024, hidden_dim=4096,
                                           dtype=torch.bfloat16)
print("RETURNED", r, flush=True)
"""


def _run(engine: str, debug: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHINFER_SAFE_WORKSPACE")}
    if debug:
        env["FLASHINFER_SAFE_WORKSPACE_DEBUG"] = "1"
    script = SCRIPT.format(shape=textwrap.dedent(SHAPES[engine]))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert proc.returncode == 0 and "RETURNED None" in proc.stdout, proc.stderr[-2000:]
    return proc


def _lines(text: str, needle: str) -> list:
    return [l for l in text.splitlines() if needle in l]


VETO_END = "What to do: docs/when-it-vetoes.md"  # every veto WARNING ends so


def test_under_vllm_the_decision_line_is_hidden_and_the_veto_warning_is_bare():
    proc = _run("vllm", debug=False)
    out = proc.stdout + proc.stderr
    assert _lines(out, "fiws decision") == []
    (warning,) = _lines(proc.stderr, VETO_END)
    assert warning.startswith("flashinfer_safe_workspace: this rank was ")  # the bare message
    assert warning.endswith(VETO_END) and " rank=- pid=" in warning
    assert "VLLMFMT" not in warning


def test_under_vllm_debug_shows_the_decision_line():
    proc = _run("vllm", debug=True)
    (line,) = _lines(proc.stderr, "fiws decision")
    assert line.startswith("[flashinfer_safe_workspace pid=") and " INFO fiws decision " in line
    assert "outcome=veto" in line


def test_under_sglang_the_decision_line_is_shown_in_its_format():
    proc = _run("sglang", debug=False)
    (line,) = _lines(proc.stderr, "fiws decision")
    assert line.startswith("[") and " TP0] fiws decision " in line and "outcome=veto" in line
    (warning,) = _lines(proc.stderr, VETO_END)
    assert " TP0] flashinfer_safe_workspace: this rank was " in warning
    assert warning.endswith(VETO_END) and " rank=- pid=" in warning
