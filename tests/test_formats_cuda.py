"""The cuda backend's formats kernels: PTX for the H200 (sm_90) without a GPU, and the simulator
against the float64 reference of a format step (optirs.core.reference).

Normal pass: every formats kernel compiles for sm_90 with 16-byte vector loads, no float64, no
local-memory arrays (the 8 elements of a lane stay in registers) and, for int8 state, the block
absmax by warp shuffles. Simulator pass (``NUMBA_ENABLE_CUDASIM=1 pytest -m cuda``): the hooks
against the reference on tiny models (the simulator runs every thread in Python). The every-backend
comparison of each format is tests/test_formats.py.
"""

from __future__ import annotations

import dataclasses
import re

import os
import types as pytypes

import ml_dtypes
import numpy as np
import pytest
from numba import cuda

from optirs.core import reference as R
from optirs.core.definitions import DEFINITIONS
from optirs.core.errors import InvalidParameterError
from optirs.core.formats import FormatState, StepFormat
from optirs.core.layout import TensorLayout
from optirs.plugin.hookspecs import StepControls, StepRequest

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
HOST = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _fmt(pdt, master, state, stochastic=False, gdt=None):
    return StepFormat(pdt, gdt or pdt, master, state, stochastic)


# (family's definition, format): every master and state with Adam, each other family once.
PTX_CASES = [("adamw", _fmt("bfloat16", m, "int8")) for m in (None, "float32", "remainder16", "remainder8")] + [
    ("adamw", _fmt("bfloat16", "remainder8", "bfloat16")),
    ("adamw", _fmt("bfloat16", None, "float32", stochastic=True)),
    ("adamw", _fmt("float16", "float32", "float32", gdt="float32")),
    ("adamw", _fmt("float32", None, "int8")),
    ("sgd", _fmt("bfloat16", "remainder16", "int8")),
    ("rmsprop", _fmt("bfloat16", "remainder8", "int8")),
    ("adagrad", _fmt("bfloat16", "float32", "bfloat16")),
    ("lion", _fmt("bfloat16", "remainder8", "int8")),
    ("nadam", _fmt("bfloat16", "float32", "int8")),
    ("radam", _fmt("bfloat16", "remainder16", "bfloat16")),
    ("adamax", _fmt("bfloat16", None, "int8")),
    ("adadelta", _fmt("float32", None, "bfloat16")),
    ("asgd", _fmt("bfloat16", "remainder8", "int8")),
    ("rprop", _fmt("bfloat16", "float32", "bfloat16")),
    ("adamw", _fmt("bfloat16", "remainder8", "int8_sqrt")),
    ("rmsprop", _fmt("float32", None, "int8_sqrt")),
    ("adamw", _fmt("bfloat16", "remainder8", "float8_e4m3fn")),
    ("adamw", _fmt("float32", None, "float8_e4m3fn")),
    ("lion", _fmt("bfloat16", None, "float8_e4m3fn", stochastic=True)),
]


@pytest.fixture
def sm90(monkeypatch):
    """numba-cuda compiles @njit helpers for the current device's compute capability: name sm_90."""
    import numba.cuda.dispatcher as dispatcher

    monkeypatch.setattr(dispatcher, "get_current_device", lambda: pytypes.SimpleNamespace(compute_capability=(9, 0)))


@pytest.mark.skipif(SIMULATOR, reason="compiles real PTX; the simulator has no compiler")
def test_the_measurement_build_compiles_its_full_round_alone(sm90):
    """make_step_kernel(hot=True), what benchmarks/cuda_sass_rounds.py --hot reads: the full round
    alone (no general round: none of its byte-wide tail accesses) for a format whose kernel keeps a
    general round beside it."""
    from numba import cuda

    from optirs.backends.cuda import formats_kernels as fk

    d = DEFINITIONS["adamw"]
    fmt = _fmt("bfloat16", "remainder8", "float8_e4m3fn")
    sig = fk.step_kernel_signature(d.scalars(d.examples[0], 3))
    kernels = [fk.make_step_kernel(d.kernel, fmt.codes, (True, False, False), 3, hot=hot) for hot in (False, True)]
    main, hot = (cuda.compile_ptx(k, sig, cc=(9, 0))[0] for k in kernels)
    assert "cvt.rn.satfinite.e4m3x2.f32" in hot and "st.global.v2.u32" in hot
    assert "st.global.u8" in main and "st.global.u8" not in hot


@pytest.mark.skipif(SIMULATOR, reason="compiles real PTX; the simulator has no compiler")
def test_the_claiming_build_compiles_its_counter(sm90):
    """make_step_kernel's default build takes its chunks by 64-bit atomic adds on the table's last
    row, the blocks in step at each chunk, nothing spilled; claim=False (each block every grid-th
    chunk, OPTIRS_CUDA_FORMATS_CLAIM=0) has no atomic."""
    from numba import cuda

    from optirs.backends.cuda import formats_kernels as fk

    d = DEFINITIONS["adamw"]
    fmt = _fmt("bfloat16", "remainder8", "float8_e4m3fn")
    sig = fk.step_kernel_signature(d.scalars(d.examples[0], 3))
    claimed, dealt = (cuda.compile_ptx(fk.make_step_kernel(d.kernel, fmt.codes, (True, False, False), 3, claim=c), sig,
                                       cc=(9, 0))[0] for c in (True, False))
    assert "atom.global.add.u64" in claimed and "bar.sync" in claimed and "membar" in claimed
    assert ".local" not in claimed and ".local" not in dealt and "atom.global.add.u64" not in dealt


@pytest.mark.skipif(SIMULATOR, reason="compiles real PTX; the simulator has no compiler")
def test_the_approximate_build_compiles_the_approximate_operations(sm90):
    """make_step_kernel(approx=True) (OPTIRS_CUDA_FORMATS_APPROX=1, tuning): Adam's root and quotient
    are ``sqrt.approx`` and ``div.approx``, while the int8_sqrt codes keep their IEEE roots (the
    encodings are the contract's)."""
    from numba import cuda

    from optirs.backends.cuda import formats_kernels as fk

    d = DEFINITIONS["adamw"]
    fmt = _fmt("float32", None, "int8_sqrt")
    sig = fk.step_kernel_signature(d.scalars(d.examples[0], 3))
    ptx = cuda.compile_ptx(fk.make_step_kernel(d.kernel, fmt.codes, (True, False, False), 3, approx=True), sig,
                           cc=(9, 0))[0]
    assert "sqrt.approx.ftz.f32" in ptx and "div.approx.ftz.f32" in ptx and "rsqrt.approx.ftz.f32" in ptx


def _shared_maps(ptx: str) -> bool:
    """Whether ``ptx`` reads or writes shared memory other than 64-bit words (the claimed chunk)."""
    return re.search(r"(ld|st)\.shared\.(?!u64)", ptx) is not None


@pytest.mark.skipif(SIMULATOR, reason="compiles real PTX; the simulator has no compiler")
@pytest.mark.parametrize("name,fmt", PTX_CASES, ids=lambda x: x if isinstance(x, str) else "-".join(map(str, x.codes)))
def test_step_kernels_compile_to_sm90_ptx(sm90, name, fmt):
    from numba import cuda

    from optirs.backends.cuda import formats_kernels as fk

    d = DEFINITIONS[name]
    sig = fk.step_kernel_signature(d.scalars(d.examples[0], 3))
    kernel = fk.make_step_kernel(d.kernel, fmt.codes, tuple(s.signed for s in d.slots), (1 << len(d.slots)) - 1)
    ptx, _ = cuda.compile_ptx(kernel, sig, cc=(9, 0))
    assert ".target sm_90" in ptx
    assert "ld.global.v4.u32" in ptx and "st.global.v4.u32" in ptx  # 8 x 16-bit (or 4 x 32-bit) per access
    assert ".f64" not in ptx, "the format step computes in float64"
    assert ".local" not in ptx, "a lane's 8 elements spilled to local memory"
    if fmt.state_dtype in ("int8", "int8_sqrt", "float8_e4m3fn"):
        # the block absmax in registers: one redux.sync (sm_80 on) or five shuffles
        assert ("redux.sync.max.u32" if fk.REDUX else "shfl.sync.bfly") in ptx
        assert "ld.global.v2.u32" in ptx and "st.global.v2.u32" in ptx  # 8 one-byte codes per access
    if fmt.state_dtype == "float8_e4m3fn":
        # no maps in shared memory (its one 64-bit word is the claimed chunk): pairs of codes
        # converted by the hardware (sm_89 on) both ways
        assert not _shared_maps(ptx)
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "cvt.rn.f16x2.e4m3x2" in ptx and "cvt.f32.f16" in ptx
    if fmt.state_dtype == "int8_sqrt":
        # codes by arithmetic: no maps in shared memory, and no integer <-> float conversion (the
        # codes and their values by float bits: a conversion runs on the narrow conversion pipe)
        assert not _shared_maps(ptx)
        assert not re.search(r"cvt\.r[nz]i?\.(f32\.[su](8|16|32)|[su]32\.f32)", ptx)
        # a root times k is rounded before the rounding add (the contract rounds twice): no operand
        # of that add (through the moves that merge paths) is a plain product, which ptxas fuses with it
        defs: dict = {}
        for op, reg, args in re.findall(r"^\s*(\S+)\s+(%f\d+),\s*([^;]*);", ptx, re.M):
            defs.setdefault(reg, []).append((op, args))

        def sources(reg, depth=0):
            for op, args in defs.get(reg, []):
                if op.startswith("mov.") and args.startswith("%f") and depth < 4:
                    yield from sources(args, depth + 1)
                else:
                    yield op

        adds = re.findall(r"add\.f32\s+%f\d+, (%f\d+), 0f4B400000;", ptx)
        ops = {op for r in adds for op in sources(r)}
        assert adds and "mul.rn.f32" in ops and not {op for op in ops if op.startswith("mul.") and op != "mul.rn.f32"}


@pytest.mark.skipif(SIMULATOR, reason="compiles real PTX; the simulator has no compiler")
@pytest.mark.parametrize("mode", ["lamb_norms", "lamb_apply"])
@pytest.mark.parametrize("fmt", [_fmt("bfloat16", "remainder8", "int8"), _fmt("bfloat16", "float32", "float32"),
                                 _fmt("float32", None, "int8_sqrt"), _fmt("bfloat16", "remainder8", "float8_e4m3fn")],
                         ids=lambda f: "-".join(map(str, f.codes)))
def test_lamb_kernels_compile_to_sm90_ptx(sm90, mode, fmt):
    from numba import cuda, types, typeof

    from optirs.backends.cuda import formats_kernels as fk

    d = DEFINITIONS["lamb"]
    sc = d.scalars(d.examples[0], 3)
    table = types.int64[:, ::1]
    sig = (table, table, table, types.int64, types.float32[:, ::1], types.uint8[:, ::1], types.int64,
           types.UniTuple(types.int64, 9), types.float64[:, ::1], types.int64, types.int64,
           types.int64, types.int64, types.int64, typeof(sc))
    kernel = fk.make_step_kernel("lamb", fmt.codes, tuple(s.signed for s in d.slots), 3, mode)
    ptx, _ = cuda.compile_ptx(kernel, sig, cc=(9, 0))
    assert ".target sm_90" in ptx and "ld.global.v4.u32" in ptx
    assert ".local" not in ptx, "a lane's 8 elements spilled to local memory"
    if mode == "lamb_norms":
        assert "atom.global.add.f64" in ptx and "st.global.v4.u32" not in ptx  # sums only: nothing else written
    else:
        assert "st.global.v4.u32" in ptx
        if fmt.state_dtype != "float32":
            assert ("redux.sync.max.u32" if fk.REDUX else "shfl.sync.bfly") in ptx
        if fmt.state_dtype == "float8_e4m3fn":
            assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    if fmt.state_dtype == "float8_e4m3fn":  # both passes decode the moments
        assert "cvt.rn.f16x2.e4m3x2" in ptx
    grad = fk.make_lamb_grad_kernel(fmt.grad_dtype)
    ptx, _ = cuda.compile_ptx(grad, (table, table, types.int64, types.float64[:, ::1], types.int64, types.int64,
                                     types.int64, typeof(sc)), cc=(9, 0))
    assert "atom.global.add.f64" in ptx


@pytest.mark.skipif(SIMULATOR, reason="compiles real PTX; the simulator has no compiler")
@pytest.mark.parametrize("gdt", ["float32", "bfloat16", "float16"])
def test_check_kernel_compiles_to_sm90_ptx(sm90, gdt):
    from numba import cuda, types

    from optirs.backends.cuda import formats_kernels as fk

    table = types.int64[:, ::1]
    ptx, _ = cuda.compile_ptx(fk.make_check_kernel(gdt), (table, table, types.int64, types.UniTuple(types.int64, 1)),
                              cc=(9, 0))
    assert ".target sm_90" in ptx and "ld.global.v4.u32" in ptx and ".f64" not in ptx


# ------------------------------------------------------------------ the simulator against the reference


def _cuda():
    import optirs

    status = {s.name: s for s in optirs.list_backends()}.get("cuda")
    if status is None or not status.available:
        pytest.skip(f"the cuda backend cannot open here: {getattr(status, 'reason', 'not installed')}")
    from numba import cuda

    from optirs.backends.cuda import plugin

    return plugin, plugin.optirs_open({}), cuda


def _bits(a):
    return a if a.dtype == np.float32 else a.view(np.uint16)


def _run(name, fmt, shapes, steps, seed=5, found=None, hp=None, cpu=False, state_grad_dtype=None, grads=None,
         params=None):
    """Steps through the hooks on numpy inputs; returns (params, buffers) after each step beside the
    reference's from the same inputs (``cpu``: beside the cpu backend's hooks' instead; ``grads``:
    a function of the step's random gradients that returns the gradients to step with; ``params``:
    likewise of the first step's parameters).
    ``state_grad_dtype``: the hook's FormatState made for gradients of this dtype (the state's
    buffers depend on the storage only; optirs.torch makes one for float32 gradients)."""
    plugin, ctx, cuda = _cuda()
    edit, edit_params = grads, params
    d = DEFINITIONS[name]
    hp = hp if hp is not None else d.examples[0]
    layout = TensorLayout(shapes)
    fs = FormatState(layout, [s for s in d.slots if s.needed(hp)], fmt)
    host = R.fresh_buffers(fs, d, hp)
    state = {k: cuda.to_device(v if v.size else np.zeros(1, v.dtype)) for k, v in host.items()}
    rng = np.random.default_rng(3)
    params = [rng.standard_normal(s).astype(HOST[fmt.param_dtype]) for s in shapes]
    if edit_params is not None:
        params = edit_params(params)
    out = []
    for step in range(1, steps + 1):
        grads = [rng.standard_normal(s).astype(HOST[fmt.grad_dtype]) for s in shapes]
        if edit is not None:
            grads = edit(grads)
        if cpu:
            want_p, want_b = _cpu_step(d, hp, fs, layout, fmt, params, grads, host, seed, step)
        else:
            want_p, want_b = R.format_step(d, hp, fs, [_bits(p).copy() for p in params], [_bits(g) for g in grads], host,
                                    seed, step)
        flag = found[step - 1] if isinstance(found, list) else found
        if flag is not None and isinstance(found, list):  # a skipped step: the reference is "nothing changes"
            want_p, want_b = [_bits(p).reshape(-1).copy() for p in params], {k: v.copy() for k, v in host.items()}
        staged = plugin.optirs_stage(ctx, params, grads, fmt)
        hook_fs = fs if state_grad_dtype is None else FormatState(
            layout, fs.slots, dataclasses.replace(fmt, grad_dtype=state_grad_dtype))
        plugin.optirs_step(ctx, StepRequest(d, staged.params, staged.grads, state, layout, d.scalars(hp, step),
                                            StepControls(step, seed, flag), fmt, hook_fs))
        staged.finish()
        got_b = {k: state[k].copy_to_host()[: v.size] for k, v in host.items()}
        out.append(([_bits(p).reshape(-1).copy() for p in params], got_b, [np.asarray(w).reshape(-1) for w in want_p],
                    want_b, fs))
        host = {k: v.copy() for k, v in got_b.items()}  # the next step starts from the kernel's state
    return out


def _cpu_step(d, hp, fs, layout, fmt, params, grads, host, seed, step):
    """One step of the cpu backend's formats hooks on copies of the same inputs."""
    import optirs

    b = optirs.get_backend("cpu")
    ps = [p.copy() for p in params]
    state = {k: v.copy() for k, v in host.items()}
    staged = b.stage(b.ctx, ps, list(grads), fmt)
    b.step(b.ctx, StepRequest(d, staged.params, staged.grads, state, layout, d.scalars(hp, step),
                              StepControls(step, seed), fmt, fs))
    return [_bits(p) for p in ps], state


def _master(fs, words, buffers):
    return np.concatenate(R.decode_master(fs, words, buffers))


def _assert_close(step_result, master_atol=1e-12, state_rel=0.0):
    """Parameters and buffers as the reference's, up to the float32 step's own rounding (an ulp of the
    master before encoding: one 16-bit step of the parameter, one int8 code). ``master_atol``: the
    float32 rounding of an update much larger than the master it moves (LAMB's lr * ratio * u near
    a zero crossing); ``state_rel``: float32 state within that fraction of the slot's largest value
    (a moment's cancellation near zero, in float32 against the float64 reference)."""
    got_p, got_b, want_p, want_b, fs = step_result
    for g, w in zip(got_p, want_p):
        if g.dtype == np.float32:
            np.testing.assert_allclose(g, w, rtol=2e-6, atol=1e-12)
        else:
            assert np.abs(g.astype(np.int64) - w.astype(np.int64)).max() <= 1
    if fs.master_buffer() is not None:
        # one ulp of the master's own precision: float32 (2**-23), or 24 bits for remainder8 (2**-15)
        rtol = 2.0**-15 if fs.fmt.master == "remainder8" else 2.0**-22
        np.testing.assert_allclose(_master(fs, got_p, got_b), _master(fs, want_p, want_b), rtol=rtol,
                                   atol=master_atol)
    for k, w in want_b.items():
        g = got_b[k]
        if k.endswith(".codes"):
            assert np.abs(g.astype(np.int64) - w.astype(np.int64)).max() <= 1, k
        elif g.dtype == np.uint16:  # bfloat16 state words
            assert np.abs(g.astype(np.int64) - w.astype(np.int64)).max() <= 1, k
        elif k != "master_remainder" and k != "master":
            atol = max(1e-12, state_rel * float(np.abs(w).max(initial=0)))
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=atol, err_msg=k)


@pytest.mark.cuda
@pytest.mark.parametrize("name,fmt", [
    ("adamw", _fmt("bfloat16", "remainder16", "bfloat16")),
    ("adamw", _fmt("bfloat16", None, "float32", stochastic=True)),
    ("adamw", _fmt("float16", "float32", "bfloat16", gdt="float32")),
    ("lion", _fmt("bfloat16", "remainder8", "float32")),
    ("sgd", _fmt("float32", None, "bfloat16")),
], ids=lambda x: x if isinstance(x, str) else "-".join(map(str, x.codes)))
def test_step_matches_the_reference(name, fmt):
    # sizes that leave partial lanes and groups, and (37) a tensor whose successor is misaligned.
    # state_rel: a new moment that cancels (Lion's 0.99 m + 0.01 g) carries the float32 rounding of
    # its terms, 1.5e-5 of the result measured on the H200 (whose kernels fuse a multiply and add)
    for result in _run(name, fmt, [(37,), (300,)], steps=2):
        _assert_close(result, state_rel=1e-6)


@pytest.mark.cuda
def test_state_made_for_float32_gradients_steps_16bit_gradients():
    """The torch front end keeps one FormatState per bucket whatever the gradients' dtype: a step
    with bfloat16 gradients on it is the bfloat16-gradient format's step (it was refused on the H200)."""
    fmt = _fmt("bfloat16", "float32", "float32", gdt="bfloat16")
    for result in _run("adamw", fmt, [(300,), (37, 5)], 2, state_grad_dtype="float32"):
        _assert_close(result)
    plugin, ctx, _ = _cuda()
    other = _fmt("bfloat16", "remainder8", "float32", gdt="bfloat16")  # another storage: refused
    d, layout = DEFINITIONS["adamw"], TensorLayout([(4,)])
    with pytest.raises(InvalidParameterError, match="same storage format"):
        plugin.optirs_step(ctx, StepRequest(d, [], [], {}, layout, d.scalars(d.examples[0], 1), StepControls(1), other,
                                            FormatState(layout, (), fmt)))


def _float16_cases(every: int) -> np.ndarray:
    """float32 bit patterns at and beside float16's rounding boundaries (the midpoints between
    neighbouring float16 values, one float32 ulp either side), every ``every``-th float16 value,
    with the specials: signed zeros, float32 subnormals, overflow, inf and NaN payloads."""
    h = np.arange(0, 0x7C00, every, dtype=np.uint16)
    lo = h.view(np.float16).astype(np.float64)
    hi = (h + 1).view(np.float16).astype(np.float64)
    mid = ((lo + hi) / 2).astype(np.float32)  # exact: at most 12 significant bits
    x = np.concatenate([lo.astype(np.float32), mid, np.nextafter(mid, np.float32(np.inf)),
                        np.nextafter(mid, np.float32(0)),
                        np.array([0.0, 1e-40, 65504.0, 65519.996, 65520.0, 1e10, np.inf], np.float32)])
    bits = np.concatenate([x, -x]).view(np.uint32)
    nans = [0x7FC00000, 0x7FFFFFFF, 0xFFC00001]
    if not SIMULATOR:  # the simulator passes values through Python floats, which quiet a signaling NaN
        nans += [0x7F800001, 0x7F802000, 0xFF800001]
    return np.concatenate([bits, np.array(nans, np.uint32)])


@pytest.mark.cuda
def test_float16_conversions_of_the_kernels_are_numpys():
    """float16 in the kernels (on a GPU its cvt instructions, NaN selected apart: one instruction
    where the bit-by-bit form took 10-25) against numpy: the cast to float16 of float32 values at
    every rounding boundary, and every float16 decoded (NaN: the quiet NaN with its sign). The
    simulator runs a sample of them."""
    _cuda()
    from optirs.backends.common.formats import bits_f32, decode16, f16_nearest, f32_bits
    from optirs.core.formats import F16

    def convert(bits, encoded, halves, decoded):  # the module's global ``cuda``: the simulator's per thread
        start, stride = cuda.grid(1), cuda.gridsize(1)
        for k in range(start, bits.size, stride):
            encoded[k] = f16_nearest(bits_f32(bits[k]))
        for k in range(start, halves.size, stride):
            decoded[k] = f32_bits(decode16(halves[k], F16))

    convert = cuda.jit(convert)
    every = 97 if SIMULATOR else 1
    bits = _float16_cases(every)
    halves = np.arange(0, 1 << 16, every, dtype=np.uint32)
    encoded, decoded = np.zeros(bits.size, np.uint32), np.zeros(halves.size, np.uint32)
    convert[4 if SIMULATOR else 256, 32 if SIMULATOR else 256](bits, encoded, halves, decoded)
    with np.errstate(over="ignore", invalid="ignore"):
        want = bits.view(np.float32).astype(np.float16).view(np.uint16).astype(np.uint32)
    assert np.array_equal(encoded, want), bits[encoded != want][:8]
    h = halves.astype(np.uint16)
    nan = (h & 0x7FFF) > 0x7C00
    want = np.where(nan, ((h.astype(np.uint32) & 0x8000) << 16) | 0x7FC00000,
                    h.view(np.float16).astype(np.float32).view(np.uint32))
    assert np.array_equal(decoded, want), halves[decoded != want][:8]




@pytest.mark.cuda
def test_division_by_a_uniform_divisor_is_the_division():
    """Adam's ``sqrt(v) / sqrt(1 - beta2**t)`` with the reciprocal taken once per launch on a GPU
    (optirs.backends.common.division) against the division itself, for the square root of every
    non-negative float32 ``v`` and of inf, NaN and -0 (the simulator: a sample), by the bias
    corrections of several betas and steps, and 1. (Dividends beyond that domain can differ:
    below 2**-100 the correction's residual is subnormal, beyond 2**64 the quotient can overflow;
    no square root of a float32 is there.)"""
    _cuda()
    import math

    from numba import njit

    from optirs.backends.common.division import divide_by_uniform
    from optirs.backends.common.formats import bits_f32, f32_bits

    divide = njit(lambda a, b: divide_by_uniform(a, b))

    def check(b, start_bits, step_bits, count, bad):
        for k in range(cuda.grid(1), count, cuda.gridsize(1)):
            v = np.float32(bits_f32(np.uint32(start_bits + k * step_bits)))  # the simulator's Python floats
            a = np.float32(math.sqrt(v)) if v == v and v >= 0 else v
            if f32_bits(divide(a, np.float32(b))) != f32_bits(np.float32(a) / np.float32(b)):
                cuda.atomic.add(bad, 0, 1)
                bad[1] = start_bits + k * step_bits

    check = cuda.jit(check)
    divisors = [np.sqrt(np.float32(1) - np.float32(b2) ** np.float32(t)) for b2, t in
                [(0.999, 1), (0.999, 2), (0.999, 7), (0.999, 1000), (0.99, 1), (0.95, 3), (0.9999, 1), (0.0, 1)]]
    step = 1 << 21 if SIMULATOR else 1
    count = (0x7F800001 + step - 1) // step  # every v from 0 to inf by ``step``
    for b in divisors + [np.float32(0.7373), np.float32(np.nextafter(np.float32(1), np.float32(0)))]:
        bad = np.zeros(2, np.int64)
        check[4 if SIMULATOR else 1024, 32 if SIMULATOR else 256](np.float32(b), 0, step, count, bad)
        check[1, 32](np.float32(b), 0x7FC00000, 1, 32, bad)  # NaNs
        check[1, 32](np.float32(b), 0x80000000, 1, 1, bad)  # -0
        assert bad[0] == 0, (float(b), hex(int(bad[1])))


@pytest.mark.cuda
@pytest.mark.skipif(SIMULATOR, reason="the fast paths are the GPU's instructions; the simulator runs the cpu's IEEE ones")
def test_fast_square_root_and_division_are_ieee_in_their_windows():
    """optirs.backends.common.fast_paths on the device: sqrt_fast is the square root and rcp_fast the
    reciprocal for every float32 of their windows; div_fast is the division for 2**26 random pairs of its windows (either sign of the
    dividend), and for every dividend of the extreme binades of its window by the extreme divisors."""
    _cuda()
    import math

    from numba import njit

    from optirs.backends.common import fast_paths as fp
    from optirs.backends.common.formats import bits_f32, f32_bits, rand32

    root = njit(lambda x: fp.sqrt_fast(x))
    divide = njit(lambda a, b: fp.div_fast(a, b))
    reciprocal = njit(lambda x: fp.rcp_fast(x))

    def check_sqrt(count, bad):
        for k in range(cuda.grid(1), count, cuda.gridsize(1)):
            x = bits_f32(np.uint32(fp.SQRT_LO + k))
            if f32_bits(root(x)) != f32_bits(math.sqrt(x)):
                cuda.atomic.add(bad, 0, 1)
                bad[1] = fp.SQRT_LO + k

    def check_rcp(count, bad):
        for k in range(cuda.grid(1), count, cuda.gridsize(1)):
            x = bits_f32(np.uint32(fp.RCP_LO + k))
            if f32_bits(reciprocal(x)) != f32_bits(np.float32(1) / x):
                cuda.atomic.add(bad, 0, 1)
                bad[1] = fp.RCP_LO + k

    def check_random(count, bad):
        a_span = np.uint32(fp.DIVIDEND_HI - fp.DIVIDEND_LO + 1)
        b_span = np.uint32(fp.DIVISOR_HI - fp.DIVISOR_LO + 1)
        for k in range(cuda.grid(1), count, cuda.gridsize(1)):
            ra = rand32(np.uint32(0x1234567), np.uint32(k))
            rb = rand32(np.uint32(0x89ABCDE), np.uint32(k))
            a = bits_f32(np.uint32(fp.DIVIDEND_LO + (ra >> np.uint32(1)) % a_span) | ((ra & np.uint32(1)) << np.uint32(31)))
            b = bits_f32(np.uint32(fp.DIVISOR_LO + rb % b_span))
            if f32_bits(divide(a, b)) != f32_bits(a / b):
                cuda.atomic.add(bad, 0, 1)
                bad[1] = k

    def check_edges(b_bits, bad):
        b = bits_f32(np.uint32(b_bits))
        for k in range(cuda.grid(1), 1 << 25, cuda.gridsize(1)):
            low = np.uint32(k & 0x7FFFFF)
            mag = fp.DIVIDEND_LO + low if (k & 0x800000) == 0 else fp.DIVIDEND_HI - low
            a = bits_f32(np.uint32(mag | ((k >> 24) << 31)))
            if f32_bits(divide(a, b)) != f32_bits(a / b):
                cuda.atomic.add(bad, 0, 1)
                bad[1] = k

    bad = np.zeros(2, np.int64)
    cuda.jit(check_sqrt)[1024, 256](int(fp.SQRT_HI - fp.SQRT_LO) + 1, bad)
    assert bad[0] == 0, hex(int(bad[1]))
    cuda.jit(check_rcp)[1024, 256](int(fp.RCP_HI - fp.RCP_LO) + 1, bad)
    assert bad[0] == 0, hex(int(bad[1]))
    cuda.jit(check_random)[1024, 256](1 << 26, bad)
    assert bad[0] == 0, int(bad[1])
    edges = cuda.jit(check_edges)
    for b in (fp.DIVISOR_LO, fp.DIVISOR_LO + 1, fp.DIVISOR_HI, fp.DIVISOR_HI - 1, 0x3F800000, 0x3FFFFFFF):
        edges[1024, 256](int(b), bad)
        assert bad[0] == 0, (hex(b), int(bad[1]))


@pytest.mark.cuda
@pytest.mark.skipif(SIMULATOR, reason="the fast paths are the GPU's instructions; the simulator runs the cpu's IEEE ones")
def test_sqrt_codes_by_the_fast_paths_are_the_contracts():
    """The square-root codes' GPU forms are the contract's: ``sqrt_fast`` is the correctly rounded
    root of every float32 radicand from the floor to 2**98 (a usual block's values; its scale is
    below 2**98) and a radicand below the floor codes as 0 under the largest k of such a block, so
    ``sqrt_code_fast`` is ``sqrt_code`` there; the roots' rounding to codes (every float32 from 0 to
    2**16 at k = 1, negated in a signed slot; NaN codes 0); the block factor by the fast paths is the
    IEEE one for every float32 scale (both slots' n), and takes the fast forms exactly in their
    window."""
    _cuda()
    import math

    from optirs.backends.common import formats as B
    from optirs.backends.common.fast_paths import sqrt_fast

    top = int(np.float32(2.0**98).view(np.uint32))
    top16 = int(np.float32(2.0**16).view(np.uint32))
    magic = np.float32(2.0**23)  # s + 2**23 - 2**23 rounds s >= 0 to an integer, ties to even
    floor, lo, hi = B.SQRT_FLOOR, B.SQRT_FAST_LO, B.SQRT_FAST_HI
    kmax = np.float32(255 / math.sqrt(2.0**-80))  # the largest k of a block that takes the fast forms

    def check_codes(count, bad):
        for i in range(cuda.grid(1), count, cuda.gridsize(1)):
            u = B.bits_f32(np.uint32(i))
            if u >= floor:
                ok = B.f32_bits(sqrt_fast(u)) == B.f32_bits(np.float32(math.sqrt(u)))
            else:
                ok = ((B.sqrt_code_fast(u, kmax, False) & 0xFF) == 0 and (B.sqrt_code_fast(-u, kmax, True) & 0xFF) == 0
                      and (B.sqrt_code(u, kmax, False) & 0xFF) == 0)
            if i <= top16:
                want = np.int32((math.sqrt(u) + magic) - magic)  # rint(sqrt.rn(u)) at k = 1
                one = np.float32(1)
                ok = ok and (B.sqrt_code_fast(u, one, False) & 0xFF) == (want & 0xFF) \
                    and (B.sqrt_code_fast(-u, one, True) & 0xFF) == (-want & 0xFF)
            if not ok:
                cuda.atomic.add(bad, 0, 1)
                bad[1] = i
        if cuda.grid(1) == 0:
            nan = B.bits_f32(np.uint32(0x7FC00000))
            if (B.sqrt_code_fast(nan, kmax, True) & 0xFF) != 0 or (B.sqrt_code_fast(nan, kmax, False) & 0xFF) != 0 \
                    or (B.sqrt_code(nan, kmax, False) & 0xFF) != 0:
                cuda.atomic.add(bad, 0, 1)
                bad[1] = -1

    def check_factors(bad):  # every scale an absmax can be: the non-negative float32 (-0 is not one)
        for i in range(cuda.grid(1), 1 << 31, cuda.gridsize(1)):
            scale = B.bits_f32(np.uint32(i))
            for n in (np.float32(127), np.float32(255)):
                k, w = B.sqrt_factors(scale, n)
                fast, fk = B.sqrt_encode_factor(scale, n)
                fw = B.sqrt_decode_factor(scale, n * n)
                if (B.f32_bits(fk) != B.f32_bits(k) or B.f32_bits(fw) != B.f32_bits(w)
                        or fast != (scale >= lo and scale < hi)):
                    cuda.atomic.add(bad, 0, 1)
                    bad[1] = i

    def check_values(stride, bad):
        # every byte of both slots under every stride-th float32 scale that a block can have (an
        # absmax: 0 to inf, or NaN): the decode of a usual block (sqrt_value_fma, in the window) or of
        # the others (sqrt_value_byte) is the contract's value
        for k in range(cuda.grid(1), (1 << 31) // stride, cuda.gridsize(1)):
            scale = B.bits_f32(np.uint32(k * stride))
            for signed in (False, True):
                n2 = np.float32(127 * 127) if signed else np.float32(255 * 255)
                w = B.sqrt_decode_factor(scale, n2)
                nw = np.float32(w * B.SQRT_FMA_BASE)
                usual = B.dividend_in_window(scale)
                for b in range(256):
                    if signed and b == 0x80:
                        continue  # -128 is no code of a signed slot
                    c = np.int32(np.int8(b)) if signed else np.int32(b)
                    want = B.sqrt_value(c, scale / n2)
                    got = B.sqrt_value_fma(np.uint32(b), signed, w, nw) if usual else B.sqrt_value_byte(np.uint32(b), signed, w)
                    if B.f32_bits(got) != B.f32_bits(want) and not (got != got and want != want):
                        cuda.atomic.add(bad, 0, 1)
                        bad[1] = k * stride

    bad = np.zeros(2, np.int64)
    cuda.jit(check_codes)[1024, 256](top, bad)
    assert bad[0] == 0, hex(int(bad[1]))
    cuda.jit(check_factors)[1024, 256](bad)
    assert bad[0] == 0, hex(int(bad[1]))
    cuda.jit(check_values)[1024, 256](1021, bad)
    assert bad[0] == 0, hex(int(bad[1]))


# ------------------------------------------------------------------ the float8 state

_F8_EDGES = [0.0, 1.4e-45, 1e-40, 1e-30, 2.0**-64, 2.0**-51, 1e-3, 1.0, 37.5, 2.0**49, 2.0**72, 1e30,
             float(np.finfo(np.float32).max)]


def _fp8_scales(count, rng):
    """Block scales of every class the float8 lanes branch on (zero, subnormal, tiny: pre 2**64, both
    windows of the fast division and the float32 just below each edge, usual, huge, the largest
    float32, inf, NaN) and ``count`` random finite ones (uniform over the bit patterns: every binade)."""
    edges = np.float32(_F8_EDGES)
    below = np.nextafter(edges[edges > 0], np.float32(0))
    rand = rng.integers(0, 0x7F800000, count, dtype=np.int64).astype(np.uint32).view(np.float32)
    return np.concatenate([edges, below, np.float32([np.inf, np.nan]), rand]).astype(np.float32)


@pytest.mark.cuda
def test_float8_lanes_code_and_decode_as_the_contract():
    """A lane's float8 codes and values as the kernels take them (``_store_state_fp8``, ``_decode_fp8``:
    the block factors by the fast division in their windows, a finite block's codes by the hardware's
    pair conversion on a GPU, ``fp8_code`` under an inf or NaN scale) against the contract's
    ``fp8_quantize`` / ``fp8_dequantize`` (optirs.core.formats), under scales of every class: values
    up to the scale and +-scale (+-inf and NaN under a non-finite one) coded, full lanes by one 8-byte
    store and partial ones byte by byte (nothing past the count written); all 256 codes decoded."""
    _cuda()
    from optirs.backends.cuda import formats_kernels as fk
    from optirs.backends.cuda.context import device_address
    from optirs.core import formats as F

    rng = np.random.default_rng(11)
    scales = _fp8_scales(4 if SIMULATOR else 4096, rng)
    per = 2 if SIMULATOR else 16  # lanes coded per scale
    s = np.repeat(scales, per)
    with np.errstate(invalid="ignore", over="ignore"):
        x = (rng.uniform(-1, 1, (s.size, 8)) * s[:, None]).astype(np.float32)
    x[::per, 0], x[::per, 1] = scales, -scales
    x[s == np.inf, 2:6] = np.float32([np.inf, -np.inf, 1.0, -0.0])
    x[np.isnan(s), 2:6] = np.float32([np.nan, -np.inf, 2.0, 0.0])
    cnt = np.full(s.size, 8, np.uint32)
    cnt[1::per] = np.arange(s.size // per, dtype=np.uint32) % 8  # partial lanes: 0 to 7 codes
    want = F.fp8_quantize(x.reshape(-1), np.repeat(s, 8)).reshape(-1, 8)
    want = np.where(np.arange(8)[None, :] < cnt[:, None], want, np.uint8(0xAA))

    def encode(xs, sc, cnts, addr, n):
        w = cuda.local.array(8, np.uint32)
        v = cuda.local.array(8, np.float32)
        for i in range(cuda.grid(1), n, cuda.gridsize(1)):
            for j in range(8):
                v[j] = xs[i, j]
            c = np.uint32(cnts[i])
            fk._store_state_fp8(True, True, 1, addr + 8 * i, c == fk.LANE32, c, w, v, sc[i])

    def decode(words, sc, out, n):
        w = cuda.local.array(8, np.uint32)
        v = cuda.local.array(8, np.float32)
        for i in range(cuda.grid(1), n, cuda.gridsize(1)):
            w[0] = words[i, 0]
            w[1] = words[i, 1]
            fk._decode_fp8(True, w, v, sc[i])
            for j in range(8):
                out[i, j] = v[j]

    grid = (4, 32) if SIMULATOR else (256, 128)
    out = cuda.to_device(np.full((s.size, 8), 0xAA, np.uint8))
    cuda.jit(encode)[grid](cuda.to_device(x), cuda.to_device(s), cuda.to_device(cnt), device_address(out), s.size)
    got = out.copy_to_host()
    bad = np.flatnonzero((got != want).any(axis=1))
    assert bad.size == 0, (s[bad[:4]], x[bad[:4]], got[bad[:4]], want[bad[:4]])

    codes = np.tile(np.arange(256, dtype=np.uint8).reshape(32, 8), (scales.size, 1))
    ds = np.repeat(scales, 32)
    values = cuda.to_device(np.zeros(codes.shape, np.float32))
    cuda.jit(decode)[grid](cuda.to_device(codes.view(np.uint32)), cuda.to_device(ds), values, ds.size)
    got = values.copy_to_host()
    want = F.fp8_dequantize(codes.reshape(-1), np.repeat(ds, 8)).reshape(codes.shape)
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    bad = np.flatnonzero(~same.all(axis=1))
    assert bad.size == 0, (ds[bad[:4]], codes[bad[:4]], got[bad[:4]], want[bad[:4]])


@pytest.mark.cuda
@pytest.mark.skipif(SIMULATOR, reason="the conversions are the GPU's; the simulator runs fp8_code / fp8_value")
def test_float8_conversions_by_the_hardware_are_the_contracts():
    """The float8 state's GPU forms: ``fp8_codes4`` (cvt.rn.satfinite.e4m3x2.f32) writes ``fp8_code``'s
    byte for every float32 that is not NaN (saturated at 448, inf included), in each of a word's four
    places, and a NaN code for NaN (never stored: a block holding a NaN has a NaN scale and takes
    fp8_code); the rounding points' words and random words against numpy's ``fp8_encode``; every byte
    decoded (``fp8_values4``: cvt.rn.f16x2.e4m3x2, float16 halves to float32) is ``fp8_decode``'s
    value; the block factors by the fast division are ``fp8_factors``' for every non-negative float32
    scale and take the fast forms exactly in their windows (the decode's with 0)."""
    _cuda()
    from optirs.backends.common import formats as B
    from optirs.backends.common.bits32 import or32, shl32
    from optirs.backends.cuda import formats_kernels as fk
    from optirs.core import formats as F

    one = np.float32(1.0)  # float8 0x38

    def check_codes(bad):
        for i in range(cuda.grid(1), 1 << 32, cuda.gridsize(1)):
            y = B.bits_f32(np.uint32(i))
            c = B.fp8_code(y) & np.uint32(0xFF)
            a = fk.fp8_codes4(y, one, y, one)
            b = fk.fp8_codes4(one, y, one, y)
            if y != y:
                ok = (a & np.uint32(0x7F)) == 0x7F and (b & np.uint32(0x7F00)) == 0x7F00
            else:
                ok = (a == or32(or32(c, 0x3800), or32(shl32(c, 16), 0x38000000))
                      and b == or32(or32(0x38, shl32(c, 8)), or32(0x380000, shl32(c, 24))))
            if not ok:
                cuda.atomic.add(bad, 0, 1)
                bad[1] = i

    def codes_of(ys, out):
        for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
            out[i] = fk.fp8_codes4(ys[4 * i], ys[4 * i + 1], ys[4 * i + 2], ys[4 * i + 3])

    def values_of(words, out):
        i = cuda.grid(1)
        if i < words.size:
            out[4 * i], out[4 * i + 1], out[4 * i + 2], out[4 * i + 3] = fk.fp8_values4(words[i])

    def check_factors(bad):  # every scale an absmax can be: the non-negative float32 (-0 is not one)
        for i in range(cuda.grid(1), 1 << 31, cuda.gridsize(1)):
            s = B.bits_f32(np.uint32(i))
            pre, k, w, post = B.fp8_factors(s)
            efast, epre, ek = fk.fp8_encode_factor(s)
            dfast, dw, dpost = fk.fp8_decode_factor(s)
            ok = (B.f32_bits(epre) == B.f32_bits(pre) and B.f32_bits(ek) == B.f32_bits(k)
                  and B.f32_bits(dw) == B.f32_bits(w) and B.f32_bits(dpost) == B.f32_bits(post)
                  and efast == (s >= 2.0**-51 and s < 2.0**49) and dfast == (s == 0 or (s >= 2.0**-64 and s < 2.0**72)))
            if not ok:
                cuda.atomic.add(bad, 0, 1)
                bad[1] = i

    bad = np.zeros(2, np.int64)
    cuda.jit(check_codes)[1024, 256](bad)
    assert bad[0] == 0, hex(int(bad[1]))
    cuda.jit(check_factors)[1024, 256](bad)
    assert bad[0] == 0, hex(int(bad[1]))

    # each exponent and kept mantissa with the 20 dropped bits at 0, 1, below, at and above the half
    # and all set; random words; both signs (NaNs apart)
    e = np.arange(255, dtype=np.uint32) << np.uint32(23)
    m = np.arange(8, dtype=np.uint32) << np.uint32(20)
    low = np.array([0, 1, 0x7FFFF, 0x80000, 0x80001, 0xFFFFF], np.uint32)
    words = (e[:, None, None] | m[None, :, None] | low[None, None, :]).reshape(-1)
    words = np.concatenate([words, np.random.default_rng(7).integers(0, 0x7F800000, 1 << 20).astype(np.uint32)])
    ys = np.concatenate([words, words | np.uint32(0x80000000)]).view(np.float32)
    ys = np.concatenate([ys, np.zeros(-ys.size % 4, np.float32)])
    out = cuda.to_device(np.zeros(ys.size // 4, np.uint32))
    cuda.jit(codes_of)[256, 256](cuda.to_device(ys), out)
    assert np.array_equal(out.copy_to_host().view(np.uint8), F.fp8_encode(ys))

    every = np.arange(256, dtype=np.uint8)
    got = cuda.to_device(np.zeros(256, np.float32))
    cuda.jit(values_of)[1, 64](cuda.to_device(every.view(np.uint32)), got)
    got, want = got.copy_to_host(), F.fp8_decode(every)
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.flatnonzero(np.isnan(got)).tolist() == [0x7F, 0xFF]
    assert np.array_equal(got[~np.isnan(got)].view(np.uint32), want[~np.isnan(want)].view(np.uint32))


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", [_fmt("bfloat16", "remainder8", "float8_e4m3fn"),
                                 _fmt("float32", None, "float8_e4m3fn")], ids=["r8-float8", "fp32-float8"])
def test_float8_step_is_the_cpu_backends_bit_for_bit(fmt):
    """AdamW with amsgrad (three float8 slots) on a tensor of 17 blocks, the last of 4 elements (a
    partial lane: codes loaded and stored byte by byte), beside a small one: every parameter word and
    buffer the cpu hooks'. Beside usual blocks, blocks of zero, tiny (pre 2**64) and huge (outside the
    fast division's windows) gradients (1e-25: a tiny first moment, 1e-12: a tiny second one); in the
    simulator also a block whose second moment overflows (an inf scale) and one holding a NaN (their
    NaNs are the hardware's on a GPU). Two steps (the
    second decodes the first's codes) with betas of 1/2 and bfloat16 gradients, which keep the moments'
    products exact on a GPU (test_step_is_the_cpu_backends_bit_for_bit); float32 gradients take one
    step there."""
    from optirs.core.params import AdamParams

    steps = 2 if SIMULATOR or fmt.grad_dtype == "bfloat16" else 1

    def special(grads):
        g = grads[0]
        blocks = ((256, 0.0), (512, 1e-25), (768, 1e16), (1536, 1e-12)) + (((1024, 1e30),) if SIMULATOR else ())
        for lo, factor in blocks:
            g[lo:lo + 256] = (g[lo:lo + 256].astype(np.float32) * np.float32(factor)).astype(g.dtype)
        if SIMULATOR:
            g[1290] = np.nan  # in an otherwise usual block
        return grads

    hp = AdamParams(lr=1e-2, amsgrad=True, beta1=0.5, beta2=0.5)
    _assert_the_cpu_bits(_run("adamw", fmt, [(4096 + 4,), (37,)], steps=steps, hp=hp, cpu=True, grads=special))


@pytest.mark.cuda
def test_float8_lamb_matches_the_cpu_backend():
    """LAMB's two passes with float8 moments (a tensor of 4096 + 40 elements and one of 5, two steps):
    the moments' codes, block scales and the small tensor's state are the cpu backend's bit for bit
    (betas of 1/2 and bfloat16 gradients: exact products on a GPU too; no clipping, whose float64
    norm either backend sums in its own order), the parameters and masters within an ulp of the
    master (a trust ratio's float64 sums, in another order, may round to another float32)."""
    from optirs.core.params import LambParams

    hp = LambParams(lr=1e-2, beta1=0.5, beta2=0.5)
    for result in _run("lamb", _fmt("bfloat16", "remainder8", "float8_e4m3fn"), [(4096 + 40,), (5,)], steps=2, hp=hp,
                       cpu=True):
        got_b, want_b = result[1], result[3]
        for k, w in want_b.items():
            if k not in ("master", "master_remainder"):
                assert np.array_equal(got_b[k].view(np.uint8), np.asarray(w).view(np.uint8)), k
        _assert_close(result, master_atol=1e-8)


@pytest.mark.cuda
@pytest.mark.skipif(SIMULATOR, reason="the conversion is the GPU's instruction; the simulator runs bf16_nearest")
def test_cvt_pack_bf16_is_bf16_nearest_but_for_nan():
    """The fast path's parameter rounding (cvt.rn.bf16x2.f32, two values packed) is bf16_nearest's
    bits for every float32 that is not NaN, in either half of the word."""
    _cuda()
    from optirs.backends.common.formats import bf16_nearest, bits_f32
    from optirs.backends.cuda import formats_kernels as fk

    def check(bad):
        i = cuda.grid(1)
        while i < (1 << 32):
            x = bits_f32(np.uint32(i))
            if x == x:
                want = np.uint32(bf16_nearest(x))
                y = bits_f32(np.uint32(0x3F800000))
                if fk.cvt_pack_bf16(x, y) != (want | np.uint32(0x3F800000)) or \
                        fk.cvt_pack_bf16(y, x) != ((want << np.uint32(16)) | np.uint32(0x3F80)):
                    cuda.atomic.add(bad, 0, 1)
                    bad[1] = i
            i += cuda.gridDim.x * cuda.blockDim.x

    bad = np.zeros(2, np.int64)
    cuda.jit(check)[1024, 256](bad)
    assert bad[0] == 0, hex(int(bad[1]))


@pytest.mark.cuda
@pytest.mark.parametrize("fmt,amsgrad", [
    (_fmt("bfloat16", None, "bfloat16", stochastic=True, gdt="float32"), True),
    (_fmt("bfloat16", "remainder8", "int8"), False),
], ids=["sr-bf16state-amsgrad", "r8-int8"])
def test_adam_rounds_outside_the_fast_windows_are_the_exact_step(monkeypatch, fmt, amsgrad):
    """The formats kernels take Adam's square roots and divisions by their fast paths with one flag
    per lane's 8 elements, and redo a round where it is false: rounds holding zero, subnormal, tiny,
    huge or NaN gradients (so zero, tiny, huge, infinite or NaN moments) are the cpu backend's bit for bit,
    beside ordinary rounds. On a GPU the fast paths themselves are wrong there (sqrt_fast(0) is NaN);
    in the simulator, which runs the cpu's IEEE operations, the fast step is made to return NaN
    wherever its flag is false, as a GPU's may, and must be taken on both kinds of round. (No NaN
    that arithmetic makes, as inf / inf: its sign is the hardware's, negative on x86, and an int8
    scale keeps a NaN's bits; the bfloat16 encoders write any NaN as the quiet NaN of its sign.)"""
    from optirs.backends.common import elementwise
    from optirs.core.params import AdamParams

    if SIMULATOR:
        setup, step, windows_ok, start = elementwise.FAST_ELEMENT_STEPS["adam"]
        taken = {True: 0, False: 0}

        def poisoned(p, g, s0, s1, s2, sc, u, w):
            # this element's windows alone, then accumulated as the step's own are (by maximum)
            p, s0, s1, s2, wj = step(p, g, s0, s1, s2, sc, u, start)
            ok = windows_ok(wj)
            taken[bool(ok)] += 1
            w = tuple(max(a, b) for a, b in zip(w, wj))
            if ok:
                return p, s0, s1, s2, w
            nan = np.float32(np.nan)
            return nan, nan, nan, nan, w

        monkeypatch.setitem(elementwise.FAST_ELEMENT_STEPS, "adam", (setup, poisoned, windows_ok, start))

    def special(grads):
        g = grads[0]  # 300 elements: rounds of 8 from the lane's first element
        g[0:8] = 0.0  # a round of zero gradients (first step: zero moments)
        g[8] = 0.0  # one zero in an ordinary round
        g[16:20] = [1e-40, -1e-42, 1e-30, -1e-25]  # subnormal, and squares that underflow to 0
        if fmt.state_dtype == "bfloat16":
            g[24:27] = [3e19, -1e30, 3e38]  # squares past float32's top: infinite second moments
            g[32] = np.nan
        else:  # an infinite int8 scale decodes its 0 code to 0 * inf, a NaN of the hardware's sign
            g[24:26] = [1e19, -1.5e19]  # second moments past the window, finite
        return grads

    def same(got, want, what):
        got, want = np.asarray(got), np.asarray(want)
        if SIMULATOR or got.dtype != np.float32:
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), what
            return
        # float32 words (an int8 format's small tensor keeps float32 state) may differ on a GPU, whose
        # compiler fuses multiply-adds (docs/formats.md): a fused b1 * m + (1 - b1) * g errs by half an
        # ulp of its larger term, not of its result, which cancellation makes small (two steps: a few
        # ulps of the tensor's largest value). NaNs and infinities stay exact
        finite = np.isfinite(got) & np.isfinite(want)
        top = np.abs(want[finite]).max(initial=np.float32(0))
        tol = np.float64(np.spacing(np.float32(top))) * 4
        with np.errstate(invalid="ignore"):  # inf - inf where both are infinite: compared by bits below
            close = np.abs(got.astype(np.float64) - want.astype(np.float64)) <= tol
        assert np.all(np.where(finite, close, got.view(np.int32) == want.view(np.int32))), what

    def nan_params(params):
        # a signalling NaN parameter in an ordinary round: the fast step's windows hold, its new value
        # is NaN (with the payload, on a cpu), and the encoders must write the quiet NaN
        if fmt.state_dtype == "bfloat16":  # (a remainder master's NaN is the hardware's: not compared)
            params[0][40:41].view(np.uint16)[0] = 0x7F81
        return params

    for got_p, got_b, want_p, want_b, _ in _run("adamw", fmt, [(300,)], steps=2, cpu=True, grads=special,
                                                params=nan_params, hp=AdamParams(lr=1e-2, amsgrad=amsgrad)):
        for g, w in zip(got_p, want_p):
            same(g, w, "parameters")
        for k, w in want_b.items():
            same(got_b[k], w, k)
    if SIMULATOR:
        assert taken[True] > 0 and taken[False] > 0, taken


@pytest.mark.cuda
def test_int8_step_matches_the_reference():
    """One int8 block tensor (4100 elements: 16 full blocks and a 4-element one) beside a small one."""
    for result in _run("adamw", _fmt("bfloat16", "remainder8", "int8"), [(5,), (4100,)], steps=1):
        _assert_close(result)


@pytest.mark.cuda
def test_int8_lanes_past_the_end_read_no_table_out_of_bounds(monkeypatch):
    """Centered RMSprop with momentum on a tensor whose last int8 block is partial (4100 elements: a
    lane of 4): the lanes past the end decode code 0 (-scale in the signed map), so their values are
    NaN and belong to no block; the finite block's quantizer, which has no upper clamp, must not look
    them up (NVIDIA's OpenCL faulted on such a read). In the simulator the quantizer runs as Python,
    whose indexing of the shared table raises on an index out of bounds."""
    from optirs.backends.cuda import formats_kernels
    from optirs.core.params import RmspropParams

    if SIMULATOR:
        monkeypatch.setattr(formats_kernels, "quantize_finite", formats_kernels.quantize_finite.py_func)
    hp = RmspropParams(lr=1e-3, alpha=0.9, momentum=0.5, centered=True)
    for result in _run("rmsprop", _fmt("bfloat16", "remainder8", "int8"), [(4100,)], steps=2, hp=hp):
        _assert_close(result, master_atol=1e-8, state_rel=1e-6)  # lr * buf moves masters near 0 by ~1e-9


LAMB_FORMATS = [_fmt("bfloat16", "remainder8", "int8"), _fmt("bfloat16", "float32", "bfloat16"),
                _fmt("float16", "float32", "float32", gdt="float32"), _fmt("bfloat16", None, "float32", stochastic=True)]


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", LAMB_FORMATS, ids=lambda f: "-".join(map(str, f.codes)))
def test_lamb_matches_the_reference_and_the_cpu_backend(fmt):
    """LAMB's passes (global clipping, per-tensor trust ratios) on a model with an int8-block tensor,
    a small one and a misaligned one, against the float64 reference and against the cpu hooks."""
    from optirs.core.params import LambParams

    shapes = [(4100,), (37,), (300,)]
    for hp in (LambParams(lr=1e-2, weight_decay=0.01, max_grad_norm=1.0), LambParams(lr=1e-2, max_trust_ratio=0.5)):
        for result in _run("lamb", fmt, shapes, steps=2, hp=hp):
            _assert_close(result, master_atol=1e-8, state_rel=1e-6)  # lr * ratio * u ~1e-2: rounding ~1e-9
        for result in _run("lamb", fmt, shapes, steps=2, hp=hp, cpu=True):
            # the same float32 element code; the float64 sums' order differs, so a trust ratio or the
            # clip factor may differ by one float32 ulp, which moves a master near zero by ~1e-9
            _assert_close(result, master_atol=1e-8, state_rel=1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt,shapes,steps", [
    (_fmt("bfloat16", None, "bfloat16", stochastic=True, gdt="float32"), [(300,), (37,)], 1),
    (_fmt("bfloat16", None, "bfloat16"), [(300,), (37,)], 1),
    (_fmt("bfloat16", "remainder8", "int8"), [(4100,), (37,)], 1),
    (_fmt("bfloat16", "remainder8", "int8_sqrt"), [(4100,), (37,)], 2),  # the second decodes codes of step 1
], ids=["sr-bf16state", "nearest-bf16state", "r8-int8", "r8-int8sqrt"])
def test_step_is_the_cpu_backends_bit_for_bit(fmt, shapes, steps):
    """The formats contract is bit-exact on every backend: AdamW with amsgrad (three slots: the two
    moments share one hash, the third its own stream; int8 codes by the block's reciprocal), every
    parameter word and every buffer equal to the cpu hooks' from the same inputs (square-root codes: by
    the GPU's fast division and root in their windows, the cpu's IEEE operations).
    Over two steps, betas of 1/2 and bfloat16 gradients make every product of the moments' updates
    exact, so NVVM's fused multiply-add (docs/formats.md) and the cpu's two roundings agree on the new
    state values from the second step on, where the decoded moments are not 0: a float32 block scale
    of a later step is then the cpu's bit for bit, and a decode that is off shows."""
    from optirs.core.params import AdamParams

    exact = {"beta1": 0.5, "beta2": 0.5} if steps > 1 else {}
    assert fmt.grad_dtype == "bfloat16" or not exact
    hp = AdamParams(lr=1e-2, amsgrad=True, **exact)
    _assert_the_cpu_bits(_run("adamw", fmt, shapes, steps=steps, hp=hp, cpu=True))


@pytest.mark.cuda
def test_another_chunk_size_steps_the_same_bits(monkeypatch):
    """``OPTIRS_CUDA_FORMATS_CHUNK`` (tuning) gives a block another count of rounds a chunk (1 here;
    2 by default where blocks claim chunks, 16 where each takes every grid-th chunk, as with
    ``OPTIRS_CUDA_FORMATS_CLAIM=0``): the step is still the cpu backend's bit for bit, int8 blocks, a
    chunk's start inside a tensor and a tensor's end included."""
    from optirs.core.params import AdamParams

    monkeypatch.setenv("OPTIRS_CUDA_FORMATS_CLAIM", "0")
    monkeypatch.setenv("OPTIRS_CUDA_FORMATS_CHUNK", "1024")
    fmt = _fmt("bfloat16", "remainder8", "int8_sqrt")
    _assert_the_cpu_bits(_run("adamw", fmt, [(2100,), (37,)], steps=1, hp=AdamParams(lr=1e-2), cpu=True))


@pytest.mark.cuda
def test_chunks_taken_from_the_counter_step_as_the_grid_dealt_ones(monkeypatch):
    """Blocks take chunks from the counter in the chunk table's last row (the default): every step's
    parameters and buffers are those of blocks that take every grid-th chunk
    (``OPTIRS_CUDA_FORMATS_CLAIM=0``), byte for byte, the second step too (the last block set the
    counter back to zero: a launch that found it where the first left it would take no chunk)."""
    from optirs.core.params import AdamParams

    monkeypatch.setenv("OPTIRS_CUDA_FORMATS_CHUNK", "1024")
    fmt = _fmt("bfloat16", "remainder8", "int8_sqrt")
    runs = {}
    for claim in ("1", "0"):
        monkeypatch.setenv("OPTIRS_CUDA_FORMATS_CLAIM", claim)
        runs[claim] = _run("adamw", fmt, [(2100,), (37,)], steps=2, hp=AdamParams(lr=1e-2))
    for (claimed_p, claimed_b, *_), (dealt_p, dealt_b, *_) in zip(runs["1"], runs["0"]):
        for c, d in zip(claimed_p, dealt_p):
            assert np.array_equal(np.asarray(c).view(np.uint8), np.asarray(d).view(np.uint8))
        assert claimed_b.keys() == dealt_b.keys()
        for k in dealt_b:
            assert np.array_equal(np.asarray(claimed_b[k]).view(np.uint8), np.asarray(dealt_b[k]).view(np.uint8)), k


@pytest.mark.cuda
@pytest.mark.parametrize("grid", ["256", "0"])
def test_chunks_cut_on_the_flat_grid_or_not_step_the_same_bits(monkeypatch, grid):
    """The chunks cut where each tensor's state offsets cross the chunk size's grid (the default: a
    tensor's first chunk shorter) and counted from each tensor's start (``OPTIRS_CUDA_FORMATS_GRID=0``)
    both step the cpu backend's bits, int8 blocks included (every chunk starts at a multiple of 256
    within its tensor)."""
    from optirs.core.params import AdamParams

    monkeypatch.setenv("OPTIRS_CUDA_FORMATS_CHUNK", "1024")
    monkeypatch.setenv("OPTIRS_CUDA_FORMATS_GRID", grid)
    fmt = _fmt("bfloat16", "remainder8", "int8_sqrt")
    _assert_the_cpu_bits(_run("adamw", fmt, [(37,), (2100,), (300,)], steps=1, hp=AdamParams(lr=1e-2), cpu=True))


@pytest.mark.cuda
def test_the_approximate_build_steps_within_ulps_of_the_exact_one(monkeypatch):
    """``OPTIRS_CUDA_FORMATS_APPROX=1`` (tuning) compiles Adam's root and quotient as the approximate
    operations (the simulator computes them exactly) and the bias correction as a product by its
    reciprocal: the moments and their codes are the cpu backend's bits (they never see the root),
    the parameters within a few float32 ulps of its."""
    from optirs.core.params import AdamParams

    monkeypatch.setenv("OPTIRS_CUDA_FORMATS_APPROX", "1")
    fmt = _fmt("float32", None, "int8_sqrt")
    for got_p, got_b, want_p, want_b, _ in _run("adamw", fmt, [(300,), (37,)], steps=2, hp=AdamParams(lr=1e-2),
                                                cpu=True):
        for g, w in zip(got_p, want_p):
            np.testing.assert_allclose(g, w, rtol=4 * 2.0**-23, atol=0)
        for k, w in want_b.items():
            assert np.array_equal(got_b[k].view(np.uint8), np.asarray(w).view(np.uint8)), k


def _assert_the_cpu_bits(results):
    """Every step's parameter words and buffers of ``_run(..., cpu=True)`` are the cpu backend's, bit for bit."""
    for got_p, got_b, want_p, want_b, _ in results:
        for g, w in zip(got_p, want_p):
            assert np.array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))
        for k, w in want_b.items():
            assert np.array_equal(got_b[k].view(np.uint8), np.asarray(w).view(np.uint8)), k


@pytest.mark.cuda
def test_lamb_found_inf_skips_every_pass_and_the_next_step_is_clean():
    """A raised found_inf at step 2 writes nothing (no pass runs, the clipping norm included); step 3
    then matches the reference from step 1's state: the per-tensor sums left by step 1 were
    cleared although step 2 was skipped."""
    from optirs.core.params import LambParams

    plugin, ctx, cuda = _cuda()
    flag = cuda.to_device(np.ones(1, np.int32))
    hp = LambParams(lr=1e-2, max_grad_norm=1.0)
    results = _run("lamb", _fmt("bfloat16", "remainder8", "int8"), [(4100,), (9,)], steps=3,
                   found=[None, flag, None], hp=hp)
    for got_p, got_b, want_p, want_b, fs in results[1:2]:
        assert all(np.array_equal(g, w) for g, w in zip(got_p, want_p))
        assert all(np.array_equal(got_b[k], want_b[k]) for k in want_b)
    _assert_close(results[0], master_atol=1e-8, state_rel=1e-6)
    _assert_close(results[2], master_atol=1e-8, state_rel=1e-6)


@pytest.mark.cuda
def test_found_inf_skips_the_whole_step():
    plugin, ctx, cuda = _cuda()
    flag = cuda.to_device(np.zeros(1, np.int32))
    fmt = _fmt("bfloat16", "remainder16", "bfloat16")
    grads = [np.ones(7, ml_dtypes.bfloat16), np.array([1.0, np.inf] * 20, ml_dtypes.bfloat16)]
    staged = plugin.optirs_stage(ctx, [np.zeros(7, ml_dtypes.bfloat16), np.zeros(40, ml_dtypes.bfloat16)],
                                         grads, fmt)
    plugin._formats_check(ctx, staged.grads, TensorLayout([(7,), (40,)]), fmt, flag)
    assert flag.copy_to_host()[0] == 1
    before = _run("adamw", fmt, [(9,)], steps=1)  # the same inputs stepped without a flag ...
    skipped = _run("adamw", fmt, [(9,)], steps=1, found=flag)  # ... and with the raised one
    rng = np.random.default_rng(3)
    initial = _bits(rng.standard_normal((9,)).astype(ml_dtypes.bfloat16))
    assert np.array_equal(skipped[0][0][0], initial)  # nothing written
    assert not np.array_equal(before[0][0][0], initial)
    assert all(not v.any() for v in skipped[0][1].values())


@pytest.mark.cuda
def test_check_flags_nonfinite_gradients_only():
    plugin, ctx, cuda = _cuda()
    for gdt in ("float32", "bfloat16", "float16"):
        fmt = _fmt("bfloat16" if gdt == "float32" else gdt, None, "float32", gdt=gdt)
        shapes = [(5,), (37,)]
        for bad in (None, 0, 1):
            grads = [np.full(s, 3.0, HOST[gdt]) for s in shapes]
            if bad is not None:
                grads[bad].reshape(-1)[-1] = np.nan if bad else np.inf
            params = [np.zeros(s, HOST[fmt.param_dtype]) for s in shapes]
            staged = plugin.optirs_stage(ctx, params, grads, fmt)
            flag = cuda.to_device(np.zeros(1, np.int32))
            plugin._formats_check(ctx, staged.grads, TensorLayout(shapes), fmt, flag)
            assert flag.copy_to_host()[0] == (bad is not None), (gdt, bad)


@pytest.mark.cuda
def test_stage_refuses_the_wrong_dtype():
    from optirs.core.errors import InvalidParameterError

    plugin, ctx, cuda = _cuda()
    fmt = _fmt("bfloat16", None, "float32")
    with pytest.raises(InvalidParameterError, match="expected bfloat16"):
        plugin.optirs_stage(ctx, [np.zeros(4, np.float16)], [np.zeros(4, ml_dtypes.bfloat16)], fmt)
    with pytest.raises(InvalidParameterError, match="expected bfloat16"):
        plugin.optirs_stage(ctx, [cuda.to_device(np.zeros(4, np.float32))],
                                    [cuda.to_device(np.zeros(4, np.uint16))], fmt)
    # uint16 device arrays are the bfloat16 bit patterns
    staged = plugin.optirs_stage(ctx, [cuda.to_device(np.zeros(4, np.uint16))],
                                         [cuda.to_device(np.zeros(4, np.uint16))], fmt)
    assert len(staged.params) == 1
