"""The ``mixed_precision`` capability of the numpy example backend, in plain numpy.

numpy's float32 -> float16 cast and ml_dtypes' float32 -> bfloat16 cast round to nearest even,
as optirs' built-in kernels do, so the results match them bit for bit.
"""

import numpy as np
from optirs.core.arrays import ArrayMeta
from optirs.core.errors import InvalidParameterError
from optirs.plugin.hookspecs import hookimpl


def _half(bfloat16):
    if bfloat16:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(np.float16)


def _slices(layout):
    return [slice(int(o), int(o + n)) for o, n in zip(layout.offsets, layout.sizes)]


@hookimpl
def optirs_mixed_precision_describe(array, what):
    if not isinstance(array, np.ndarray):
        raise InvalidParameterError(f"{what} is a {type(array).__name__}, expected a numpy array on the numpy backend")
    return ArrayMeta("numpy", array.shape, array.dtype, bool(array.flags.c_contiguous), bool(array.flags.writeable),
                     array.__array_interface__["data"][0])


@hookimpl
def optirs_mixed_precision_unscale(grads, out, layout, inv_scale, bfloat16):
    dtype = _half(bfloat16)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow is what the flag reports
        for g, s in zip(grads, _slices(layout)):
            out[s] = g.reshape(-1).view(dtype).astype(np.float32) * np.float32(inv_scale)
    return not bool(np.isfinite(out).all())


@hookimpl
def optirs_mixed_precision_narrow(masters, params, layout, bfloat16):
    dtype = _half(bfloat16)
    with np.errstate(over="ignore", invalid="ignore"):
        for p, s in zip(params, _slices(layout)):
            p.reshape(-1).view(np.uint16)[:] = masters[s].astype(dtype).view(np.uint16)
