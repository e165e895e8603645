"""CUDA-specific behaviour: in-place device arrays, the real compiler (PTX for sm_90), memory errors.

The optimizer-vs-reference tests of every backend live in test_optimizers.py. Here:

* on a machine without a GPU, every kernel is compiled to PTX for sm_90 (the normal pass);
* under ``NUMBA_ENABLE_CUDASIM=1`` (``pytest -m cuda``) the backend runs in numba's simulator with
  tiny arrays: both kernel paths (16-byte vectors, and scalar for misaligned or tail elements),
  tensors spanning several chunks, device arrays stepped in place;
* on the GPU machine the same tests run against the device, plus torch CUDA tensors.
"""

from __future__ import annotations

import types as pytypes

import numpy as np
import pytest

import optirs
from optirs.core import reference
from optirs.core.errors import DeviceMemoryError, InvalidParameterError
from optirs.core.layout import TensorLayout
from optirs.optim.optimizers import OPTIMIZERS

from conftest import backend_step, SIMULATOR

pytestmark = pytest.mark.cuda

CASES = {
    "adam": optirs.AdamParams(lr=3e-3, weight_decay=0.05, amsgrad=True),
    "adamw": optirs.AdamParams(lr=1e-2, weight_decay=0.1),
    "sgd": optirs.SgdParams(lr=0.01, momentum=0.9, nesterov=True, weight_decay=0.01),
    "rmsprop": optirs.RmspropParams(lr=1e-3, alpha=0.9, momentum=0.5, centered=True),
    "adagrad": optirs.AdagradParams(lr_decay=0.1, initial_accumulator_value=0.5),
    "lamb": optirs.LambParams(lr=1e-2, max_grad_norm=5.0),
}


def _cuda_status():
    return {s.name: s for s in optirs.list_backends()}.get("cuda")


def _cuda_backend():
    status = _cuda_status()
    if status is None or not status.available:
        pytest.skip(f"cuda backend cannot open here: {status.reason if status else 'not installed'}")
    return optirs.get_backend("cuda")


def _close(actual, expected):
    for a, e in zip(actual, expected):
        scale = float(np.max(np.abs(e))) or 1.0
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5 * scale)


# ------------------------------------------------------------------ probe


def test_probe_says_why_or_lists_devices():
    status = _cuda_status()
    assert status is not None
    if SIMULATOR:
        assert status.available and status.devices[0].kind == "simulator"
    elif status.available:
        d = status.devices[0]
        assert d.kind == "gpu" and d.memory_bytes > 0 and d.compute_units > 0
        assert "compute_capability" in d.details
    else:
        assert status.reason.startswith("no CUDA GPU") or "numba-cuda" in status.reason
        with pytest.raises(optirs.BackendUnavailableError, match="cuda"):
            optirs.get_backend("cuda")


# ------------------------------------------------------------------ the real compiler


def _signatures():
    import numba
    from numba import types

    from optirs.core import params as P
    from optirs.core import scalars as S
    from optirs.backends.cuda import kernels as K

    i64, table, acc = types.int64, types.int64[:, ::1], types.float64[:, ::1]
    from optirs.core.definitions import DEFINITIONS

    # one scalars record per elementwise kernel family, from its definition
    step_sc = {d.kernel: d.scalars(d.examples[0], 1) for d in DEFINITIONS.values() if d.pointwise}
    lamb_sc = numba.typeof(S.lamb_scalars(P.LambParams(), 1))
    for name, fn in K.STEP_FUNCTIONS.items():
        yield name, fn, (table, table, i64, i64, i64, i64, i64, i64, i64, numba.typeof(step_sc[name]))
    for name, fn in K.LAMB_FUNCTIONS.items():
        head = (table, table, i64, acc, i64, i64) if name == "grad_norm" else (table, table, i64, i64, i64, acc, i64, i64)
        yield f"lamb_{name}", fn, head + (lamb_sc,)


@pytest.mark.skipif(SIMULATOR, reason="the simulator has no compiler; the normal pass compiles PTX")
def test_every_kernel_compiles_to_ptx_for_sm90(monkeypatch):
    from numba import cuda
    import numba.cuda.dispatcher as dispatcher

    if not cuda.is_available():
        # numba-cuda compiles @njit helpers as device functions for the *current* device's compute
        # capability; without a GPU, name the target that compile_ptx is asked for.
        monkeypatch.setattr(dispatcher, "get_current_device",
                            lambda: pytypes.SimpleNamespace(compute_capability=(9, 0)))
    compiled = {}
    for name, fn, sig in _signatures():
        ptx, _ = cuda.compile_ptx(fn, sig, cc=(9, 0))
        assert ".target sm_90" in ptx
        compiled[name] = ptx
    more = ("nadam", "radam", "adamax", "adadelta", "asgd", "rprop")  # the rest of torch.optim's elementwise ones
    for name in ("adam", "sgd", "rmsprop", "adagrad", "lamb_moments", "lamb_apply") + more:
        # 16-byte vector loads and stores: what takes a memory-bound step to copy bandwidth
        assert "ld.global.v4.f32" in compiled[name] and "st.global.v4.f32" in compiled[name], name
    for name in ("adam", "sgd", "rmsprop", "adagrad") + more:
        # float32 kernels keep float32 arithmetic (no silent float64 promotion)
        assert ".f64" not in compiled[name], name
    for name in ("adam", "rmsprop", "adagrad", "nadam", "radam", "adadelta"):
        # IEEE division and square root, not the approximate instructions
        assert "div.rn.f32" in compiled[name] and "sqrt.rn.f32" in compiled[name], name
        assert "div.approx" not in compiled[name] and "sqrt.approx" not in compiled[name], name


# ------------------------------------------------------------------ kernels against the reference


def _run_hooks(backend, name, hp, host_params, host_grads, as_device):
    """Step through the backend's hooks directly (device arrays need no optimizer support)."""
    from numba import cuda

    opt = OPTIMIZERS[name](hp)
    layout = TensorLayout([p.shape for p in host_params])
    state = {k: backend.alloc(backend.ctx, layout.total, np.float32, float(v)) for k, v in opt.state_slots(hp).items()}
    if as_device:
        # The last tensor is a view one element into a larger allocation: its address is not 16-byte
        # aligned, so it must take the scalar path (a vector access there faults on the GPU).
        params = [cuda.to_device(p.reshape(-1)) for p in host_params[:-1]]
        padded = cuda.to_device(np.concatenate([np.zeros(1, np.float32), host_params[-1].reshape(-1)]))
        params.append(padded[1:])
    else:
        params = [p.copy() for p in host_params]
    for t, gs in enumerate(host_grads, start=1):
        grads = [cuda.to_device(g.reshape(-1)) for g in gs] if as_device else gs
        staged = backend.stage(backend.ctx, params, grads, None)
        if as_device:
            assert staged.finish is None and all(a is b for a, b in zip(staged.params, params))
        backend_step(backend, name, staged.params, staged.grads, state, layout, opt.step_scalars(t), step=t)
        if staged.finish is not None:
            staged.finish()
    out = [p.copy_to_host().reshape(h.shape) for p, h in zip(params, host_params)] if as_device else params
    return out, {k: backend.to_host(backend.ctx, v) for k, v in state.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_device_arrays_stepped_in_place_over_both_kernel_paths(name, rng, monkeypatch):
    """Tensors spanning several chunks, at 16-byte aligned and misaligned offsets, given as device arrays."""
    from optirs.backends.cuda import kernels as cuda_kernels

    backend = _cuda_backend()
    # Any host staging would be a copy: fail loudly if the device path tried it.
    monkeypatch.setattr(backend.ctx, "staging", lambda *a: pytest.fail("device arrays were staged through the host"))
    chunk = cuda_kernels.CHUNK
    shapes = [(chunk + 7,), (3,), (2, 5), (chunk // 2 + 1,)]
    params = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(3)]
    expected, expected_state = reference.run(name, params, grads, CASES[name])
    actual, state = _run_hooks(backend, name, CASES[name], params, grads, as_device=True)
    _close(actual, expected)
    layout = TensorLayout(shapes)
    for k, flat in state.items():
        _close([v for v in layout.views(flat)], [s[k] for s in expected_state])


def test_optimizer_accepts_device_arrays(rng):
    """Through the public API: a numba device array is updated in place (arrays.describe must know it)."""
    from numba import cuda

    from optirs.core.arrays import describe

    _cuda_backend()
    host = rng.standard_normal(37).astype(np.float32)
    param = cuda.to_device(host)
    try:
        describe(param)
    except InvalidParameterError as exc:
        pytest.skip(f"optirs.core.arrays.describe does not accept this device array kind yet: {exc}")
    grads = [[rng.standard_normal(37).astype(np.float32)] for _ in range(3)]
    expected, _ = reference.run("adam", [host], grads, optirs.AdamParams())
    opt = optirs.GpuAdam(optirs.AdamParams(), optirs.GpuOptimizerConfig(backend="cuda"))
    for (g,) in grads:
        opt.step_gpu(param, cuda.to_device(g))
    _close([param.copy_to_host()], expected)


def test_dropped_device_arrays_are_not_kept_by_the_backend(rng):
    """An optimizer and the device arrays it stepped, dropped, leave nothing of theirs alive in the
    backend's caches (its address cache held each list of arrays until 16 later lists pushed it
    out: a process stepping one large model after another ran out of device memory); a list that
    lives on keeps its cached addresses."""
    import gc
    import weakref

    from numba import cuda

    backend = _cuda_backend()
    kept = [cuda.to_device(rng.standard_normal(40).astype(np.float32))]
    gc.collect()
    gc.disable()
    try:
        params = [cuda.to_device(rng.standard_normal(n).astype(np.float32)) for n in (37, 300)]
        opt = optirs.GpuAdamW(optirs.AdamParams(), optirs.GpuOptimizerConfig(backend="cuda"))
        for _ in range(2):
            opt.step_gpu(params, [cuda.to_device(rng.standard_normal(p.shape).astype(np.float32)) for p in params])
        before = len(backend.ctx._address_cache)
        first = backend.ctx.addresses(kept, "params")
        assert len(backend.ctx._address_cache) == before + 1
        held = [weakref.ref(p) for p in params]
        del opt, params
        assert [r for r in held if r() is not None] == []
        after = len(backend.ctx._address_cache)
        assert after <= before  # the params' entry went with them (the kept list's came)
        assert backend.ctx.addresses(kept, "params") == first
        assert len(backend.ctx._address_cache) == after  # found, not added again
    finally:
        gc.enable()


def test_numpy_inputs_are_written_back_and_launches_cached(rng):
    backend = _cuda_backend()
    shapes = [(9, 4), (5,), (130,)]
    params = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(4)]
    expected, _ = reference.run("adagrad", params, grads, CASES["adagrad"])
    opt = optirs.GpuAdagrad(CASES["adagrad"], optirs.GpuOptimizerConfig(backend="cuda"))
    opt.step_gpu(params, grads[0])
    prepared = len(backend.ctx._launches)
    for g in grads[1:]:
        opt.step_gpu(params, g)
    assert len(backend.ctx._launches) == prepared  # later steps reuse the marshalled launch
    _close(params, expected)


def test_mixed_or_foreign_arrays_are_rejected_before_anything_changes(rng):
    from numba import cuda

    backend = _cuda_backend()
    host = np.ones(8, np.float32)
    with pytest.raises(InvalidParameterError, match="mix numpy and device"):
        backend.stage(backend.ctx, [host], [cuda.to_device(host)], None)
    with pytest.raises(InvalidParameterError, match=r"params\[0\] is a builtins.list"):
        backend.stage(backend.ctx, [[1.0]], [[1.0]], None)


# ------------------------------------------------------------------ memory errors


def _fake_oom(*args, **kwargs):
    from numba.cuda.cudadrv.driver import CudaAPIError

    raise CudaAPIError(2, "Call to cuMemAlloc results in CUDA_ERROR_OUT_OF_MEMORY")


def test_out_of_memory_raises_with_sizes_and_changes_nothing(rng, monkeypatch):
    backend = _cuda_backend()
    params = [rng.standard_normal(11).astype(np.float32)]
    before = params[0].copy()
    opt = optirs.GpuAdam(optirs.AdamParams(), optirs.GpuOptimizerConfig(backend="cuda"))
    monkeypatch.setattr(backend.ctx, "device_array", _fake_oom)
    with pytest.raises(DeviceMemoryError, match=r"could not allocate 44 bytes .*11 x float32.*free"):
        opt.step_gpu(params, [np.ones(11, np.float32)])
    np.testing.assert_array_equal(params[0], before)
    assert opt.step_count == 0 and opt.state_dict()["state"] == []


def test_out_of_memory_when_state_returns_to_the_device(rng, monkeypatch):
    backend = _cuda_backend()
    params = [rng.standard_normal(6).astype(np.float32)]
    opt = optirs.GpuAdam(optirs.AdamParams(), optirs.GpuOptimizerConfig(backend="cuda"))
    opt.step_gpu(params, [np.ones(6, np.float32)])
    opt.move_to_cpu()
    saved, before = opt.state_dict(), params[0].copy()
    monkeypatch.setattr(backend.ctx, "device_array", _fake_oom)
    with pytest.raises(DeviceMemoryError, match="free"):
        opt.step_gpu(params, [np.ones(6, np.float32)])
    monkeypatch.undo()
    np.testing.assert_array_equal(params[0], before)
    assert not opt.state_on_device and opt.step_count == 1
    after = opt.state_dict()
    for k in saved["state"][0]:
        np.testing.assert_array_equal(after["state"][0][k], saved["state"][0][k])


# ------------------------------------------------------------------ torch on the GPU machine


def test_torch_cuda_tensors_stepped_in_place(rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or SIMULATOR:
        pytest.skip("torch.cuda is not available here")
    _cuda_backend()
    shapes = [(64, 33), (7,), (4097,)]
    host = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(4)]
    expected, _ = reference.run("adamw", host, grads, CASES["adamw"])
    params = [torch.from_numpy(h.copy()).cuda() for h in host]
    pointers = [p.data_ptr() for p in params]
    opt = optirs.GpuAdamW(CASES["adamw"], optirs.GpuOptimizerConfig(backend="cuda"))
    for gs in grads:
        opt.step_gpu(params, [torch.from_numpy(g).cuda() for g in gs])
    torch.cuda.synchronize()
    assert [p.data_ptr() for p in params] == pointers
    _close([p.cpu().numpy() for p in params], expected)


def test_torch_tensor_with_swapped_storage_is_followed(rng):
    """``tensor.data = ...`` keeps the tensor object but moves its memory: the step must follow it."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or SIMULATOR:
        pytest.skip("torch.cuda is not available here")
    _cuda_backend()
    host = rng.standard_normal(1000).astype(np.float32)
    g = torch.ones(1000, device="cuda")
    p = torch.from_numpy(host.copy()).cuda()
    hp = optirs.SgdParams(lr=0.5)
    opt = optirs.GpuSgd(hp, optirs.GpuOptimizerConfig(backend="cuda"))
    opt.step_gpu([p], [g])
    old = p.data
    p.data = torch.from_numpy(host.copy()).cuda()  # new storage, same object
    opt.step_gpu([p], [g])
    torch.cuda.synchronize()
    np.testing.assert_allclose(p.cpu().numpy(), host - 0.5, rtol=1e-6)  # stepped once, in the new storage
    np.testing.assert_allclose(old.cpu().numpy(), host - 0.5, rtol=1e-6)  # the old one not again


# ------------------------------------------------------------------ the benchmark harness


def test_bench_checks_and_times_the_cuda_backend(tmp_path):
    """``optirs bench`` on this backend (tiny sizes): the reference check passes and every time is positive."""
    import json

    from optirs.tools import bench

    _cuda_backend()
    out = tmp_path / "bench.json"
    argv = ["--backends", "cuda", "--cases", "flat", "--optimizers", "adam,lamb", "--size-scale", "1e-6",
            "--reps", "1", "--repeats", "1", "--warmup", "0", "--no-torch", "--json", str(out)]
    assert bench.main(argv) == 0
    report = json.loads(out.read_text())
    assert set(report["checks"]) == {"cuda/adam", "cuda/lamb"}
    assert all(v.startswith("ok") for v in report["checks"].values())
    rows = [r for r in report["rows"] if r["impl"] == "optirs"]
    assert [r["optimizer"] for r in rows] == ["adam", "lamb"]
    for r in rows:
        assert r["ms"] > 0 and r["kernel_ms"] > 0 and r["elements"] == bench.case_sizes("flat", 1e-6)[0]
        assert r["gbps"] == pytest.approx(bench.BYTES_PER_ELEMENT[r["optimizer"]] * r["elements"] / r["kernel_ms"] / 1e6)
    assert report["copy_gbps"]["cuda/flat"] > 0  # measured per backend and case


def test_bench_rejects_unknown_names():
    from optirs.tools import bench

    with pytest.raises(SystemExit) as exc:
        bench.main(["--optimizers", "adamx"])
    assert exc.value.code == 2
