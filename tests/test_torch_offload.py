"""optirs.torch.CPUOffload: trajectories equal to the same optirs.torch optimizer without offload.

On this CPU-only machine the parameters are torch CPU tensors: the offload is then a degenerate
case (the "transfers" are host copies) that still runs the hooks, the chunking, the worker pool,
the state bookkeeping and the interrupt handling. The tests marked ``gpu`` make real copies on a
CUDA device (the lead's H200 run). References: the front end without offload (itself checked
against torch.optim in tests/test_torch_frontend.py) and, for bf16 parameters, torch's AdamW run
on fp32 masters and rounded to bf16.
"""

from __future__ import annotations

import _thread
import copy
import io
import pickle
import sys
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import optirs  # noqa: E402
import optirs.torch as ot  # noqa: E402
from conftest import register_third_party_backend  # noqa: E402
from optirs.backends.cpu import CpuBackend  # noqa: E402
from optirs.core import formats as F  # noqa: E402
from optirs.core.errors import (DeviceMemoryError, GpuOptimError, InvalidParameterError,  # noqa: E402
                                PluginError, UnsupportedOperationError)
from optirs.plugin.hookspecs import hookimpl  # noqa: E402
from optirs.torch import offload as offload_mod  # noqa: E402

STEPS = 32
TOL = dict(rtol=2e-5, atol=2e-6)
CUDA = torch.cuda.is_available()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Linear(12, 24)
        self.mid = torch.nn.Linear(24, 24)
        self.norm = torch.nn.LayerNorm(24)
        self.head = torch.nn.Linear(24, 5)

    def forward(self, x):
        return self.head(self.norm(torch.tanh(self.mid(torch.relu(self.emb(x))))))


def make_model(dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    return Net().to(device=device, dtype=dtype)


def batch(t, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + t)
    return (torch.randn(16, 12, generator=g).to(device=device, dtype=dtype),
            torch.randint(0, 5, (16,), generator=g).to(device))


def loss_of(model, t, device="cpu"):
    x, y = batch(t, device, next(model.parameters()).dtype)
    return torch.nn.functional.cross_entropy(model(x).float(), y)


def groups(model):
    """Three groups: decayed weights, the LayerNorm at another lr, biases without decay."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight") and not n.startswith("norm")], "weight_decay": 0.1},
            {"params": [p for n, p in named if n.startswith("norm")], "lr": 3e-3, "weight_decay": 0.0},
            {"params": [p for n, p in named if n.endswith("bias") and not n.startswith("norm")], "weight_decay": 0.0}]


def assert_same(a, b, **tol):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(q.detach().cpu(), p.detach().cpu(), msg=lambda m: f"{name}: {m}", **(tol or TOL))


def takes_formats(name):
    return name != "Adafactor"  # the one optirs.torch optimizer without step formats


def plain(name, params, **kwargs):
    """The same optimizer without offload, in the offload's default format (float32 masters)."""
    if takes_formats(name):
        kwargs.setdefault("master_weights", "float32")
    return getattr(ot, name)(params, backend="cpu", **kwargs)


def offload(name, params, **kwargs):
    # tiny chunks, so a model of a few tensors still has several chunks and both workers work
    kwargs.setdefault("bucket_elements", 300)
    kwargs.setdefault("workers", 2)
    return ot.CPUOffload(name, params, **kwargs)


CASES = [
    ("AdamW", {"lr": 1e-2}), ("SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    ("Lion", {"lr": 1e-3, "weight_decay": 0.1}), ("Adafactor", {"lr": 1e-2}),
    ("Adam", {"lr": 1e-2, "amsgrad": True, "maximize": True}),
    ("RMSprop", {"lr": 1e-3, "centered": True, "momentum": 0.5}),
    ("Adagrad", {"lr": 1e-2}), ("Lamb", {"lr": 1e-2}), ("Lamb", {"lr": 1e-2, "max_grad_norm": 0.5}),
]


def run_pair(name, kwargs, steps=STEPS, accumulation=1, mode=None, **offload_kwargs):
    """Train the plain optirs.torch optimizer and its offloaded twin; compare after every step.

    Three groups, a OneCycleLR scheduler (lr, and betas / momentum where the optimizer has them)
    and, on every third step, the closure form of step().
    """
    ref_model, our_model = make_model(), make_model()
    ref = plain(name, groups(ref_model), **kwargs)
    ours = offload(name, groups(our_model), accumulation_steps=accumulation, **offload_kwargs, **kwargs)
    cycle = "betas" in ref.defaults or "momentum" in ref.defaults
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=[2e-2, 5e-3, 2e-2], total_steps=steps,
                                                  cycle_momentum=cycle) for o in (ref, ours)]
    for t in range(steps):
        for model, opt in ((ref_model, ref), (our_model, ours)):
            def closure(model=model, opt=opt, t=t):
                opt.zero_grad()
                for a in range(accumulation):
                    (loss_of(model, t * accumulation + a) / accumulation).backward()
                return torch.tensor(0.0)
            if t % 3 == 2:
                opt.step(closure)
            else:
                closure()
                opt.step()
        for s in scheds:
            s.step()
        assert_same(ref_model, our_model)
    return ref, ours, ref_model, our_model


@pytest.mark.parametrize("name,kwargs", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_trajectory_equals_no_offload(name, kwargs):
    ref, ours, _, our_model = run_pair(name, kwargs)
    if "max_grad_norm" in kwargs:  # clipping over the group: the group is one chunk
        assert len(ours._chunks) == len(ours.param_groups)
    else:
        assert len(ours._chunks) > len(ours.param_groups)  # really chunked
    assert [g["lr"] for g in ours.param_groups] == [g["lr"] for g in ref.param_groups]
    sd, rsd = ours.state_dict(), ref.state_dict()
    assert sd["param_groups"] == rsd["param_groups"]
    assert set(sd["state"]) == set(rsd["state"])
    for i in rsd["state"]:
        assert set(sd["state"][i]) == set(rsd["state"][i])
        for k, v in rsd["state"][i].items():
            torch.testing.assert_close(sd["state"][i][k], v, **TOL)


@pytest.mark.parametrize("name,kwargs", [CASES[0], CASES[1], CASES[3]], ids=["AdamW", "SGD", "Adafactor"])
def test_step_in_backward_and_accumulation(name, kwargs):
    """The steps started by the hooks (from the second round on) give the same trajectory."""
    _, ours, _, _ = run_pair(name, kwargs, steps=12, accumulation=3, step_in_backward=True)
    assert ours._armed


def test_accumulation_count_wrong_either_way_is_still_correct():
    # the hooks expect 3 backwards; the loop does 2 (step() copies what the hooks skipped) or 4
    # (the hooks copy again after the 3rd: the last copy is the one used)
    ref_model, our_model = make_model(), make_model()
    ref = ot.AdamW(ref_model.parameters(), lr=1e-2, backend="cpu")
    ours = offload("AdamW", our_model.parameters(), lr=1e-2, accumulation_steps=3)
    for t in range(6):
        for m, o in ((ref_model, ref), (our_model, ours)):
            o.zero_grad()
            for a in range(2 if t % 2 else 4):  # fewer and more backwards than announced
                loss_of(m, 4 * t + a).backward()
            o.step()
        assert_same(ref_model, our_model)


def armed_offload(model):
    """A step_in_backward offload after two rounds (the first is plain; it arms the hooks)."""
    opt = offload("AdamW", model.parameters(), lr=1e-2, step_in_backward=True)
    for t in range(2):
        opt.zero_grad()
        loss_of(model, t).backward()
        opt.step()
    return opt


def test_step_in_backward_refuses_an_extra_backward():
    model = make_model()
    opt = armed_offload(model)
    opt.zero_grad()
    loss_of(model, 5).backward()
    with pytest.raises(UnsupportedOperationError, match="already started"):
        loss_of(model, 6).backward()


@pytest.fixture
def busy_cpu():
    """Two threads multiplying matrices (numpy releases the GIL): the workers compete for the cores."""
    np = pytest.importorskip("numpy")
    stop = threading.Event()

    def burn():
        x = np.full((192, 192), 0.5)
        while not stop.is_set():
            x @ x

    threads = [threading.Thread(target=burn, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    yield
    stop.set()
    for t in threads:
        t.join()


def test_step_in_backward_orders_the_workers_before_the_next_line(busy_cpu, monkeypatch):
    """Whatever the workers' timing (slowed down here in every other round, on a busy CPU), a
    chunk step started in backward has written its parameters when backward returns: an extra
    forward and backward meet the optimizer's own refusal, never torch's in-place RuntimeError
    (the saved parameters moved under it), and the forward saw the stepped parameters only."""
    run_chunk = offload_mod.CPUOffload._run_chunk
    slow = [False]

    def slowed(self, *args, **kwargs):
        if slow[0]:
            time.sleep(0.02)  # the main thread is by then well into the next forward
        return run_chunk(self, *args, **kwargs)

    monkeypatch.setattr(offload_mod.CPUOffload, "_run_chunk", slowed)
    for r in range(16):
        slow[0] = False
        model = make_model()
        opt = armed_offload(model)
        slow[0] = r % 2 == 0
        opt.zero_grad()
        loss_of(model, 5).backward()
        stepped = [p.detach().clone() for p in model.parameters()]
        assert opt._started(), "no chunk started in backward"
        with pytest.raises(UnsupportedOperationError, match="already started"):
            loss_of(model, 6).backward()
        assert all(torch.equal(a, b) for a, b in zip(stepped, model.parameters())), f"round {r}"


def test_gradients_changed_after_backward_are_copied_again():
    """clip_grad_norm_ after backward (in place): the offload steps with the clipped gradients."""
    ref_model, our_model = make_model(), make_model()
    ref = ot.AdamW(ref_model.parameters(), lr=1e-2, backend="cpu")
    ours = offload("AdamW", our_model.parameters(), lr=1e-2)
    for t in range(8):
        for m, o in ((ref_model, ref), (our_model, ours)):
            o.zero_grad()
            (loss_of(m, t) * 50).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            o.step()
        assert_same(ref_model, our_model)


def test_gradients_changed_after_backward_are_refused_with_step_in_backward():
    model = make_model()
    opt = offload("AdamW", model.parameters(), lr=1e-2, step_in_backward=True)
    loss_of(model, 0).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(UnsupportedOperationError, match="changed after backward.*nothing was stepped"):
        opt.step()  # the first round: refused before anything is stepped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


EDITS = {
    # in-place edits after backward that move no version counter of the gradient torch hands out
    "data-mul": lambda g: g.data.mul_(0.5),
    "data-neg": lambda g: g.data.neg_(),  # the bit sum alone can miss a sign flip
    "data-copy": lambda g: g.data.copy_(torch.full_like(g, 1e-3)),
    "numpy-view": lambda g: g.numpy().__setitem__(Ellipsis, g.numpy() * 0.25),
    "one-element": lambda g: g.data.view(-1)[0].add_(1e-3),
}


@pytest.fixture(params=[offload_mod.COPY_AT_STEP, offload_mod.FINGERPRINT])
def gradient_check(request, monkeypatch):
    """Each way of checking the gradients, on CPU tensors: FINGERPRINT is what CUDA tensors use."""
    monkeypatch.setattr(offload_mod, "_gradient_check", lambda device, step_in_backward: request.param)
    return request.param


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_gradients_edited_without_a_version_bump_are_copied_again(edit, gradient_check):
    """Edits through .data or a numpy view after backward: the offload steps with the edited
    gradients, as the optimizer without offload does."""
    ref_model, our_model = make_model(), make_model()
    ref = plain("AdamW", groups(ref_model), lr=1e-2)
    ours = offload("AdamW", groups(our_model), lr=1e-2)
    assert ours._check == gradient_check
    for t in range(3):
        for m, o in ((ref_model, ref), (our_model, ours)):
            o.zero_grad()
            loss_of(m, t).backward()
            for q in list(m.parameters())[::2]:
                EDITS[edit](q.grad)
            o.step()
        assert_same(ref_model, our_model, rtol=0, atol=0)


def test_the_fingerprint_moves_with_every_edit_of_the_tests():
    g = torch.tensor([1.0, -1.0, 2.0, -2.0])
    out = torch.zeros((6, 2), dtype=torch.int64)
    offload_mod._fingerprint(g, out[0])
    offload_mod._fingerprint(g.clone(), out[1])
    offload_mod._fingerprint(-g, out[2])  # the same values (and bit sum): only their places moved
    h = g.clone()
    h.view(torch.int32)[3] += 1  # one ulp of one element
    offload_mod._fingerprint(h, out[3])
    offload_mod._fingerprint(g * 0.5, out[4])
    assert torch.equal(out[0], out[1]) and out[2, 0] == out[0, 0]
    for i in (2, 3, 4):
        assert not torch.equal(out[i], out[0]), i
    nan = torch.tensor([float("nan"), 1.0]).bfloat16()
    offload_mod._fingerprint(nan, out[5])
    again = torch.zeros(2, dtype=torch.int64)
    offload_mod._fingerprint(nan.clone(), again)
    assert torch.equal(again, out[5])  # the same bits, NaN included, give the same fingerprint
    offload_mod._fingerprint(torch.zeros(0), again)  # an empty gradient
    assert not again.any()


@pytest.mark.parametrize("via", ["capability", "torch"])
@pytest.mark.parametrize("edit", ["data-mul", "numpy-view"])
def test_gradients_edited_without_a_version_bump_are_refused_with_step_in_backward(edit, via, monkeypatch):
    """The fingerprints by the cpu backend's fingerprint capability (one pass over each gradient),
    or by torch's reductions where no backend of the gradients' device has it."""
    if via == "torch":
        monkeypatch.setattr(offload_mod, "_fingerprint_backend", lambda device: None)
    model = make_model()
    opt = offload("AdamW", model.parameters(), lr=1e-2, step_in_backward=True)
    assert opt._check == offload_mod.FINGERPRINT
    assert opt.gradient_check == ("fingerprint (cpu)" if via == "capability" else "fingerprint (torch)")
    loss_of(model, 0).backward()
    EDITS[edit](model.head.weight.grad)
    before = _snapshot(model, opt)
    with pytest.raises(UnsupportedOperationError, match=r"changed after backward.*nothing was stepped"):
        opt.step()  # the first round: refused before anything is stepped
    _assert_snapshot(_snapshot(model, opt), before)
    _train(model, opt, 2, start=1)  # armed: the next round's chunks start in backward
    opt.zero_grad()
    loss_of(model, 4).backward()
    assert all(c.future is not None for c in opt._chunks)
    EDITS[edit](model.head.weight.grad)
    with pytest.raises(UnsupportedOperationError, match=r"changed after backward.*differ from the rest by one step"):
        opt.step()


INF_STEPS = (2, 5, 6)


def _scaler_run(make_opt, classic, steps=12):
    model = make_model()
    opt = make_opt(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=3)
    scales = []
    for t in range(steps):
        opt.zero_grad()
        scaler.scale(loss_of(model, t)).backward()
        if t in INF_STEPS:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        if classic:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return model, scales, opt


@pytest.mark.parametrize("classic", [False, True], ids=["fused-way", "classic"])
def test_grad_scaler_with_injected_infs(classic):
    ref_model, ref_scales, _ = _scaler_run(lambda m: ot.AdamW(groups(m), lr=1e-2, backend="cpu"), classic)
    our_model, our_scales, ours = _scaler_run(lambda m: offload("AdamW", groups(m), lr=1e-2), classic)
    assert our_scales == ref_scales and min(ref_scales) < 2.0**12
    assert_same(ref_model, our_model)
    assert float(ours.state[next(our_model.parameters())]["step"]) == 12 - len(INF_STEPS)


def test_grad_scaler_refused_with_step_in_backward_before_anything_changes():
    model = make_model()
    opt = offload("AdamW", model.parameters(), step_in_backward=True)
    before = [p.detach().clone() for p in model.parameters()]
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(loss_of(model, 0)).backward()
    with pytest.raises(UnsupportedOperationError, match="GradScaler.*nothing was stepped"):
        scaler.step(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and not opt.state


# ---------------------------------------------------------------- bf16 / fp16 parameters

def _manual_masters_run(dtype, steps):
    """torch.optim.AdamW on fp32 masters; the 16-bit model is the masters rounded (the reference)."""
    model = make_model(dtype)
    masters = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1)
    for t in range(steps):
        model.zero_grad()
        loss_of(model, t).backward()
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters()):
                p.copy_(m)
    return model, masters


@pytest.mark.parametrize("fuse", [False, None], ids=["separate-passes", "fused"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16bit_parameters_against_torch_on_fp32_masters(dtype, fuse):
    steps = 30
    ref_model, ref_masters = _manual_masters_run(dtype, steps)
    model = make_model(dtype)
    opt = offload("AdamW", model.parameters(), lr=1e-2, weight_decay=0.1, fuse_conversions=fuse)
    for t in range(steps):
        opt.zero_grad()
        loss_of(model, t).backward()
        opt.step()
    ours = [c.master(k) for p in model.parameters() for c, k in [opt._where[p]]]
    # float32 masters with float32 state: the formats step (one pass) by default, the float32 kernel
    # between two conversion passes when asked
    assert all(c.mode == (offload_mod.WIDEN if fuse is False else offload_mod.FUSED) for c in opt._chunks)
    for a, b in zip(ours, ref_masters):
        # two runs whose 16-bit models differ by a rounding now and then (a master within float32
        # rounding of the reference's can round to the neighbouring 16-bit value): loose, the
        # bit-exact check is test_state_formats_bit_exact_against_the_same_chunks
        torch.testing.assert_close(a, b.detach(), rtol=1e-3, atol=1e-4)
    for p, m in zip(model.parameters(), ours):
        assert p.dtype == dtype and torch.equal(p, m.to(dtype))  # the parameters are the masters rounded
    # the 16-bit parameters follow the reference up to a rounding step of their dtype
    assert_same(ref_model, model, rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------- step formats

FORMATS = [
    # (parameter dtype, the optimizer's format keywords)
    (torch.float32, {"state_dtype": "int8"}),
    (torch.float32, {"state_dtype": "bfloat16", "seed": 3}),
    (torch.bfloat16, {}),  # the offload's default: float32 masters, float32 state, the formats step (FUSED)
    (torch.bfloat16, {"fuse_conversions": False}),  # the same stepped apart (WIDEN)
    (torch.bfloat16, {"state_dtype": "int8"}),
    (torch.bfloat16, {"master_weights": "remainder16", "state_dtype": "bfloat16"}),
    (torch.bfloat16, {"master_weights": "remainder8", "state_dtype": "int8"}),
    (torch.bfloat16, {"master_weights": "remainder8", "state_dtype": "int8_sqrt"}),
    (torch.bfloat16, {"master_weights": "remainder8", "state_dtype": "float8_e4m3fn"}),
    (torch.bfloat16, {"master_weights": None, "stochastic_rounding": True, "seed": 7}),
    (torch.float16, {"state_dtype": "int8"}),
]
FORMAT_IDS = [f"{str(d).split('.')[-1]}-{'-'.join(f'{k}={v}' for k, v in kw.items()) or 'default'}"
              for d, kw in FORMATS]


class Wide(torch.nn.Module):
    """Tensors of more than 4096 elements, so int8 state is really blockwise (smaller ones keep float32)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(96, 80)
        self.b = torch.nn.Linear(80, 64)
        self.head = torch.nn.Linear(64, 5)

    def forward(self, x):
        return self.head(torch.tanh(self.b(torch.relu(self.a(x)))))


def make_wide(dtype):
    torch.manual_seed(1)
    return Wide().to(dtype)


def wide_loss(model, t):
    g = torch.Generator().manual_seed(300 + t)
    x = torch.randn(32, 96, generator=g).to(next(model.parameters()).dtype)
    return torch.nn.functional.cross_entropy(model(x).float(), torch.randint(0, 5, (32,), generator=g))


def mirrored_reference(name, ours, ref_model, our_model, **kwargs):
    """The same optimizer and format without offload over the same tensor groups as the offload's
    chunks, in the same order: the same layouts, so the same cpu kernel gives the same bits
    (stochastic rounding draws its bits by the element's index in the layout)."""
    index = {id(p): i for i, p in enumerate(our_model.parameters())}
    ref_params = list(ref_model.parameters())
    groups_ = []
    for c in ours._chunks:
        hyper = {k: v for k, v in ours.param_groups[c.gi].items() if k not in ("params", "param_names")}
        groups_.append({**hyper, "params": [ref_params[index[id(p)]] for p in c.params]})
    return getattr(ot, name)(groups_, backend="cpu", **kwargs)


@pytest.mark.parametrize("name", ["AdamW", "Lion", "SGD", "Lamb"])
@pytest.mark.parametrize("dtype,fmt", FORMATS, ids=FORMAT_IDS)
def test_state_formats_bit_exact_against_the_same_chunks(name, dtype, fmt):
    """Every format through the offload is the same optimizer and format without offload, bit for
    bit (both run the cpu backend's formats kernel on the same bytes); states included."""
    kwargs = {"AdamW": {"lr": 1e-2, "weight_decay": 0.1}, "Lion": {"lr": 1e-3, "weight_decay": 0.1},
              "SGD": {"lr": 0.05, "momentum": 0.9}, "Lamb": {"lr": 1e-2}}[name]
    ref_model, our_model = make_wide(dtype), make_wide(dtype)
    ours = offload(name, our_model.parameters(), bucket_elements=9000, **fmt, **kwargs)
    assert len(ours._chunks) > 1
    precision = {k: v for k, v in fmt.items() if k != "fuse_conversions"}
    ref = mirrored_reference(name, ours, ref_model, our_model, **{"master_weights": "float32", **precision}, **kwargs)
    for t in range(6):
        for m, o in ((ref_model, ref), (our_model, ours)):
            o.zero_grad()
            wide_loss(m, t).backward()
            o.step()
        for p, q in zip(ref_model.parameters(), our_model.parameters()):
            assert torch.equal(p, q), t
    for p, q in zip(ref_model.parameters(), our_model.parameters()):
        a, b = ref.state[p], dict(ours.state[q])
        c, k = ours._where[q]
        if c.mode == offload_mod.WIDEN:  # the float32 masters are the inner optimizer's parameters
            b[offload_mod.MASTER_KEY] = c.host[k]
        assert set(a) == set(b)
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    if fmt.get("state_dtype", "") in F.INT8_STATES:
        codes = F.CODES_SUFFIX[fmt["state_dtype"]]
        slot = "exp_avg" if name != "SGD" else "momentum_buffer"
        assert ours.state[our_model.a.weight][f"{slot}.{codes}"].dtype == torch.uint8
    assert all(c.mode == expected_mode(dtype, fmt, fmt.get("fuse_conversions")) for c in ours._chunks)


def expected_mode(dtype, fmt, fuse=None):
    if dtype == torch.float32:
        return offload_mod.DIRECT
    return offload_mod.WIDEN if fuse is False else offload_mod.FUSED


@pytest.mark.parametrize("state_dtype", ["float32", "int8"])
def test_separate_passes_and_the_fused_step_give_the_same_bits(state_dtype):
    """bf16 parameters on float32 masters stepped apart (WIDEN: float32 masters, a conversion pass
    each way) and in the formats step (FUSED): the same parameters, state and checkpoints, and a
    checkpoint of one continues in the other."""
    models = {fuse: make_wide(torch.bfloat16) for fuse in (False, True)}
    opts = {fuse: offload("AdamW", m.parameters(), lr=1e-2, bucket_elements=9000, state_dtype=state_dtype,
                          fuse_conversions=fuse) for fuse, m in models.items()}
    assert {c.mode for c in opts[False]._chunks} == {offload_mod.WIDEN}
    assert {c.mode for c in opts[True]._chunks} == {offload_mod.FUSED}
    for fuse in (False, True):
        _train_wide(models[fuse], opts[fuse], 4)
    for p, q in zip(models[False].parameters(), models[True].parameters()):
        assert torch.equal(p, q)
    sds = {fuse: _through_disk(o.state_dict()) for fuse, o in opts.items()}
    for i, entry in sds[True]["state"].items():
        other = sds[False]["state"][i]
        assert set(entry) == set(other) and offload_mod.MASTER_KEY in entry
        for k in entry:
            assert entry[k].dtype == other[k].dtype and torch.equal(entry[k], other[k]), (i, k)
    # swap: each continues from the other's checkpoint
    ckpt_model = _through_disk(models[True].state_dict())
    swapped = {}
    for fuse in (False, True):
        m = make_wide(torch.bfloat16)
        o = offload("AdamW", m.parameters(), lr=1e-2, bucket_elements=9000, state_dtype=state_dtype,
                    fuse_conversions=fuse)
        m.load_state_dict(ckpt_model)
        o.load_state_dict(sds[not fuse])
        _train_wide(m, o, 3, start=4)
        swapped[fuse] = m
    _train_wide(models[True], opts[True], 3, start=4)
    for fuse in (False, True):
        for p, q in zip(models[True].parameters(), swapped[fuse].parameters()):
            assert torch.equal(p, q)


@pytest.mark.parametrize("dtype,fmt", [FORMATS[0], FORMATS[4], FORMATS[6]], ids=[FORMAT_IDS[i] for i in (0, 4, 6)])
def test_int8_state_equals_the_plain_optimizer_in_the_users_groups(dtype, fmt):
    """Deterministic formats do not depend on how the tensors are grouped: the offload equals the
    plain optimizer over the caller's own groups, bit for bit."""
    ref_model, our_model = make_wide(dtype), make_wide(dtype)
    ref = plain("AdamW", ref_model.parameters(), lr=1e-2, **fmt)
    ours = offload("AdamW", our_model.parameters(), lr=1e-2, bucket_elements=9000, **fmt)
    for t in range(5):
        for m, o in ((ref_model, ref), (our_model, ours)):
            o.zero_grad()
            wide_loss(m, t).backward()
            o.step()
    for p, q in zip(ref_model.parameters(), our_model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int8_state_moves_fewer_host_bytes(dtype):
    """The bytes each CPU step touches and each step copies: int8 state against float32 state."""
    touched, copied = {}, {}
    for state_dtype in ("float32", "int8"):
        model = make_wide(dtype)
        opt = offload("AdamW", model.parameters(), bucket_elements=9000, state_dtype=state_dtype,
                      fuse_conversions=True)  # 16-bit parameters: the formats step for both
        _train_wide(model, opt, 1)
        opt.timing = offload_mod.OffloadTiming()
        _train_wide(model, opt, 2, start=1)
        t = opt.timing.as_dict()
        touched[state_dtype], copied[state_dtype] = t["step_bytes"] / 2, (t["d2h_bytes"] + t["h2d_bytes"]) / 2
        assert t["convert_s"] == 0  # no separate widening or narrowing pass
    n = sum(p.numel() for p in make_wide(dtype).parameters())
    small = sum(p.numel() for p in make_wide(dtype).parameters() if p.numel() < 4096)  # float32 state kept
    size = torch.empty((), dtype=dtype).element_size()
    blocks = sum(-(-p.numel() // 256) for p in make_wide(dtype).parameters() if p.numel() >= 4096)
    master = 0 if dtype == torch.float32 else 8  # float32 master read and written
    # gradient read, parameter read + written, master, two moments read + written
    assert touched["float32"] == n * (3 * size + master + 16)
    assert touched["int8"] == n * (3 * size + master) + 2 * 2 * ((n - small) * 1 + small * 4 + 4 * blocks)
    assert copied["float32"] == copied["int8"] == 2 * n * size  # gradients out, parameters back, in their dtype


def _train_wide(model, opt, steps, start=0):
    for t in range(start, start + steps):
        opt.zero_grad()
        wide_loss(model, t).backward()
        opt.step()


@pytest.mark.parametrize("dtype,fmt", [FORMATS[0], FORMATS[1], FORMATS[4], FORMATS[6]],
                         ids=[FORMAT_IDS[i] for i in (0, 1, 4, 6)])
def test_compact_state_resumes_bit_exact(dtype, fmt):
    """state_dict (compact tensors in their own dtypes) through torch.save / weights_only load, and a
    resumed run equal to the uninterrupted one; the checkpoint also loads into the plain optimizer."""
    model = make_wide(dtype)
    opt = offload("AdamW", model.parameters(), lr=1e-2, bucket_elements=9000, **fmt)
    _train_wide(model, opt, 3)
    ckpt = _through_disk({"model": model.state_dict(), "opt": opt.state_dict()})
    _train_wide(model, opt, 3, start=3)
    resumed = make_wide(dtype)
    ropt = offload("AdamW", resumed.parameters(), lr=1e-2, bucket_elements=9000, **fmt)
    resumed.load_state_dict(ckpt["model"])
    ropt.load_state_dict(ckpt["opt"])
    _train_wide(resumed, ropt, 3, start=3)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    saved = ckpt["opt"]["state"][0]
    if fmt.get("state_dtype") == "int8":
        assert saved["exp_avg.codes"].dtype == torch.uint8 and saved["exp_avg.scales"].dtype == torch.float32
    if fmt.get("state_dtype") == "bfloat16":
        assert saved["exp_avg"].dtype == torch.bfloat16
    if fmt.get("master_weights") == "remainder8":
        assert saved["master_remainder"].dtype == torch.int8


def test_offload_int8_checkpoint_continues_in_the_plain_optimizer():
    fmt = {"state_dtype": "int8"}
    model = make_wide(torch.float32)
    opt = offload("AdamW", model.parameters(), lr=1e-2, bucket_elements=9000, **fmt)
    _train_wide(model, opt, 3)
    ckpt = _through_disk({"model": model.state_dict(), "opt": opt.state_dict()})
    other = make_wide(torch.float32)
    other.load_state_dict(ckpt["model"])
    popt = plain("AdamW", other.parameters(), lr=1e-2, **fmt)
    popt.load_state_dict(ckpt["opt"])
    _train_wide(model, opt, 2, start=3)
    _train_wide(other, popt, 2, start=3)
    for p, q in zip(model.parameters(), other.parameters()):
        assert torch.equal(p, q)


# ---------------------------------------------------------------- the backend: a capability, not a name

class _NoHostView(CpuBackend):
    optirs_host_view = None  # every hook of the cpu backend but the zero-copy host view


@pytest.fixture
def host_backends():
    names = {"offload-host-alias": CpuBackend(), "offload-no-host-view": _NoHostView()}
    for n, p in names.items():
        optirs.register_plugin(p, n)
    yield list(names)
    for n in names:
        optirs.unregister_plugin(n)


def test_any_backend_with_host_views_steps_the_offload(host_backends):
    alias, _ = host_backends
    ref_model, our_model = make_model(), make_model()
    ref = plain("AdamW", ref_model.parameters(), lr=1e-2)
    ours = offload("AdamW", our_model.parameters(), lr=1e-2, backend=alias)
    assert ours._backend.name == alias and all(c.inner._backend_name == alias for c in ours._chunks)
    for t in range(4):
        for m, o in ((ref_model, ref), (our_model, ours)):
            o.zero_grad()
            loss_of(m, t).backward()
            o.step()
    assert_same(ref_model, our_model)


def test_a_backend_without_host_views_is_refused_naming_the_capability(host_backends):
    _, lacking = host_backends
    model = make_model()
    with pytest.raises(UnsupportedOperationError, match=f"{lacking}.*optirs_host_view"):
        ot.CPUOffload("AdamW", model.parameters(), backend=lacking)
    register_third_party_backend()  # the example numpy backend: no host views either
    with pytest.raises(UnsupportedOperationError, match="'numpy'.*optirs_host_view"):
        ot.CPUOffload("SGD", model.parameters(), backend="numpy")
    with pytest.raises(GpuOptimError):  # a backend that does not open here says so
        ot.CPUOffload("AdamW", model.parameters(), backend="no-such-backend")


# ---------------------------------------------------------------- state_dict

def _through_disk(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _train(model, opt, steps, start=0):
    for t in range(start, start + steps):
        opt.zero_grad()
        loss_of(model, t).backward()
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name,kwargs", [CASES[0], CASES[1], CASES[3]], ids=["AdamW", "SGD", "Adafactor"])
def test_resume_equals_uninterrupted(name, kwargs, dtype):
    model = make_model(dtype)
    opt = offload(name, groups(model), **kwargs)
    _train(model, opt, 5)
    ckpt = _through_disk({"model": model.state_dict(), "opt": opt.state_dict()})
    _train(model, opt, 5, start=5)
    resumed = make_model(dtype)
    ropt = offload(name, groups(resumed), **kwargs)  # masters read from the fresh model here...
    resumed.load_state_dict(ckpt["model"])  # ...and again from the loaded weights at the next step
    ropt.load_state_dict(ckpt["opt"])
    _train(resumed, ropt, 5, start=5)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    if dtype == torch.bfloat16:  # the float32 masters are in the checkpoint, under the front end's key
        assert ckpt["opt"]["state"][0][offload_mod.MASTER_KEY].dtype == torch.float32


def test_state_dict_loads_into_the_plain_optimizer_and_back():
    model = make_model()
    opt = offload("AdamW", groups(model), lr=1e-2)
    _train(model, opt, 4)
    ckpt = _through_disk({"model": model.state_dict(), "opt": opt.state_dict()})
    plain_model = make_model()
    plain_model.load_state_dict(ckpt["model"])
    plain = ot.AdamW(groups(plain_model), lr=1e-2, backend="cpu")
    plain.load_state_dict(ckpt["opt"])
    _train(model, opt, 4, start=4)
    _train(plain_model, plain, 4, start=4)
    assert_same(plain_model, model)
    # and back: the plain optimizer's checkpoint continues under the offload
    clone = copy.deepcopy(plain_model)
    back = offload("AdamW", groups(clone), lr=1e-2)
    back.load_state_dict(_through_disk(plain.state_dict()))
    _train(plain_model, plain, 3, start=8)
    _train(clone, back, 3, start=8)
    assert_same(plain_model, clone)
    assert float(back.state[next(clone.parameters())]["step"]) == 11


# ---------------------------------------------------------------- copies

def _through_pickle(obj):
    return pickle.loads(pickle.dumps(obj))


COPIES = {
    # (parameters' dtype, the offload's keywords): DIRECT, WIDEN (masters held by the offload),
    # FUSED with int8 state (masters and compact state held by the inner optimizer), step_in_backward
    "fp32": (torch.float32, {}),
    "bf16-widen": (torch.bfloat16, {"fuse_conversions": False}),
    "bf16-int8": (torch.bfloat16, {"state_dtype": "int8", "bucket_elements": 9000}),
    "fp32-step_in_backward": (torch.float32, {"step_in_backward": True}),
}


@pytest.mark.parametrize("how", [copy.deepcopy, _through_pickle], ids=["deepcopy", "pickle"])
@pytest.mark.parametrize("case", sorted(COPIES))
def test_a_copy_of_model_and_optimizer_continues_as_the_original(case, how):
    dtype, kwargs = COPIES[case]
    wide = "bucket_elements" in kwargs
    model = make_wide(dtype) if wide else make_model(dtype)
    opt = offload("AdamW", model.parameters() if wide else groups(model), lr=1e-2, **kwargs)
    train = _train_wide if wide else _train
    train(model, opt, 3)
    opt.param_groups[0]["lr"] = 5e-3  # as a scheduler would: the copy takes the groups as they are
    model2, opt2 = how((model, opt))
    assert opt2.param_groups[0]["params"][0] is next(model2.parameters())
    assert opt2.param_groups[0]["lr"] == 5e-3 and opt2._armed == opt._armed
    train(model, opt, 3, start=3)
    train(model2, opt2, 3, start=3)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    _assert_snapshot(_snapshot(model2, opt2), _snapshot(model, opt))


def test_a_deepcopy_of_the_optimizer_alone_steps_copies_of_the_parameters_as_torch():
    model = make_model()
    opt = offload("AdamW", model.parameters(), lr=1e-2)
    _train(model, opt, 2)
    twin = copy.deepcopy(opt)
    torch_twin = copy.deepcopy(torch.optim.AdamW(model.parameters()))
    for a, b, p in zip(twin.param_groups[0]["params"], torch_twin.param_groups[0]["params"], model.parameters()):
        assert a is not p and b is not p and torch.equal(a, p)  # torch copies the parameters too
    for a, p in zip(twin.param_groups[0]["params"], model.parameters()):
        a.grad = None
    opt.zero_grad()
    loss_of(model, 2).backward()  # the original's hooks only: the twin's parameters have no gradient
    for a, p in zip(twin.param_groups[0]["params"], model.parameters()):
        assert a.grad is None
        a.grad = p.grad.clone()
    opt.step()
    twin.step()
    for a, p in zip(twin.param_groups[0]["params"], model.parameters()):
        assert torch.equal(a, p)


# ---------------------------------------------------------------- interrupted steps

def _snapshot(model, opt):
    sd = opt.state_dict()
    return ([p.detach().clone() for p in model.parameters()],
            {i: {k: v.clone() for k, v in s.items()} for i, s in sd["state"].items()},
            [c.host[k].clone() for c in opt._chunks for k in range(len(c.params))])


def _assert_snapshot(a, b):
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)
    assert set(a[1]) == set(b[1])
    for i in a[1]:
        for k in a[1][i]:
            assert torch.equal(a[1][i][k], b[1][i][k]), (i, k)
    for x, y in zip(a[2], b[2]):
        assert torch.equal(x, y)


def _pair_after_steps(steps=3):
    ref_model, our_model = make_model(), make_model()
    ref = offload("AdamW", groups(ref_model), lr=1e-2)
    ours = offload("AdamW", groups(our_model), lr=1e-2)
    _train(ref_model, ref, steps)
    _train(our_model, ours, steps)
    for m in (ref_model, our_model):
        m.zero_grad()
        loss_of(m, steps).backward()
    ref.step()  # the uninterrupted step
    return ref_model, ref, our_model, ours


def test_a_failing_worker_leaves_the_step_complete(monkeypatch):
    ref_model, ref, our_model, ours = _pair_after_steps()
    chunk = ours._chunks[1]
    real = chunk.inner.step
    calls = []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected worker failure")
        return real(*a, **k)

    monkeypatch.setattr(chunk.inner, "step", flaky)
    with pytest.raises(GpuOptimError, match="completed by retrying") as info:
        ours.step()
    assert isinstance(info.value.__cause__, RuntimeError) and "injected" in str(info.value.__cause__)
    _assert_snapshot(_snapshot(our_model, ours), _snapshot(ref_model, ref))  # fully after the step


def test_a_worker_failing_for_good_is_reported(monkeypatch):
    _, _, our_model, ours = _pair_after_steps()
    monkeypatch.setattr(ours._chunks[0].inner, "step", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("broken")))
    with pytest.raises(GpuOptimError, match="failed again") as info:
        ours.step()
    assert isinstance(info.value.__cause__, RuntimeError)


class FlakyCpu(CpuBackend):
    """The cpu backend whose optirs_step raises while ``fails(request)`` says so."""

    def __init__(self):
        self.fails = lambda request: False
        self.calls = 0

    @hookimpl
    def optirs_step(self, ctx, request):
        self.calls += 1
        if self.fails(request):
            raise RuntimeError(f"injected failure of call {self.calls}")
        return super().optirs_step(ctx, request)


@pytest.fixture
def flaky(fresh_registry):
    plugin = FlakyCpu()
    optirs.register_plugin(plugin, "flaky-cpu")
    return plugin


def _flaky_pair(dtype=torch.float32, steps=3):
    """The same training on the flaky plugin and on the cpu backend, up to a backward after ``steps`` steps."""
    runs = []
    for backend in ("flaky-cpu", "cpu"):
        model = make_model(dtype)
        opt = offload("AdamW", groups(model), lr=1e-2, backend=backend)
        _train(model, opt, steps)
        opt.zero_grad()
        loss_of(model, steps).backward()
        runs.append((model, opt))
    return runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_plugin_failing_for_good_changes_nothing_and_names_itself(flaky, dtype):
    (model, opt), (ref_model, ref) = _flaky_pair(dtype)
    before = _snapshot(model, opt)
    flaky.fails = lambda request: True
    with pytest.raises(PluginError, match=r"plugin 'flaky-cpu' raised RuntimeError in optirs_step: injected.*"
                                          r"failed again when retried.*nothing was stepped") as info:
        opt.step()
    assert info.value.stepped == [] and len(info.value.not_stepped) == len(list(model.parameters()))
    _assert_snapshot(_snapshot(model, opt), before)  # parameters, masters, state and step counts
    flaky.fails = lambda request: False
    opt.step()  # the same gradients: the step the failed call would have taken
    ref.step()
    _assert_snapshot(_snapshot(model, opt), _snapshot(ref_model, ref))


def test_a_plugin_failing_once_is_retried_and_the_step_completes(flaky):
    (model, opt), (ref_model, ref) = _flaky_pair()
    flaky.fails = lambda request: flaky.calls == flaky.calls_at_start + 1
    flaky.calls_at_start = flaky.calls
    with pytest.raises(PluginError, match=r"plugin 'flaky-cpu' raised RuntimeError in optirs_step.*"
                                          r"completed by retrying") as info:
        opt.step()
    assert info.value.not_stepped == [] and isinstance(info.value.__cause__.__cause__, RuntimeError)
    ref.step()
    _assert_snapshot(_snapshot(model, opt), _snapshot(ref_model, ref))  # after the whole step


def test_a_plugin_failing_on_one_chunk_says_exactly_what_was_stepped(flaky):
    (model, opt), _ = _flaky_pair()
    last = max(opt._chunks, key=lambda c: c.index)  # submitted last: others may step before it fails
    size = sum(p.numel() for p in last.params)
    assert sum(sum(p.numel() for p in c.params) == size for c in opt._chunks) == 1
    flaky.fails = lambda request: int(request.layout.sizes.sum()) == size
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PluginError, match="plugin 'flaky-cpu' raised RuntimeError in optirs_step") as info:
        opt.step()
    names = {p: f"param_groups[{gi}]['params'][{j}]" for gi, g in enumerate(opt.param_groups)
             for j, p in enumerate(g["params"])}
    changed = {names[p] for p, b in zip(model.parameters(), before) if not torch.equal(p, b)}
    assert set(info.value.stepped) == changed and not changed & set(info.value.not_stepped)
    assert {names[p] for p in last.params} <= set(info.value.not_stepped)
    assert ("nothing was stepped" in str(info.value)) == (not changed)
    assert ("the step is incomplete" in str(info.value)) == bool(changed)


def test_no_chunk_starts_after_a_chunk_failed(flaky):
    """One worker, so chunk 0 steps first: its plugin failure holds every other chunk back, and the
    step leaves everything as it was although only chunk 0's tensors make the plugin fail."""
    model = make_model()
    opt = offload("AdamW", groups(model), lr=1e-2, backend="flaky-cpu", workers=1)
    _train(model, opt, 2)
    opt.zero_grad()
    loss_of(model, 2).backward()
    first = min(opt._chunks, key=lambda c: c.index)
    size = sum(p.numel() for p in first.params)
    assert sum(sum(p.numel() for p in c.params) == size for c in opt._chunks) == 1
    flaky.fails = lambda request: int(request.layout.sizes.sum()) == size
    before = _snapshot(model, opt)
    with pytest.raises(PluginError, match="optirs_step.*nothing was stepped"):
        opt.step()
    _assert_snapshot(_snapshot(model, opt), before)


class _BadOpen(CpuBackend):
    @hookimpl
    def optirs_open(self, options):
        return {}["device"]  # a KeyError out of the plugin


class _GarbageStage(CpuBackend):
    @hookimpl
    def optirs_stage(self, ctx, params, grads, fmt):
        return params, grads  # a tuple, not a Staged


class _RaisingStage(CpuBackend):
    @hookimpl
    def optirs_stage(self, ctx, params, grads, fmt):
        return params.staged  # AttributeError


@pytest.mark.parametrize("plugin,words", [
    (_BadOpen, r"plugin 'bad' raised KeyError in optirs_open: 'device'"),
    (_GarbageStage, r"plugin 'bad''s optirs_stage returned \(\[array.*expected an optirs.plugin.hookspecs.Staged"),
    (_RaisingStage, r"plugin 'bad' raised AttributeError in optirs_stage: 'list' object has no attribute 'staged'"),
], ids=["open-KeyError", "stage-garbage", "stage-AttributeError"])
def test_a_plugin_failing_to_open_or_stage_is_named_before_anything(fresh_registry, plugin, words):
    optirs.register_plugin(plugin(), "bad")
    model = make_model()
    with pytest.raises(PluginError, match=words):
        ot.CPUOffload("AdamW", model.parameters(), backend="bad")


def test_keyboard_interrupt_during_the_step_lands_after_it(monkeypatch):
    ref_model, ref, our_model, ours = _pair_after_steps()
    chunk = ours._chunks[2]
    real = chunk.inner.step

    def interrupting(*a, **k):
        _thread.interrupt_main()  # a SIGINT while the workers are stepping
        return real(*a, **k)

    monkeypatch.setattr(chunk.inner, "step", interrupting)
    with pytest.raises(KeyboardInterrupt):
        ours.step()
        for _ in range(1000):  # the interrupt is delivered by the main thread's next bytecodes
            pass
    _assert_snapshot(_snapshot(our_model, ours), _snapshot(ref_model, ref))


def test_a_bad_hyperparameter_at_step_changes_nothing():
    model = make_model()
    opt = offload("AdamW", groups(model), lr=1e-2)
    _train(model, opt, 2)
    loss_of(model, 3).backward()
    before = _snapshot(model, opt)
    opt.param_groups[1]["lr"] = -1.0
    with pytest.raises(InvalidParameterError):
        opt.step()
    _assert_snapshot(_snapshot(model, opt), before)


def _drop(key):
    def edit(opt):
        del opt.param_groups[1][key]
    return edit


def _set(key, value):
    def edit(opt):
        opt.param_groups[1][key] = value
    return edit


BAD_STEPS = {
    # what is wrong -> (how, step()'s keywords, the words the error must contain)
    "no-lr-in-group-1": (_drop("lr"), {}, r"param_groups\[1\] has no 'lr'"),
    "no-betas-in-group-1": (_drop("betas"), {}, r"param_groups\[1\] has no 'betas'"),
    "beta2-in-group-1": (_set("betas", (0.9, 1.5)), {}, r"param_groups\[1\]: beta2=1.5"),
    "lr-tensor-in-group-1": (_set("lr", torch.tensor([1e-2, 2e-2])), {}, r"param_groups\[1\]: lr is a tensor of 2"),
    "grad_scale-of-2": (None, {"grad_scale": torch.tensor([1.0, 2.0])}, "grad_scale is a tensor of 2 elements"),
    "grad_scale-0": (None, {"grad_scale": torch.tensor(0.0)}, "grad_scale=tensor.*finite scale > 0"),
    "found_inf-yes": (None, {"found_inf": "yes"}, "found_inf='yes', expected None, a number or a 1-element"),
    "found_inf-of-3": (None, {"found_inf": torch.zeros(3)}, "found_inf is a tensor of 3 elements"),
}


@pytest.mark.parametrize("case", sorted(BAD_STEPS))
def test_everything_is_checked_before_anything_is_stepped(case):
    """A bad value anywhere (the second group, GradScaler's tensors) is an optirs error naming it,
    and the parameters, masters and state are exactly as before the call."""
    edit, kwargs, words = BAD_STEPS[case]
    model = make_model()
    opt = offload("AdamW", groups(model), lr=1e-2)
    _train(model, opt, 2)
    loss_of(model, 3).backward()
    before = _snapshot(model, opt)
    if edit is not None:
        edit(opt)
    with pytest.raises(InvalidParameterError, match=words + ".*nothing was stepped"):
        opt.step(**kwargs)
    _assert_snapshot(_snapshot(model, opt), before)


def test_a_bad_group_starts_nothing_in_backward():
    """step_in_backward: a group made invalid before the backward starts no chunk there, so
    step() refuses it before anything is stepped."""
    model = make_model()
    opt = offload("AdamW", groups(model), lr=1e-2, step_in_backward=True)
    _train(model, opt, 2)  # armed
    opt.zero_grad()
    opt.param_groups[2]["weight_decay"] = -0.5
    loss_of(model, 2).backward()
    assert all(c.future is None for c in opt._chunks)
    before = _snapshot(model, opt)
    with pytest.raises(InvalidParameterError, match=r"param_groups\[2\]: weight_decay=-0.5.*nothing was stepped"):
        opt.step()
    _assert_snapshot(_snapshot(model, opt), before)
    opt.param_groups[2]["weight_decay"] = 0.0
    opt.step()  # the same gradients, copied again: the round goes on
    assert not any(torch.equal(a, b) for a, b in zip(before[0], model.parameters()))


# ---------------------------------------------------------------- bad cases

PINNED_FAILURES = {
    # what torch raises when cudaHostAlloc fails, by torch version and CUDA error
    "OutOfMemoryError": lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    "RuntimeError": lambda: RuntimeError("CUDA error: out of memory"),
    "AcceleratorError": lambda: getattr(torch, "AcceleratorError", RuntimeError)("CUDA error: invalid argument"),
}


@pytest.mark.parametrize("kind", sorted(PINNED_FAILURES))
def test_pinned_allocation_failure_names_the_bytes(monkeypatch, kind):
    """The failure is injected at torch's allocation, whatever the host's memory: on a CUDA host a
    real pinned allocation of this size succeeds (why the earlier form of this test, which relied
    on pin_memory=True failing without CUDA, failed on the H200)."""
    from optirs.core.layout import aligned_offsets

    model = make_model()
    # one chunk, the tensors in backward's order, each at its layout offset
    n = aligned_offsets([p.numel() for p in reversed(list(model.parameters()))])[1]
    asked = []

    def failing(numel, dtype, pin):
        asked.append((numel, dtype, pin))
        if pin:
            raise PINNED_FAILURES[kind]()
        return torch.empty(numel, dtype=dtype)

    monkeypatch.setattr(offload_mod, "_pins", lambda device: True)
    monkeypatch.setattr(offload_mod, "_allocate", failing)
    with pytest.raises(DeviceMemoryError, match=rf"{n * 4} bytes of pinned host memory.*{kind}") as info:
        ot.CPUOffload("AdamW", model.parameters())
    assert isinstance(info.value.__cause__, RuntimeError)
    assert asked == [(n, torch.float32, True)]  # one chunk: the fp32 parameter copies, nothing after it
    # a group that cannot be allocated is not added: the optimizer is as before the call
    monkeypatch.setattr(offload_mod, "_pins", lambda device: False)
    opt = ot.CPUOffload("AdamW", model.parameters())
    monkeypatch.setattr(offload_mod, "_pins", lambda device: True)
    extra = torch.nn.Parameter(torch.zeros(7))
    with pytest.raises(DeviceMemoryError, match="28 bytes of pinned"):
        opt.add_param_group({"params": [extra]})
    assert len(opt.param_groups) == 1 and extra not in opt._where


def test_bad_arguments_and_tensors():
    model = make_model()
    with pytest.raises(InvalidParameterError, match="optimizer_class"):
        ot.CPUOffload("AdamX", model.parameters())
    with pytest.raises(InvalidParameterError, match="optimizer_class"):
        ot.CPUOffload(torch.optim.AdamW, model.parameters())
    with pytest.raises(InvalidParameterError, match="workers"):
        ot.CPUOffload("AdamW", model.parameters(), workers=0)
    with pytest.raises(InvalidParameterError, match="fuse_conversions"):
        ot.CPUOffload("AdamW", model.parameters(), fuse_conversions=1)
    for bad in (0, True, 2.0):
        with pytest.raises(InvalidParameterError, match=f"cpu_threads={bad!r}"):
            ot.CPUOffload("AdamW", model.parameters(), cpu_threads=bad)
    with pytest.raises(InvalidParameterError, match="fuse_conversions=False.*remainder8"):
        ot.CPUOffload("AdamW", make_model(torch.bfloat16).parameters(), fuse_conversions=False,
                      master_weights="remainder8")
    with pytest.raises(InvalidParameterError, match="master_weights='remainder16' with float16"):
        ot.CPUOffload("AdamW", make_model(torch.float16).parameters(), master_weights="remainder16")
    with pytest.raises(InvalidParameterError):
        ot.CPUOffload("AdamW", model.parameters(), lr=-1.0)
    with pytest.raises(UnsupportedOperationError, match="float64"):
        ot.CPUOffload("SGD", [torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))])
    opt = ot.CPUOffload(ot.SGD, model.parameters(), lr=0.1)
    with pytest.raises(InvalidParameterError):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "momentum": -1.0})
    assert len(opt.param_groups) == 1 and len(opt._chunks) == 1
    emb = torch.nn.Embedding(10, 4, sparse=True)
    sopt = ot.CPUOffload("Adam", emb.parameters())
    with pytest.raises(UnsupportedOperationError, match="sparse"):
        emb(torch.tensor([1, 2])).sum().backward()  # the hook refuses it as soon as it is written
    with pytest.raises(UnsupportedOperationError, match="sparse"):
        sopt.step()
    assert not sopt.state


def test_a_format_changed_after_the_group_was_added_is_refused_before_anything_steps():
    model = make_model(torch.bfloat16)
    opt = offload("AdamW", model.parameters(), lr=1e-2, fuse_conversions=False)
    _train(model, opt, 2)
    assert {c.mode for c in opt._chunks} == {offload_mod.WIDEN}
    loss_of(model, 2).backward()
    before = _snapshot(model, opt)
    opt.param_groups[0]["master_weights"] = "remainder16"  # only the formats step holds it
    with pytest.raises(InvalidParameterError, match=r"param_groups\[0\]: fuse_conversions=False.*'remainder16'"):
        opt.step()
    _assert_snapshot(_snapshot(model, opt), before)
    opt.param_groups[0]["master_weights"] = "float32"
    opt.fuse_conversions = None  # the chunks were made apart: the formats step would need them fused
    with pytest.raises(UnsupportedOperationError, match="step format changed.*'widen'.*'fused'"):
        opt.step()
    _assert_snapshot(_snapshot(model, opt), before)


def test_parameters_on_several_devices_are_refused():
    meta = torch.nn.Parameter(torch.zeros(4, device="meta"))
    with pytest.raises(UnsupportedOperationError, match="one device"):
        ot.CPUOffload("AdamW", [torch.nn.Parameter(torch.zeros(4)), meta])
    opt = ot.CPUOffload("AdamW", [torch.nn.Parameter(torch.zeros(4))])
    with pytest.raises(UnsupportedOperationError, match="one device"):
        opt.add_param_group({"params": [meta]})
    assert len(opt.param_groups) == 1


# ---------------------------------------------------------------- real copies (the GPU machine)

@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("step_in_backward", [False, True], ids=["step-at-step", "step-in-backward"])
def test_cuda_trajectory_equals_no_offload(step_in_backward):
    ref_model, our_model = make_model(device="cuda"), make_model(device="cuda")
    ref = ot.AdamW(groups(ref_model), lr=1e-2, backend="cuda")
    ours = ot.CPUOffload("AdamW", groups(our_model), lr=1e-2, bucket_elements=300,
                         step_in_backward=step_in_backward, accumulation_steps=2)
    for t in range(STEPS):
        for m, o in ((ref_model, ref), (our_model, ours)):
            o.zero_grad()
            for a in range(2):
                (loss_of(m, 2 * t + a, "cuda") / 2).backward()
            o.step()
        assert_same(ref_model, our_model, rtol=1e-4, atol=1e-5)  # cuda vs cpu kernels: float32 rounding
    assert all(c.host_flat.is_pinned() and c.grad_flat.is_pinned() for c in ours._chunks)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", [{"fuse_conversions": False}, {"fuse_conversions": True},
                                 {"state_dtype": "int8"}, {"master_weights": "remainder8", "state_dtype": "int8"}],
                         ids=["bf16-separate", "bf16-fused", "bf16-int8", "bf16-remainder8-int8"])
@pytest.mark.parametrize("step_in_backward", [False, True], ids=["step-at-step", "step-in-backward"])
def test_cuda_16bit_formats_equal_the_gpu_optimizer(fmt, step_in_backward):
    """bf16 parameters on the GPU, their masters and state on the host: the same trajectory as the
    same optimizer and format stepped on the GPU (the formats contract is the same on every
    backend; the float32 arithmetic may round differently, so within a bf16 rounding step)."""
    ref_model, our_model = make_wide(torch.bfloat16).cuda(), make_wide(torch.bfloat16).cuda()
    precision = {"master_weights": "float32", **{k: v for k, v in fmt.items() if k != "fuse_conversions"}}
    ref = ot.AdamW(ref_model.parameters(), lr=1e-2, backend="cuda", **precision)
    ours = ot.CPUOffload("AdamW", our_model.parameters(), lr=1e-2, bucket_elements=9000,
                         step_in_backward=step_in_backward, **fmt)
    for t in range(8):
        for m, o in ((ref_model, ref), (our_model, ours)):
            o.zero_grad()
            g = torch.Generator().manual_seed(300 + t)
            x = torch.randn(32, 96, generator=g).to("cuda", torch.bfloat16)
            y = torch.randint(0, 5, (32,), generator=g).cuda()
            torch.nn.functional.cross_entropy(m(x).float(), y).backward()
            o.step()
        assert_same(ref_model, our_model, rtol=2e-2, atol=1e-2)
    assert all(v.device.type == "cpu" for s in ours.state.values() for v in s.values())
    assert all(c.host_flat.is_pinned() and c.grad_flat.is_pinned() or c.staging_flat.is_pinned()
               for c in ours._chunks)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("edit", ["data-mul", "data-neg", "one-element"])
def test_cuda_gradients_edited_without_a_version_bump_are_copied_again(edit):
    """The fingerprints on the device: an edit queued after backward (through .data: no version
    bump), racing the copy on its side stream, is seen and copied again."""
    ref_model, our_model = make_model(device="cuda"), make_model(device="cuda")
    ref = ot.AdamW(groups(ref_model), lr=1e-2, backend="cuda")
    ours = ot.CPUOffload("AdamW", groups(our_model), lr=1e-2, bucket_elements=300)
    assert ours._check == offload_mod.FINGERPRINT
    ours.timing = offload_mod.OffloadTiming()
    for t in range(6):
        for m, o in ((ref_model, ref), (our_model, ours)):
            o.zero_grad()
            loss_of(m, t, "cuda").backward()
            for q in list(m.parameters())[::2]:
                EDITS[edit](q.grad)
            o.step()
        assert_same(ref_model, our_model, rtol=1e-4, atol=1e-5)
    n = sum(p.numel() for p in our_model.parameters())
    edited = sum(p.numel() for p in list(our_model.parameters())[::2])
    assert ours.timing.d2h_bytes == 6 * 4 * (n + edited) and ours.timing.check_s > 0


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_edits_are_refused_with_step_in_backward():
    model = make_model(device="cuda")
    opt = ot.CPUOffload("AdamW", model.parameters(), lr=1e-2, bucket_elements=300, step_in_backward=True)
    loss_of(model, 0, "cuda").backward()
    model.head.weight.grad.data.mul_(0.5)
    with pytest.raises(UnsupportedOperationError, match=r"changed after backward.*nothing was stepped"):
        opt.step()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_optimizer_state_takes_no_gpu_memory():
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda()
    x = torch.randn(64, 1024, device="cuda")
    model(x).sum().backward()  # the gradients exist before the baseline
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    opt = ot.CPUOffload("AdamW", model.parameters(), lr=1e-3)
    for _ in range(3):
        model(x).sum().backward()
        opt.step()
    torch.cuda.synchronize()
    # all state is on the host; the GPU keeps only the gradients' fingerprints (two int64 per
    # tensor, sent and now; torch's allocator rounds each table up to 512 bytes)
    tensors = len(list(model.parameters()))
    assert torch.cuda.memory_allocated() - before <= max(2 * 2 * 8 * tensors, 2 * 512)
    assert all(v.device.type == "cpu" for s in opt.state.values() for v in s.values())


@pytest.mark.parametrize("name,fuse", [("AdamW", None), ("AdamW", False), ("Adafactor", None)])
def test_timing_counts_every_byte_moved(name, fuse):
    model = make_model(torch.bfloat16)
    opt = offload(name, model.parameters(), **({"fuse_conversions": fuse} if fuse is not None else {}))
    opt.timing = offload_mod.OffloadTiming()
    _train(model, opt, 3)
    t = opt.timing.as_dict()
    n = sum(p.numel() for p in model.parameters())
    assert t["steps"] == 3 and t["d2h_bytes"] == t["h2d_bytes"] == 3 * n * 2  # bf16 both ways
    assert t["cpu_step_s"] > 0 and t["step_call_s"] >= t["cpu_step_s"] / opt.workers
    assert t["early_chunks"] == 0 and t["step_bytes"] > 0
    # the formats step (the default) widens and narrows in its own pass; the float32 step on float32
    # masters (fuse_conversions=False, and Adafactor, which has no step formats) converts apart
    mode = offload_mod.FUSED if name == "AdamW" and fuse is None else offload_mod.WIDEN
    assert all(c.mode == mode for c in opt._chunks)
    assert (t["convert_s"] > 0) == (mode == offload_mod.WIDEN)


def _bench_module(name="bench_offload"):
    """A fresh copy of ``benchmarks/<name>.py``, registered under its name (numba's cache finds the
    module of a kernel it defines)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[name] = bench
    spec.loader.exec_module(bench)
    return bench


def test_a_failing_benchmark_row_is_a_failed_row_and_the_rest_is_kept(tmp_path, monkeypatch, capsys):
    """A row raising after its steps (torchao 0.18's optimizer has no .state: state_bytes raised
    after four minutes on the H200) is a FAILED row, said at once; the other rows are reported."""
    bench = _bench_module()
    real = bench.bench_row

    def failing(row, *args, **kwargs):
        if row == "optirs_torch":
            if len(args) > 4:  # the row's measurements so far stay in it
                args[4]["step_ms"] = 1.0
            raise AttributeError("'CPUOffloadOptimizer' object has no attribute 'state'")
        return real(row, *args, **kwargs)

    monkeypatch.setattr(bench, "bench_row", failing)
    out = tmp_path / "offload.json"
    code = bench.main(["--quick", "--rows", "none,optirs_torch,torch_fused", "--chunk-elements", "0",
                       "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 1
    assert "optirs_torch FAILED: AttributeError: 'CPUOffloadOptimizer' object has no attribute 'state'" in printed
    assert printed.index("optirs_torch FAILED") < printed.index("torch_fused: ")  # said as it came
    import json

    r = json.loads(out.read_text())
    assert r["rows"]["optirs_torch"]["failed"].startswith("AttributeError") and r["rows"]["optirs_torch"]["step_ms"] == 1.0
    assert r["rows"]["none"]["step_ms"] > 0 and r["rows"]["torch_fused"]["step_ms"] > 0
    assert "optirs_torch" not in r["analysis"]


def test_the_benchmark_counts_no_state_where_an_optimizer_shows_none():
    bench = _bench_module()

    class NoState:  # torchao 0.18's CPUOffloadOptimizer
        param_groups = []

    assert bench.state_bytes(NoState(), "cpu") is None
    model = make_model()
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt, 1)
    assert bench.state_bytes(opt, "cpu") == 2 * 4 * sum(p.numel() for p in model.parameters()) + 4 * 8


def test_the_benchmark_quick_mode_runs_and_counts_the_bytes(tmp_path):
    bench = _bench_module()
    out = tmp_path / "offload.json"
    assert bench.main(["--quick", "--rows", "torch_fused,offload,offload_int8,torchao,torch_fused_bf16,"
                       "offload_bf16_r8_int8", "--chunk-elements", "8192", "--json", str(out)]) == 0
    import json

    r = json.loads(out.read_text())
    off = r["rows"]["offload"]
    assert off["step_ms"] > 0 and r["rows"]["torch_fused"]["step_ms"] > 0
    assert "skipped" in r["rows"]["torchao"] or r["rows"]["torchao"]["step_ms"] > 0
    # fp32 parameters: every step copies each gradient out and each parameter back, 4 bytes each
    for row in ("offload", "offload_int8"):
        t = r["rows"][row]["timing"]
        assert t["d2h_bytes"] == t["h2d_bytes"] == 4 * off["parameters"]
    # bf16 parameters on remainder masters: only bf16 gradients and parameters cross, and the added
    # time is over the bf16 model's own no-offload step
    bf16 = r["rows"]["offload_bf16_r8_int8"]
    assert bf16["param_dtype"] == "bfloat16" and "fused" in bf16["note"]
    assert bf16["timing"]["d2h_bytes"] == bf16["timing"]["h2d_bytes"] == 2 * bf16["parameters"]
    assert bf16["added_ms"] == bf16["step_ms"] - r["rows"]["torch_fused_bf16"]["step_ms"]
    a = r["analysis"]
    assert a["offload_bf16_r8_int8"]["added_over"] == "torch_fused_bf16"
    # a bf16 step reads the gradient (2) and reads and writes the parameter (2 + 2), the int8
    # remainder (1 + 1) and the moments (2 + 2 with int8 codes) where they are int8: 12 B and up
    assert 12 <= a["offload_bf16_r8_int8"]["step_bytes_per_param"] < a["offload_int8"]["step_bytes_per_param"]
    assert a["offload"]["cpu_step_GBps"] > 0 and r["bandwidth"]["host_copy_GBps"] > 0
    # the CPU step touches 28 B per parameter with float32 state, about 16 with int8 state (the
    # quick model's small tensors keep float32 state)
    assert a["offload"]["step_bytes_per_param"] == 28 and a["offload_int8"]["step_bytes_per_param"] < 28
    # the host state: 8 B per parameter with float32 state (the masters are the parameters' host
    # copies, not state), plus the step counts (4 B per tensor)
    assert 0 <= r["rows"]["offload"]["opt_state_host_bytes"] - 8 * off["parameters"] < 4096
    cases = r["chunk_cpu"]["cases"]
    assert cases["bf16_fused"]["equals_before"] and cases["bf16_before"]["bytes_per_param"] == 40
    assert cases["bf16_fused"]["bytes_per_param"] == 30 and cases["fp32"]["bytes_per_param"] == 28
    assert cases["bf16_r16"]["bytes_per_param"] == 26 and 12 < cases["bf16_r8_int8"]["bytes_per_param"] < 12.1


def test_step_in_backward_starts_the_steps_before_step_is_called():
    ref_model, model = make_model(), make_model()
    ref = ot.SGD(ref_model.parameters(), lr=0.05, momentum=0.9, backend="cpu")
    opt = offload("SGD", model.parameters(), lr=0.05, momentum=0.9, step_in_backward=True, accumulation_steps=2)
    opt.timing = offload_mod.OffloadTiming()
    for t in range(4):
        for m, o in ((ref_model, ref), (model, opt)):
            o.zero_grad()
            loss_of(m, 2 * t).backward()
            if o is opt:
                assert all(c.future is None for c in opt._chunks)  # the first backward of two: nothing yet
            loss_of(m, 2 * t + 1).backward()
            if o is opt:
                started = [c.future is not None for c in opt._chunks]
                assert all(started) if t > 0 else not any(started)  # the first round runs in step()
            o.step()
        assert_same(ref_model, model)
    assert opt.timing.early_chunks == 3 * len(opt._chunks)  # every chunk of rounds 2-4 started in backward


@pytest.mark.parametrize("in_backward", [False, True], ids=["at_step", "in_backward"])
def test_timeline_places_every_chunk_of_the_last_step(in_backward):
    """OffloadTiming(timeline=True): each chunk of the last step once, its times in order on the
    step() call's clock (before it exactly for the chunks stepped in backward), its elements and
    bytes those of its tensors; the summary splits them as early_chunks counts them."""
    model = make_model()
    opt = offload("SGD", model.parameters(), lr=0.05, momentum=0.9, step_in_backward=in_backward)
    _train(model, opt, 1)  # step_in_backward starts in backward from the second round on
    opt.timing = offload_mod.OffloadTiming(timeline=True)
    _train(model, opt, 2, start=1)
    rows = opt.timing.timeline_rows()
    assert sorted(r["chunk"] for r in rows) == sorted(c.index for c in opt._chunks)
    for r in rows:
        chunk = next(c for c in opt._chunks if c.index == r["chunk"])
        assert r["elements"] == sum(p.numel() for p in chunk.params)
        assert r["h2d_bytes"] == 4 * r["elements"] and r["step_bytes"] > r["h2d_bytes"]
        assert r["ready"] <= r["step_start"] <= r["step_end"] <= r["h2d_queued"]
        assert (r["step_start"] < 0) == in_backward and r["d2h_ms"] >= 0 and r["h2d_ms"] >= 0
    summary = opt.timing.timeline_summary()
    early = summary["in_backward"]["chunks"]
    assert early + summary["after"]["chunks"] == len(rows) == summary["chunks"]
    assert early == opt.timing.early_chunks / 2  # two timed steps, the timeline keeps the last
    assert summary["in_backward" if in_backward else "after"]["elements"] == sum(p.numel() for p in model.parameters())
    steps = sorted((r["step_start"], r["step_end"]) for r in rows)  # one host pass at a time: in sequence
    assert all(a[1] <= b[0] for a, b in zip(steps, steps[1:]))
    span = summary["last_step_end_ms"] - summary["first_step_start_ms"]
    assert summary["idle_between_steps_ms"] == pytest.approx(span - sum(e - s for s, e in steps))
    assert opt.timing.timeline is True and not offload_mod.OffloadTiming().timeline


def test_cpu_threads_limit_the_chunk_steps_and_survive_a_copy(monkeypatch):
    """The chunks' steps run on at most ``cpu_threads`` of numba's threads (the cpu backend's thread
    count is capped by the launching thread's numba count), the caller's own count is left as it
    was, and a copy of the optimizer keeps the limit."""
    import copy

    import numba

    from optirs.backends.cpu.threads import StepThreads

    limits = []
    real = StepThreads.count

    def count(self, elements, limit):
        limits.append(limit)
        return real(self, elements, limit)

    monkeypatch.setattr(StepThreads, "count", count)
    before = numba.get_num_threads()
    model = make_model()
    opt = ot.CPUOffload("AdamW", model.parameters(), cpu_threads=1)
    _train(model, opt, 1)
    assert limits and set(limits) == {1}
    assert numba.get_num_threads() == before
    twin = copy.deepcopy(opt)
    assert twin.cpu_threads == 1
    limits.clear()
    model = make_model()
    opt = ot.CPUOffload("AdamW", model.parameters())
    _train(model, opt, 1)
    assert set(limits) == {numba.config.NUMBA_NUM_THREADS}


def test_the_benchmark_runs_a_row_per_thread_count(tmp_path):
    """``ROW@N`` sets that row's cpu_threads; a repeat keeps its own result, so thread counts can
    alternate in one process; a count on a row without offload is refused. The rows' baseline
    (torch_fused), not asked for, is run first: the added time needs it."""
    bench = _bench_module()
    out = tmp_path / "offload.json"
    assert bench.main(["--quick", "--rows", "offload@1,offload@1", "--split-steps", "0",
                       "--chunk-elements", "0", "--json", str(out)]) == 0
    import json

    r = json.loads(out.read_text())
    assert r["rows_run"] == ["torch_fused", "offload@1", "offload@1#2"]
    assert r["rows"]["offload@1"]["gradient_check"] == "copy-at-step"  # CPU tensors, steps at step()
    for row in ("offload@1", "offload@1#2"):
        assert "cpu_threads=1)" in r["rows"][row]["note"] and r["rows"][row]["step_ms"] > 0
        assert "added_ms" in r["rows"][row]
    for bad in ("torch_fused@2", "offload@0", "offload@x"):
        with pytest.raises(SystemExit):
            bench.main(["--quick", "--rows", bad])


def test_the_benchmark_puts_each_offload_rows_baseline_in_front():
    """Every row whose added time is measured (the offload rows, torchao's: the figure the offload
    rows are held to) gets its parameter dtype's no-offload baseline in the same run."""
    bench = _bench_module()
    rows, added = bench.with_baselines(["offload_bf16_r8_int8sqrt_sib", "torchao", "offload_int8sqrt@14"])
    assert added == ["torch_fused_bf16", "torch_fused"]
    assert rows == ["torch_fused_bf16", "torch_fused", "offload_bf16_r8_int8sqrt_sib", "torchao", "offload_int8sqrt@14"]
    kept = ["torch_fused", "none_bf16", "offload", "torch_fused_bf16", "offload_bf16_r8_int8"]
    assert bench.with_baselines(kept) == (kept, [])
    assert bench.with_baselines(["none", "torchao"]) == (["torch_fused", "none", "torchao"], ["torch_fused"])
    assert bench.with_baselines(["none", "none_bf16"]) == (["none", "none_bf16"], [])


def test_contention_benchmark_refuses_bad_sizes_and_a_machine_without_cuda(capsys):
    bench = _bench_module("bench_host_contention")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--mib", "0"])
    assert exc.value.code == 2 and "--mib=0, expected an int >= 1" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert bench.main(["--mib", "1"]) == 2
        assert "needs a CUDA device" in capsys.readouterr().err


def test_contention_benchmark_host_load_copies_and_counts_while_running():
    np = pytest.importorskip("numpy")
    bench = _bench_module("bench_host_contention")
    load = bench.HostLoad(1)
    load.src[:] = np.arange(load.src.size, dtype=np.uint64)
    assert load.once() > 0 and np.array_equal(load.dst, load.src)
    load.src[:] += 1
    with load:
        time.sleep(0.05)
    assert load.bytes >= 2 * load.src.nbytes and load.rate() > 0 and np.array_equal(load.dst, load.src)


def _vm_flags(address):
    """The VmFlags of the mapping of this process that holds ``address`` (Linux's /proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    return None


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(),
                    reason="no transparent huge pages (Linux only)")
def test_large_host_buffers_ask_for_huge_pages():
    """The front end's state buffers and CPUOffload's ordinary host buffers of 2 MiB and more carry
    the kernel's huge-page advice (VmFlags 'hg'); small ones are left alone."""
    from optirs.core.host_pages import HUGE_PAGE, advise_huge_pages

    assert not advise_huge_pages(HUGE_PAGE + 1, HUGE_PAGE)  # no whole huge page inside
    big = torch.nn.Parameter(torch.zeros(3 << 20))  # 12 MiB
    opt = ot.AdamW([big], lr=1e-3, backend="cpu")
    big.grad = torch.ones_like(big)
    opt.step()
    state = opt.state[big]["exp_avg"]
    assert "hg" in _vm_flags(state.data_ptr() + state.numel() * state.element_size() // 2)
    model = torch.nn.Linear(1024, 1024)  # 4 MiB of weight: one chunk, its host copies ordinary memory on the CPU
    off = offload("AdamW", model.parameters(), bucket_elements=1 << 22)
    host = off._chunks[0].host_flat
    assert "hg" in _vm_flags(host.data_ptr() + host.numel() * host.element_size() // 2)


@pytest.mark.parametrize("step_in_backward", [False, True])
def test_chunk_steps_run_with_a_short_gil_switch_interval_and_restore_it(monkeypatch, step_in_backward):
    """A chunk step hands the GIL between threads many times; while any runs, the interval is the
    offload's short one (a thread busy in Python then delays each handoff by that, not by Python's
    5 ms); after step() the caller's is back, and a caller's shorter one is never raised."""
    from optirs.torch import _gil

    seen = []
    run_chunk = offload_mod.CPUOffload._run_chunk

    def recording(self, *args, **kwargs):
        seen.append(sys.getswitchinterval())
        return run_chunk(self, *args, **kwargs)

    monkeypatch.setattr(offload_mod.CPUOffload, "_run_chunk", recording)
    before = sys.getswitchinterval()
    try:
        for asked in (0.005, 0.0001):
            sys.setswitchinterval(asked)
            caller = sys.getswitchinterval()  # as Python keeps it (whole microseconds)
            model = make_model()
            opt = offload("AdamW", groups(model), lr=1e-2, step_in_backward=step_in_backward)
            for t in range(3):
                opt.zero_grad()
                loss_of(model, t).backward()
                opt.step()
                assert sys.getswitchinterval() == caller
            assert seen and all(s <= min(caller, _gil.SWITCH_INTERVAL) for s in seen), (caller, seen)
            assert caller > _gil.SWITCH_INTERVAL or all(s == caller for s in seen)
            seen.clear()
    finally:
        sys.setswitchinterval(before)


def test_the_gil_benchmark_runs_both_intervals_and_refuses_bad_input(tmp_path, capsys):
    import json

    bench = _bench_module("bench_offload_gil")
    out = tmp_path / "gil.json"
    assert bench.main(["--bursts", "0,100", "--steps", "1", "--reps", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"0", "100"}
    assert all(set(r) == {"python's interval", "the offload's"} and all(v["wall_ms"] > 0 for v in r.values())
               for r in rows.values())
    for bad in (["--bursts", "x"], ["--bursts", "-1"], ["--steps", "0"]):
        with pytest.raises(SystemExit):
            bench.main(bad)


def test_the_chunk_diagnosis_profiles_every_chunk_and_refuses_bad_input(capsys):
    pytest.importorskip("transformers")
    diag = _bench_module("diag_offload_chunks")
    assert diag.main(["--quick", "--row", "offload_int8sqrt", "--warmup", "1", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "chunk   0:" in out and "ns an element" in out and "Ordered by: internal time" in out
    for bad in (["--row", "torchao"], ["--quick", "--warmup", "0"]):
        with pytest.raises(SystemExit):
            diag.main(bad)


def test_every_chunk_step_runs_on_one_thread_whatever_the_workers():
    """numba's omp layer gives each thread that launches a parallel loop its own team of threads,
    which spin a while after the loop: every host pass of an optimizer runs on its one stepper
    thread, so that two workers taking chunks in turn do not leave one team spinning beside the
    other's step."""
    model = make_model()
    opt = offload("AdamW", groups(model), lr=1e-2, workers=3, bucket_elements=64)
    assert len(opt._chunks) > 3
    threads = set()
    for chunk in opt._chunks:
        step = chunk.inner.step

        def recording(*args, _step=step, **kwargs):
            threads.add(threading.get_ident())
            return _step(*args, **kwargs)

        chunk.inner.step = recording
    for t in range(3):
        opt.zero_grad()
        loss_of(model, t).backward()
        opt.step()
    assert len(threads) == 1 and threading.get_ident() not in threads
