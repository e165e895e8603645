"""What a newcomer meets first on the command line: ``optirs --version``, ``optirs bench``'s exit
codes, its output in a pipe (80 columns, plain characters, a line per case on stderr) and its
partial results on Ctrl-C."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import tomllib
import types
from pathlib import Path

import pytest

import optirs
from optirs.tools import bench, cli

pytest.importorskip("rich")
ROOT = Path(__file__).resolve().parents[1]
# A bench run small enough for a test: one case of a few thousand elements, one timed step.
TINY = ["--backends", "cpu", "--cases", "small", "--size-scale", "0.005", "--reps", "1", "--repeats", "1",
        "--warmup", "0", "--no-torch"]


def _run(args, **kw):
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "optirs", *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=env, **kw)


def test_version_is_the_packages():
    expected = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    out = _run(["--version"])
    assert out.returncode == 0 and out.stdout.strip() == f"optirs {expected}", out.stdout + out.stderr
    assert optirs.__version__ == expected


@pytest.mark.parametrize("args,words", [
    (["--backends", "nosuch"], ["unknown backend 'nosuch'", "cpu", "cuda", "opencl"]),
    (["--backends", "CPU"], ["unknown backend 'CPU'", "cpu"]),
    (["--optimizers", "adamm"], ["unknown optimizer 'adamm'", "adamw", "adafactor"]),
    (["--cases", "tiny"], ["unknown case 'tiny'", "flat", "model", "small"]),
    (["--reps", "0"], ["--reps 0"]),
])
def test_bench_refuses_unknown_names_listing_the_known_ones(args, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_bench_refuses_a_named_backend_that_is_not_available(capsys):
    down = [b.name for b in optirs.list_backends() if not b.available]
    if not down:
        pytest.skip("every backend is available here")
    assert bench.main(["--backends", down[0]]) == 2
    assert f"not available here: {down[0]}" in capsys.readouterr().err


def test_bench_sizes_each_backend_for_its_device():
    cpu = next(s for s in optirs.list_backends() if s.name == "cpu")
    gpu = types.SimpleNamespace(devices=[types.SimpleNamespace(kind="gpu")])
    args = argparse.Namespace(size_scale=None, reps=None, repeats=None, warmup=None, full=False)
    host = bench.sizing_for(args, cpu)
    assert (host.profile, host.size_scale, host.reps, host.repeats, host.warmup) == ("host", bench.CPU_SCALE, 3, 5, 1)
    assert host.budget_s == bench.CPU_BUDGET_S
    full = bench.sizing_for(args, gpu)
    assert (full.profile, full.size_scale, full.reps, full.budget_s) == ("full", 1.0, 10, None)
    # every case shrinks with the scale, small included
    assert sum(bench.case_sizes("small", bench.CPU_SCALE)) < sum(bench.case_sizes("small", 1.0)) / 16
    args.full, args.reps = True, 2
    forced = bench.sizing_for(args, cpu)
    assert (forced.profile, forced.size_scale, forced.reps, forced.repeats) == ("full", 1.0, 2, 7)  # the user's reps


def test_bench_in_a_pipe_is_plain_80_column_text_with_a_line_per_case():
    out = _run(["bench", *TINY, "--optimizers", "sgd,adamw"])
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert max(map(len, lines)) <= 80, [line for line in lines if len(line) > 80]
    assert out.stdout.isascii() and "..." not in out.stdout  # ASCII boxes, no cut cell
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("| ")]
    assert any(r[:2] == ["sgd", "optirs"] for r in rows)
    assert any(r[:2] == ["adamw", "numpy"] and r[-1] == "" for r in rows)
    assert all(r[-1] == "ok" for r in rows if r[1] == "optirs")
    assert "[1/1] cpu small: 2 optimizers" in out.stderr


def test_ctrl_c_prints_the_cases_finished_so_far_and_exits_130(monkeypatch, capsys):
    calls = []
    real = bench.bench_optirs

    def interrupted_on_the_second(*args, **kwargs):
        calls.append(args[2])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(bench, "bench_optirs", interrupted_on_the_second)
    assert bench.main([*TINY, "--optimizers", "sgd,lion,adam", "--no-numpy"]) == 130
    out = capsys.readouterr().out
    assert calls == ["sgd", "lion"]
    assert "| sgd " in out and "| lion " not in out and "interrupted (Ctrl-C)" in out


def test_sigint_exits_130_without_a_traceback():
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env["PYTHONPATH"] = str(ROOT)
    args = [sys.executable, "-m", "optirs", "bench", "--backends", "cpu", "--cases", "small", "--size-scale", "0.005",
            "--reps", "100000000", "--repeats", "1", "--optimizers", "sgd"]  # runs until interrupted
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        started = proc.stderr.readline()  # the run's first line: the arguments are checked and it measures
        assert started.startswith("optirs bench: cpu"), started
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err and "interrupted (Ctrl-C)" in out


def test_ctrl_c_dropped_inside_a_ctypes_callback_still_stops_the_bench(capfd):
    """A Ctrl-C whose KeyboardInterrupt is raised inside a ctypes callback (llvmlite's, while numba
    compiles) is dropped by Python: the bench's handler records it, prints nothing, and the next
    measurement stops the run."""
    import ctypes

    from optirs.tools import bench

    @ctypes.CFUNCTYPE(None)
    def callback():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)  # the handler runs here, in the callback

    before = signal.getsignal(signal.SIGINT)
    with bench._CtrlC():
        callback()
        assert bench._INTERRUPTED.is_set()
        with pytest.raises(KeyboardInterrupt):
            bench._stop_if_interrupted()
    assert "KeyboardInterrupt" not in capfd.readouterr().err
    assert signal.getsignal(signal.SIGINT) is before


def test_backend_status_lines_end_whole():
    """A reason ends at its last word (numba's CUDA driver message ends in a dangling " :")."""
    for status in optirs.list_backends():
        assert not status.reason.rstrip().endswith(":"), status.reason


def test_cli_help_names_version_and_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--version" in out and all(name in out for name in cli.SUBCOMMANDS)
