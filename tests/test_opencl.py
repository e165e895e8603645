"""OpenCL-specific behaviour (PoCL here, NVIDIA OpenCL on the GPU machine).

The generic optimizer-vs-reference suite (tests/test_optimizers.py) covers numpy models and a
single device array on this backend; these tests cover what only OpenCL has: pyopencl arrays
stepped in place as separate buffers, shared buffers and misaligned views, the launch shapes
(float4 body, scalar tail, chunked multi-buffer groups), kernel reuse, device selection, build
errors, and the struct/record agreement.
"""

from __future__ import annotations

import numpy as np
import pytest

import optirs
from optirs.core import reference
from optirs.core.errors import BackendUnavailableError, DeviceMemoryError, GpuOptimError, InvalidParameterError
from optirs.core.layout import TensorLayout
from optirs.optim.optimizers import OPTIMIZERS

cl = pytest.importorskip("pyopencl")
cla = pytest.importorskip("pyopencl.array")
from optirs.backends import opencl as ocl  # noqa: E402

_STATUS = {s.name: s for s in optirs.list_backends()}.get("opencl")
pytestmark = [
    pytest.mark.opencl,
    pytest.mark.skipif(_STATUS is None or not _STATUS.available,
                       reason=f"backend opencl cannot open here: {getattr(_STATUS, 'reason', 'not installed')}"),
]

CFG = optirs.GpuOptimizerConfig(backend="opencl")
# One option set per optimizer that switches on every state slot.
CASES = {
    "adam": optirs.AdamParams(lr=3e-3, beta1=0.5, beta2=0.9, eps=1e-6, weight_decay=0.05, amsgrad=True),
    "adamw": optirs.AdamParams(lr=1e-2, weight_decay=0.3),
    "sgd": optirs.SgdParams(lr=0.01, momentum=0.9, nesterov=True, weight_decay=0.01),
    "rmsprop": optirs.RmspropParams(lr=1e-3, alpha=0.9, momentum=0.5, centered=True, weight_decay=0.1),
    "adagrad": optirs.AdagradParams(lr_decay=0.1, weight_decay=0.1, initial_accumulator_value=0.5),
    "lamb": optirs.LambParams(lr=1e-2, max_trust_ratio=10.0, max_grad_norm=5.0),
}
# Sizes not multiples of 4 put later tensors' state at odd offsets (scalar path); 8195 spans
# two chunks with a 3-element tail; 1024 after 7+12 is aligned in neither params nor state.
SHAPES = [(7,), (4, 3), (1024,), (5,), (8195,), (2, 2)]


@pytest.fixture(scope="module")
def ctx():
    return optirs.get_backend("opencl").ctx


def problem(rng, shapes=SHAPES, steps=3):
    params = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(steps)]
    return params, grads


def assert_close(actual, expected):
    for a, e in zip(actual, expected):
        scale = float(np.max(np.abs(e))) if np.size(e) else 1.0
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5 * (scale or 1.0))


def run_cpu(name, hp, params, grads):
    host = [p.copy() for p in params]
    opt = OPTIMIZERS[name](hp, optirs.GpuOptimizerConfig(backend="cpu"))
    for g in grads:
        opt.step_gpu(host, g)
    return host


class Spy:
    """Stands in for one Kernel object in ctx.kernels: records launches, then calls the real one."""

    def __init__(self, kernel, name, log):
        self.kernel, self.name, self.log = kernel, name, log

    def __call__(self, queue, gsize, lsize, *args):
        self.log.append((self.name, id(self.kernel), gsize[0]))
        return self.kernel(queue, gsize, lsize, *args)


@pytest.fixture
def launches(ctx, monkeypatch):
    log = []
    for name, kernel in list(ctx.kernels.items()):
        monkeypatch.setitem(ctx.kernels, name, Spy(kernel, name, log))
    return log


# ---------------------------------------------------------------- device arrays in place


@pytest.mark.parametrize("name", list(CASES))
def test_separate_device_arrays_stepped_in_place(ctx, name, rng, launches):
    """A model of separate pyopencl arrays: updated in place, like the reference and bit-identical to numba."""
    hp = CASES[name]
    params, grads = problem(rng)
    expected, _ = reference.run(name, params, grads, hp)
    dev = [cla.to_device(ctx.queue, p) for p in params]
    opt = OPTIMIZERS[name](hp, CFG)
    for gs in grads:
        opt.step_gpu(dev, [cla.to_device(ctx.queue, g) for g in gs])
    got = [d.get() for d in dev]
    assert_close(got, expected)
    assert [d.shape for d in dev] == [p.shape for p in params]
    cpu = run_cpu(name, hp, params, grads)
    for a, b in zip(got, cpu):
        if name == "lamb":  # norms are summed in another order: the ratio may round differently
            np.testing.assert_array_max_ulp(a, b, maxulp=4)
        else:  # same formulas, no contraction, correctly rounded / and sqrt: the same bits
            np.testing.assert_array_equal(a, b)
    family = "adam" if name == "adamw" else name
    kernels = {n for n, _, _ in launches}
    assert (f"{family}_chunks" in kernels) if name != "lamb" else {"lamb_moments", "lamb_apply"} <= kernels
    assert isinstance(opt.engine.state[next(iter(opt.engine.state))], cla.Array)  # state stays on the device


def test_flat_views_take_one_float4_launch_and_match_separate_arrays(ctx, rng, launches):
    """Views of one allocation at the layout's offsets: one float4 launch per step, same bits as separate arrays."""
    params, grads = problem(rng)
    layout = TensorLayout(SHAPES)  # each tensor from a multiple of 8 elements, as the state
    sizes, offsets = layout.sizes.tolist(), layout.offsets.tolist()

    def packed(arrays):
        flat = cla.to_device(ctx.queue, layout.pack(arrays))
        return flat, layout.views(flat)

    flat, views = packed(params)
    separate = [cla.to_device(ctx.queue, p) for p in params]
    a, b = optirs.GpuAdam(CASES["adam"], CFG), optirs.GpuAdam(CASES["adam"], CFG)
    for gs in grads:
        del launches[:]
        a.step_gpu(views, packed(gs)[1])
        assert [n for n, _, _ in launches] == ["adam_flat4"]
        total = layout.total
        assert launches[0][2] >= total // 4 + 1  # one work-item per float4 plus one for the tail
        b.step_gpu(separate, [cla.to_device(ctx.queue, g) for g in gs])
    got = flat.get()
    for v, o, n, s in zip(separate, offsets, sizes, SHAPES):
        np.testing.assert_array_equal(got[o: o + n].reshape(s), v.get())


@pytest.mark.parametrize("n", [1, 3, 4, 5, 4099])
def test_single_array_float4_body_and_scalar_tail(ctx, rng, n, launches):
    """Lengths around multiples of 4: the float4 body and the 0-3 element tail give the numba results."""
    (host,), grads = problem(rng, [(n,)], steps=2)
    dev = cla.to_device(ctx.queue, host)
    opt = optirs.GpuAdam(CASES["adam"], CFG)
    for (g,) in grads:
        opt.step_gpu(dev, cla.to_device(ctx.queue, g))
    assert {k for k, _, _ in launches} == {"adam_flat4"}
    np.testing.assert_array_equal(dev.get(), run_cpu("adam", CASES["adam"], [host], grads)[0])


def test_misaligned_view_takes_the_scalar_kernel(ctx, rng, launches):
    """A view starting one element into its buffer cannot be read as float4: the per-element kernel, same bits."""
    (host,), grads = problem(rng, [(37,)], steps=2)
    base = cla.to_device(ctx.queue, np.concatenate([[np.float32(9)], host]))
    view = base[1:]
    opt = optirs.GpuRmsprop(CASES["rmsprop"], CFG)
    for (g,) in grads:
        gbase = cla.to_device(ctx.queue, np.concatenate([[np.float32(0)], g]))
        opt.step_gpu(view, gbase[1:])
    assert {k for k, _, _ in launches} == {"rmsprop_flat1"}
    got = base.get()
    assert got[0] == np.float32(9)  # the element before the view is untouched
    np.testing.assert_array_equal(got[1:], run_cpu("rmsprop", CASES["rmsprop"], [host], grads)[0])


def test_many_buffers_are_grouped_by_slots(ctx, rng, launches):
    """Separate buffers take one launch per ``ctx.slots`` of them (what the device's argument space
    holds: 32 on PoCL, 128 on NVIDIA's driver): these slots + 8 buffers take 2 launches, where 16
    buffers a launch took 3 on PoCL and 9 on NVIDIA's driver. Views of one buffer (with gaps) take one."""
    assert ctx.slots == ocl.slot_count(ctx.device) > 16
    shapes = [(3 + i % 20,) for i in range(ctx.slots + 8)]
    params, grads = problem(rng, shapes, steps=2)
    expected, _ = reference.run("sgd", params, grads, CASES["sgd"])
    separate = [cla.to_device(ctx.queue, p) for p in params]
    opt = optirs.GpuSgd(CASES["sgd"], CFG)
    for gs in grads:
        del launches[:]
        opt.step_gpu(separate, [cla.to_device(ctx.queue, g) for g in gs])
        assert [k for k, _, _ in launches] == ["sgd_chunks"] * 2
    assert_close([d.get() for d in separate], expected)

    def gapped(arrays):  # each tensor followed by one unused element: not at the layout's offsets
        flat = cla.to_device(ctx.queue, np.concatenate([np.append(a, np.float32(7)) for a in arrays]))
        out, o = [], 0
        for a in arrays:
            out.append(flat[o: o + a.size])
            o += a.size + 1
        return flat, out

    flat, views = gapped(params)
    opt = optirs.GpuSgd(CASES["sgd"], CFG)
    for gs in grads:
        del launches[:]
        opt.step_gpu(views, gapped(gs)[1])
        assert [k for k, _, _ in launches] == ["sgd_chunks"]
    assert_close([v.get() for v in views], expected)
    got, o = flat.get(), 0
    for a in params:  # the gaps are untouched
        assert got[o + a.size] == np.float32(7)
        o += a.size + 1


@pytest.mark.parametrize("name", ["adam", "lamb"])
def test_a_small_grid_changes_no_bit(ctx, name, rng, launches, monkeypatch):
    """A grid of one work-group per compute unit (OPTIRS_OPENCL_RESIDENT: one work-group's
    work-items): on PoCL's 2 units each work-group takes several of the 7 chunks from the counter,
    and every launch after it starts at the ticket the host expects. The same bits as the default
    grid, LAMB's norms included (summed per chunk, whichever work-group takes it)."""
    params, grads = problem(rng, steps=2)

    def run():
        dev = [cla.to_device(ctx.queue, p) for p in params]
        opt = OPTIMIZERS[name](CASES[name], CFG)
        for gs in grads:
            opt.step_gpu(dev, [cla.to_device(ctx.queue, g) for g in gs])
        return [d.get() for d in dev]

    want = run()
    monkeypatch.setenv("OPTIRS_OPENCL_RESIDENT", str(ctx.work_group))
    del launches[:]
    got = run()
    chunked = [items for k, _, items in launches if k.endswith(("_chunks", "_sumsq", "_moments", "_apply"))]
    assert chunked and set(chunked) == {min(7, ctx.compute_units) * ctx.work_group}
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)
    monkeypatch.setenv("OPTIRS_OPENCL_RESIDENT", "many")
    with pytest.raises(InvalidParameterError, match="OPTIRS_OPENCL_RESIDENT='many'"):
        run()


def test_slot_counts_fit_the_argument_space(ctx):
    """The slots a device gets leave room for every other argument of every chunked kernel, float32
    and formats, on NVIDIA's driver (4352 bytes: 128 slots) and PoCL (1024: 32)."""
    from optirs.backends.opencl import formats as OF
    from optirs.backends.opencl.slots import argument_bytes, slots_for

    for room, slots in ((4352, 128), (1024, 32), (1023, 16)):
        assert slots_for(room) == slots
        kernels = dict(ocl.context.kernel_arg_types(ctx.records, slots))
        for family in (None, "adam", "radam", "lamb"):
            kernels.update(OF._arg_types(ctx, family, slots))
        need = {name: argument_bytes(types) for name, types in kernels.items()}
        assert max(need.values()) <= room, (room, max(need.items(), key=lambda kv: kv[1]))


def test_the_nvidia_slot_count_builds_with_the_host_arguments(ctx):
    """The float32 program with the 128 slots of NVIDIA's driver builds, and every kernel takes
    the arguments the host passes."""
    program = ocl.build_program(ctx.context, ctx.device, ocl.kernel_source(128), ctx.build_options, "slots128")
    for name, types in ocl.context.kernel_arg_types(ctx.records, 128).items():
        assert cl.Kernel(program, name).num_args == len(types), name


def test_launch_plan_follows_the_arrays_passed(ctx, rng):
    """The plan cached for one list of arrays is not used for another list of the same shapes."""
    params, grads = problem(rng, [(6,), (9,), (12,)], steps=4)
    first = [cla.to_device(ctx.queue, p) for p in params]
    other_host = [p[::-1].copy() for p in params]
    # the same shapes as views into one buffer with gaps: other offsets, so a stale plan would step the wrong elements
    packed = cla.to_device(ctx.queue, np.concatenate([np.append(p, np.float32(3)) for p in other_host]))
    other = [packed[0:6], packed[7:16], packed[17:29]]
    gdev = [cla.to_device(ctx.queue, g) for g in grads[0]]
    opt = optirs.GpuSgd(optirs.SgdParams(lr=0.1), CFG)  # stateless: each step depends only on p and g
    for k, gs in enumerate(grads):
        for d, g in zip(gdev, gs):  # same gradient objects, new values
            d.set(g)
        opt.step_gpu(first if k % 2 == 0 else other, gdev)
    want_first = reference.run("sgd", params, grads[0::2], optirs.SgdParams(lr=0.1))[0]
    want_other = reference.run("sgd", other_host, grads[1::2], optirs.SgdParams(lr=0.1))[0]
    assert_close([d.get() for d in first], want_first)
    assert_close([d.get() for d in other], want_other)
    assert np.all(packed.get()[[6, 16, 29]] == np.float32(3))


def test_lamb_launch_count_does_not_grow_with_tensors(ctx, rng, launches):
    """LAMB on a 6-tensor numpy model: moments, trust ratios and apply, plus two clipping passes: 5 launches."""
    params, grads = problem(rng, steps=1)
    expected, _ = reference.run("lamb", params, grads, CASES["lamb"])
    opt = optirs.GpuLamb(CASES["lamb"], CFG)
    opt.step_gpu(params, grads[0])
    assert [k for k, _, _ in launches] == ["lamb_grad_sumsq", "lamb_grad_scale", "lamb_moments",
                                           "lamb_trust_ratios", "lamb_apply"]
    assert_close(params, expected)


def test_empty_tensors_in_a_model(ctx, rng):
    shapes = [(0,), (6,), (0, 3), (3,)]
    params, grads = problem(rng, shapes, steps=2)
    for name in ("adam", "lamb"):
        expected, _ = reference.run(name, params, grads, CASES[name])
        host = [p.copy() for p in params]
        dev = [cla.to_device(ctx.queue, p) for p in params]
        o1, o2 = OPTIMIZERS[name](CASES[name], CFG), OPTIMIZERS[name](CASES[name], CFG)
        for gs in grads:
            o1.step_gpu(host, gs)
            o2.step_gpu(dev, [cla.to_device(ctx.queue, g) for g in gs])
        assert_close(host, expected)
        assert_close([d.get() for d in dev], expected)


def test_arrays_on_another_queue_are_ordered(ctx, rng):
    """Arrays tied to a second queue of the same context: the step waits for it and it waits for the step."""
    other = cl.CommandQueue(ctx.context)
    params, grads = problem(rng, [(1000,), (3,)], steps=3)
    expected, _ = reference.run("adagrad", params, grads, CASES["adagrad"])
    dev = [cla.to_device(other, p) for p in params]
    opt = optirs.GpuAdagrad(CASES["adagrad"], CFG)
    for gs in grads:
        opt.step_gpu(dev, [cla.to_device(other, g) for g in gs])
    assert_close([d.get(queue=other) for d in dev], expected)


def test_bad_arrays_are_rejected_and_nothing_changes(ctx, rng):
    params, grads = problem(rng, [(8,), (5,)], steps=1)
    dev = [cla.to_device(ctx.queue, p) for p in params]
    opt = optirs.GpuAdam(CASES["adam"], CFG)
    with pytest.raises(InvalidParameterError, match="numpy array among pyopencl arrays"):
        opt.step_gpu([dev[0], params[1].copy()], [cla.to_device(ctx.queue, grads[0][0]), grads[0][1]])
    foreign = cl.CommandQueue(cl.Context([ctx.device]))
    with pytest.raises(InvalidParameterError, match="another OpenCL context"):
        opt.step_gpu([cla.to_device(foreign, p) for p in params], [cla.to_device(foreign, g) for g in grads[0]])
    assert opt.step_count == 0
    for d, p in zip(dev, params):
        np.testing.assert_array_equal(d.get(), p)


# ---------------------------------------------------------------- kernels, build, memory


def test_kernels_are_built_once_and_reused(ctx, rng, launches, monkeypatch):
    """Every launch uses a Kernel object made at open; no Kernel is constructed while stepping."""
    made = []
    real = cl.Kernel
    monkeypatch.setattr(cl, "Kernel", lambda *a, **k: made.append(a) or real(*a, **k))
    program = ctx.program
    params, grads = problem(rng, steps=3)
    for name in CASES:
        opt = OPTIMIZERS[name](CASES[name], CFG)
        for gs in grads:
            opt.step_gpu([p.copy() for p in params], gs)
    assert made == []
    assert ctx.program is program
    originals = {name: spy.kernel for name, spy in ctx.kernels.items()}
    assert {kid for _, kid, _ in launches} <= {id(k) for k in originals.values()}


def test_build_error_carries_the_compiler_log(ctx):
    bad = "__kernel void broken(__global float *a) { a[0] = optirs_no_such_symbol; }"
    with pytest.raises(GpuOptimError, match="compiler log") as info:
        ocl.build_program(ctx.context, ctx.device, bad, ["-DOPTIRS_WG=64"], "bad")
    assert "optirs_no_such_symbol" in str(info.value)


def test_build_options_keep_exact_math(ctx):
    opts = ocl.build_options(ctx.device, ctx.work_group)
    assert not any("fast-relaxed" in o or "mad-enable" in o or "unsafe" in o for o in opts)
    rounded = bool(ctx.device.single_fp_config & cl.device_fp_config.CORRECTLY_ROUNDED_DIVIDE_SQRT)
    assert ("-cl-fp32-correctly-rounded-divide-sqrt" in opts) == rounded
    assert "#pragma OPENCL FP_CONTRACT OFF" in ocl.kernel_source(ctx.slots)


def test_struct_records_match_the_scalars():
    """Host records follow optirs.core.scalars field by field (the device sizes are checked at open)."""
    from optirs.core import scalars

    rec = ocl.record_dtype(scalars.AdamScalars)
    assert rec.names == scalars.AdamScalars._fields
    assert rec["amsgrad"] == np.dtype("<i4") and rec["beta1"] == np.dtype("<f4")
    sc = scalars.adam_scalars(optirs.AdamParams(amsgrad=True), 3, decoupled=False)
    value = np.array(tuple(sc), rec)
    assert value["amsgrad"] == 1 and value["step_size"] == sc.step_size


def test_allocation_beyond_the_device_is_a_memory_error(ctx):
    backend = optirs.get_backend("opencl")
    huge = int(ctx.device.max_mem_alloc_size) // 4 + 1
    with pytest.raises(DeviceMemoryError, match=str(huge * 4)):
        backend.alloc(backend.ctx, huge, np.float32, 0.0)
    small = backend.alloc(backend.ctx, 5, np.float32, 0.25)
    np.testing.assert_array_equal(backend.to_host(backend.ctx, small), np.full(5, 0.25, np.float32))


# ---------------------------------------------------------------- devices


def test_probe_describes_the_device():
    (first, *_others) = _STATUS.devices
    assert first.details["selected"] is True
    assert first.compute_units > 0 and first.memory_bytes > 0
    assert first.details["max_work_group_size"] >= 1 and first.details["platform"]


def _real_pairs():
    return [(pi, p, di, d) for pi, p in enumerate(cl.get_platforms()) for di, d in enumerate(p.get_devices())]


def test_select_by_index_and_name():
    pi, p, di, d = _real_pairs()[-1]
    plat, dev, _ = ocl.select_device({"platform": pi, "device": di})
    assert plat == p and dev == d
    # Name substrings, case-insensitive: the first device of the platform whose name matches.
    part = d.name.strip()[-5:].lower()
    want = next(x for x in p.get_devices() if part in x.name.lower())
    plat, dev, _ = ocl.select_device({"platform": p.name.strip().upper()[:6], "device": part})
    assert plat == p and dev == want
    backend = optirs.get_backend("opencl", platform=pi, device=di)
    assert backend.ctx.device == d


@pytest.mark.parametrize("opts,message", [
    ({"device": 99}, "out of range"),
    ({"device": "no-such-device"}, "matches none"),
    ({"platform": "no-such-platform"}, "matches none"),
    ({"device": 1.5}, "expected an index or"),
])
def test_bad_choice_is_unavailable_with_reason(opts, message):
    with pytest.raises(BackendUnavailableError, match=message):
        optirs.get_backend("opencl", **opts)


def test_pyopencl_ctx_is_honoured_when_no_option_is_given(monkeypatch):
    pi, p, di, d = _real_pairs()[-1]
    monkeypatch.setenv("PYOPENCL_CTX", f"{pi}:{di}")
    plat, dev, _ = ocl.select_device({})
    assert (plat, dev) == (p, d)
    monkeypatch.setenv("PYOPENCL_CTX", f"{pi}:no-such-device")
    from optirs.backends.opencl.context import _NoDevice

    with pytest.raises(_NoDevice, match="PYOPENCL_CTX"):
        ocl.select_device({})
    plat, dev, _ = ocl.select_device({"platform": pi, "device": di})  # options win over the variable
    assert dev == d


class _FakeDevice:
    def __init__(self, name, kind):
        self.name, self.type = name, kind


class _FakePlatform:
    def __init__(self, name, devices):
        self.name, self._devices = name, devices

    def get_devices(self):
        return self._devices


def test_default_prefers_a_gpu(monkeypatch):
    cpu = _FakeDevice("Some CPU", cl.device_type.CPU)
    gpu = _FakeDevice("Some GPU", cl.device_type.GPU)
    monkeypatch.delenv("PYOPENCL_CTX", raising=False)
    monkeypatch.setattr(cl, "get_platforms", lambda: [_FakePlatform("Portable", [cpu]), _FakePlatform("Vendor", [gpu])])
    assert ocl.select_device({})[1] is gpu
    assert ocl.select_device({"device": "cpu"})[1] is cpu
    assert ocl.select_device({"device": 0})[1] is cpu  # an index counts over all platforms' devices
    assert ocl.select_device({"platform": "vendor", "device": 0})[1] is gpu


def test_probe_without_pyopencl_says_how_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pyopencl", None)  # makes "import pyopencl" raise ImportError
    result = ocl.plugin.optirs_probe({})
    assert not result.available and "pip install 'optirs[opencl]'" in result.reason
    with pytest.raises(BackendUnavailableError, match="needs pyopencl"):
        ocl.plugin.optirs_open({})
