"""float32 <-> float16 by the hardware's own conversion instructions, where it has them (cpu and GPU).

LLVM's ``fptrunc`` / ``fpext`` between float and half are ``vcvtps2ph`` / ``vcvtph2ps`` on x86
with F16C (every x86-64 since 2013) and ``fcvt`` on arm64: in the cpu format loops one
instruction per 16 values, where the bit-by-bit forms in :mod:`optirs.backends.common.formats`
take some 25 (a decode-multiply-encode loop measured 0.25 against 0.56 ns a value on one Zen 4
thread). They round to nearest even with subnormals and overflow to inf, as IEEE fixes and the
contract asks (docs/formats.md, numpy's cast); only NaN differs (the hardware keeps the payload
and sets the quiet bit), so a NaN is selected apart to the contract's value. Checked equal to the
bit-by-bit forms for all 2**32 float32 and all 2**16 float16 inputs (tests/test_formats.py checks
the encodings against numpy and ml_dtypes on the special values and rounding boundaries).

:func:`native_or` wraps a bit-by-bit function: the wrapper compiles the conversion instruction
form on a cpu that has it and in a cuda device function (``cvt.rn.f16.f32`` / ``cvt.f32.f16``,
IEEE as well; tests/test_formats_cuda.py checks them against numpy on the device), and the
bit-by-bit form elsewhere (a cpu without F16C).
"""

from __future__ import annotations

import platform

import numpy as np

from llvmlite import ir
from numba import njit, types
from numba.core.cpu import CPUContext
from numba.extending import intrinsic

from optirs.backends.common.bits32 import and32, bits_f32_cast, f32_bits_cast, or32, shl32, shr32, u32


def _cpu_converts() -> bool:
    """Whether the cpu numba compiles for has float <-> half instructions (x86: F16C; arm64 always).

    numba compiles for this machine's cpu unless ``NUMBA_CPU_NAME`` names another (a portable
    cache: ``generic``); then only the features it is given count. Without the instructions LLVM
    would call a runtime helper that numba's JIT may not link."""
    from numba.core import config

    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return True
    if machine not in ("x86_64", "amd64", "i386", "i686", "x86"):
        return False
    if config.CPU_NAME is not None and config.CPU_NAME != "host":
        return "+f16c" in (config.CPU_FEATURES or "").split(",")
    from llvmlite import binding

    try:
        return bool(binding.get_host_cpu_features().get("f16c", False))
    except RuntimeError:  # llvmlite cannot read the features: keep the bit-by-bit form
        return False


_NATIVE = _cpu_converts()


@intrinsic
def _fptrunc_half(typingctx, x):
    """float32 -> float16 bits (uint32) by ``fptrunc``: IEEE round to nearest even, NaN as the cpu makes it."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        h = builder.fptrunc(args[0], ir.HalfType())
        return builder.zext(builder.bitcast(h, ir.IntType(16)), ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def _fpext_half(typingctx, h):
    """float16 bits (the low 16 of a uint32) -> float32 by ``fpext``: exact, NaN as the cpu makes it."""
    if h != types.uint32:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(builder.trunc(args[0], ir.IntType(16)), ir.HalfType()), ir.FloatType())

    return types.float32(types.uint32), codegen


def _encode_native(x):
    u = f32_bits_cast(x)
    # numpy's NaN: the top 10 payload bits, never 0 (that would be inf), no quiet bit added
    payload = and32(shr32(u, 13), 0x3FF)
    nan = or32(and32(shr32(u, 16), 0x8000), or32(0x7C00, or32(payload, 1 if payload == 0 else 0)))
    return nan if and32(u, 0x7FFFFFFF) > 0x7F800000 else _fptrunc_half(x)


def _decode_native(h):
    # the contract's NaN: the quiet NaN with h's sign
    nan = bits_f32_cast(or32(shl32(and32(h, 0x8000), 16), 0x7FC00000))
    return nan if and32(h, 0x7FFF) > 0x7C00 else _fpext_half(h)


def _is_cuda(context) -> bool:
    """Whether ``context`` compiles for a GPU, whose ``cvt.rn.f16.f32`` / ``cvt.f32.f16`` are the
    conversions (sm_53 on; NVVM lowers ``fptrunc`` / ``fpext`` to them): one instruction where the
    bit-by-bit forms take 10-25 in the formats kernels."""
    try:
        from numba.cuda.target import CUDATargetContext
    except ImportError:
        return False
    return isinstance(context, CUDATargetContext)


def native_or(fallback, native):
    """A function of ``fallback``'s signature (float32 -> uint32 or uint32 -> float32) that compiles
    ``native`` (``"encode"`` or ``"decode"``) on a cpu with conversion instructions, ``fallback``
    (an ``@njit`` function) on every other target."""
    impl = {"encode": _encode_native, "decode": _decode_native}[native]

    @intrinsic
    def choose(typingctx, a):
        sig = types.uint32(types.float32) if native == "encode" else types.float32(types.uint32)
        if a != sig.args[0]:
            return None

        def codegen(context, builder, sig, args):
            use = impl if (_NATIVE and isinstance(context, CPUContext)) or _is_cuda(context) else fallback.py_func
            return context.compile_internal(builder, use, sig, args)

        return sig, codegen

    if native == "encode":

        @njit(cache=False, error_model="numpy")
        def converted(x):
            return choose(np.float32(x))

    else:

        @njit(cache=False, error_model="numpy")
        def converted(h):
            return choose(u32(h))

    return converted
