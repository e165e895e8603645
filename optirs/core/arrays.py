"""What the step needs to know about any array it is given, without importing its library.

numpy arrays, objects with ``__cuda_array_interface__`` (numba, CuPy, PyTorch CUDA tensors) and
``pyopencl.array.Array`` are described uniformly, so the optimizer validates every input
before a backend touches anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Tuple

import numpy as np

from optirs.core.errors import InvalidParameterError
from optirs.core.simulator import is_simulator_array


@dataclass(frozen=True)
class ArrayMeta:
    kind: str  # "numpy", "cuda" or "opencl"
    shape: Tuple[int, ...]
    dtype: np.dtype
    contiguous: bool
    writeable: bool
    address: int  # to recognise the same memory passed twice

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def _c_contiguous(shape: Tuple[int, ...], strides, itemsize: int) -> bool:
    if strides is None:
        return True
    expected = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim != 1 and stride != expected:
            return False
        expected *= dim
    return True


def describe(array: Any, what: str = "array") -> ArrayMeta:
    """Describe ``array``; raises InvalidParameterError for a kind optirs cannot step."""
    if isinstance(array, np.ndarray):
        return ArrayMeta("numpy", array.shape, array.dtype, bool(array.flags.c_contiguous),
                         bool(array.flags.writeable), array.__array_interface__["data"][0])
    if is_simulator_array(array):
        # The CUDA simulator's device arrays wrap a host array and expose no
        # __cuda_array_interface__; describe the array they wrap.
        host = array._ary
        return ArrayMeta("cuda", host.shape, host.dtype, bool(host.flags.c_contiguous), True,
                         host.__array_interface__["data"][0])
    cai = getattr(array, "__cuda_array_interface__", None)
    if cai is not None:
        shape = tuple(int(d) for d in cai["shape"])
        dtype = np.dtype(cai["typestr"])
        ptr, readonly = cai["data"]
        return ArrayMeta("cuda", shape, dtype, _c_contiguous(shape, cai.get("strides"), dtype.itemsize),
                         not readonly, int(ptr or 0))
    if type(array).__module__.startswith("pyopencl"):
        return ArrayMeta("opencl", tuple(array.shape), np.dtype(array.dtype), bool(array.flags.c_contiguous),
                         True, id(array.base_data) ^ int(getattr(array, "offset", 0)))
    raise InvalidParameterError(
        f"{what} of type {type(array).__module__}.{type(array).__qualname__}, expected a numpy array, "
        "an object with __cuda_array_interface__ (numba/CuPy/PyTorch CUDA) or a pyopencl.array.Array"
    )
