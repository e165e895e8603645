"""The docs/plugins.md example backend (examples/minimal_backend.py) computes what the reference specifies."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import optirs
from optirs.core import reference
from optirs.plugin.registry import PluginDeprecationWarning

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.fixture
def minimal_backend(fresh_registry, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import minimal_backend

    optirs.register_plugin(minimal_backend.TinyBackend(), "tiny")
    return minimal_backend


@pytest.mark.parametrize("hp", [optirs.SgdParams(lr=0.05), optirs.SgdParams(lr=0.1, momentum=0.9, weight_decay=0.01),
                                optirs.SgdParams(lr=0.1, momentum=0.9, nesterov=True)])
@pytest.mark.parametrize("grad_factor", [1.0, -0.5])  # -0.5: maximize with a loss scale of 2
def test_example_backend_matches_reference(minimal_backend, hp, grad_factor, rng):
    params = [rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal(5).astype(np.float32)]
    grads = [[rng.standard_normal(p.shape).astype(np.float32) for p in params] for _ in range(6)]
    expected, _ = reference.run("sgd", params, [[grad_factor * g for g in gs] for gs in grads], hp)
    opt = optirs.GpuSgd(hp, optirs.GpuOptimizerConfig(backend="tiny"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginDeprecationWarning)  # the documented example uses the current hook
        for g in grads:
            opt.step_gpu(params, g, grad_factor=grad_factor)
    for a, e in zip(params, expected):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)
    assert opt.backend.ctx.steps == 6
    status = {s.name: s for s in optirs.list_backends()}["tiny"]
    assert status.optimizers == ("sgd",) and status.capabilities == ()


def test_example_backend_fits_in_100_lines_and_runs():
    source = EXAMPLES / "minimal_backend.py"
    assert len(source.read_text().splitlines()) < 100
    out = subprocess.run([sys.executable, str(source)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "does not run the 'adam' step" in out.stdout


def test_docs_show_the_example_as_it_is():
    """docs/plugins.md lists the backend class exactly as the file has it, and says how long the file is."""
    import re

    source = (EXAMPLES / "minimal_backend.py").read_text()
    doc = (EXAMPLES.parent / "docs" / "plugins.md").read_text()
    listing = doc.split("```python\n", 1)[1].split("```", 1)[0]
    assert listing.startswith("class TinyBackend:") and listing in source
    assert "def optirs_step(" in listing and "def optirs_step_support(" in listing
    heading = re.search(r"## A dense-step backend in (\d+) lines", doc)
    assert heading and int(heading.group(1)) == len(source.splitlines())
