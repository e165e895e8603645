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


def _matrix_rows(text):
    """The capability matrix of ``optirs info``'s output (box-drawing glyphs in a terminal, plain
    ASCII in a pipe): header cells and row name -> cells, each cell's folded lines joined again."""
    lines = text.split("Capability matrix", 1)[1].splitlines()
    rows, header, rules = {}, None, 0
    for line in lines:
        if line.startswith(("┏", "┡", "+", "├", "└")):
            rules += 1  # top, under the header, between sections, bottom
        elif line.startswith(("┃", "│", "|")):
            sep = "┃" if line.startswith("┃") else "│" if line.startswith("│") else "|"
            cells = [c.strip() for c in line[1:-1].split(sep)]
            if rules < 2:
                header = cells if header is None else [f"{a} {b}".strip() for a, b in zip(header, cells)]
            elif cells[0]:
                rows[cells[0]] = current = cells
            else:
                current[:] = [f"{a} {b}".strip() for a, b in zip(current, cells)]
        elif rules >= 2:
            break
    return header, rows


def test_optirs_info_matrix_is_readable_in_a_pipe(fresh_registry, monkeypatch, capsys):
    """Piped (80 columns, plain ASCII), every cell is whole (folded, never cut to "..."), and the
    matrix says per backend which optimizers its step runs, in which formats, and its capabilities."""
    pytest.importorskip("rich")
    from conftest import THIRD_PARTY_BACKEND, register_third_party_backend
    from optirs.tools import cli

    register_third_party_backend()
    monkeypatch.setenv("COLUMNS", "80")
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "\u2026" not in out and "..." not in out and "+---" in out  # plain ASCII rules
    assert max(map(len, out.splitlines())) <= 80
    header, rows = _matrix_rows(out)
    names = [b.name for b in optirs.list_backends()]
    assert header == ["optimizer / capability"] + names
    col = {name: i + 1 for i, name in enumerate(names)}
    assert rows["adam"][col[THIRD_PARTY_BACKEND]] == "float32" and rows["lamb"][col[THIRD_PARTY_BACKEND]] == "-"
    assert rows["adam"][col["cpu"]] == "float32, formats" and rows["adafactor"][col["cpu"]] == "float32"
    assert rows["sparse"][col[THIRD_PARTY_BACKEND]] == "yes" and rows["formats"][col[THIRD_PARTY_BACKEND]] == "-"
    assert rows["capturable"][col["cpu"]] == "-"
    if not fresh_registry.records["cuda"].broken:  # read from its optirs_step_support, with or without a GPU
        assert rows["adam"][col["cuda"]] == "float32, formats, capturable"
        assert rows["capturable"][col["cuda"]] == "yes"


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
