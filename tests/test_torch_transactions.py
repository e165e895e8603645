"""optirs.torch's step as one transaction over every group (docs/torch.md, "One step, one transaction").

Each case checks the promise: a refused step changes nothing in any group (parameters, state and
step counts bit-identical to before), an interrupted one is exactly before or after the whole
step (an uninterrupted twin is the reference), state in another format is converted as the
formats' own reference decodes and encodes it, and what is wrong is an optirs error naming the
value and what was expected. torch.optim is the reference for what torch itself refuses.
"""

from __future__ import annotations

import _thread
import copy
import pickle
import signal
import sys
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import optirs  # noqa: E402
import optirs.torch as ot  # noqa: E402
from optirs.core import reference as fref  # noqa: E402
from optirs.core.errors import InvalidParameterError, PluginError, ShapeMismatchError  # noqa: E402
from optirs.plugin.hookspecs import StepSupport, hookimpl  # noqa: E402
from optirs.torch._guards import TensorCheck  # noqa: E402

from conftest import FakeHostBackend, interrupt_at  # noqa: E402

SHAPES = [(3, 2), (4,), (2, 2), (3,)]


def make_params(seed=0, dtype=torch.float32, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def two_groups(params):
    half = len(params) // 2
    return [{"params": params[:half], "weight_decay": 0.1}, {"params": params[half:], "weight_decay": 0.0}]


def set_grads(params, step, dtype=None):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(dtype or p.dtype)


def snapshot(opt, params):
    """Parameters and every state entry (step counts included), as copies."""
    return ([p.detach().clone() for p in params],
            [{k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state.get(p, {}).items()}
             for p in params])


def same(a, b):
    """Bit-identical snapshots."""
    (pa, sa), (pb, sb) = a, b
    if not all(torch.equal(x, y) for x, y in zip(pa, pb)):
        return False
    for x, y in zip(sa, sb):
        if set(x) != set(y):
            return False
        for k in x:
            if isinstance(x[k], torch.Tensor):
                if x[k].dtype != y[k].dtype or not torch.equal(x[k], y[k]):
                    return False
            elif x[k] != y[k]:
                return False
    return True


def twins(make_opt, dtype=torch.float32, shapes=SHAPES):
    """Two identical optimizers on identical parameters, each stepped once (their buckets built)."""
    out = []
    for _ in range(2):
        params = make_params(dtype=dtype, shapes=shapes)
        opt = make_opt(two_groups(params))
        set_grads(params, 0)
        opt.step()
        out.append((opt, params))
    return out


# ------------------------------------------------------------------ Ctrl-C during step()


def test_ctrl_c_anywhere_in_a_two_group_lamb_step_lands_before_or_after_the_whole_step():
    assert threading.current_thread() is threading.main_thread()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    (victim, vp), (twin, tp) = twins(lambda g: ot.Lamb(g, lr=1e-2, backend="cpu"))
    set_grads(vp, 1)
    set_grads(tp, 1)  # the same gradients every step: the twin is the reference
    tracer, count = interrupt_at(-1)
    sys.settrace(tracer)
    try:
        victim.step()
    finally:
        sys.settrace(None)
    twin.step()
    events = count[0]
    assert events > 50
    outcomes = {"before": 0, "after": 0}
    for k in range(1, events + 1, max(1, events // 60)):
        assert same(snapshot(victim, vp), snapshot(twin, tp))
        tracer, seen = interrupt_at(k)
        interrupted = False
        sys.settrace(tracer)
        try:
            try:
                victim.step()
            finally:
                sys.settrace(None)
            for _ in range(3):  # a signal still pending is delivered here, after the step
                pass
        except KeyboardInterrupt:
            interrupted = True
        assert interrupted or seen[0] < k, f"the interrupt at line event {k} of {events} was lost"
        assert torch.is_grad_enabled(), f"an interrupt at line event {k} left grad mode off"
        if same(snapshot(victim, vp), snapshot(twin, tp)):
            outcomes["before"] += 1
        else:
            twin.step()
            assert same(snapshot(victim, vp), snapshot(twin, tp)), f"torn by an interrupt at line event {k}"
            outcomes["after"] += 1
    assert outcomes["before"] and outcomes["after"], outcomes
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_inside_the_first_groups_launch_lands_after_the_second(monkeypatch):
    (victim, vp), (twin, tp) = twins(lambda g: ot.AdamW(g, lr=1e-2, backend="cpu"))
    backend = optirs.get_backend("cpu")
    real, calls = backend.step, []

    def interrupting(ctx, request):
        calls.append(request.definition.name)
        if len(calls) == 1:
            _thread.interrupt_main()  # Ctrl-C while the first group's kernel runs
        return real(ctx, request)

    monkeypatch.setattr(backend, "step", interrupting)
    with pytest.raises(KeyboardInterrupt):
        victim.step()
    monkeypatch.setattr(backend, "step", real)
    assert calls == ["adamw", "adamw"]
    twin.step()
    assert same(snapshot(victim, vp), snapshot(twin, tp))
    assert float(victim.state[vp[0]]["step"]) == float(victim.state[vp[-1]]["step"]) == 2.0


# ------------------------------------------------------------------ a refused step changes nothing


def test_a_bad_step_count_in_the_second_group_refuses_the_whole_step():
    params = make_params()
    opt = ot.AdamW(two_groups(params), lr=1e-2, backend="cpu")
    set_grads(params, 0)
    opt.step()
    opt.state[params[3]]["step"] = torch.tensor(-5.0)
    set_grads(params, 1)
    before = snapshot(opt, params)
    with pytest.raises(InvalidParameterError, match=r"param_groups\[1\]\['params'\]\[1\].*step=tensor\(-5\.\)"):
        opt.step()
    assert same(snapshot(opt, params), before)


def test_mixed_gradient_dtypes_in_a_bf16_group_refuse_the_whole_step():
    fp32 = make_params(shapes=[(3,), (2, 2)])
    bf16 = make_params(1, torch.bfloat16, shapes=[(4,), (5,)])
    opt = ot.AdamW([{"params": fp32}, {"params": bf16}], lr=1e-2, backend="cpu")
    set_grads(fp32 + bf16, 0)
    opt.step()
    set_grads(fp32 + bf16, 1)
    bf16[1].grad.data = bf16[1].grad.data.float()  # one float32 gradient among bfloat16 ones
    before = snapshot(opt, fp32 + bf16)
    with pytest.raises(ShapeMismatchError, match=r"param_groups\[1\].*torch.bfloat16.*torch.float32"):
        opt.step()
    assert same(snapshot(opt, fp32 + bf16), before)


# ------------------------------------------------------------------ silent corruption, refused


def _with(opt_params, change):
    opt, params = opt_params
    set_grads(params, 1)
    change(params)
    return opt, params


CORRUPTIONS = {
    # a gradient of another shape through .data (the .grad setter's check is bypassed)
    "grad.data of another shape": lambda ps: setattr(ps[1].grad, "data", torch.zeros(2)),
    # the same memory under another shape: the state is for the old one (torch's AdamW refuses too)
    "p.data = p.data[:4]": lambda ps: (setattr(ps[0], "data", ps[0].data.view(-1)[:4]),
                                       setattr(ps[0], "grad", torch.zeros(4))),
    # the same memory, transposed: elements would pair with the wrong gradients
    "p.data = p.data.t()": lambda ps: setattr(ps[2], "data", ps[2].data.t()),
    "a non-contiguous gradient": lambda ps: setattr(ps[2], "grad", torch.randn(2, 2).t()),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_tensors_changed_under_the_same_objects_are_refused(case):
    params = make_params()
    opt = ot.AdamW(two_groups(params), lr=1e-2, backend="cpu")
    set_grads(params, 0)
    opt.step()
    opt, params = _with((opt, params), CORRUPTIONS[case])
    before = snapshot(opt, params)
    with pytest.raises(ShapeMismatchError):
        opt.step()
    assert same(snapshot(opt, params), before)


def test_torch_refuses_the_reshaped_parameter_too():
    # (torch's CPU fused kernel does not compare the shapes; its for-loop AdamW does)
    p = torch.nn.Parameter(torch.randn(3, 2))
    ref = torch.optim.AdamW([p], foreach=False)
    p.grad = torch.ones(3, 2)
    ref.step()
    p.data = p.data.view(-1)[:4]
    p.grad = torch.zeros(4)
    with pytest.raises(RuntimeError):
        ref.step()


# ------------------------------------------------------------------ checkpoints


@pytest.mark.parametrize("key,value", [("exp_avg_sq", "missing"), ("exp_avg", None)])
def test_a_checkpoint_without_a_moment_is_refused_naming_it_as_torch_refuses_it(key, value):
    params = make_params()
    opt = ot.AdamW(two_groups(params), lr=1e-2, backend="cpu")
    set_grads(params, 0)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    if value == "missing":
        del sd["state"][3][key]
    else:
        sd["state"][3][key] = value
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ref = torch.optim.AdamW(two_groups([torch.nn.Parameter(p.detach().clone()) for p in params]), lr=1e-2)
    ref.load_state_dict(copy.deepcopy(sd))
    set_grads(ref.param_groups[0]["params"] + ref.param_groups[1]["params"], 1)
    with pytest.raises((KeyError, AttributeError)):
        ref.step()
    loaded = ot.AdamW(two_groups(fresh), lr=1e-2, backend="cpu")
    loaded.load_state_dict(sd)
    set_grads(fresh, 1)
    before = snapshot(loaded, fresh)
    with pytest.raises(InvalidParameterError, match=rf"param_groups\[1\]\['params'\]\[1\].*'{key}'"):
        loaded.step()
    assert same(snapshot(loaded, fresh), before)


CONVERT_SHAPES = [(4100,), (5,)]  # one tensor with int8 blocks (4096 elements at least), one small one
SIGNED = {"exp_avg": True, "exp_avg_sq": False}


def _decoded(entry, slot):
    """A slot's float32 values from a checkpoint entry in any state_dtype (the formats' reference decoders)."""
    if slot in entry:
        return entry[slot].float().numpy()
    codes, scales = entry[f"{slot}.codes"].numpy(), entry[f"{slot}.scales"].numpy()
    return fref.dequantize_blocks(codes, scales, SIGNED[slot]).reshape(codes.shape)


def _encoded(values, slot, state_dtype):
    """The checkpoint keys of ``values`` in ``state_dtype`` (the formats' reference encoders)."""
    t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    if state_dtype == "float32" or (state_dtype == "int8" and values.size < 4096):
        return {slot: t}
    if state_dtype == "bfloat16":
        return {slot: t.to(torch.bfloat16)}
    codes, scales = fref.quantize_blocks(values.reshape(-1), SIGNED[slot])
    return {f"{slot}.codes": torch.from_numpy(codes.reshape(values.shape)), f"{slot}.scales": torch.from_numpy(scales)}


@pytest.mark.parametrize("source,target", [("int8", "float32"), ("bfloat16", "int8"), ("float32", "bfloat16")])
def test_a_checkpoint_of_another_state_dtype_is_converted_as_the_reference_does(source, target):
    params = make_params(shapes=CONVERT_SHAPES)
    opt = ot.AdamW(params, lr=1e-2, backend="cpu", state_dtype=source)
    for step in range(2):
        set_grads(params, step)
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    # the reference: the same checkpoint converted here, loaded as the target keeps it
    ref_sd = copy.deepcopy(sd)
    for i, entry in sd["state"].items():
        ref_sd["state"][i] = {"step": entry["step"]}
        for slot in SIGNED:
            ref_sd["state"][i].update(_encoded(_decoded(entry, slot), slot, target))
    runs = []
    for checkpoint in (sd, ref_sd):
        ps = [torch.nn.Parameter(p.detach().clone()) for p in params]
        o = ot.AdamW(ps, lr=1e-2, backend="cpu", state_dtype=target)
        o.load_state_dict(checkpoint)
        o.param_groups[0]["state_dtype"] = target  # (torch's groups take the checkpoint's values)
        for step in (2, 3):
            set_grads(ps, step)
            o.step()
        runs.append(snapshot(o, ps))
    assert same(*runs)
    keys = set(runs[0][1][0])
    assert keys == ({"step", "exp_avg.codes", "exp_avg.scales", "exp_avg_sq.codes", "exp_avg_sq.scales"}
                    if target == "int8" else {"step", "exp_avg", "exp_avg_sq"})


def test_masters_a_format_cannot_hold_are_refused_not_dropped():
    params = make_params(dtype=torch.bfloat16, shapes=[(6,)])
    opt = ot.AdamW(params, lr=1e-2, backend="cpu", master_weights="float32")
    set_grads(params, 0)
    opt.step()
    ps = [torch.nn.Parameter(p.detach().clone()) for p in params]
    plain = ot.AdamW(ps, lr=1e-2, backend="cpu")  # master_weights=None: nowhere to keep them
    plain.load_state_dict(copy.deepcopy(opt.state_dict()))
    plain.param_groups[0]["master_weights"] = None  # (torch's groups take the checkpoint's values)
    set_grads(ps, 1)
    with pytest.raises(InvalidParameterError, match="'master'.*master_weights"):
        plain.step()


# ------------------------------------------------------------------ foreign exceptions become optirs errors


def _trained():
    params = make_params()
    opt = ot.AdamW(two_groups(params), lr=1e-2, backend="cpu")
    set_grads(params, 0)
    opt.step()
    set_grads(params, 1)
    return opt, params


def _drop_lr(opt):
    del opt.param_groups[1]["lr"]
    opt.step()


BAD_CALLS = {
    "grad_scale of 2 elements": (lambda opt: opt.step(grad_scale=torch.tensor([2.0, 2.0])),
                                 r"grad_scale is a tensor of shape \(2,\).*1-element"),
    "found_inf='yes'": (lambda opt: opt.step(found_inf="yes"), r"found_inf='yes'.*expected None, a number"),
    "a group without lr": (_drop_lr, r"param_groups\[1\] has no 'lr'"),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_step_inputs_are_optirs_errors_and_change_nothing(case):
    call, match = BAD_CALLS[case]
    opt, params = _trained()
    before = snapshot(opt, params)
    with pytest.raises(InvalidParameterError, match=match):
        call(opt)
    assert same(snapshot(opt, params), before)


def test_tensor_betas_of_two_elements_are_an_optirs_error():
    with pytest.raises(InvalidParameterError, match=r"betas\[0\] is a tensor of shape \(2,\)"):
        ot.AdamW(make_params(), betas=(torch.tensor([0.9, 0.9]), 0.99), backend="cpu")


@pytest.mark.parametrize("step", [float("nan"), torch.tensor(float("nan")), -5, "2", [2, 2]],
                         ids=["nan", "nan-tensor", "-5", "'2'", "[2, 2]"])
def test_a_checkpoint_step_that_is_not_a_count_is_an_optirs_error(step):
    opt, params = _trained()
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][2]["step"] = step
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in params]
    loaded = ot.AdamW(two_groups(fresh), lr=1e-2, backend="cpu")
    with pytest.raises(InvalidParameterError, match=r"state_dict\['state'\]\[2\] has step=.*expected a whole number"):
        loaded.load_state_dict(sd)
    assert not loaded.state


class _RaisingHost(FakeHostBackend):
    """A host backend (the front end's hooks, host memory) whose hook ``fail`` raises a foreign exception."""

    def __init__(self, fail):
        super().__init__()
        self.fail = fail

    @hookimpl
    def optirs_step_support(self):
        return StepSupport(optimizers=("adamw",))

    @hookimpl
    def optirs_step(self, ctx, request):
        if self.fail == "optirs_step":
            raise RuntimeError("kernel exploded")

    @hookimpl
    def optirs_host_view(self, ctx, array):
        if self.fail == "optirs_host_view":
            raise RuntimeError("kernel exploded")
        return array.reshape(-1)

    @hookimpl
    def optirs_measure_copy(self, ctx, size):
        return "no copy", lambda: None

    @hookimpl
    def optirs_measure_elapsed_ms(self, ctx, fn, reps):
        return 0.0

    @hookimpl
    def optirs_torch_device(self, ctx):
        return "cpu"


@pytest.mark.parametrize("hook", ["optirs_step", "optirs_host_view"])
def test_a_raising_plugin_hook_is_a_plugin_error_naming_plugin_and_hook(fresh_registry, hook):
    optirs.register_plugin(_RaisingHost(hook), "raising")
    params = make_params()
    opt = ot.AdamW(two_groups(params), lr=1e-2, backend="raising")
    set_grads(params, 0)
    before = snapshot(opt, params)
    with pytest.raises(PluginError, match=rf"plugin 'raising' raised RuntimeError in {hook}: kernel") as info:
        opt.step()
    assert isinstance(info.value.__cause__, RuntimeError)
    assert same(snapshot(opt, params), before) and not opt.state


# ------------------------------------------------------------------ copies


FORMATS = {"float32": {}, "bf16-remainder8-int8": dict(master_weights="remainder8", state_dtype="int8")}


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_copied_optimizer_steps_on_like_the_original(how, fmt):
    dtype = torch.float32 if fmt == "float32" else torch.bfloat16
    params = make_params(dtype=dtype)
    opt = ot.AdamW(two_groups(params), lr=1e-2, backend="cpu", **FORMATS[fmt])
    for step in range(2):
        set_grads(params, step)
        opt.step()
    other = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    others = [p for g in other.param_groups for p in g["params"]]
    assert all(p is not q and torch.equal(p, q) for p, q in zip(params, others))
    for step in (2, 3):
        set_grads(params, step)
        set_grads(others, step)
        opt.step()
        other.step()
        assert same(snapshot(opt, params), snapshot(other, others))
    assert float(other.state[others[0]]["step"]) == 4.0


# ------------------------------------------------------------------ the cached plan


def test_a_repeat_step_replans_nothing_and_a_change_replans_its_group_only(monkeypatch):
    params = make_params()
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = ot.AdamW(two_groups(params), lr=1e-2, backend="cpu")
    ref = torch.optim.AdamW(two_groups(ref_params), lr=1e-2)
    planned = []
    real = ot.OptirsOptimizer._plan_group
    monkeypatch.setattr(ot.OptirsOptimizer, "_plan_group",
                        lambda self, gi, *a: planned.append(gi) or real(self, gi, *a))

    def step(t, change=lambda ps: None):
        for ps, o in ((params, opt), (ref_params, ref)):
            set_grads(ps, t)
            change(ps)
            o.step()
        for p, q in zip(params, ref_params):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)

    step(0)
    assert planned == [0, 1]
    step(1)
    assert planned == [0, 1]  # nothing changed: the plans were reused
    for o in (opt, ref):
        o.param_groups[1]["lr"] = 5e-3  # a scheduler's write: the plan stands, the value is used
    step(2)
    assert planned == [0, 1]
    step(3, lambda ps: setattr(ps[3], "grad", None))  # one gradient missing: that group re-plans
    assert planned == [0, 1, 1]
    step(4)
    assert planned == [0, 1, 1, 1]
    opt.state[params[0]]["exp_avg"] = opt.state[params[0]]["exp_avg"].clone()  # an entry set by hand
    ref.state[ref_params[0]]["exp_avg"] = ref.state[ref_params[0]]["exp_avg"].clone()
    step(5)
    assert planned == [0, 1, 1, 1, 0]


@pytest.mark.parametrize("native", [True, False], ids=["torch-guards", "map-checks"])
def test_the_metadata_check_sees_every_change(native):
    def fresh():
        return [torch.nn.Parameter(torch.zeros(3, 2)), torch.zeros(4)]

    ts = fresh()
    check = TensorCheck(ts, use_dynamo=native)
    assert check(ts) and check(fresh())
    changes = [lambda t: setattr(t[0], "data", t[0].data.t()), lambda t: setattr(t[0], "data", t[0].data[:1]),
               lambda t: setattr(t[1], "data", t[1].data.double()), lambda t: t[1].requires_grad_(True),
               lambda t: t.__setitem__(1, None)]
    for change in changes:
        ts = fresh()
        change(ts)
        assert not check(ts)


def test_a_group_without_gradients_is_skipped_until_they_arrive_as_in_torch():
    params = make_params()
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = ot.Adam(two_groups(params), lr=1e-2, backend="cpu")
    ref = torch.optim.Adam(two_groups(ref_params), lr=1e-2)
    for t in range(4):
        for ps, o in ((params, opt), (ref_params, ref)):
            set_grads(ps, t)
            if t < 2:  # the second group is frozen for two steps
                for p in ps[2:]:
                    p.grad = None
            o.step()
        for p, q in zip(params, ref_params):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert [float(opt.state[p]["step"]) for p in params] == [float(ref.state[q]["step"]) for q in ref_params] == \
        [4.0, 4.0, 2.0, 2.0]
