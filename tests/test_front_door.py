"""The README's promises: the quickstart example runs, `optirs info` works, the CLI explains itself."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import optirs

ROOT = Path(__file__).resolve().parents[1]


def _run(args, **kw):
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env, **kw)


def test_quickstart_example(backend):
    out = _run([sys.executable, "examples/quickstart.py", backend])
    assert out.returncode == 0, out.stderr
    assert f"backend: {backend}" in out.stdout
    # One Adam step from p=1 with any nonzero constant gradient moves p by lr (bias-corrected m/sqrt(v) = 1).
    value = float(out.stdout.split("params[0] after one step: ")[1].split()[0])
    np.testing.assert_allclose(value, 1.0 - 1e-3, rtol=1e-6)


def test_optirs_info_command():
    exe = shutil.which("optirs")
    args = [exe, "info"] if exe else [sys.executable, "-m", "optirs.tools.cli", "info"]
    out = _run(args)
    assert out.returncode == 0, out.stderr
    assert "Capability matrix" in out.stdout
    for name in ("cpu", "cuda", "opencl"):  # the built-ins (this process may also hold test plugins)
        assert name in out.stdout
    assert "available" in out.stdout


def test_cli_unknown_command_lists_known_ones():
    out = _run([sys.executable, "-m", "optirs.tools.cli", "frobnicate"])
    assert out.returncode == 2
    assert "unknown command 'frobnicate'" in out.stderr and "info" in out.stderr


@pytest.mark.parametrize("name", sorted(optirs.__all__))
def test_public_names_resolve(name):
    assert getattr(optirs, name) is not None
    assert optirs.SUPPORTED_BACKENDS == ("cuda", "opencl", "cpu")


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'GpuAdamm'"):
        optirs.GpuAdamm
