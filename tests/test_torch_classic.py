"""optirs.torch's NAdam, RAdam, Adamax, Adadelta, ASGD, Rprop and SparseAdam against torch.optim.

Each trajectory trains one small model twice, with torch.optim's class and optirs.torch's of the
same name and arguments (two param groups, a scheduler), and compares the parameters after every
step; checkpoints go both ways (a torch state_dict continues in optirs and the other way round).
The float64 reference of every definition runs on every backend in tests/test_optimizers.py (the
CUDA kernels under the simulator with ``-m cuda``, OpenCL on PoCL); LBFGS is refused with a reason.
"""

from __future__ import annotations

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import optirs.torch as ot  # noqa: E402
from optirs.core.errors import InvalidParameterError, UnsupportedOperationError  # noqa: E402

STEPS = 30
TOL = dict(rtol=2e-5, atol=2e-6)


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


_G = torch.Generator().manual_seed(1)
DATA = torch.randn(24, 6, generator=_G), torch.randint(0, 3, (24,), generator=_G)


def groups(model, **second):
    """Weights and biases as two groups; the second group's own hyperparameters."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")]},
            {"params": [p for n, p in named if n.endswith("bias")], **second}]


def backward(model):
    x, y = DATA
    model.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss


def scheduler(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)


# name -> (constructor keywords for both groups, the second group's own): weight decay variants,
# decoupled decay, maximize, each optimizer's own options
CASES = [
    ("NAdam", dict(lr=1e-2, weight_decay=0.1), dict(weight_decay=0.0, momentum_decay=0.01)),
    ("NAdam", dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True, maximize=True), dict(betas=(0.8, 0.99))),
    ("RAdam", dict(lr=1e-2, weight_decay=0.1), dict(weight_decay=0.0)),
    ("RAdam", dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True), dict(betas=(0.5, 0.9), eps=1e-6)),
    ("Adamax", dict(lr=1e-2, weight_decay=0.1), dict(betas=(0.8, 0.99))),
    ("Adamax", dict(lr=1e-2, maximize=True), dict(eps=1e-4)),
    ("Adadelta", dict(lr=0.5, weight_decay=0.1), dict(rho=0.5)),
    ("Adadelta", dict(maximize=True), dict(eps=1e-4)),
    ("ASGD", dict(lr=5e-2, weight_decay=0.1, t0=5), dict(lambd=1e-2, alpha=0.5)),
    ("ASGD", dict(lr=5e-2, maximize=True), dict(t0=0)),
    ("Rprop", dict(lr=1e-2), dict(etas=(0.3, 1.5))),
    ("Rprop", dict(lr=1e-2, maximize=True), dict(step_sizes=(1e-3, 0.02))),
]
IDS = [f"{c[0]}-{i}" for i, c in enumerate(CASES)]


def _saved(state_dict):
    """A state_dict through torch.save / torch.load (weights only), as a checkpoint file holds it
    (torch's state_dict() and load_state_dict() share tensors otherwise)."""
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _maximize_sign(kwargs):
    """maximize ascends: train on the negated loss so both runs stay bounded."""
    return -1.0 if kwargs.get("maximize") else 1.0


def _run(opt, model, steps, sign, sched=None, after=None):
    x, y = DATA
    for t in range(steps):
        model.zero_grad()
        (sign * torch.nn.functional.cross_entropy(model(x), y)).backward()
        opt.step()
        if sched is not None:
            sched.step()
        if after is not None:
            after(t)


@pytest.mark.parametrize("name,kwargs,second", CASES, ids=IDS)
def test_trajectory_matches_torch(name, kwargs, second):
    """30 steps, two param groups with their own hyperparameters, a StepLR schedule: optirs' params
    and state after every step as torch's (float32 rounding), state_dict keys, shapes and dtypes too."""
    ref_model, our_model = make_model(), make_model()
    ref = getattr(torch.optim, name)(groups(ref_model, **second), **kwargs)
    ours = getattr(ot, name)(groups(our_model, **second), backend="cpu", **kwargs)
    ref_sched, our_sched = scheduler(ref), scheduler(ours)
    sign = _maximize_sign(kwargs)
    for t in range(STEPS):
        for model, opt, sched in ((ref_model, ref, ref_sched), (our_model, ours, our_sched)):
            model.zero_grad()
            (sign * torch.nn.functional.cross_entropy(model(DATA[0]), DATA[1])).backward()
            opt.step()
            sched.step()
        for p, q in zip(ref_model.parameters(), our_model.parameters()):
            torch.testing.assert_close(q.detach(), p.detach(), **TOL, msg=lambda m: f"step {t + 1}: {m}")
    ref_sd, our_sd = ref.state_dict(), ours.state_dict()
    assert [{k: v for k, v in g.items() if k in ref_sd["param_groups"][0]} for g in our_sd["param_groups"]] == \
        ref_sd["param_groups"]
    for index, want in ref_sd["state"].items():
        got = our_sd["state"][index]
        assert set(got) == set(want)
        for k, v in want.items():
            assert got[k].shape == v.shape and got[k].dtype == v.dtype, k
            torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-6, msg=lambda m: f"state {index} {k}: {m}")


@pytest.mark.parametrize("name,kwargs,second", CASES[::2], ids=IDS[::2])
def test_state_dict_loads_both_ways(name, kwargs, second):
    """A torch checkpoint after 10 steps continues in optirs as in torch, and an optirs one in torch
    (a scheduler included: ASGD's eta comes from the checkpoint's state)."""
    sign = _maximize_sign(kwargs)
    for source, target in ((torch.optim, ot), (ot, torch.optim)):
        first_model = make_model()
        opts = {"backend": "cpu"} if source is ot else {}
        first = getattr(source, name)(groups(first_model, **second), **kwargs, **opts)
        sched = scheduler(first)
        _run(first, first_model, 10, sign, sched)
        checkpoint, sched_state = _saved(first.state_dict()), sched.state_dict()

        twin_model = make_model()
        twin_model.load_state_dict(first_model.state_dict())
        opts = {"backend": "cpu"} if target is ot else {}
        twin = getattr(target, name)(groups(twin_model, **second), **kwargs, **opts)
        twin_sched = scheduler(twin)  # made before the loads, as a resumed script does
        twin.load_state_dict(checkpoint)
        twin_sched.load_state_dict(sched_state)

        _run(first, first_model, 8, sign, sched)
        _run(twin, twin_model, 8, sign, twin_sched)
        for p, q in zip(first_model.parameters(), twin_model.parameters()):
            torch.testing.assert_close(q.detach(), p.detach(), **TOL)


def test_asgd_eta_lags_the_schedule_as_torch():
    """torch's ASGD steps with the eta its state holds (the previous step's lr): a schedule that
    changes lr every step shows it, and state['eta'] / ['mu'] are torch's."""
    lam = lambda t: 1.0 / (1 + t)  # noqa: E731
    pairs = _scheduled_pair("ASGD", dict(lr=0.1, lambd=0.05, t0=3),
                            lambda o: torch.optim.lr_scheduler.LambdaLR(o, lam), 6)
    for (p, ref), (q, ours) in pairs:
        for k in ("eta", "mu", "step"):
            assert float(ours.state[q][k]) == pytest.approx(float(ref.state[p][k]), rel=1e-6), k


def _scheduled_pair(name, kwargs, make_scheduler, steps):
    """torch.optim.<name> and optirs.torch.<name> trained in lockstep under a scheduler; the params
    compared to TOL; returns ((torch's param, torch's optimizer), (optirs' param, its optimizer)) pairs."""
    ref_model, our_model = make_model(), make_model()
    ref = getattr(torch.optim, name)(ref_model.parameters(), **kwargs)
    ours = getattr(ot, name)(our_model.parameters(), backend="cpu", **kwargs)
    scheds = [make_scheduler(o) for o in (ref, ours)]
    for _ in range(steps):
        for model, opt, sched in zip((ref_model, our_model), (ref, ours), scheds):
            backward(model)
            opt.step()
            sched.step()
    for p, q in zip(ref_model.parameters(), our_model.parameters()):
        torch.testing.assert_close(q.detach(), p.detach(), **TOL)
    return [((p, ref), (q, ours)) for p, q in zip(ref_model.parameters(), our_model.parameters())]


def test_nadam_mu_product_follows_a_beta1_schedule():
    """OneCycleLR cycles beta1 every step: torch multiplies each step's own mu into mu_product, and
    so does optirs (the product is carried in the state, not recomputed from the current beta1)."""
    pairs = _scheduled_pair("NAdam", dict(lr=1e-2),
                            lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=5e-2, total_steps=12), 12)
    for (p, ref), (q, ours) in pairs:
        assert float(ours.state[q]["mu_product"]) == float(ref.state[p]["mu_product"])


def test_bfloat16_state_steps_near_torch():
    """The compact formats run for the new optimizers through optirs.torch (bfloat16 moments here):
    the trajectory stays within bfloat16 rounding of torch's float32 one."""
    ref_model, our_model = make_model(), make_model()
    ref = torch.optim.NAdam(ref_model.parameters(), lr=1e-2)
    ours = ot.NAdam(our_model.parameters(), lr=1e-2, state_dtype="bfloat16", backend="cpu")
    _run(ref, ref_model, 10, 1.0)
    _run(ours, our_model, 10, 1.0)
    for p, q in zip(ref_model.parameters(), our_model.parameters()):
        torch.testing.assert_close(q.detach(), p.detach(), rtol=0, atol=2e-3)
    assert ours.state[next(our_model.parameters())]["exp_avg"].dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["NAdam", "RAdam", "Adamax", "Adadelta", "ASGD", "Rprop"])
def test_refusals_change_nothing(name):
    """capturable=True, foreach=True and differentiable=True are refused (with the reason), as are
    torch's invalid hyperparameters, before any parameter or state changes."""
    model = make_model()
    before = [p.detach().clone() for p in model.parameters()]
    cls = getattr(ot, name)
    with pytest.raises(UnsupportedOperationError, match="foreach"):
        cls(model.parameters(), foreach=True, backend="cpu")
    for flag in ("capturable", "differentiable"):
        with pytest.raises(UnsupportedOperationError, match=flag):
            cls(model.parameters(), backend="cpu", **{flag: True})
    opt = cls(model.parameters(), backend="cpu")
    backward(model)
    with pytest.raises(UnsupportedOperationError, match="capturable"):
        opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)], "capturable": True})
    assert len(opt.param_groups) == 1 and not opt.state
    with pytest.raises(InvalidParameterError, match="lr"):
        cls(model.parameters(), lr=-1.0, backend="cpu")
    for p, q in zip(before, model.parameters()):
        assert torch.equal(p, q.detach())


def test_rprop_etas_and_step_sizes_checked():
    model = make_model()
    with pytest.raises(InvalidParameterError, match="etaminus"):
        ot.Rprop(model.parameters(), etas=(1.5, 1.2), backend="cpu")
    with pytest.raises(InvalidParameterError, match="step_size_min"):
        ot.Rprop(model.parameters(), step_sizes=(1.0, 0.1), backend="cpu")


def test_lbfgs_is_refused_with_the_reason():
    with pytest.raises(UnsupportedOperationError, match="closure-driven and not elementwise.*torch.optim.LBFGS"):
        ot.LBFGS(make_model().parameters(), line_search_fn="strong_wolfe")


# ---------------------------------------------------------------- SparseAdam


def _embedding():
    torch.manual_seed(0)
    return torch.nn.Embedding(40, 5, sparse=True)


def _sparse_run(opt, emb, steps, seed=3, sched=None):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, 40, (9,), generator=g)  # duplicates included: coalesced as torch does
        opt.zero_grad()
        (emb(idx) ** 2).sum().backward()
        opt.step()
        if sched is not None:
            sched.step()


@pytest.mark.parametrize("maximize", [False, True])
def test_sparse_adam_matches_torch(maximize):
    """Two groups (an embedding table and a 1-D sparse parameter), a schedule, 30 steps; the state
    as torch keeps it (int step, moments shaped like the parameter) and checkpoints both ways."""
    ref_emb, our_emb = _embedding(), _embedding()
    ref = torch.optim.SparseAdam([{"params": [ref_emb.weight]}], lr=1e-2, maximize=maximize)
    ours = ot.SparseAdam([{"params": [our_emb.weight]}], lr=1e-2, maximize=maximize, backend="cpu")
    vec = [torch.zeros(40, requires_grad=True) for _ in range(2)]
    ref.add_param_group({"params": [vec[0]], "lr": 5e-2, "betas": (0.5, 0.9)})
    ours.add_param_group({"params": [vec[1]], "lr": 5e-2, "betas": (0.5, 0.9)})
    scheds = [torch.optim.lr_scheduler.StepLR(o, 7, 0.5) for o in (ref, ours)]
    g = torch.Generator().manual_seed(5)
    for _ in range(STEPS):
        idx = torch.randint(0, 40, (9,), generator=g)
        for emb, v, opt, sched in ((ref_emb, vec[0], ref, scheds[0]), (our_emb, vec[1], ours, scheds[1])):
            opt.zero_grad()
            v.grad = torch.sparse_coo_tensor(idx[None, :4], torch.ones(4), (40,), check_invariants=True)
            (emb(idx) ** 2).sum().backward()
            opt.step()
            sched.step()
    torch.testing.assert_close(our_emb.weight.detach(), ref_emb.weight.detach(), **TOL)
    torch.testing.assert_close(vec[1].detach(), vec[0].detach(), **TOL)
    want, got = ref.state_dict(), ours.state_dict()
    for index, entry in want["state"].items():
        assert got["state"][index]["step"] == entry["step"] and isinstance(got["state"][index]["step"], int)
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got["state"][index][k], entry[k], rtol=1e-5, atol=1e-7)

    for source, target in ((torch.optim, ot), (ot, torch.optim)):
        first_emb, twin_emb = _embedding(), _embedding()
        first = getattr(source, "SparseAdam")(first_emb.parameters(), lr=1e-2,
                                              **({"backend": "cpu"} if source is ot else {}))
        _sparse_run(first, first_emb, 5)
        twin_emb.load_state_dict(first_emb.state_dict())
        twin = getattr(target, "SparseAdam")(twin_emb.parameters(), lr=1e-2,
                                             **({"backend": "cpu"} if target is ot else {}))
        twin.load_state_dict(_saved(first.state_dict()))
        _sparse_run(first, first_emb, 5, seed=9)
        _sparse_run(twin, twin_emb, 5, seed=9)
        torch.testing.assert_close(twin_emb.weight.detach(), first_emb.weight.detach(), **TOL)


def test_sparse_adam_refuses_dense_gradients_and_changes_nothing():
    emb = _embedding()
    dense = torch.nn.Linear(3, 2)
    opt = ot.SparseAdam([emb.weight, dense.weight], backend="cpu")
    (emb(torch.tensor([1, 2])).sum() + dense(torch.ones(3)).sum()).backward()
    before = emb.weight.detach().clone()
    with pytest.raises(UnsupportedOperationError, match="dense gradient"):
        opt.step()
    assert torch.equal(emb.weight.detach(), before) and not opt.state
    with pytest.raises(InvalidParameterError, match="beta1"):
        ot.SparseAdam(emb.parameters(), betas=(1.0, 0.9), backend="cpu")
    np.testing.assert_array_equal(emb.weight.detach().numpy(), before.numpy())


# ---------------------------------------------------------------- the H200: torch CUDA tensors


def _torch_cuda_or_skip():
    import os

    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" or not torch.cuda.is_available():
        pytest.skip("needs torch with a real CUDA GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("name,kwargs,second", CASES[::2] + [("SparseAdam", dict(lr=1e-2), dict(lr=5e-2))],
                         ids=IDS[::2] + ["SparseAdam"])
def test_cuda_tensors_match_torch(name, kwargs, second):
    """CUDA tensors stepped in place on the cuda backend, beside torch.optim on the same GPU."""
    _torch_cuda_or_skip()
    if name == "SparseAdam":
        ref_model, our_model = (torch.nn.Embedding(1000, 64, sparse=True).cuda() for _ in range(2))
        our_model.load_state_dict(ref_model.state_dict())
        make = lambda m: m.parameters()  # noqa: E731
        loss = lambda m: (m(torch.arange(0, 1000, 7, device="cuda")) ** 2).sum()  # noqa: E731
    else:
        ref_model, our_model = make_model().cuda(), make_model().cuda()
        make = lambda m: groups(m, **second)  # noqa: E731
        x, y = DATA[0].cuda(), DATA[1].cuda()
        loss = lambda m: _maximize_sign(kwargs) * torch.nn.functional.cross_entropy(m(x), y)  # noqa: E731
    ref = getattr(torch.optim, name)(make(ref_model), **kwargs)
    ours = getattr(ot, name)(make(our_model), **kwargs)
    for _ in range(STEPS):
        for model, opt in ((ref_model, ref), (our_model, ours)):
            opt.zero_grad()
            loss(model).backward()
            opt.step()
    for p, q in zip(ref_model.parameters(), our_model.parameters()):
        torch.testing.assert_close(q.detach(), p.detach(), **TOL)
