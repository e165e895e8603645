"""What the step needs to know about any array it is given, without importing its library.

numpy arrays, objects with ``__cuda_array_interface__`` (numba, CuPy, PyTorch CUDA tensors) and
``pyopencl.array.Array`` are described uniformly, so the optimizer validates every input
before a backend touches anything.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

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
    address: int  # the data pointer (numpy, cuda); 0 where unknown
    # The bytes the array spans, to recognise memory passed twice or overlapping views:
    # (memory space, first byte, end byte). The space is "numpy" or "cuda" (one address space each:
    # host pointers, device pointers under unified addressing), or ("opencl", cl_mem handle of the
    # root buffer) with byte offsets inside that buffer. None: unknown (no check possible).
    extent: Optional[Tuple[Any, int, int]] = None

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def memory(self) -> Optional[Tuple[Any, int, int]]:
        """``extent``, or the one derived from ``address`` for metas made without one (0: unknown)."""
        if self.extent is not None:
            return self.extent
        if self.address:
            return (self.kind, self.address, self.address + self.nbytes)
        return None


def _c_contiguous(shape: Tuple[int, ...], strides, itemsize: int) -> bool:
    if strides is None:
        return True
    expected = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim != 1 and stride != expected:
            return False
        expected *= dim
    return True


def _span(pointer: int, shape: Tuple[int, ...], strides, itemsize: int) -> Tuple[int, int]:
    """[first, end) byte of an array at ``pointer`` with these strides (None: C-contiguous)."""
    if any(d == 0 for d in shape):
        return pointer, pointer
    if strides is None:
        return pointer, pointer + int(np.prod(shape, dtype=np.int64)) * itemsize
    low = sum((d - 1) * s for d, s in zip(shape, strides) if s < 0)
    high = sum((d - 1) * s for d, s in zip(shape, strides) if s > 0)
    return pointer + low, pointer + high + itemsize


def _numpy_meta(array: np.ndarray, kind: str, writeable: bool) -> ArrayMeta:
    pointer = array.__array_interface__["data"][0]
    first, end = _span(pointer, array.shape, array.strides, array.itemsize)
    return ArrayMeta(kind, array.shape, array.dtype, bool(array.flags.c_contiguous), writeable, pointer,
                     (kind, first, end))


def _opencl_root(buffer: Any) -> Tuple[int, int]:
    """(cl_mem handle of the buffer that owns the memory, byte offset of ``buffer`` in it):
    a sub-buffer is a handle of its own over its parent's memory."""
    import pyopencl as cl

    offset = 0
    while True:
        parent = buffer.get_info(cl.mem_info.ASSOCIATED_MEMOBJECT)
        if parent is None:
            return int(buffer.int_ptr), offset
        offset += int(buffer.get_info(cl.mem_info.OFFSET))
        buffer = parent


def _bfloat16() -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def _cuda_interface(array: Any) -> Tuple[Optional[Dict[str, Any]], Optional[np.dtype]]:
    """(``__cuda_array_interface__``, the element dtype) of ``array``, or (None, None).

    torch refuses bfloat16 in the interface (TypeError: no typestr for it), or in some versions
    exports the anonymous ``<V2``; a torch CUDA bfloat16 tensor is described through its int16 view
    (the same memory, shape and strides) and keeps bfloat16 as its dtype.
    """
    if type(array).__module__.startswith("torch") and str(getattr(array, "dtype", "")) == "torch.bfloat16":
        torch = sys.modules.get("torch")
        if torch is not None and getattr(array, "is_cuda", False):
            return array.view(torch.int16).__cuda_array_interface__, _bfloat16()
    try:
        cai = getattr(array, "__cuda_array_interface__", None)
    except (TypeError, ValueError) as exc:  # an exporter that refuses this array's dtype
        raise InvalidParameterError(f"{type(array).__qualname__} refuses __cuda_array_interface__ ({exc}), expected "
                                    "an array of a dtype its library exports") from exc
    if cai is None:
        return None, None
    return cai, np.dtype(cai["typestr"])


# numba, CuPy and torch's __cuda_array_interface__ have no bfloat16: bfloat16 device arrays
# travel as their 16-bit patterns.
BITS_DTYPES = (np.dtype(np.uint16), np.dtype(np.int16))


def as_16bit(meta: ArrayMeta, dtype: Any) -> ArrayMeta:
    """``meta`` of a device array of 16-bit patterns (uint16/int16) as an array of ``dtype``
    (bfloat16 or float16); any other array's meta as it is."""
    if meta.kind != "numpy" and meta.dtype in BITS_DTYPES:
        return replace(meta, dtype=np.dtype(dtype))
    return meta


# ndarray subclasses that are plain memory: numpy's memory-mapped files.
_PLAIN_SUBCLASSES = (np.memmap,)


def describe(array: Any, what: str = "array") -> ArrayMeta:
    """Describe ``array``; raises InvalidParameterError for a kind optirs cannot step."""
    if isinstance(array, np.ndarray):
        if type(array) is not np.ndarray and not isinstance(array, _PLAIN_SUBCLASSES):
            # np.matrix, np.ma.MaskedArray, ...: their semantics (masks, 2-D-only algebra) would be
            # dropped by some backends and refused by others; optirs steps plain arrays only.
            raise InvalidParameterError(
                f"{what} of type {type(array).__module__}.{type(array).__qualname__} (a numpy.ndarray subclass), "
                "expected a plain numpy.ndarray (np.asarray(x) for np.matrix; decide what a mask means for a masked array)"
            )
        return _numpy_meta(array, "numpy", bool(array.flags.writeable))
    if is_simulator_array(array):
        # The CUDA simulator's device arrays wrap a host array and expose no
        # __cuda_array_interface__; describe the array they wrap.
        return _numpy_meta(array._ary, "cuda", True)
    cai, dtype = _cuda_interface(array)
    if cai is not None:
        shape = tuple(int(d) for d in cai["shape"])
        ptr, readonly = cai["data"]
        strides = cai.get("strides")
        first, end = _span(int(ptr or 0), shape, None if strides is None else tuple(strides), dtype.itemsize)
        return ArrayMeta("cuda", shape, dtype, _c_contiguous(shape, strides, dtype.itemsize),
                         not readonly, int(ptr or 0), ("cuda", first, end) if ptr else None)
    if type(array).__module__.startswith("pyopencl"):
        shape, dtype = tuple(int(d) for d in array.shape), np.dtype(array.dtype)
        offset = int(getattr(array, "offset", 0))
        extent = None
        if array.base_data is not None:
            handle, base = _opencl_root(array.base_data)
            first, end = _span(base + offset, shape, tuple(array.strides), dtype.itemsize)
            extent = (("opencl", handle), first, end)
        return ArrayMeta("opencl", shape, dtype, bool(array.flags.c_contiguous), True, 0, extent)
    raise InvalidParameterError(
        f"{what} of type {type(array).__module__}.{type(array).__qualname__}, expected a numpy array, "
        "an object with __cuda_array_interface__ (numba/CuPy/PyTorch CUDA) or a pyopencl.array.Array"
    )


def check_no_overlap(params: Sequence[ArrayMeta], grads: Sequence[ArrayMeta] = (), what: str = "params",
                     expected: str = "distinct tensors") -> None:
    """Raise InvalidParameterError when any two of ``params`` share a byte, or a gradient shares one
    with any parameter. Gradients may alias each other: the step only reads them (as torch allows
    one tensor as the gradient of several parameters).

    Metas whose memory is unknown (``ArrayMeta.memory`` None) and empty arrays are not compared.
    One sort and one sweep per memory space: O(n log n) in the number of arrays.
    """
    spans: List[Tuple[Any, int, int, int, str, int]] = []
    for order, (label, metas) in enumerate(((what, params), ("grads", grads))):
        for i, m in enumerate(metas):
            memory = m.memory
            if memory is not None and memory[2] > memory[1]:
                spans.append((memory[0], memory[1], memory[2], order, label, i))
    spans.sort(key=lambda s: (repr(s[0]), s[1], s[3], s[5]))
    space = None
    reach_any = reach_param = None  # the span reaching furthest so far (any / a parameter's) in this space
    for span in spans:
        if span[0] != space:
            space, reach_any, reach_param = span[0], None, None
        is_param = span[3] == 0
        other = reach_any if is_param else reach_param
        if other is not None and other[2] > span[1]:
            a, b = sorted((span, other), key=lambda s: (s[3], s[5]), reverse=True)
            shared = min(a[2], b[2]) - max(a[1], b[1])
            how = "all its bytes" if (a[1], a[2]) == (b[1], b[2]) else f"{shared} overlapping bytes"
            reason = "expected gradients that alias no parameter (parameters are written while gradients are read)" \
                if a[3] != b[3] else f"expected {expected} that do not overlap"
            raise InvalidParameterError(f"{a[4]}[{a[5]}] is the same memory as {b[4]}[{b[5]}] ({how}), {reason}")
        if reach_any is None or span[2] > reach_any[2]:
            reach_any = span
        if is_param and (reach_param is None or span[2] > reach_param[2]):
            reach_param = span
