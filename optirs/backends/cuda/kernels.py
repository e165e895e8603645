"""The CUDA backend's kernels (imported when the backend opens: this imports numba.cuda).

Every step kernel covers a whole model in one launch. Two small device tables drive it:

* the chunk table (``int64[nchunks + 1, 4]``: tensor, start, count, state offset; the last row
  is the counter from which the formats kernels claim chunks), cut from
  :meth:`optirs.core.layout.TensorLayout.chunks`, cached per layout;
* the pointer table (``int64[ntensors, 2]``: parameter and gradient addresses), so parameters
  and gradients may be separate allocations (numba, CuPy, torch tensors) and are used in place.

Each block takes whole chunks (grid-stride over the chunk table); inside a chunk each thread moves
4 elements per iteration with one 16-byte load or store per array (``ld.global.v4.f32``), which
is what brings a memory-bound step close to copy bandwidth. Chunks whose addresses are not
16-byte aligned (a tensor view at an odd offset, a state offset that is not a multiple of 4) take
the scalar path. The per-element math is the shared ``@njit`` code of
:mod:`optirs.backends.common.elementwise`, compiled here as device functions.

Memory is reached through raw addresses, so a kernel does not care where an array came from.
On the GPU the access primitives are LLVM intrinsics (``inttoptr`` into the global address
space). Under numba's simulator (``NUMBA_ENABLE_CUDASIM=1``) device arrays are numpy arrays in
host memory, so the same kernels run with the primitives below reading and writing those
addresses through ctypes: the kernels themselves have no simulator branch.
"""

from __future__ import annotations

import ctypes
import math

import numba
import numpy as np
from numba import cuda, float64

from optirs.backends.common.elementwise import (ELEMENT_STEPS, lamb_direction, lamb_grad_scale, lamb_moments,
                                               lamb_trust_ratio)

from optirs.core.definitions import DEFINITIONS
from optirs.core.scalars import FORMULAS
from optirs.core.simulator import cuda_simulator_enabled

SIMULATOR = cuda_simulator_enabled()

# Elements per chunk, at least: a multiple of 1024, small enough that the last round of blocks
# leaves few SMs idle. Larger blocks get larger chunks (chunk_elements), so that every thread
# moves at least MIN_VECTORS_PER_THREAD float4 vectors per chunk: on the H200 a block that lives
# for a single vector per thread measured slower than one that loops twice or more.
CHUNK = 4096
MIN_VECTORS_PER_THREAD = 2


def chunk_elements(block: int) -> int:
    """The chunk size for a launch of ``block`` threads per block."""
    need = block * 4 * MIN_VECTORS_PER_THREAD
    return max(CHUNK, -(-need // 1024) * 1024)

# Slot bits of the generic step kernel's ``used`` argument.
SLOT0, SLOT1, SLOT2 = 1, 2, 4

_F32 = np.float32


# ------------------------------------------------------------------ memory access primitives

if SIMULATOR:
    # Simulator only: device memory is host memory, so the addresses are dereferenced directly.
    def ld(addr):
        return _F32(ctypes.c_float.from_address(int(addr)).value)

    def st(addr, x):
        ctypes.c_float.from_address(int(addr)).value = float(x)

    def ld4(addr):
        v = (ctypes.c_float * 4).from_address(int(addr))
        return _F32(v[0]), _F32(v[1]), _F32(v[2]), _F32(v[3])

    def st4(addr, a, b, c, d):
        v = (ctypes.c_float * 4).from_address(int(addr))
        v[0], v[1], v[2], v[3] = float(a), float(b), float(c), float(d)

else:
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    _VEC4 = ir.VectorType(ir.FloatType(), 4)
    _GLOBAL = 1  # NVPTX global address space: plain ld.global / st.global, no generic lookup

    @intrinsic
    def ld(typingctx, addr):
        """float32 at byte address ``addr``."""

        def codegen(context, builder, sig, args):
            return builder.load(builder.inttoptr(args[0], ir.PointerType(ir.FloatType(), _GLOBAL)), align=4)

        return types.float32(types.int64), codegen

    @intrinsic
    def st(typingctx, addr, x):
        """Store float32 ``x`` at byte address ``addr``."""

        def codegen(context, builder, sig, args):
            builder.store(args[1], builder.inttoptr(args[0], ir.PointerType(ir.FloatType(), _GLOBAL)), align=4)
            return context.get_dummy_value()

        return types.void(types.int64, types.float32), codegen

    @intrinsic
    def ld4(typingctx, addr):
        """Four float32 at 16-byte aligned ``addr``, one vector load."""
        ret = types.UniTuple(types.float32, 4)

        def codegen(context, builder, sig, args):
            vec = builder.load(builder.inttoptr(args[0], ir.PointerType(_VEC4, _GLOBAL)), align=16)
            vals = [builder.extract_element(vec, ir.Constant(ir.IntType(32), i)) for i in range(4)]
            return context.make_tuple(builder, ret, vals)

        return ret(types.int64), codegen

    @intrinsic
    def st4(typingctx, addr, a, b, c, d):
        """Store four float32 at 16-byte aligned ``addr``, one vector store."""

        def codegen(context, builder, sig, args):
            vec = ir.Constant(_VEC4, ir.Undefined)
            for i in range(4):
                vec = builder.insert_element(vec, args[1 + i], ir.Constant(ir.IntType(32), i))
            builder.store(vec, builder.inttoptr(args[0], ir.PointerType(_VEC4, _GLOBAL)), align=16)
            return context.get_dummy_value()

        f32 = types.float32
        return types.void(types.int64, f32, f32, f32, f32), codegen


# Helpers are plain ``@njit`` functions, which numba-cuda compiles as device functions (as the
# shared elementwise math); ``cuda.jit(device=True)`` would ask the driver for the compute
# capability and so cannot compile PTX on a machine without a GPU. Under the simulator they are
# plain Python, like the access primitives they call.
_device = numba.njit if not SIMULATOR else (lambda f: f)


@_device
def ld4_if(flag, addr):
    if flag:
        return ld4(addr)
    z = _F32(0.0)
    return z, z, z, z


@_device
def ld_if(flag, addr):
    if flag:
        return ld(addr)
    return _F32(0.0)


def record_loader(record):
    """A device function ``(rec, sc) -> record``: the scalars record read from the float32 device
    buffer at address ``rec`` (field k at ``rec + 4k``, bools stored as 0 / 1), written by the
    device-side scalars kernel of capturable steps. ``sc`` only gives the function its type."""
    fields = []
    for k, name in enumerate(record._fields):
        ann = record.__annotations__[name]
        text = getattr(ann, "__forward_arg__", ann)
        fields.append(f"ld(rec + {4 * k}) != 0" if text in (bool, "bool") else f"ld(rec + {4 * k})")
    namespace = {"ld": ld, "Record": record}
    exec(f"def load(rec, sc):\n    return Record({', '.join(fields)})\n", namespace)  # one field list per record
    return _device(namespace["load"])


def _make_step_kernel(update, family, load):
    """The generic one-launch step kernel around one family's element step
    ``(p, g, slot0, slot1, slot2, sc) -> (p, slot0..2)`` (optirs.backends.common.elementwise).

    ``s0``..``s2`` are the state slots' base addresses; bit k of ``used`` says slot k exists
    (an unused slot is neither read nor written). ``rec``: 0, or the address of a device scalars
    record that replaces ``sc`` (capturable steps); ``flag``: 0, or the address of a float32
    found_inf flag: when it is non-zero the launch writes nothing (each thread reads it once).
    """

    def step(chunks, ptrs, nchunks, s0, s1, s2, used, rec, flag, sc):
        if flag != 0:
            if ld(flag) != 0:
                return
        if rec != 0:
            sc = load(rec, sc)
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        u0 = (used & 1) != 0
        u1 = (used & 2) != 0
        u2 = (used & 4) != 0
        c = cuda.blockIdx.x
        while c < nchunks:
            t = chunks[c, 0]
            start = chunks[c, 1]
            n = chunks[c, 2]
            off = (chunks[c, 3] + start) * 4
            pa = ptrs[t, 0] + start * 4
            ga = ptrs[t, 1] + start * 4
            a0 = s0 + off
            a1 = s1 + off
            a2 = s2 + off
            nvec = n >> 2 if ((pa | ga | off) & 15) == 0 else 0
            k = tid
            while k < nvec:
                o = k << 4
                p0, p1, p2, p3 = ld4(pa + o)
                g0, g1, g2, g3 = ld4(ga + o)
                x0, x1, x2, x3 = ld4_if(u0, a0 + o)
                y0, y1, y2, y3 = ld4_if(u1, a1 + o)
                z0, z1, z2, z3 = ld4_if(u2, a2 + o)
                p0, x0, y0, z0 = update(p0, g0, x0, y0, z0, sc)
                p1, x1, y1, z1 = update(p1, g1, x1, y1, z1, sc)
                p2, x2, y2, z2 = update(p2, g2, x2, y2, z2, sc)
                p3, x3, y3, z3 = update(p3, g3, x3, y3, z3, sc)
                st4(pa + o, p0, p1, p2, p3)
                if u0:
                    st4(a0 + o, x0, x1, x2, x3)
                if u1:
                    st4(a1 + o, y0, y1, y2, y3)
                if u2:
                    st4(a2 + o, z0, z1, z2, z3)
                k += nthreads
            # The tail of the chunk (or all of a misaligned chunk), one element per thread.
            i = (nvec << 2) + tid
            while i < n:
                o = i << 2
                p, x, y, z = update(ld(pa + o), ld(ga + o), ld_if(u0, a0 + o), ld_if(u1, a1 + o),
                                    ld_if(u2, a2 + o), sc)
                st(pa + o, p)
                if u0:
                    st(a0 + o, x)
                if u1:
                    st(a1 + o, y)
                if u2:
                    st(a2 + o, z)
                i += nthreads
            c += cuda.gridDim.x

    step.__name__ = step.__qualname__ = f"step_{family}"
    return step


# The generic kernel around each elementwise family's element step (compiled lazily by the
# backend for the scalars' numba type).
RECORDS = {d.kernel: d.scalars_type for d in DEFINITIONS.values() if d.kernel in ELEMENT_STEPS}
LOADERS = {family: record_loader(record) for family, record in RECORDS.items()}
STEP_FUNCTIONS = {family: _make_step_kernel(update, family, LOADERS[family]) for family, update in ELEMENT_STEPS.items()}


# ------------------------------------------------------------------ device-side scalars (capturable)


def _make_scalars_kernel(values, nfields, name):
    """The one-thread kernel that advances a capturable step on the device: unless the float32
    flag at ``flag`` is non-zero (found_inf), ``step = steps[0] + 1`` is written to every entry
    of ``steps`` and the family's record for (constants, lr, step, grad_factor) to ``out``
    (float32 per field, bools as 0 / 1). ``values`` is the family's float64 formula of
    optirs.core.scalars, compiled here, so the record has the host's bits. lr is read at
    ``lr_addr`` (a float32 tensor) unless it is 0 (then ``lr``); grad_factor is ``sign / scale``
    with the float32 scale at ``scale_addr``, or ``sign``. The constants come last (they change
    with the group's hyperparameters and are rewritten in the prepared launch)."""

    def scalars(lr_addr, steps, nsteps, scale_addr, flag, out, floats):
        if cuda.grid(1) != 0:
            return
        if flag != 0:
            if ld(flag) != 0:
                return
        consts = floats[2:]
        sign = floats[1]
        rate = floats[0]
        if lr_addr != 0:
            rate = float64(ld(lr_addr))
        factor = sign
        if scale_addr != 0:
            factor = sign / float64(ld(scale_addr))
        step = float64(ld(steps)) + 1.0
        v = values(consts, rate, step, factor)
        for i in range(nfields):
            st(out + 4 * i, _F32(v[i]))
        count = _F32(step)
        for i in range(nsteps):
            st(steps + 4 * i, count)

    scalars.__name__ = scalars.__qualname__ = name
    return scalars


SCALARS_FUNCTIONS = {family: _make_scalars_kernel(_device(FORMULAS[family].values), len(RECORDS[family]._fields),
                                                  f"scalars_{family}")
                     for family in RECORDS if family in FORMULAS}


# ------------------------------------------------------------------ LAMB
# Three kernels, each one launch for the whole model: (optional) the global gradient norm, the
# moments pass that also sums ||p||^2 and ||u||^2 per tensor, and the apply pass. The per-tensor
# sums live in ``acc[q]`` (float64, 2 * ntensors + 1 entries: p^2 per tensor, u^2 per tensor,
# global g^2); ``q`` alternates per step and the apply pass zeroes ``acc[1 - q]`` for the next
# step, so no extra launch clears them.


@_device
def _block_add(acc, q, index, value):
    """Sum ``value`` over the block (a shared-memory tree, any block size up to 1024) and add
    it to ``acc[q, index]`` with one atomic."""
    partial = cuda.shared.array(1024, float64)
    tid = cuda.threadIdx.x
    n = cuda.blockDim.x
    partial[tid] = value
    cuda.syncthreads()
    stride = 1
    while stride < n:
        stride <<= 1
    stride >>= 1
    while stride > 0:
        if tid < stride and tid + stride < n:
            partial[tid] += partial[tid + stride]
        cuda.syncthreads()
        stride >>= 1
    if tid == 0:
        cuda.atomic.add(acc, (q, index), partial[0])
    cuda.syncthreads()


def lamb_grad_norm(chunks, ptrs, nchunks, acc, q, ntensors, sc):
    """acc[q, 2 * ntensors] += sum of g^2 over the model (``sc`` unused: every launch ends with the scalars)."""
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    s = 0.0
    c = cuda.blockIdx.x
    while c < nchunks:
        ga = ptrs[chunks[c, 0], 1] + chunks[c, 1] * 4
        n = chunks[c, 2]
        i = tid
        while i < n:
            g = ld(ga + (i << 2))
            s += float64(g) * float64(g)  # widened before squaring: no float32 overflow
            i += nthreads
        c += cuda.gridDim.x
    if cuda.blockIdx.x < nchunks:
        _block_add(acc, q, 2 * ntensors, s)


@_device
def _lamb_pass1(p, g, m, v, grad_scale, sc):
    m, v = lamb_moments(g, m, v, grad_scale, sc)
    u = lamb_direction(p, m, v, sc)
    return m, v, float64(p) * float64(p), float64(u) * float64(u)


def lamb_moments_pass(chunks, ptrs, nchunks, s0, s1, acc, q, ntensors, sc):
    """m, v updated in place; acc[q, t] += ||p_t||^2, acc[q, ntensors + t] += ||u_t||^2."""
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    raw_norm = 0.0
    if sc.max_grad_norm > 0:
        raw_norm = math.sqrt(acc[q, 2 * ntensors])
    grad_scale = lamb_grad_scale(raw_norm, sc)
    current = -1
    sp = 0.0
    su = 0.0
    c = cuda.blockIdx.x
    while c < nchunks:
        t = chunks[c, 0]
        if t != current:  # the same for the whole block: flush the previous tensor's sums
            if current >= 0:
                _block_add(acc, q, current, sp)
                _block_add(acc, q, ntensors + current, su)
            current = t
            sp = 0.0
            su = 0.0
        start = chunks[c, 1]
        n = chunks[c, 2]
        off = (chunks[c, 3] + start) * 4
        pa = ptrs[t, 0] + start * 4
        ga = ptrs[t, 1] + start * 4
        ma = s0 + off
        va = s1 + off
        nvec = n >> 2 if ((pa | ga | off) & 15) == 0 else 0
        k = tid
        while k < nvec:
            o = k << 4
            p0, p1, p2, p3 = ld4(pa + o)
            g0, g1, g2, g3 = ld4(ga + o)
            m0, m1, m2, m3 = ld4(ma + o)
            v0, v1, v2, v3 = ld4(va + o)
            m0, v0, dp0, du0 = _lamb_pass1(p0, g0, m0, v0, grad_scale, sc)
            m1, v1, dp1, du1 = _lamb_pass1(p1, g1, m1, v1, grad_scale, sc)
            m2, v2, dp2, du2 = _lamb_pass1(p2, g2, m2, v2, grad_scale, sc)
            m3, v3, dp3, du3 = _lamb_pass1(p3, g3, m3, v3, grad_scale, sc)
            st4(ma + o, m0, m1, m2, m3)
            st4(va + o, v0, v1, v2, v3)
            sp += (dp0 + dp1) + (dp2 + dp3)
            su += (du0 + du1) + (du2 + du3)
            k += nthreads
        i = (nvec << 2) + tid
        while i < n:
            o = i << 2
            m, v, dp, du = _lamb_pass1(ld(pa + o), ld(ga + o), ld(ma + o), ld(va + o), grad_scale, sc)
            st(ma + o, m)
            st(va + o, v)
            sp += dp
            su += du
            i += nthreads
        c += cuda.gridDim.x
    if current >= 0:
        _block_add(acc, q, current, sp)
        _block_add(acc, q, ntensors + current, su)


@_device
def _lamb_apply1(p, m, v, step, sc):
    return p - step * lamb_direction(p, m, v, sc)


def lamb_apply_pass(chunks, ptrs, nchunks, s0, s1, acc, q, ntensors, sc):
    """p -= lr * trust_ratio(t) * u; zeroes acc[1 - q] for the next step."""
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    j = cuda.grid(1)
    while j < 2 * ntensors + 1:
        acc[1 - q, j] = 0.0
        j += cuda.gridDim.x * nthreads
    c = cuda.blockIdx.x
    while c < nchunks:
        t = chunks[c, 0]
        ratio = _F32(lamb_trust_ratio(math.sqrt(acc[q, t]), math.sqrt(acc[q, ntensors + t]),
                                      float64(sc.max_trust_ratio)))
        step = sc.lr * ratio
        start = chunks[c, 1]
        n = chunks[c, 2]
        off = (chunks[c, 3] + start) * 4
        pa = ptrs[t, 0] + start * 4
        ma = s0 + off
        va = s1 + off
        nvec = n >> 2 if ((pa | off) & 15) == 0 else 0
        k = tid
        while k < nvec:
            o = k << 4
            p0, p1, p2, p3 = ld4(pa + o)
            m0, m1, m2, m3 = ld4(ma + o)
            v0, v1, v2, v3 = ld4(va + o)
            st4(pa + o, _lamb_apply1(p0, m0, v0, step, sc), _lamb_apply1(p1, m1, v1, step, sc),
                _lamb_apply1(p2, m2, v2, step, sc), _lamb_apply1(p3, m3, v3, step, sc))
            k += nthreads
        i = (nvec << 2) + tid
        while i < n:
            o = i << 2
            st(pa + o, _lamb_apply1(ld(pa + o), ld(ma + o), ld(va + o), step, sc))
            i += nthreads
        c += cuda.gridDim.x


LAMB_FUNCTIONS = {"grad_norm": lamb_grad_norm, "moments": lamb_moments_pass, "apply": lamb_apply_pass}


# ------------------------------------------------------------------ helpers


def fill(out, value):
    """out[:] = value (state initialisation), grid-stride."""
    i = cuda.grid(1)
    while i < out.shape[0]:
        out[i] = value
        i += cuda.gridsize(1)


fill_kernel = cuda.jit(fill)
