"""optirs.torch.Muon against torch.optim.Muon: trajectories, state_dicts both ways, compact momentum.

torch's Muon orthogonalises in bfloat16; optirs runs the same Newton-Schulz through torch's matmul
on a momentum computed by its own kernels, whose float32 rounding can differ from torch's lerp by
an ulp before the bfloat16 cast, so trajectories agree to float32/bfloat16 rounding, not bits.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch.optim, "Muon"):
    pytest.skip("this torch has no torch.optim.Muon", allow_module_level=True)

import optirs.torch as ot  # noqa: E402
from optirs.core.errors import InvalidParameterError, ShapeMismatchError  # noqa: E402

STEPS = 30
TOL = dict(rtol=1e-4, atol=2e-5)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8)
        self.hidden = torch.nn.Linear(8, 12)
        self.tall = torch.nn.Linear(12, 20, bias=False)
        self.head = torch.nn.Linear(20, 11)

    def forward(self, x):
        return self.head(torch.tanh(self.tall(torch.relu(self.hidden(self.emb(x))))))


TOKENS = torch.randint(0, 11, (24,), generator=torch.Generator().manual_seed(2))


def make_model():
    torch.manual_seed(0)
    return Net()


def split(model):
    """The usual recipe: Muon for the hidden 2-D weights, AdamW for embeddings, head, biases and norms."""
    hidden = [model.hidden.weight, model.tall.weight]
    rest = [p for n, p in model.named_parameters() if not any(p is q for q in hidden)]
    return hidden, rest


def muon_groups(model):
    hidden, _ = split(model)
    return [{"params": [hidden[0]]},
            {"params": [hidden[1]], "lr": 0.01, "nesterov": False, "adjust_lr_fn": "match_rms_adamw",
             "weight_decay": 0.02}]


def loss_of(model):
    return torch.nn.functional.cross_entropy(model(TOKENS), TOKENS)


def run(make_muon, steps=STEPS, model=None, opts=None):
    model = model or make_model()
    if opts is None:
        muon = make_muon(muon_groups(model))
        adamw = torch.optim.AdamW(split(model)[1], lr=3e-3)
        sched = torch.optim.lr_scheduler.StepLR(muon, step_size=10, gamma=0.5)
        opts = (muon, adamw, sched)
    muon, adamw, sched = opts
    for _ in range(steps):
        muon.zero_grad()
        adamw.zero_grad()
        loss_of(model).backward()
        muon.step()
        adamw.step()
        sched.step()
    return model, opts


def ours(groups, **kw):
    return ot.Muon(groups, lr=0.02, backend="cpu", **kw)


def theirs(groups):
    return torch.optim.Muon(groups, lr=0.02)


def test_trajectory_equals_torch_muon_two_groups_and_a_scheduler():
    a, (muon, _, _) = run(ours)
    b, _ = run(theirs)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), msg=lambda m: f"{name}: {m}", **TOL)
    assert set(muon.state[a.hidden.weight]) == {"momentum_buffer"}


@pytest.mark.parametrize("direction", ["optirs->torch", "torch->optirs"])
def test_state_dicts_load_both_ways_and_resume(direction):
    first, second = (ours, theirs) if direction == "optirs->torch" else (theirs, ours)
    model, (muon, adamw, sched) = run(first, steps=5)
    reference, _ = run(first, steps=10)
    # a second optimizer of the other kind takes the state and resumes the same trajectory
    other = second(muon_groups(model))
    other.load_state_dict(muon.state_dict())
    for p in split(model)[0]:
        torch.testing.assert_close(other.state[p]["momentum_buffer"], muon.state[p]["momentum_buffer"], rtol=0,
                                   atol=0)
    run(None, steps=5, model=model, opts=(other, adamw, sched))
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), **TOL)


@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_compact_momentum_state(state_dtype):
    torch.manual_seed(4)
    w = torch.randn(64, 80)  # 5120 elements: int8 blocks, not the small tensors' float32 state
    a, b = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    opt = ot.Muon([a], lr=0.02, state_dtype=state_dtype, backend="cpu")
    ref = torch.optim.Muon([b], lr=0.02)
    for step in range(8):
        g = torch.randn(64, 80, generator=torch.Generator().manual_seed(step))
        a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    keys = {"bfloat16": {"momentum_buffer"}, "int8": {"momentum_buffer.codes", "momentum_buffer.scales"}}
    assert set(opt.state[a]) == keys[state_dtype]
    if state_dtype == "bfloat16":
        assert opt.state[a]["momentum_buffer"].dtype == torch.bfloat16
    # the orthogonalised update has unit-scale singular values: the compact momentum moves it by its rounding
    torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=2e-3)
    assert not torch.equal(a.detach(), w)


def test_errors_are_torchs_as_optirs_errors():
    with pytest.raises(ShapeMismatchError, match=r"shape \(4,\), expected a 2-D parameter"):
        ot.Muon([torch.nn.Parameter(torch.zeros(4))])
    with pytest.raises(ValueError):  # optirs' errors are ValueErrors where torch raises one
        ot.Muon([torch.nn.Parameter(torch.zeros(2, 2, 2))])
    opt = ot.Muon([torch.nn.Parameter(torch.zeros(3, 3))], backend="cpu")
    with pytest.raises(ShapeMismatchError):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    assert len(opt.param_groups) == 1
    for bad in (dict(adjust_lr_fn="rms"), dict(lr=-1.0), dict(momentum=1.5), dict(ns_steps=100),
                dict(ns_coefficients=(1.0, 2.0))):
        with pytest.raises(InvalidParameterError):
            ot.Muon([torch.nn.Parameter(torch.zeros(3, 3))], **bad)
