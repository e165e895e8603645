"""optirs.torch's capturable steps and the GradScaler's device path.

* Simulator (``NUMBA_ENABLE_CUDASIM=1 pytest -m cuda tests/test_torch_cuda.py``): torch has no
  CUDA here, so the optimizers run on torch CPU tensors through a backend that is the cpu backend
  with the ``capturable`` capability added: the CUDA simulator's own ``optirs_capturable_step``
  over the tensors' memory (wrapped, not copied, as the simulator's device arrays). That runs the
  front end's whole capturable path (device step counts, a tensor lr read at every step,
  grad_scale / found_inf never read on the host) against torch.optim.
* GPU (``pytest -m gpu tests/test_torch_cuda.py`` on the H200; skipped without torch CUDA): the
  stream race of the issue, a step captured in a CUDA graph and replayed, the GradScaler's
  fused way inside the graph, and checkpoints between capturable optimizers.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import optirs  # noqa: E402
import optirs.torch as ot  # noqa: E402
from optirs.core.errors import InvalidParameterError, UnsupportedOperationError  # noqa: E402

from conftest import SIMULATOR  # noqa: E402

TOL = dict(rtol=2e-5, atol=2e-6)
LR = 2.0**-7  # exact in float32: a float32 lr tensor and torch's float lr are the same number


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def batches(n, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 12, generator=g).to(device), torch.randint(0, 3, (8,), generator=g).to(device))
            for _ in range(n)]


def backward(model, batch, scale=1.0):
    x, y = batch
    (torch.nn.functional.cross_entropy(model(x), y) * scale).backward()


def assert_same(a, b, **tol):
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(q.detach().cpu(), p.detach().cpu(), **(tol or TOL))


# ------------------------------------------------------------------ simulator: the front end's capturable path


class SimulatedCapturable:
    """The cpu backend plus the CUDA simulator's device-side scalars, over host memory.

    Everything but a step with ``controls.device`` is the cpu backend's; such a step wraps every
    array it is given as a simulator device array over the same memory and runs through the
    cuda backend's own ``optirs_step`` (whose kernels the simulator runs on those addresses)."""

    def __init__(self):
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        from optirs.plugin.hookspecs import StepSupport

        self._wrap_type = FakeCUDAArray
        self.cpu, self.cuda = optirs.get_backend("cpu"), optirs.get_backend("cuda")
        self.name = "cpu+simulated-capturable"
        self.capabilities = set(self.cpu.capabilities) | {"capturable"}
        self.support = StepSupport(self.cpu.support.optimizers, self.cpu.support.formats, self.cuda.support.capturable)
        self.calls = []

    def supports(self, capability):
        return capability in self.capabilities

    def steps(self, optimizer, fmt=None, device_scalars=False):
        if device_scalars:
            return optimizer in self.support.capturable
        return self.cpu.steps(optimizer, fmt)

    def __getattr__(self, name):
        return getattr(self.cpu, name)

    def _wrap(self, t):
        if isinstance(t, np.ndarray):  # the front end's numpy views of CPU parameters
            return self._wrap_type(t)
        if not isinstance(t, torch.Tensor):
            return t
        assert t.is_cpu and t.dtype == torch.float32 and t.is_contiguous()
        return self._wrap_type(t.detach().numpy())

    def step(self, ctx, request):
        from dataclasses import replace

        assert ctx is self.cpu.ctx
        inputs = request.controls.device
        if inputs is None:
            return self.cpu.step(ctx, request)
        self.calls.append(request.definition.name)
        w = self._wrap
        inputs = replace(inputs, steps=w(inputs.steps), record=w(inputs.record), lr=w(inputs.lr),
                         grad_scale=w(inputs.grad_scale), found_inf=w(inputs.found_inf))
        self.cuda.step(self.cuda.ctx, request._replace(
            params=[w(p) for p in request.params], grads=[w(g) for g in request.grads],
            state={k: w(v) for k, v in request.state.items()}, controls=request.controls._replace(device=inputs)))


def lockstep(pairs, data):
    """Each (model, optimizer) of ``pairs`` trained on every batch of ``data`` in turn; after each batch
    the models are the same (to float32 rounding)."""
    for batch in data:
        for m, o in pairs:
            o.zero_grad()
            backward(m, batch)
            o.step()
        for m, _ in pairs[1:]:
            assert_same(pairs[0][0], m)


def _simulated(opt):
    backend = SimulatedCapturable()
    opt._backends["cpu"] = backend
    return backend


simulator = pytest.mark.skipif(not SIMULATOR, reason="needs NUMBA_ENABLE_CUDASIM=1 (the CUDA simulator)")


@pytest.mark.cuda
@simulator
@pytest.mark.parametrize("name,kwargs", [("AdamW", {"weight_decay": 0.1}), ("Adam", {"amsgrad": True, "maximize": True}),
                                         ("RMSprop", {"momentum": 0.5, "centered": True})])
def test_capturable_equals_torch_with_a_tensor_lr_a_scheduler_and_grouping(name, kwargs):
    data = batches(12)
    ref_model, our_model = make_model(), make_model()
    ref = getattr(torch.optim, name)(ref_model.parameters(), lr=LR, **kwargs)
    lr = torch.tensor(LR)
    named = list(our_model.named_parameters())
    groups = [{"params": [p for n, p in named if n.endswith("weight")]},
              {"params": [p for n, p in named if n.endswith("bias")]}]
    ours = getattr(ot, name)(groups, lr=lr, capturable=True, **kwargs)
    backend = _simulated(ours)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=0.5) for o in (ref, ours)]
    for t, batch in enumerate(data):
        for m, o in ((ref_model, ref), (our_model, ours)):
            o.zero_grad()
            backward(m, batch)
            o.step()
        for s in scheds:
            s.step()
        assert_same(ref_model, our_model)
    # the scheduler wrote the lr tensor in place (each group shares it): the steps read it there
    assert ours.param_groups[0]["lr"] is lr and float(lr) == LR * 0.5**3 == ref.param_groups[0]["lr"]
    assert backend.calls == [name.lower() if name != "AdamW" else "adamw"] * (2 * len(data))  # one per group and step
    p = next(our_model.parameters())
    step = ours.state[p]["step"]
    assert isinstance(step, torch.Tensor) and step.dtype == torch.float32 and step.dim() == 0
    assert step.device == p.device and float(step) == len(data)


@pytest.mark.cuda
@simulator
@pytest.mark.parametrize("name,kwargs", [("SGD", {"momentum": 0.9, "nesterov": True}), ("Adagrad", {"lr_decay": 0.01})])
def test_capturable_through_a_param_group(name, kwargs):
    # torch's SGD and Adagrad take no capturable argument: a group's entry asks for it
    data = batches(8)
    ref_model, our_model = make_model(), make_model()
    ref = getattr(torch.optim, name)(ref_model.parameters(), lr=LR, **kwargs)
    params = list(our_model.parameters())
    ours = getattr(ot, name)(params[:2], lr=LR, **kwargs)
    ours.add_param_group({"params": params[2:], "capturable": True})
    ours.param_groups[0]["capturable"] = True
    backend = _simulated(ours)
    lockstep([(ref_model, ref), (our_model, ours)], data)
    assert backend.calls == [name.lower()] * (2 * len(data))


@pytest.mark.cuda
@simulator
def test_capturable_grad_scaler_fused_way_skips_infs_on_the_device():
    data = batches(10)
    ref_model, our_model = make_model(), make_model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=LR, fused=True)
    ours = ot.AdamW(our_model.parameters(), lr=LR, capturable=True)
    _simulated(ours)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3) for _ in range(2)]
    for t, batch in enumerate(data):
        for m, o, sc in ((ref_model, ref, scalers[0]), (our_model, ours, scalers[1])):
            o.zero_grad()
            sc.scale(torch.nn.functional.cross_entropy(m(batch[0]), batch[1])).backward()
            if t in (2, 6):
                next(m.parameters()).grad.view(-1)[0] = float("inf")
            sc.step(o)
            sc.update()
        assert scalers[0].get_scale() == scalers[1].get_scale()
        assert_same(ref_model, our_model)
    assert float(ours.state[next(our_model.parameters())]["step"]) == len(data) - 2


@pytest.mark.cuda
@simulator
def test_capturable_state_dict_round_trips_with_torch():
    data = batches(16)
    model = make_model()
    ours = ot.AdamW(model.parameters(), lr=LR, capturable=True)
    _simulated(ours)
    for batch in data[:6]:
        ours.zero_grad()
        backward(model, batch)
        ours.step()
    sd = ours.state_dict()
    assert sd["param_groups"][0]["capturable"] is True
    assert all(isinstance(s["step"], torch.Tensor) and s["step"].dim() == 0 for s in sd["state"].values())
    # into torch (non-capturable on the CPU, as torch's capturable refuses CPU tensors) and on
    twin = copy.deepcopy(model)
    ref = torch.optim.AdamW(twin.parameters(), lr=LR)
    sd_torch = copy.deepcopy(sd)
    for g in sd_torch["param_groups"]:
        g["capturable"] = False
    ref.load_state_dict(sd_torch)
    lockstep([(model, ours), (twin, ref)], data[6:11])
    # and a non-capturable torch checkpoint back into a capturable optimizer: torch's groups take
    # the checkpoint's flags, so capturable is set again after loading (the step moves to the device)
    back_model = copy.deepcopy(twin)
    back = ot.AdamW(back_model.parameters(), lr=LR, capturable=True)
    backend = _simulated(back)
    back.load_state_dict(copy.deepcopy(ref.state_dict()))  # torch's load keeps the tensors it is given
    assert back.param_groups[0]["capturable"] is False
    back.param_groups[0]["capturable"] = True
    lockstep([(twin, ref), (back_model, back)], data[11:])
    assert backend.calls == ["adamw"] * len(data[11:])
    assert float(back.state[next(back_model.parameters())]["step"]) == 16


@pytest.mark.cuda
@simulator
def test_ctrl_c_inside_a_capturable_launch_lands_after_every_group():
    """A SIGINT while the first group's capturable pair runs is delivered after the second group's
    launch and the step's install: both groups (and their device step counts) are stepped."""
    import _thread

    data = batches(2)
    models = [make_model(), make_model()]
    opts = []
    for m in models:
        named = list(m.named_parameters())
        groups = [{"params": [p for n, p in named if n.endswith("weight")]},
                  {"params": [p for n, p in named if n.endswith("bias")]}]
        opts.append(ot.AdamW(groups, lr=LR, capturable=True))
    backends = [_simulated(o) for o in opts]
    lockstep(list(zip(models, opts)), data[:1])
    real = backends[0].step

    def interrupting(ctx, request):
        if request.controls.device is not None and len(backends[0].calls) == 2:
            _thread.interrupt_main()
        return real(ctx, request)

    backends[0].step = interrupting
    for m, o in zip(models, opts):
        o.zero_grad()
        backward(m, data[1])
    with pytest.raises(KeyboardInterrupt):
        opts[0].step()
    opts[1].step()
    assert backends[0].calls == backends[1].calls == ["adamw"] * 4
    assert_same(models[1], models[0])
    assert all(float(opts[0].state[p]["step"]) == 2.0 for p in models[0].parameters())


def test_capturable_refusals_change_nothing():
    # the cpu backend has no capturable capability: refused at the first step, as torch refuses
    # capturable CPU tensors (torch raises at its step too), with nothing changed
    model = make_model()
    opt = ot.AdamW(model.parameters(), capturable=True, backend="cpu")
    backward(model, batches(1)[0])
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(UnsupportedOperationError, match="capturable.*'cpu'"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and not opt.state
    # non-elementwise families: at construction
    with pytest.raises(UnsupportedOperationError, match="capturable=True for Lamb"):
        ot.Lamb(model.parameters(), capturable=True)
    with pytest.raises(UnsupportedOperationError, match="capturable=True for Adafactor"):
        ot.Adafactor(model.parameters()).add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))],
                                                          "capturable": True})
    with pytest.raises(UnsupportedOperationError, match="state_dtype"):
        ot.AdamW(model.parameters(), capturable=True, state_dtype="int8")
    with pytest.raises(InvalidParameterError, match="lr is a tensor of 2 elements"):
        ot.AdamW(model.parameters(), lr=torch.tensor([1e-3, 1e-3]), capturable=True)
    with pytest.raises(UnsupportedOperationError, match="capturable"):
        ot.CPUOffload(ot.AdamW, model.parameters(), capturable=True)


# ------------------------------------------------------------------ the H200: torch CUDA tensors


def _torch_cuda_or_skip():
    if SIMULATOR or not torch.cuda.is_available():
        pytest.skip("needs torch with a real CUDA GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("capturable", [False, True])
def test_step_after_fill_on_a_side_stream_is_ordered(capturable):
    """The issue's race: on torch.cuda.stream(s), g.fill_(1.0) then opt.step(): p moves exactly as
    torch's AdamW with that gradient (a step on another stream would run before the fill)."""
    _torch_cuda_or_skip()
    n = 1 << 20
    p = torch.nn.Parameter(torch.randn(n, device="cuda"))
    twin = torch.nn.Parameter(p.detach().clone())
    p.grad, twin.grad = torch.zeros(n, device="cuda"), torch.ones(n, device="cuda")
    opt = ot.AdamW([p], lr=1e-2, capturable=capturable)
    ref = torch.optim.AdamW([twin], lr=1e-2, capturable=capturable)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # the side stream is late: only ordering on it gives the right answer
        p.grad.fill_(1.0)
        opt.step()
    ref.step()
    torch.cuda.synchronize()
    torch.testing.assert_close(p.detach(), twin.detach(), **TOL)


def _graph_pair(make_ours, make_ref, amp=False, replays=20):
    """Warm up on a side stream, capture one step into a CUDA graph, replay it ``replays`` times
    with new gradients copied into the static ones (the lr tensor halved at replay 10, and with
    ``amp`` an inf found at replay 7); torch's capturable optimizer takes the same steps eagerly
    on the same gradients (its model's backward gives them)."""
    warm = 3
    data = batches(warm + replays, device="cuda")
    ours_model, ref_model = make_model().cuda(), make_model().cuda()
    lrs = [torch.tensor(1e-2, device="cuda"), torch.tensor(1e-2, device="cuda")]
    ours, ref = make_ours(ours_model.parameters(), lrs[0]), make_ref(ref_model.parameters(), lrs[1])
    # 0-d, as GradScaler makes them (torch's fused step subtracts found_inf from its 0-d step counts)
    scale = torch.full((), 2.0**8, device="cuda")
    found = torch.zeros((), device="cuda")
    static = [torch.zeros_like(p) for p in ours_model.parameters()]
    for p, g in zip(ours_model.parameters(), static):
        p.grad = g

    def next_grads(batch):
        ref.zero_grad()
        backward(ref_model, batch, scale=2.0**8 if amp else 1.0)
        for st, p in zip(static, ref_model.parameters()):
            st.copy_(p.grad)

    def ours_step():
        if amp:
            ours.step(grad_scale=scale, found_inf=found)
        else:
            ours.step()

    def ref_step():
        if amp:  # torch's fused optimizers read the attributes GradScaler sets
            ref.grad_scale, ref.found_inf = scale, found
            ref.step()
            del ref.grad_scale, ref.found_inf
        else:
            ref.step()

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # torch's recipe: warm-up steps on a side stream
        for batch in data[:warm]:
            next_grads(batch)
            ours_step()
            ref_step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert_same(ref_model, ours_model)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ours_step()
    for r, batch in enumerate(data[warm:]):
        next_grads(batch)
        if amp:
            found.fill_(1.0 if r == 7 else 0.0)
        if r == 10:
            for lr in lrs:
                lr.fill_(5e-3)
        graph.replay()
        ref_step()
        torch.cuda.synchronize()
        assert_same(ref_model, ours_model)
    return ours, ref, (ours_model, ref_model)


@pytest.mark.gpu
def test_a_captured_step_replays_like_torch_capturable_adamw():
    _torch_cuda_or_skip()
    ours, ref, models = _graph_pair(lambda ps, lr: ot.AdamW(ps, lr=lr, capturable=True),
                                    lambda ps, lr: torch.optim.AdamW(ps, lr=lr, capturable=True))
    p, q = next(models[0].parameters()), next(models[1].parameters())
    assert float(ours.state[p]["step"]) == float(ref.state[q]["step"]) == 23  # the bias corrections advanced


@pytest.mark.gpu
def test_grad_scaler_fused_way_inside_a_cuda_graph():
    _torch_cuda_or_skip()
    ours, ref, models = _graph_pair(lambda ps, lr: ot.AdamW(ps, lr=lr, capturable=True),
                                    lambda ps, lr: torch.optim.AdamW(ps, lr=lr, capturable=True, fused=True),
                                    amp=True)
    p = next(models[0].parameters())
    assert float(ours.state[p]["step"]) == 22  # the replay with found_inf set changed nothing


@pytest.mark.gpu
def test_grad_scaler_fused_way_without_a_host_sync():
    """Not capturable: the GradScaler's grad_scale / found_inf still stay on the device (a host
    read would be a synchronisation, which torch's sync debug mode turns into an error)."""
    _torch_cuda_or_skip()
    data = batches(12, device="cuda")
    ref_model, our_model = make_model().cuda(), make_model().cuda()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    ours = ot.AdamW(our_model.parameters(), lr=1e-2)
    scalers = [torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=3) for _ in range(2)]
    for t, batch in enumerate(data):
        for m, o, sc in ((ref_model, ref, scalers[0]), (our_model, ours, scalers[1])):
            o.zero_grad()
            sc.scale(torch.nn.functional.cross_entropy(m(batch[0]), batch[1])).backward()
            if t in (2, 5, 6):
                next(m.parameters()).grad.view(-1)[0] = float("inf")
            if o is ours and t > 0:  # the first step builds the state (host work, allowed to sync)
                torch.cuda.set_sync_debug_mode("error")
            try:
                sc.step(o)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            sc.update()
        assert_same(ref_model, our_model)
    assert float(ours.state[next(our_model.parameters())]["step"]) == len(data) - 3


@pytest.mark.gpu
def test_capturable_checkpoints_interoperate_with_torch_on_cuda():
    _torch_cuda_or_skip()
    import io

    data = batches(16, device="cuda")
    model = make_model().cuda()
    ours = ot.AdamW(model.parameters(), lr=1e-2, capturable=True)
    for batch in data[:6]:
        ours.zero_grad()
        backward(model, batch)
        ours.step()
    buf = io.BytesIO()
    torch.save(ours.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    twin = copy.deepcopy(model)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, capturable=True)
    ref.load_state_dict(sd)
    lockstep([(model, ours), (twin, ref)], data[6:11])
    back_model = copy.deepcopy(twin)
    back = ot.AdamW(back_model.parameters(), lr=1e-2, capturable=True)
    back.load_state_dict(copy.deepcopy(ref.state_dict()))
    lockstep([(twin, ref), (back_model, back)], data[11:])
    p = next(back_model.parameters())
    assert back.state[p]["step"].device == p.device


@pytest.mark.gpu
@pytest.mark.parametrize("master_weights", [None, "float32"])
def test_a_step_keeps_no_gradient_alive_and_follows_moved_gradients(master_weights):
    """As with torch.optim, no gradient outlives zero_grad() (the step keeps their addresses, not the
    tensors), and a step over gradients at new addresses (new tensors each step, some kept alive so
    the allocator cannot hand the same memory back) moves the parameters as torch's AdamW does."""
    import gc
    import weakref

    _torch_cuda_or_skip()
    dtype = torch.float32 if master_weights is None else torch.bfloat16
    shapes = [(300, 7), (64,), (5, 5, 3)]
    params = [torch.nn.Parameter(torch.randn(s, device="cuda").to(dtype)) for s in shapes]
    twins = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    kw = {} if master_weights is None else {"master_weights": master_weights}
    opt = ot.AdamW(params, lr=1e-2, **kw)
    ref = torch.optim.AdamW(twins, lr=1e-2)
    kept = []

    def new_grads(k):  # (no local of this test holds a gradient)
        gen = torch.Generator(device="cuda").manual_seed(k)
        for p, t in zip(params, twins):
            p.grad = torch.randn(p.shape, device="cuda", generator=gen).to(dtype)
            t.grad = p.grad.float().clone()

    for k in range(4):
        new_grads(k)
        if k % 2:
            kept.append([p.grad for p in params])
        gone = [weakref.ref(p.grad) for p in params]
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
        gc.collect()  # (cyclic garbage of a first step's compile is not a reference the step keeps)
        assert all(r() is None for r in gone) or k % 2
    for p, t in zip(params, twins):
        tol = {} if master_weights is None else {"atol": 1e-2, "rtol": 1e-2}
        torch.testing.assert_close(p.float(), t.detach(), **tol)


@pytest.mark.gpu
def test_a_second_process_loads_the_cuda_kernels_from_the_disk_cache(tmp_path):
    """The step kernels are closures (numba-cuda's own cache key never hits for them): keyed by
    their name and the sources' state, a second process compiles none of them, nor a side
    feature's kernel launched through numba's dispatcher."""
    _torch_cuda_or_skip()
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import torch, optirs.torch as ot
        from optirs.core.compile_cache import compile_records
        for kw in ({}, {"master_weights": "float32", "state_dtype": "int8"}):
            dtype = torch.bfloat16 if kw else torch.float32
            p = torch.nn.Parameter(torch.randn(5000, device="cuda", dtype=dtype))
            opt = ot.AdamW([p], lr=1e-3, **kw)
            for _ in range(2):
                p.grad = torch.ones_like(p)
                opt.step()
        torch.cuda.synchronize()
        import numpy as np
        from optirs.analysis import quantization as qz
        x = np.linspace(-3, 3, 1000, dtype=np.float32)  # a side feature's kernel (numba's own launch)
        qz.fake_quant_int(x, qz.per_tensor_params(x), backend="cuda")
        print(sorted(r.name for r in compile_records() if r.name.startswith("cuda.")))
    """)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "OPTIRS_COMPILE_LOG": "0"}
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
            for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    first, second = (eval(r.stdout.strip().splitlines()[-1]) for r in runs)
    assert "cuda.fake_quant.forward" in first, runs[0].stdout  # the cold process built its kernels (and logged them)
    assert second == [], second
