"""The cpu backend's step formats (``optirs_step`` with a format): 16-bit parameters, compact masters and state (docs/formats.md).

Staging views the caller's numpy arrays as words (float32 as uint32, bfloat16 / float16 as
uint16; a torch CPU bfloat16 tensor arrives from the caller as a numpy uint16 view), so the
loops of :mod:`optirs.backends.cpu.formats_kernels` update them in place: one parallel loop per
pass for the whole model. The kernels compile on first use and are cached on disk.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Dict, List

import numpy as np

from optirs.backends.cpu.steps import CHUNK
from optirs.backends.cpu.context import staged_lists
from optirs.core.definitions import DEFINITIONS
from optirs.core.errors import InvalidParameterError, UnsupportedOperationError
from optirs.backends.common.int8_buckets import bucket_table, padded_midpoints
from optirs.core.formats import BLOCK, FORMAT_FAMILIES, FormatState, StepFormat, dynamic_map, sqrt_levels
from optirs.plugin.hookspecs import Staged

assert CHUNK % BLOCK == 0  # every int8 block lies in one chunk

_EMPTY = {np.dtype(d): np.zeros(0, dtype=d) for d in (np.uint32, np.uint16, np.uint8, np.float32)}
_FAMILY_DEFINITION = {d.kernel: d for d in DEFINITIONS.values() if d.kernel in FORMAT_FAMILIES}


def _kernels():
    import optirs.backends.cpu.formats_kernels as formats_kernels

    return formats_kernels


def _words(array: np.ndarray, dtype: str, what: str) -> np.ndarray:
    """The flat word view of one caller array of ``dtype`` (float32 -> uint32, 16-bit -> uint16)."""
    if not isinstance(array, np.ndarray):
        raise InvalidParameterError(f"{what} is a {type(array).__name__}, expected a numpy array on the cpu backend")
    name = array.dtype.name
    if dtype == "float32":
        if name != "float32":
            raise InvalidParameterError(f"{what} has dtype {name}, expected float32")
        return array.reshape(-1).view(np.uint32)
    if name not in (dtype, "uint16"):
        raise InvalidParameterError(f"{what} has dtype {name}, expected {dtype} (or its uint16 bits)")
    return array.reshape(-1).view(np.uint16)


def _build(ctx, role: str, dtype: str):
    """Builds the typed list of the word views of a list of arrays of ``dtype``."""
    return lambda a: ctx.kernels.typed_list([_words(x, dtype, f"{role}[{i}]") for i, x in enumerate(a)])


@lru_cache(maxsize=2)
def _decoder_table(signed: bool) -> np.ndarray:
    """The map as the cpu's int8 decoders read it (:func:`optirs.backends.cpu.int8_native.decoder_table`)."""
    from optirs.backends.cpu.int8_native import decoder_table

    return decoder_table(dynamic_map(signed))


@lru_cache(maxsize=2)
def _sqrt_levels(signed: bool) -> np.ndarray:
    """A slot's square-root codes as the format loops read them: [largest code, signed]."""
    return np.array([sqrt_levels(signed), 1 if signed else 0], np.float32)


def _first_table(state_dtype: str, signed: bool) -> np.ndarray:
    """A slot's first table: the square-root codes' levels (also the float8 codes' stand-in: they read
    none), else the dynamic map's decoder table (also float32 and bfloat16 state's stand-in)."""
    return _sqrt_levels(signed) if state_dtype in ("int8_sqrt", "float8_e4m3fn") else _decoder_table(signed)


def _slot_arrays(state: Dict[str, Any], fs: FormatState, k_names, fmt: StepFormat):
    """Per kernel slot: (words, scales, small, map's decoder table, padded midpoints, bucket table), the
    used bit mask and the mask of the unsigned slots."""
    out, used, unsigned = [], 0, 0
    signed = {s.name: s.signed for s in fs.slots}
    f32 = _EMPTY[np.dtype(np.float32)]
    for k, name in enumerate(k_names):
        if name is None or name not in fs.slot_names:
            words = np.uint8 if fs.int8 else {"bfloat16": np.uint16, "float32": np.float32}[fmt.state_dtype]
            first = _first_table(fmt.state_dtype, True)
            out.append((_EMPTY[np.dtype(words)], f32, f32, first, padded_midpoints(True), bucket_table(True)))
            continue
        used |= 1 << k
        sg = signed[name]
        unsigned |= 0 if sg else 1 << k
        first = _first_table(fmt.state_dtype, sg)
        maps = first, padded_midpoints(sg), bucket_table(sg)
        if fs.int8:
            out.append((state[f"{name}.{fs.codes}"], state[f"{name}.scales"], state[f"{name}.small"]) + maps)
        elif fmt.state_dtype == "bfloat16":
            out.append((state[name], f32, f32) + maps)
        else:
            out.append((state[name], f32, f32) + maps)
    return out, used, unsigned


def _master(state: Dict[str, Any], fs: FormatState) -> np.ndarray:
    name = fs.master_buffer()
    if name is None:
        return _EMPTY[np.dtype(np.uint32)]
    buf = state[name]
    return buf.view(np.uint32) if buf.dtype == np.float32 else buf


class CpuFormats:
    """16-bit parameters, compact masters and compact state in one parallel loop per pass."""

    def _formats_stage(self, ctx, params: List[Any], grads: List[Any], fmt: StepFormat) -> Staged:
        return Staged(*staged_lists(ctx.format_lists, params, grads, _build(ctx, "params", fmt.param_dtype),
                                    _build(ctx, "grads", fmt.grad_dtype)))

    def _formats_step(self, ctx, request) -> None:
        family, params, grads, state, layout = (request.definition.kernel, request.params, request.grads,
                                                request.state, request.layout)
        format_state, fmt, scalars = request.format_state, request.fmt, request.scalars
        seed, step = request.controls.seed, request.controls.step
        if family not in _FAMILY_DEFINITION:
            raise UnsupportedOperationError(f"family {family!r} has no format step on cpu; expected one of "
                                            f"{list(FORMAT_FAMILIES)}")
        k = _kernels()
        names = _FAMILY_DEFINITION[family].slot_names()
        fc, seed, step = fmt.codes, np.uint64(int(seed) & 0xFFFFFFFF), np.uint64(step)
        table = format_state.tensor_table()
        mbuf = _master(state, format_state)
        chunks = layout.chunks(CHUNK)
        if family == "lamb":
            slots, _, _ = _slot_arrays(state, format_state, names[:2], fmt)
            (w0, c0, m0, q0, d0, t0), (w1, c1, m1, q1, d1, t1) = slots
            k.lamb(fc)(params, grads, mbuf, w0, c0, m0, w1, c1, m1, q0, d0, t0, q1, d1, t1, table, *chunks, len(layout),
                       scalars, seed, step)
            return
        slots, used, unsigned = _slot_arrays(state, format_state, (tuple(names) + (None, None, None))[:3], fmt)
        (w0, c0, m0, q0, d0, t0), (w1, c1, m1, q1, d1, t1), (w2, c2, m2, q2, d2, t2) = slots
        k.pointwise(fc, used, unsigned)(params, grads, mbuf, w0, c0, m0, w1, c1, m1, w2, c2, m2, q0, d0, t0, q1, d1, t1, q2, d2,
                              t2, table, *chunks, scalars, seed, step)

    def _formats_check(self, ctx, grads, layout, fmt, flag) -> None:
        chunks = layout.chunks(CHUNK)
        flags = np.zeros(len(chunks[0]), dtype=np.int32)
        _kernels().check(grads, *chunks, fmt.codes.grad, flags)
        if flags.any():
            flag[0] = 1
