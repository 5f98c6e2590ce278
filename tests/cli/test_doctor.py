"""``python -m flashinfer_safe_workspace doctor``: real interpreters, real .pth, real hooks.

Every case runs the installed package in a fresh subprocess (the answer depends on
how the interpreter started), bounded by a timeout.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from importlib.metadata import version

import pytest

from flashinfer_safe_workspace.planning import facts as _facts, rules
from flashinfer_safe_workspace.cli import doctor as _doctor, preflight as _preflight

TIMEOUT = 120
VAR = "FLASHINFER_SAFE_WORKSPACE"


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(VAR)}
    env.update(extra)
    return env


def doctor(*args, **env):
    proc = subprocess.run([sys.executable, "-m", "flashinfer_safe_workspace", "doctor", *args],
                          env=_env(**env), capture_output=True, text=True, timeout=TIMEOUT)
    return proc


def doctor_json(*args, **env):
    proc = doctor("--json", *args, **env)
    assert proc.stdout.strip(), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def test_unset_is_inactive_exit_1():
    rc, r = doctor_json()
    assert rc == 1
    assert r["active"] is False
    assert r["variable"] == {"name": VAR, "value": None, "enabled": False}
    assert r["flashinfer"]["imported"] is True
    assert r["flashinfer"]["wrapped"] == []  # imported, but nothing hooked
    assert r["hooks_registered"] is False
    assert r["wrapt"]["imported"] is False  # the dormant shim never loads wrapt
    assert any("not set" in line for line in r["why"])


def active_code(r) -> int:
    """doctor's exit code for an active shim: 3 when every call here would be vetoed (on a
    machine without a CUDA driver, such as CI), else 0."""
    return 3 if r["vetoes_every_call"] else 0


def test_enabled_is_active_and_wraps_both_targets():
    rc, r = doctor_json(**{VAR: "1"})
    assert rc == active_code(r)
    assert r["active"] is True and r["hooks_registered"] is True
    assert r["variable"]["value"] == "1" and r["variable"]["enabled"] is True
    wrapped = set(r["flashinfer"]["wrapped"])
    for name in ("flashinfer.comm.create_allreduce_fusion_workspace",
                 "flashinfer.comm.trtllm_create_ipc_workspace_for_all_reduce_fusion",
                 "flashinfer.comm.allreduce.create_allreduce_fusion_workspace",
                 "flashinfer.comm.trtllm_ar.trtllm_create_ipc_workspace_for_all_reduce_fusion"):
        assert name in wrapped
    assert r["wrapt"]["imported"] is True


def test_text_output_names_the_wrapped_functions():
    proc = doctor(**{VAR: "yes", f"{VAR}_FAIL_OPEN": "1"})  # fail-open: no veto of every call
    assert proc.returncode == 0, proc.stderr
    assert "active in this interpreter: yes" in proc.stdout
    assert "flashinfer.comm.create_allreduce_fusion_workspace" in proc.stdout
    assert f"{VAR}: 'yes' -> enabled=True" in proc.stdout


@pytest.mark.parametrize("value", ["0", "off", "  "])
def test_off_values_are_inactive(value):
    rc, r = doctor_json(**{VAR: value})
    assert rc == 1
    assert r["active"] is False and r["variable"]["enabled"] is False


def test_garbage_value_warns_and_stays_off():
    proc = doctor("--json", **{VAR: "maybe"})
    assert proc.returncode == 1
    r = json.loads(proc.stdout)
    assert r["variable"]["value"] == "maybe" and r["active"] is False
    assert any("does not turn the shim on" in line for line in r["why"])


def test_no_import_reports_nothing_wrapped():
    rc, r = doctor_json("--no-import", **{VAR: "1"})
    assert rc == active_code(r)  # hooks registered, or the bootstrap waits for flashinfer
    assert r["hooks_registered"] or r["waiting_for_flashinfer"]
    assert r["flashinfer"]["imported"] is False
    assert r["flashinfer"]["wrapped"] == []
    if r["waiting_for_flashinfer"]:  # lazy bootstrap: wrapt not loaded before flashinfer
        assert r["wrapt"]["imported"] is False


def test_versions_match_the_installed_distributions():
    rc, r = doctor_json(**{VAR: "1"})
    assert r["wrapt"]["version"] == version("wrapt")
    assert r["wrapt"]["major"] == int(version("wrapt").split(".")[0])
    fi = version("flashinfer-python")
    assert r["flashinfer"]["version"] == fi
    assert r["flashinfer"]["rules"] == rules.range_of(fi)
    assert r["flashinfer"]["verified"] is (not rules.is_unknown(fi))
    from flashinfer_safe_workspace import __version__
    assert r["package_version"] == __version__


def test_pth_is_found_in_a_site_directory():
    rc, r = doctor_json("--no-import")
    running = [e for e in r["pth"]["files"] if e["runs_at_start"]]
    assert running, r["pth"]
    site_dirs = {os.path.realpath(d) for d in site.getsitepackages()}
    assert any(os.path.realpath(os.path.dirname(e["path"])) in site_dirs for e in running)
    assert all(e["ok"] for e in running)


def test_settings_are_the_effective_ones():
    rc, r = doctor_json("--no-import", **{VAR: "1", f"{VAR}_HEADROOM_MB": "100",
                                          f"{VAR}_ON_VETO": "raise",
                                          f"{VAR}_VOTE_TIMEOUT": "bogus"})
    assert r["settings"]["headroom_mb"] == 100
    assert r["settings"]["on_veto"] == "raise"
    assert r["settings"]["vote_timeout"] == 120.0  # malformed: the default


def test_no_driver_is_reported_gracefully():
    rc, r = doctor_json("--no-import", **{VAR: "1"})
    cuda = r["cuda"]
    if cuda["driver_version"] is not None:
        pytest.skip(f"this machine has a CUDA driver ({cuda['driver_version']})")
    assert r["active"] is True  # no driver does not make the shim inactive ...
    assert rc == 3  # ... but every call is vetoed (issue 23: it exited 0, "active")
    assert cuda["error"].startswith("no driver") or cuda["error"].startswith("no cuda-python")
    assert cuda["device_count"] is None


def test_install_in_code_counts_as_active():
    code = ("import flashinfer_safe_workspace as f, json, sys; f.install();"
            "from flashinfer_safe_workspace.cli import doctor as _doctor;"
            "r = _doctor.doctor_report(); print(json.dumps([r['active'], r['flashinfer']['wrapped'],"
            " r['why'][0]]))")
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    active, wrapped, why = json.loads(proc.stdout)
    assert active is True
    assert "flashinfer.comm.create_allreduce_fusion_workspace" in wrapped
    assert "install()" in why


def test_unverified_flashinfer_release_is_flagged(monkeypatch):
    # Stand-in: pretend the installed FlashInfer is newer than the newest mirrored
    # release (CI cannot install a FlashInfer that does not exist yet).
    newer = "%d.%d.%d" % (rules.NEWEST[0], rules.NEWEST[1], rules.NEWEST[2] + 1)
    monkeypatch.setattr(rules, "flashinfer_version", lambda: newer)
    r = _doctor.doctor_report(import_flashinfer=False)
    assert r["flashinfer"]["version"] == newer
    assert r["flashinfer"]["verified"] is False
    assert r["flashinfer"]["rules"] == rules.RANGES[-1][1]
    assert any(newer in line and "UNKNOWN_VERSION" in line for line in r["why"])
    text = _doctor.format_doctor(r)
    assert "verified no" in text


def test_doctor_prints_the_facts_it_plans_with():
    """torch's real signal pad, and (no driver here) H200's per-size multicast rule."""
    rc, r = doctor_json("--no-import", **{VAR: "1"})
    pad, source = _facts.signal_pad()
    facts = r["facts"]
    assert facts["torch_signal_pad"] == pad and facts["torch_signal_pad_source"] == source
    if r["cuda"]["error"]:
        assert facts["source"].startswith("H200 values")
        assert facts["multicast_granularity_by_size"] == {str(2 << 20): 2 << 20,
                                                          str(1 << 30): 512 << 20}
    text = " ".join(doctor("--no-import", **{VAR: "1"}).stdout.split())  # lines are wrapped
    assert f"torch signal pad {pad} B ({source})" in text
    # the line states the granularity the facts hold (H200's 2 MiB without a driver; the
    # driver's answer with one)
    assert f"granularity {facts['granularity'] / (1 << 20):g} MiB;" in text, (facts, text)
    if r["cuda"]["error"]:
        assert facts["granularity"] == 2 << 20


def test_text_lines_are_wrapped_and_the_cuda_error_said_once():
    proc = doctor("--no-import", **{VAR: "1"})
    lines = proc.stdout.splitlines()
    assert all(len(l) <= 100 or " " not in l.strip() for l in lines), \
        [l for l in lines if len(l) > 100]
    rc, r = doctor_json("--no-import", **{VAR: "1"})
    if r["cuda"]["error"]:
        assert proc.stdout.count("CUDA:") == 1, proc.stdout
        # the error's own words once in all (not again per check), and nothing on stderr
        words = " ".join(r["cuda"]["error"].split()[-4:])
        assert " ".join(proc.stdout.split()).count(words) == 1, proc.stdout
        assert "internal error" not in proc.stderr, proc.stderr
    assert "activated by pth" in proc.stdout or "activated by start" in proc.stdout


def test_doctor_lists_every_check_with_its_verdict():
    """Every preflight check (``checks.ALL``), for both backends, in the JSON and in the
    text, each with a verdict; with no driver here the checks that need the facts say
    so in a few words and fail closed (CHECK_ERROR), as a decision would."""
    from flashinfer_safe_workspace import _reasons as R, checks

    names = [c.NAME for c in checks.ALL]
    proc = doctor("--no-import")
    rc, r = doctor_json("--no-import")
    for backend in ("trtllm", "mnnvl"):
        rows = r["checks"][backend]
        assert [row["check"] for row in rows] == names
        for row in rows:
            line = next(l for l in proc.stdout.splitlines()
                        if l.split()[:2] == [backend, row["check"]])
            verdict = line.split()[2]
            assert verdict in ("ok", "n/a", "per", "VETO"), line
            if r["checks"]["facts_error"] and row["ok"] is False:
                assert row["code"] == R.CHECK_ERROR and "facts" in line, line


def test_checks_report_with_facts_gives_each_checks_answer():
    """In-process with a simulated device that has no multicast: a named mnnvl vetoes on
    the multicast check with NO_MULTICAST; trtllm passes it; shared-GPU does not apply to
    trtllm (FlashInfer 0.7.4 handles it)."""
    from flashinfer_safe_workspace import _config, _reasons as R
    from flashinfer_safe_workspace.planning import probe as _probe
    from flashinfer_safe_workspace.planning.simulated import SimulatedDevice

    _probe.set_prober(SimulatedDevice(80 << 30, multicast=False))
    rep = _preflight.checks_report("0.7.4", _config.current())
    by = {b: {row["check"]: row for row in rep[b]} for b in ("trtllm", "mnnvl")}
    assert rep["facts_error"] == "" and rep["facts"]["multicast"] is False
    assert by["mnnvl"]["multicast"]["ok"] is False
    assert by["mnnvl"]["multicast"]["code"] == R.NO_MULTICAST
    assert "multicast=0" in by["mnnvl"]["multicast"]["value"]
    assert by["trtllm"]["multicast"]["applies"] is False or by["trtllm"]["multicast"]["ok"]
    assert by["trtllm"]["gpus"]["applies"] is False
    assert by["trtllm"]["capture"]["ok"] and by["trtllm"]["capture"]["value"] == "capturing=0"
    text = "\n".join(_preflight.format_checks(rep))
    assert "mnnvl   multicast VETO (23)" in text, text


# --------------------------------------------------------------------------- every call vetoed


def test_active_but_every_call_vetoed_exits_3_and_says_why():
    """Issue 23: without a usable CUDA driver every call is vetoed, yet doctor said "active"
    and exited 0. It exits 3 and names the cause; a real two-rank call through the shim on
    this machine is vetoed with the code doctor names (NO_DEVICE). FAIL_OPEN lifts it."""
    rc, r = doctor_json("--no-import", **{VAR: "1"})
    if r["cuda"]["driver_version"] is not None:
        pytest.skip("this machine has a CUDA driver")
    assert r["active"] is True and rc == 3, r["vetoes_every_call"]
    assert "NO_DEVICE" in r["vetoes_every_call"][0]
    text = " ".join(doctor("--no-import", **{VAR: "1"}).stdout.split())
    assert "but every call here would be vetoed" in text
    assert "every workspace creation here would be vetoed" in text and "NO_DEVICE" in text
    rc_open, r_open = doctor_json("--no-import", **{VAR: "1", f"{VAR}_FAIL_OPEN": "1"})
    assert rc_open == 0 and r_open["vetoes_every_call"] == []
    rc_off, r_off = doctor_json("--no-import")  # not active: 1, whatever would be vetoed
    assert rc_off == 1 and r_off["vetoes_every_call"]

    from harness import results, run_ranks

    runs = run_ranks(2, """
        import rank_lib, flashinfer_safe_workspace as fiws
        rank_lib.capture = rank_lib._Capture()
        fiws.install()  # the real CUDA prober: no simulated device
        outcome, secs, err = rank_lib.create(rank=RANK)
        result.update(outcome=outcome, reasons=rank_lib.last_reasons)
    """, internal_errors=None)
    assert [(x["outcome"], x["reasons"]) for x in results(runs)] == [("none", ["NO_DEVICE"])] * 2


def _simulated_report(monkeypatch, device, **settings):
    from flashinfer_safe_workspace import _config
    from flashinfer_safe_workspace.planning import probe as _probe

    _probe.set_prober(device)
    version = settings.pop("version", "0.7.4")
    monkeypatch.setattr(rules, "flashinfer_version", lambda: version)
    for name, value in settings.items():
        monkeypatch.setenv(f"{VAR}_{name.upper()}", value)
    _config.reload()
    try:
        return _doctor.doctor_report(import_flashinfer=False)
    finally:
        _probe.set_prober(None)
        monkeypatch.undo()
        _config.reload()


def test_a_device_where_calls_pass_is_not_every_call_vetoed(monkeypatch):
    """The same verdict from the checks themselves: a simulated device with multicast
    passes every check (no veto of every call); without multicast mnnvl vetoes, trtllm
    does not (still not every call); UNKNOWN_VERSION=veto on a release not read vetoes all."""
    from flashinfer_safe_workspace.planning.simulated import SimulatedDevice

    r = _simulated_report(monkeypatch, SimulatedDevice(80 << 30))
    assert r["checks"]["facts_error"] == "" and r["vetoes_every_call"] == []
    r = _simulated_report(monkeypatch, SimulatedDevice(80 << 30, multicast=False))
    assert any(row["ok"] is False for row in r["checks"]["mnnvl"])
    assert r["vetoes_every_call"] == []
    r = _simulated_report(monkeypatch, SimulatedDevice(80 << 30), version="0.7.4.post1",
                          unknown_version="veto")
    assert r["flashinfer"]["verified"] is False
    assert "UNKNOWN_VERSION" in r["vetoes_every_call"][0]


# --------------------------------------------------------------------------- issue 30


def _fake_flashinfer_release(folder, release: str) -> str:
    """A folder whose only content is flashinfer-python's metadata for ``release``: first on
    PYTHONPATH, it is the FlashInfer version doctor reads (with --no-import)."""
    info = folder / f"flashinfer_python-{release}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: flashinfer-python\n"
                                   f"Version: {release}\n")
    return str(folder)


@pytest.mark.parametrize("setting,does", [
    (None, "with UNKNOWN_VERSION=newest (the default) each call is planned with the rules of "
           "R10 (0.7.4's, the newest read), probed and voted as usual"),
    ("pass-through", "with UNKNOWN_VERSION=pass-through each call goes to FlashInfer "
                     "unprotected (no plan, no probe, no vote)"),
    ("veto", "with UNKNOWN_VERSION=veto every call is vetoed (reason UNKNOWN_VERSION)"),
])
def test_a_newer_release_not_read_is_said_in_one_line(tmp_path, setting, does):
    """Issue 30: FlashInfer 0.7.5 is out but was not read. doctor says in one line that it
    is not verified and what each call does with it under this UNKNOWN_VERSION."""
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [
        _fake_flashinfer_release(tmp_path, "0.7.5"), os.environ.get("PYTHONPATH")]))}
    if setting is not None:
        env[f"{VAR}_UNKNOWN_VERSION"] = setting
    rc, r = doctor_json("--no-import", **env)
    fi = r["flashinfer"]
    assert (fi["version"], fi["rules"], fi["verified"]) == ("0.7.5", "R10", False)
    said = [line for line in r["why"] if line.startswith("FlashInfer 0.7.5")]
    assert said == [f"FlashInfer 0.7.5 is newer than the newest release mirrored (0.7.4), so "
                    f"not verified: {does}"], r["why"]
    text = doctor("--no-import", **env).stdout
    assert "  FlashInfer: 0.7.5, rules R10, verified no (newest mirrored 0.7.4)" in text
    assert "  - FlashInfer 0.7.5 is newer than the newest release mirrored (0.7.4)" in text


def test_limits_print_as_integers_and_the_warnings_read_as_english():
    """Issue 30: a limit printed as "expected at most 1.04858e+06" and a warning read
    "expected a int"."""
    proc = doctor("--no-import", **{f"{VAR}_HEADROOM_MB": "99999999",
                                    f"{VAR}_VOTE_TIMEOUT": "1e9", f"{VAR}_CREATE_TIMEOUT": "x"})
    err = proc.stderr
    assert f"ignoring {VAR}_HEADROOM_MB='99999999' (expected at most 1048576)" in err, err
    assert f"ignoring {VAR}_VOTE_TIMEOUT='1e9' (expected at most 86400)" in err, err
    assert f"ignoring {VAR}_CREATE_TIMEOUT='x' (expected a number in the digits 0-9)" in err
    word = doctor("--no-import", **{f"{VAR}_HEADROOM_MB": "lots"}).stderr
    assert f"{VAR}_HEADROOM_MB='lots' (expected a whole number in the digits 0-9)" in word, word
    for text in (err, word):
        assert "e+0" not in text and " a int" not in text and " a float" not in text


def test_environment_numbers_take_ascii_digits_only():
    """Issue 30's rule for numbers, on the variables doctor reports: int() and float() read
    '٨' and '𝟠'; the settings do not."""
    rc, r = doctor_json("--no-import", **{f"{VAR}_HEADROOM_MB": "\u0668",
                                          f"{VAR}_VOTE_TIMEOUT": "\U0001d7e0"})
    assert r["settings"]["headroom_mb"] == "auto" and r["settings"]["vote_timeout"] == 120.0


def test_under_python_dash_s_the_advice_is_about_dash_s():
    """Issue 30: under ``python -S`` doctor advised "reinstall the package": the .pth is
    installed, but with site off no .pth runs. It says so, and what to do instead."""
    import flashinfer_safe_workspace

    home = os.path.dirname(os.path.dirname(os.path.abspath(flashinfer_safe_workspace.__file__)))
    proc = subprocess.run([sys.executable, "-S", "-m", "flashinfer_safe_workspace", "doctor",
                           "--no-import", "--json"],
                          env=_env(**{VAR: "1", "PYTHONPATH": home, "PYTHONSAFEPATH": "1"}),
                          capture_output=True, text=True, timeout=TIMEOUT)
    r = json.loads(proc.stdout)
    assert proc.returncode == 1 and r["pth"]["site_enabled"] is False, proc.stderr
    assert not any("reinstall" in line for line in r["why"]), r["why"]
    dash_s = [line for line in r["why"] if "-S" in line]
    assert len(dash_s) == 1, r["why"]
    assert "no .pth file runs" in dash_s[0] and "run python without -S" in dash_s[0]
    assert "install()" in dash_s[0]


# --------------------------------------------------------------------------- issue 30's review


def test_pass_through_with_a_release_not_read_is_unprotected_not_vetoed(tmp_path):
    """Review of issue 30, W4: with UNKNOWN_VERSION=pass-through and a release not read, a
    call goes to FlashInfer at once (``_decide.decide``: before any fact is read), yet doctor
    said "every workspace creation here would be vetoed: ... NO_DEVICE" and exited 3. It
    says the calls are unprotected and exits 0; a real two-rank call with 0.7.5 installed
    reaches FlashInfer on both ranks (no veto) on this same machine."""
    fake = _fake_flashinfer_release(tmp_path, "0.7.5")
    env = {VAR: "1", f"{VAR}_UNKNOWN_VERSION": "pass-through",
           "PYTHONPATH": os.pathsep.join(filter(None, [fake, os.environ.get("PYTHONPATH")]))}
    rc, r = doctor_json("--no-import", **env)
    assert r["active"] is True and r["flashinfer"]["verified"] is False
    assert rc == 0 and r["vetoes_every_call"] == [], r["vetoes_every_call"]
    assert "UNKNOWN_VERSION=pass-through" in r["unprotected"]
    assert not any("vetoed" in line for line in r["why"]), r["why"]
    text = " ".join(doctor("--no-import", **env).stdout.split())
    assert "but each call goes to FlashInfer unprotected (UNKNOWN_VERSION=pass-through" in text
    assert "would be vetoed" not in text, text
    # the same setting with a verified release: the checks decide, as before
    rc_read, r_read = doctor_json("--no-import", **{VAR: "1",
                                                    f"{VAR}_UNKNOWN_VERSION": "pass-through"})
    assert r_read["unprotected"] == "" and rc_read == active_code(r_read)

    from harness import results, run_ranks

    runs = run_ranks(2, """
        import flashinfer, rank_lib, flashinfer_safe_workspace as fiws
        flashinfer.__version__ = "0.7.5"  # the release the shim reads first
        rank_lib.capture = rank_lib._Capture()
        fiws.install(unknown_version="pass-through")  # the real CUDA prober, as doctor's
        outcome, secs, err = rank_lib.create(rank=RANK)
        result.update(outcome=outcome, reasons=rank_lib.last_reasons)
    """, internal_errors=None)
    assert all(x["outcome"] != "none" and "NO_DEVICE" not in (x["reasons"] or [])
               for x in results(runs)), results(runs)


def test_under_python_dash_s_doctor_says_what_it_cannot_know(tmp_path):
    """Review of issue 30, M4: under ``python -S`` doctor still said "the hooks are not
    registered: see the warnings above (wrapt missing?)", "FlashInfer is not installed",
    "wrapt is not installed" and "every workspace creation here would be vetoed ...
    NO_DEVICE": -S hides site-packages, so none of these is known. It names what it did not
    find and that it cannot tell, and no veto."""
    import shutil

    import flashinfer_safe_workspace

    # a folder holding the package alone: the installed copy's folder is site-packages
    # itself (a non-editable install, as in CI), where wrapt and FlashInfer are too
    home = str(tmp_path)
    shutil.copytree(os.path.dirname(os.path.abspath(flashinfer_safe_workspace.__file__)),
                    tmp_path / "flashinfer_safe_workspace",
                    ignore=shutil.ignore_patterns("__pycache__"))
    run = lambda *extra: subprocess.run(  # noqa: E731
        [sys.executable, "-S", "-m", "flashinfer_safe_workspace", "doctor", *extra],
        env=_env(**{VAR: "1", "PYTHONPATH": home, "PYTHONSAFEPATH": "1"}),
        capture_output=True, text=True, timeout=TIMEOUT)
    proc = run("--json")
    r = json.loads(proc.stdout)
    assert proc.returncode == 1 and r["pth"]["site_enabled"] is False, proc.stderr
    assert r["hidden_by_dash_s"] == ["wrapt", "FlashInfer", "cuda-python"], r["hidden_by_dash_s"]
    why = " ".join(r["why"])
    for wrong in ("hooks are not registered", "FlashInfer is not installed",
                  "wrapt is not installed", "would be vetoed"):
        assert wrong not in why, r["why"]
    assert r["vetoes_every_call"] == [] and "cannot be told" in r["cannot_tell"]
    assert any(line.startswith("not found on this sys.path: wrapt, FlashInfer, cuda-python")
               for line in r["why"]), r["why"]
    text = " ".join(run().stdout.split())
    assert "wrapt: not found (python -S)" in text and "FlashInfer: not found (python -S)" in text
    assert "not installed" not in text and "would be vetoed" not in text, text
    assert "will vote no" not in text, text
