"""A literal swap from torch: ``torch.optim.X(..., fused=..., foreach=...)`` -> ``optirs.torch.X``
with the same arguments trains the same way; a misspelt backend fails at construction; the
import stays light."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import optirs.torch as ot  # noqa: E402
from optirs.core.errors import BackendUnavailableError, InvalidParameterError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEPS = 8

# (class name, hyperparameters, the implementation hints torch's class takes)
SWAPS = [
    ("AdamW", {"lr": 1e-2, "weight_decay": 0.1}, [{"fused": False}, {"fused": True}, {"foreach": True},
                                                   {"foreach": False}, {"fused": False, "foreach": True}]),
    ("Adam", {"lr": 1e-2, "amsgrad": True}, [{"fused": True}, {"foreach": True}]),
    ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True}, [{"fused": True}, {"foreach": True}, {"fused": False}]),
    ("Adagrad", {"lr": 0.1}, [{"fused": True}, {"foreach": True}]),
    ("RMSprop", {"lr": 1e-2, "momentum": 0.5}, [{"foreach": True}, {"foreach": False}]),
    ("Adafactor", {"lr": 1e-2}, [{"foreach": True}, {"foreach": False}]),
]


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _loss(model, t):
    g = torch.Generator().manual_seed(100 + t)
    x, y = torch.randn(32, 12, generator=g), torch.randint(0, 3, (32,), generator=g)
    return torch.nn.functional.cross_entropy(model(x), y)


@pytest.mark.parametrize("name,hp,hints", [(n, hp, h) for n, hp, hs in SWAPS for h in hs],
                         ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in h.items())}" for n, _, hs in SWAPS for h in hs])
def test_implementation_hints_swap_like_torch(name, hp, hints):
    """The same arguments, hints included, give torch's trajectory and torch's param groups."""
    ref_model, our_model = _model(), _model()
    ref = getattr(torch.optim, name)(ref_model.parameters(), **hp, **hints)
    ours = getattr(ot, name)(our_model.parameters(), **hp, **hints)
    for t in range(STEPS):
        for model, opt in ((ref_model, ref), (our_model, ours)):
            opt.zero_grad()
            _loss(model, t).backward()
            opt.step()
    for p, q in zip(ref_model.parameters(), our_model.parameters()):
        torch.testing.assert_close(q.detach(), p.detach(), rtol=2e-5, atol=2e-6)
    for key in hints:
        assert ours.param_groups[0][key] == ref.param_groups[0][key] == hints[key]


def test_fused_and_foreach_together_are_refused_as_torch_refuses_them():
    with pytest.raises(RuntimeError):  # torch's own refusal, for reference
        torch.optim.AdamW(_model().parameters(), fused=True, foreach=True)
    with pytest.raises(InvalidParameterError, match="foreach=True and fused=True"):
        ot.AdamW(_model().parameters(), fused=True, foreach=True)
    with pytest.raises(InvalidParameterError, match="fused='no'"):
        ot.SGD(_model().parameters(), fused="no")


@pytest.mark.parametrize("name", ["nosuch", "CPU"])
def test_unknown_backend_fails_at_construction_naming_the_known_ones(name):
    with pytest.raises(BackendUnavailableError, match=rf"unknown backend .{name}..*cpu.*cuda.*opencl"):
        ot.AdamW(_model().parameters(), backend=name)


def test_import_optirs_torch_does_not_load_dynamo():
    """torch._dynamo takes about a second to import; ``import optirs.torch`` leaves it to whoever
    needs it (torch.optim.Optimizer's constructor does, through ``torch._disable_dynamo``)."""
    code = "import sys, optirs.torch\nprint('torch._dynamo' in sys.modules, 'torch' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"], out.stdout + out.stderr
