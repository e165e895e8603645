"""The examples explain themselves: ``--help`` prints a whole description and every option, and
does nothing else."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _help(name):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(ROOT / "examples" / name), "--help"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


@pytest.mark.parametrize("name", ["quickstart.py", "minimal_backend.py", "train_torch.py"])
def test_help_describes_and_does_not_run(name):
    out = _help(name)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage:") and "PYTHONPATH" not in out.stdout
    first = out.stdout.split("\n\n")[1]
    assert first.rstrip().endswith("."), first  # the description's first paragraph is whole
    assert "tiny backend, 3 SGD steps" not in out.stdout and "params[0]" not in out.stdout


def test_train_torch_documents_every_option():
    pytest.importorskip("torch")
    out = _help("train_torch.py")
    options = out.stdout.split("options:")[1]
    named = re.findall(r"^  (--[\w-]+)(?: [A-Z_]+)?(.*)$", options, re.M)
    assert {n for n, _ in named} == {"--steps", "--batch", "--context", "--lr", "--target", "--threads"}
    assert all(text.strip() for _, text in named), named  # each has its help on its own line
