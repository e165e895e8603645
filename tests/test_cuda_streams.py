"""torch's current CUDA stream and the CUDA-graph capture guard (backend side).

* CPU (no GPU, no simulator): the prepared cuLaunchKernel path with a fake launcher records
  the hStream argument; the stream rule (pinned, torch's current stream, else 0) and the capture
  guard with fake driver answers.
* Simulator (``NUMBA_ENABLE_CUDASIM=1 pytest -m cuda``): numba's fallback launch gets the
  context's stream, a step under a (faked) capture raises and changes nothing.
* GPU (``-m gpu`` on the H200): the side-stream race (``g.fill_`` on a side stream, then a
  step) and a real ``torch.cuda.graph`` capture.
"""

from __future__ import annotations

import ctypes
import types as pytypes
from collections import OrderedDict

import numpy as np
import pytest

import optirs
from optirs.core.simulator import cuda_simulator_enabled
from optirs.core import reference
from optirs.core.errors import InvalidParameterError, UnsupportedOperationError

from conftest import backend_step, SIMULATOR

cuda_backend_mod = pytest.importorskip("optirs.backends.cuda.context")
CudaContext, PreparedLaunch = cuda_backend_mod.CudaContext, cuda_backend_mod.PreparedLaunch


def _close(actual, expected):
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(np.asarray(a, np.float64), e, rtol=2e-6, atol=2e-7)


# ------------------------------------------------------------------ fakes of the driver


class _Recorder:
    """Stands in for ctypes' cuLaunchKernel: records every call's arguments."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)
        return 0

    @property
    def streams(self):
        return [c[8] for c in self.calls]  # hStream is cuLaunchKernel's ninth argument


class _FakeKernel:
    """A compiled kernel as PreparedLaunch reads it: argument types and numba's flattening."""

    argument_types = ("i64", "i64", "scalars")

    @staticmethod
    def _prepare_args(ty, val, stream, retr, kernelargs):
        if ty == "scalars":
            kernelargs.extend(ctypes.c_float(float(v)) for v in val)
        else:
            kernelargs.append(ctypes.c_int64(int(val)))


def _fake_context(capture_status=0):
    """A CudaContext without a device: a recording launcher and fake external streams."""
    ctx = CudaContext.__new__(CudaContext)
    recorder = _Recorder()
    ctx.simulator = False
    ctx.launcher = pytypes.SimpleNamespace(fn=recorder, capture_status=lambda h: capture_status)
    ctx.cuda = pytypes.SimpleNamespace(external_stream=lambda h: pytypes.SimpleNamespace(handle=h))
    ctx._launches, ctx._launch_shapes, ctx._numba_streams = OrderedDict(), OrderedDict(), {}
    ctx._table_siblings = {}
    ctx.pinned, ctx.stream, ctx.nstream = None, 0, 0
    compiled = pytypes.SimpleNamespace(name="fake_step", handle=ctypes.c_void_p(0x1000), kernel=_FakeKernel(),
                                       dispatcher=None)
    return ctx, recorder, compiled


def _scalars(x):
    return (np.float32(x), np.float32(2 * x))


# ------------------------------------------------------------------ CPU: the prepared launch


def test_prepared_launch_default_stream_is_null():
    ctx, rec, compiled = _fake_context()
    ctx.launch(compiled, (1, 2, _scalars(0.5)), 4, 256)
    assert rec.streams == [None]  # hStream NULL: the legacy default stream, as before


def test_pinned_stream_reaches_cuLaunchKernel():
    ctx, rec, compiled = _fake_context()
    ctx.use_stream(0xBEEF)
    ctx.launch(compiled, (1, 2, _scalars(0.5)), 4, 256)
    ctx.launch(compiled, (1, 2, _scalars(0.25)), 4, 256)  # cached launch, new scalars, same stream
    assert rec.streams == [0xBEEF, 0xBEEF]
    assert len(ctx._launches) == 1
    ctx.use_stream(None)  # back to the rule: numpy/numba arrays go on stream 0
    ctx.resolve_stream(np.zeros(1))
    ctx.launch(compiled, (1, 2, _scalars(0.25)), 4, 256)
    assert rec.streams[-1] is None


class _DeviceTable:
    """A device array as the context reads one: shape, dtype, strides, its address."""

    def __init__(self, address, n):
        self.shape, self.dtype, self.strides, self.size = (n,), np.dtype(np.int64), (8,), n
        self.__cuda_array_interface__ = {"data": (address, False), "shape": (n,), "typestr": "<i8", "version": 3}


def _address(array):
    return array.__cuda_array_interface__["data"][0]


class _TableKernel:
    """A kernel of (array, count, scalars): an array marshals as its address and size."""

    argument_types = ("array", "i64", "scalars")

    def __init__(self):
        self.marshalled = []

    def _prepare_args(self, ty, val, stream, retr, kernelargs):
        self.marshalled.append(ty)
        if ty == "array":
            kernelargs.extend((ctypes.c_int64(val.size), ctypes.c_int64(_address(val))))
        elif ty == "scalars":
            kernelargs.extend(ctypes.c_float(float(v)) for v in val)
        else:
            kernelargs.append(ctypes.c_int64(int(val)))


def _decoding_context():
    """A fake context of a (table, count, scalars) kernel whose launcher decodes the argument block
    as the driver reads it, at the call: (ctx, kernel, compiled, [(ints, floats) per launch])."""
    ctx, _, compiled = _fake_context()
    compiled.kernel = kernel = _TableKernel()
    seen = []

    def launch(*call):
        ptrs = call[9]
        ints = [ctypes.cast(ptrs[i], ctypes.POINTER(ctypes.c_int64)).contents.value for i in range(3)]
        floats = [ctypes.cast(ptrs[i], ctypes.POINTER(ctypes.c_float)).contents.value for i in (3, 4)]
        seen.append((ints, floats))
        return 0

    ctx.launcher.fn = launch
    return ctx, kernel, compiled, seen


def test_a_new_table_of_the_same_shape_patches_only_its_address():
    ctx, kernel, compiled, seen = _decoding_context()
    a, b = _DeviceTable(0xA000, 6), _DeviceTable(0xB000, 6)
    ctx.launch(compiled, (a, 3, _scalars(0.5)), 4, 256)
    assert kernel.marshalled == ["array", "i64", "scalars"]
    ctx.launch(compiled, (b, 3, _scalars(0.25)), 4, 256)  # another table, same shapes: its address patched
    assert len(kernel.marshalled) == 3
    ctx.launch(compiled, (a, 3, _scalars(1.0)), 4, 256)  # back to the first: its own launch
    ctx.launch(compiled, (b, 3, _scalars(0.25)), 4, 256)
    assert len(kernel.marshalled) == 3 and len(ctx._launches) == 2
    assert seen == [([6, 0xA000, 3], [0.5, 1.0]), ([6, 0xB000, 3], [0.25, 0.5]),
                    ([6, 0xA000, 3], [1.0, 2.0]), ([6, 0xB000, 3], [0.25, 0.5])]
    ctx.launch(compiled, (_DeviceTable(0xC000, 7), 3, _scalars(0.25)), 4, 256)  # another shape: marshalled whole
    assert kernel.marshalled[3:] == ["array", "i64", "scalars"]
    assert seen[-1] == ([7, 0xC000, 3], [0.25, 0.5])


def test_a_pointer_tables_siblings_are_prepared_with_its_first_launch():
    """The first launch on one table of a PointerTables prepares the launch on each other table, so
    that a step meeting a new address set (the second) marshals nothing: only the table's address
    differs, and each sibling launches with its own address and the step's scalars."""
    import weakref

    ctx, kernel, compiled, seen = _decoding_context()
    holder = type("Tables", (), {})()  # weakref-able, as PointerTables is
    holder.devices = [_DeviceTable(0xA000 + 0x100 * k, 6) for k in range(3)]
    for t in holder.devices:
        ctx._table_siblings[id(t)] = weakref.ref(holder)
    a, b, c = holder.devices
    ctx.launch(compiled, (a, 3, _scalars(0.5)), 4, 256)
    assert kernel.marshalled == ["array", "i64", "scalars"]  # marshalled once; the siblings are copies
    ctx.launch(compiled, (c, 3, _scalars(0.25)), 4, 256)
    ctx.launch(compiled, (b, 3, _scalars(1.0)), 4, 256)
    ctx.launch(compiled, (c, 3, _scalars(2.0)), 4, 256)
    assert len(kernel.marshalled) == 3
    assert seen == [([6, 0xA000, 3], [0.5, 1.0]), ([6, 0xA200, 3], [0.25, 0.5]), ([6, 0xA100, 3], [1.0, 2.0]),
                    ([6, 0xA200, 3], [2.0, 4.0])]
    ctx.launch(compiled, (c, 4, _scalars(2.0)), 4, 256)  # another count: not a sibling, a new launch
    assert seen[-1] == ([6, 0xA200, 4], [2.0, 4.0])


def test_stream_objects_and_bad_streams():
    ctx, _, _ = _fake_context()
    torch_like = pytypes.SimpleNamespace(cuda_stream=0x77)
    numba_like = pytypes.SimpleNamespace(handle=ctypes.c_void_p(0x88))
    for stream, handle in ((torch_like, 0x77), (numba_like, 0x88), (5, 5), (0, 0), ("auto", 0), (None, 0)):
        ctx.use_stream(stream)
        assert ctx.stream == handle
    for bad in (-1, "s", 1.5, True):
        with pytest.raises(InvalidParameterError, match="stream="):
            ctx.use_stream(bad)


class _TorchLikeTensor:
    """Looks like a torch CUDA tensor to the stream rule (its module and device)."""

    __module__ = "torch.fake"

    def __init__(self, index=0):
        self.device = pytypes.SimpleNamespace(type="cuda", index=index)


def test_torch_tensors_follow_torchs_current_stream(monkeypatch):
    torch = pytest.importorskip("torch")
    asked = []

    def current_stream(device=None):
        asked.append(device)
        return pytypes.SimpleNamespace(cuda_stream=0xC0DE)

    def raw_stream(index):  # torch's builds with CUDA answer the raw handle directly
        asked.append(index)
        return 0xC0DE

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", raw_stream, raising=False)
    ctx, rec, compiled = _fake_context()
    tensor = _TorchLikeTensor()
    assert ctx.resolve_stream(tensor) == 0xC0DE
    assert asked == [tensor.device.index]  # the tensor's device, at the time of the call
    ctx.launch(compiled, (1, 2, _scalars(1.0)), 4, 256)
    assert rec.streams == [0xC0DE]
    ctx.use_stream(0x42)  # pinned beats the rule
    assert ctx.resolve_stream(tensor) == 0x42
    assert ctx.resolve_stream(np.zeros(1)) == 0x42


@pytest.mark.parametrize("status", [1, 2])
def test_capture_guard_raises_a_clear_error(status):
    ctx, rec, _ = _fake_context(capture_status=status)
    with pytest.raises(UnsupportedOperationError, match="captured into a CUDA graph.*stale"):
        ctx.refuse_capture(0x99, "an optimizer step")
    ok, _, _ = _fake_context(capture_status=0)
    ok.refuse_capture(0x99, "an optimizer step")
    unknown, _, _ = _fake_context(capture_status=-1)  # the driver cannot tell: never in the way
    unknown.refuse_capture(0x99, "an optimizer step")


def test_cuStreamIsCapturing_through_ctypes():
    """The driver query: status written through the pointer, IMPLICIT (906) on the legacy stream."""

    class Lib:
        def __init__(self, err, status):
            self.err, self.status, self.asked = err, status, []

        def cuStreamIsCapturing(self, stream, out):
            self.asked.append(stream.value)
            out._obj.value = self.status
            return self.err

    launcher = cuda_backend_mod._Launcher.__new__(cuda_backend_mod._Launcher)
    for err, status, expected in ((0, 0, 0), (0, 1, 1), (0, 2, 2), (906, 0, 1), (1, 0, -1)):
        launcher.lib = Lib(err, status)
        assert launcher.capture_status(0x1234) == expected
        assert launcher.lib.asked == [0x1234]
    launcher.lib = None
    assert launcher.capture_status(0) == -1


def test_cpu_backend_has_only_stream_zero():
    backend = optirs.get_backend("cpu")
    use = backend.hook("streams", "optirs_use_stream")
    use(backend.ctx, None)
    use(backend.ctx, 0)
    assert backend.hook("streams", "optirs_current_stream")(backend.ctx) == 0
    with pytest.raises(UnsupportedOperationError, match="no device streams"):
        use(backend.ctx, 0x10)


# ------------------------------------------------------------------ simulator (and GPU): the whole step


def _cuda_or_skip():
    status = {s.name: s for s in optirs.list_backends()}.get("cuda")
    if status is None or not status.available:
        pytest.skip(f"the cuda backend cannot open here: {getattr(status, 'reason', 'not installed')}")


class _DispatcherSpy:
    """Wraps a numba dispatcher: records the launch configurations (grid, block, stream)."""

    def __init__(self, dispatcher, seen):
        self.dispatcher, self.seen = dispatcher, seen

    def __getitem__(self, config):
        self.seen.append(config)
        return self.dispatcher[config]


def _spy_launches(ctx, monkeypatch):
    seen = []
    # Launches prepared from here on (new arrays) take numba's launch too, so the spy sees them.
    monkeypatch.setenv("OPTIRS_CUDA_RAW_LAUNCH", "0")
    for compiled in ctx._compiled.values():
        monkeypatch.setattr(compiled, "dispatcher", _DispatcherSpy(compiled.dispatcher, seen))
    for prepared in ctx._launches.values():  # numba's fallback path (no raw launcher)
        monkeypatch.setattr(prepared, "fn", None)
        for sibling in (prepared.family or {}).values():  # the same launch on a pointer table's siblings
            monkeypatch.setattr(sibling, "fn", None)
    return seen


@pytest.mark.cuda
def test_step_goes_on_the_pinned_stream(rng, monkeypatch):
    _cuda_or_skip()
    if not cuda_simulator_enabled():
        pytest.skip("a made-up stream handle is only safe under the simulator (the driver dereferences it); "
                    "the gpu tests below use real streams")
    from numba import cuda

    hp = optirs.AdamParams(lr=1e-2, weight_decay=0.1)
    shapes = [(33,), (4, 5)]
    host = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(3)]
    expected, _ = reference.run("adamw", host, grads, hp)
    opt = optirs.GpuAdamW(hp, optirs.GpuOptimizerConfig(backend="cuda", options={"stream": 0xABC0}))
    ctx = opt.backend.ctx
    assert opt.backend.hook("streams", "optirs_current_stream")(ctx) == 0xABC0
    params = [cuda.to_device(h) for h in host]
    opt.step_gpu(params, [cuda.to_device(g) for g in grads[0]])
    seen = _spy_launches(ctx, monkeypatch)
    for gs in grads[1:]:
        opt.step_gpu(params, [cuda.to_device(g) for g in gs])
    assert seen and all(config[2] is ctx.numba_stream(0xABC0) for config in seen)
    _close([p.copy_to_host() for p in params], expected)


@pytest.mark.cuda
def test_default_stream_stays_legacy(rng, monkeypatch):
    _cuda_or_skip()
    from numba import cuda

    hp = optirs.SgdParams(lr=0.1, momentum=0.9)
    host = [rng.standard_normal(17).astype(np.float32)]
    grads = [[rng.standard_normal(17).astype(np.float32)] for _ in range(2)]
    expected, _ = reference.run("sgd", host, grads, hp)
    opt = optirs.GpuSgd(hp, optirs.GpuOptimizerConfig(backend="cuda"))
    params = [cuda.to_device(host[0])]
    opt.step_gpu(params, [cuda.to_device(grads[0][0])])
    seen = _spy_launches(opt.backend.ctx, monkeypatch)
    opt.step_gpu(params, [cuda.to_device(grads[1][0])])
    assert seen and all(config[2] == 0 for config in seen)
    assert opt.backend.ctx.stream == 0
    _close([params[0].copy_to_host()], expected)


@pytest.mark.cuda
@pytest.mark.parametrize("first", [True, False], ids=["first-step", "later-step"])
def test_step_under_capture_raises_and_changes_nothing(rng, monkeypatch, first):
    _cuda_or_skip()
    if not cuda_simulator_enabled():
        pytest.skip("a made-up stream handle is only safe under the simulator (the driver dereferences it); "
                    "test_capture_in_a_cuda_graph_raises_clearly captures for real")
    from numba import cuda

    hp = optirs.AdamParams(lr=1e-2)
    host = rng.standard_normal(40).astype(np.float32)
    g = cuda.to_device(rng.standard_normal(40).astype(np.float32))
    opt = optirs.GpuAdam(hp, optirs.GpuOptimizerConfig(backend="cuda", options={"stream": 0x5EED}))
    param = cuda.to_device(host)
    if not first:
        opt.step_gpu(param, g)
    before_p, before_state, before_step = param.copy_to_host(), opt.state_dict(), opt.step_count
    monkeypatch.setattr(opt.backend.ctx, "stream_capturing", lambda handle: handle == 0x5EED)
    with pytest.raises(UnsupportedOperationError, match="0x5eed.*CUDA graph.*stale"):
        opt.step_gpu(param, g)
    assert opt.step_count == before_step
    np.testing.assert_array_equal(param.copy_to_host(), before_p)
    after = opt.state_dict()
    assert (after["step"], after["shapes"], len(after["state"])) == (
        before_state["step"], before_state["shapes"], len(before_state["state"]))
    for a, b in zip(after["state"], before_state["state"]):
        assert set(a) == set(b)
        for k in b:
            np.testing.assert_array_equal(a[k], b[k])
    monkeypatch.undo()
    opt.step_gpu(param, g)  # outside the capture it steps again
    assert opt.step_count == before_step + 1


# ------------------------------------------------------------------ simulator (and GPU): the capturable hook


CAPTURABLE = [("adamw", lambda: optirs.AdamParams(lr=2.0**-7, weight_decay=0.1, amsgrad=True)),
              ("adam", lambda: optirs.AdamParams(lr=2.0**-7, weight_decay=0.05)),
              ("sgd", lambda: optirs.SgdParams(lr=2.0**-5, momentum=0.9, nesterov=True)),
              ("rmsprop", lambda: optirs.RmspropParams(lr=2.0**-8, momentum=0.5, centered=True)),
              ("adagrad", lambda: optirs.AdagradParams(lr=2.0**-6, lr_decay=0.01)),
              ("lion", lambda: optirs.LionParams(lr=2.0**-9, weight_decay=0.1))]


@pytest.mark.cuda
@pytest.mark.parametrize("name,make", CAPTURABLE, ids=[n for n, _ in CAPTURABLE])
def test_capturable_hook_equals_the_host_path_step_after_step(rng, name, make):
    """optirs_capturable_step (step count, lr, grad_scale and found_inf on the device) against the
    plain step hook with host scalars, bit for bit, over steps with a changing tensor lr, a gradient
    scale, maximize's sign and an injected found_inf (which must change nothing, not the count)."""
    _cuda_or_skip()
    from dataclasses import replace

    from numba import cuda

    from optirs.core.definitions import DEFINITIONS
    from optirs.core.layout import TensorLayout
    from optirs.core.scalars import FORMULAS
    from optirs.plugin.hookspecs import DeviceStepInputs

    backend = optirs.get_backend("cuda")
    assert backend.supports("capturable")
    definition, hp = DEFINITIONS[name], make()
    shapes = [(37,), (4, 9), (1,)]
    layout_a, layout_b = TensorLayout(shapes), TensorLayout(shapes)
    host = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    slots = definition.state_slots(hp)
    sizes = definition.state_layout(layout_a, tuple(slots)).buffer_sizes()
    state_a = {k: cuda.to_device(np.full(sizes[k], fill, np.float32)) for k, fill in slots.items()}
    state_b = {k: cuda.to_device(np.full(sizes[k], fill, np.float32)) for k, fill in slots.items()}
    pa, pb = [cuda.to_device(h) for h in host], [cuda.to_device(h) for h in host]
    steps = cuda.to_device(np.zeros(len(shapes), np.float32))
    record = cuda.to_device(np.zeros(len(definition.scalars_type._fields), np.float32))
    lr = cuda.to_device(np.array([hp.lr], np.float32))
    scale, found = cuda.to_device(np.array([8.0], np.float32)), cuda.to_device(np.zeros(1, np.float32))
    sign, host_step, host_lr = -1.0, 0, hp.lr
    for t in range(7):
        grads = [cuda.to_device(rng.standard_normal(s).astype(np.float32) * 8.0) for s in shapes]
        skip = t == 3
        found.copy_to_device(np.array([1.0 if skip else 0.0], np.float32))
        if t == 4:  # a scheduler writing the tensor lr in place: the next step reads it
            host_lr = hp.lr / 2
            lr.copy_to_device(np.array([host_lr], np.float32))
        inputs = DeviceStepInputs(steps=steps, record=record, constants=FORMULAS[name].constants(hp), lr=lr,
                                  sign=sign, grad_scale=scale, found_inf=found)
        backend_step(backend, name, pa, grads, state_a, layout_a, definition.scalars(hp, 1), device=inputs)
        if not skip:
            host_step += 1
            scalars = definition.scalars(replace(hp, lr=host_lr), host_step, grad_factor=sign / 8.0)
            backend_step(backend, name, pb, grads, state_b, layout_b, scalars, step=host_step)
        np.testing.assert_array_equal(steps.copy_to_host(), np.full(len(shapes), host_step, np.float32))
        for a, b in zip(pa, pb):
            np.testing.assert_array_equal(a.copy_to_host(), b.copy_to_host())
        for k in state_a:
            np.testing.assert_array_equal(state_a[k].copy_to_host(), state_b[k].copy_to_host())
    assert host_step == 6


@pytest.mark.cuda
def test_capturable_hook_refuses_what_it_cannot_do(rng, monkeypatch):
    _cuda_or_skip()
    from numba import cuda

    from optirs.core.definitions import DEFINITIONS
    from optirs.core.layout import TensorLayout
    from optirs.plugin.hookspecs import DeviceStepInputs

    backend = optirs.get_backend("cuda")

    def hook(ctx, name, params, grads, state, layout, scalars, inputs):
        backend_step(backend, name, params, grads, state, layout, scalars, device=inputs)

    layout = TensorLayout([(8,)])
    p, g = cuda.to_device(np.ones(8, np.float32)), cuda.to_device(np.ones(8, np.float32))
    state = {"exp_avg": cuda.to_device(np.zeros(8, np.float32)), "exp_avg_sq": cuda.to_device(np.zeros(8, np.float32))}
    steps, record = cuda.to_device(np.zeros(1, np.float32)), cuda.to_device(np.zeros(16, np.float32))
    hp = optirs.LambParams()
    inputs = DeviceStepInputs(steps=steps, record=record, constants=(), lr=1e-3)
    with pytest.raises(UnsupportedOperationError, match="lamb"):
        hook(backend.ctx, "lamb", [p], [g], state, layout, DEFINITIONS["lamb"].scalars(hp, 1), inputs)
    hp = optirs.AdamParams()
    from optirs.core.scalars import FORMULAS

    inputs = DeviceStepInputs(steps=steps, record=record, constants=FORMULAS["adam"].constants(hp), lr=1e-3)
    with pytest.raises(InvalidParameterError, match="device arrays"):
        hook(backend.ctx, "adam", [np.ones(8, np.float32)], [g], state, layout, DEFINITIONS["adam"].scalars(hp, 1),
             inputs)
    # a first step under capture: nothing is built, nothing changes
    monkeypatch.setattr(backend.ctx, "stream_capturing", lambda handle: True)
    with pytest.raises(UnsupportedOperationError, match="warm-up"):
        hook(backend.ctx, "adam", [p], [g], state, layout, DEFINITIONS["adam"].scalars(hp, 1), inputs)
    np.testing.assert_array_equal(p.copy_to_host(), np.ones(8, np.float32))
    np.testing.assert_array_equal(steps.copy_to_host(), np.zeros(1, np.float32))


@pytest.mark.skipif(SIMULATOR, reason="the simulator has no compiler; the normal pass compiles PTX")
def test_capturable_scalars_kernels_compile_to_ptx_for_sm90(monkeypatch):
    """The device scalars kernel of every elementwise family, with the argument types the hook
    launches it with (the step kernel itself is test_cuda's)."""
    import numba
    import numba.cuda.dispatcher as dispatcher
    from numba import cuda

    from optirs.backends.cuda import _head_types
    from optirs.backends.cuda import kernels as K
    from optirs.core.definitions import DEFINITIONS
    from optirs.core.scalars import FORMULAS

    if not cuda.is_available():
        monkeypatch.setattr(dispatcher, "get_current_device",
                            lambda: pytypes.SimpleNamespace(compute_capability=(9, 0)))
    assert set(K.SCALARS_FUNCTIONS) == {"adam", "sgd", "rmsprop", "adagrad", "lion"}
    for family, fn in K.SCALARS_FUNCTIONS.items():
        hp = next(d for d in DEFINITIONS.values() if d.kernel == family).examples[0]
        floats = (1e-3, 1.0) + tuple(float(c) for c in FORMULAS[family].constants(hp))
        ptx, _ = cuda.compile_ptx(fn, _head_types("scalars") + (numba.typeof(floats),), cc=(9, 0))
        assert ".target sm_90" in ptx, family


# ------------------------------------------------------------------ the H200: torch streams and graphs


def _torch_cuda_or_skip():
    torch = pytest.importorskip("torch")
    if SIMULATOR or not torch.cuda.is_available():
        pytest.skip("needs torch with a real CUDA GPU")
    _cuda_or_skip()
    return torch


@pytest.mark.gpu
def test_step_is_ordered_after_work_on_torchs_current_stream(rng):
    """The side-stream race: the step must see g.fill_(1.0) queued on a side stream just before it."""
    torch = _torch_cuda_or_skip()
    hp = optirs.AdamParams(lr=1e-2, weight_decay=0.1)
    n = 1 << 22
    host = rng.standard_normal(n).astype(np.float32)
    expected, _ = reference.run("adamw", [host], [[np.ones(n, np.float32)]], hp)
    p = torch.from_numpy(host.copy()).cuda()
    g = torch.zeros(n, device="cuda")
    opt = optirs.GpuAdamW(hp, optirs.GpuOptimizerConfig(backend="cuda"))
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # delay the side stream: a step on any other stream would win the race
        g.fill_(1.0)
        opt.step_gpu(p, g)
        assert opt.backend.hook("streams", "optirs_current_stream")(opt.backend.ctx) == s.cuda_stream
    torch.cuda.synchronize()
    _close([p.cpu().numpy()], expected)


@pytest.mark.gpu
def test_seed_api_steps_cuda_tensors_that_require_grad(rng):
    """A model's parameters require grad, and such a tensor refuses __cuda_array_interface__."""
    torch = _torch_cuda_or_skip()
    hp = optirs.AdamParams(lr=1e-2)
    host = rng.standard_normal(1000).astype(np.float32)
    grad = rng.standard_normal(1000).astype(np.float32)
    expected, _ = reference.run("adam", [host], [[grad]], hp)
    p = torch.nn.Parameter(torch.from_numpy(host.copy()).cuda())
    optirs.GpuAdam(hp, optirs.GpuOptimizerConfig(backend="cuda")).step_gpu(p, torch.from_numpy(grad).cuda())
    torch.cuda.synchronize()
    _close([p.detach().cpu().numpy()], expected)


@pytest.mark.gpu
@pytest.mark.parametrize("warm", [True, False], ids=["after-a-step", "first-step"])
def test_capture_in_a_cuda_graph_raises_clearly(rng, warm):
    torch = _torch_cuda_or_skip()
    host = rng.standard_normal(4096).astype(np.float32)
    p = torch.from_numpy(host.copy()).cuda()
    g = torch.ones(4096, device="cuda")
    opt = optirs.GpuAdam(optirs.AdamParams(lr=1e-2), optirs.GpuOptimizerConfig(backend="cuda"))
    opt.backend  # opened before the capture: the guard is about the step, not about opening a device
    if warm:
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            opt.step_gpu(p, g)
        torch.cuda.synchronize()
    before, steps = p.clone(), opt.step_count
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(UnsupportedOperationError, match="CUDA graph.*stale"):
        with torch.cuda.graph(graph):
            opt.step_gpu(p, g)
    torch.cuda.synchronize()
    assert opt.step_count == steps
    assert torch.equal(p, before)


# ------------------------------------------------------------------ the H200 benchmark script


def _bench_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_torch_step.py"
    spec = importlib.util.spec_from_file_location("bench_torch_step", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return path, module


def test_bench_gpt2_shapes_are_gpt2_124m():
    _, bench = _bench_module()
    shapes = bench.gpt2_shapes(bench.gpt2_config(smoke=False))
    assert len(shapes) == 148
    assert sum(bench._prod(s) for _, s in shapes) == 124_439_808  # GPT-2 124M with the tied head
    groups = bench.groups_of(shapes, list(range(len(shapes))))
    assert len(groups[0]["params"]) == 2 + 4 * 12 and len(groups[1]["params"]) == 2 + 8 * 12
    small = bench.small_shapes(1_000_000, 50)
    assert len(small) == 50 and abs(sum(bench._prod(s) for _, s in small) - 1_000_000) < 100


def test_bench_smoke_skips_cleanly_without_cuda(tmp_path):
    import json
    import os
    import subprocess
    import sys

    path, bench = _bench_module()
    out = tmp_path / "smoke.json"
    env = dict(os.environ, PYTHONPATH=str(path.parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, str(path), "--smoke", "--json", str(out)], capture_output=True, text=True,
                         env=env, timeout=900)
    reason = bench.cuda_unavailable_reason()
    assert run.returncode == 0, run.stdout + run.stderr
    if reason is None:  # a GPU machine: the smoke run measured something
        assert "copy:" in run.stdout and "ms" in json.loads(out.read_text())["copy"]
    else:
        assert "skipped" in run.stdout and "needs torch with a CUDA GPU" in run.stdout
        assert json.loads(out.read_text()) == {"skipped": reason}
        full = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=900)
        assert full.returncode == 2 and "skipped" in full.stdout  # a full run without CUDA is an error
