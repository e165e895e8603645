"""What the cpu and cuda backends share to compile and run generated fused kernels (numba Python).

The texts come from ``optirs_fusion_compile``'s :class:`FusedGroupSource`; their parameter names
(see :class:`optirs.plugin.hookspecs.FusedKernelText`) say which argument goes where.
"""

from __future__ import annotations

import linecache
import threading
from typing import Any, Callable, Dict, Hashable, List, Sequence

import numpy as np

from optirs.plugin.hookspecs import FusedGroupSource


class KernelCache:
    """Compiled kernels by key (the text names no sizes, so one kernel serves every group like it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hits: Dict[Hashable, Any] = {}

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The kernel cached under ``key``, built (outside the lock) on first use."""
        with self._lock:
            hit = self._hits.get(key)
        if hit is None:
            hit = build()
            with self._lock:
                hit = self._hits.setdefault(key, hit)
        return hit


def exec_source(text: str, tag: str, namespace: Dict[str, Any]) -> Dict[str, Any]:
    """Execute generated Python in ``namespace`` and return it (the kernels are its functions)."""
    filename = f"<optirs-fusion-{tag}-{abs(hash(text)):x}>"
    # registered so that numba and tracebacks can show the generated lines
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    exec(compile(text, filename, "exec"), namespace)
    return namespace


def product(a, b):
    """A plain product (the CPU and the simulator round it on its own; no fma contraction)."""
    return a * b


def _array_dtype(source: FusedGroupSource, param: str) -> np.dtype:
    stores = len(source.output_dtypes) - len(source.reductions)
    j = int(param.lstrip("inoutredpart"))
    if param.startswith("in"):
        return source.input_dtypes[j]
    if param.startswith("out"):
        return source.output_dtypes[j]
    if param.startswith("red"):
        return source.output_dtypes[stores + j]
    return np.dtype(np.float64)  # part<j>: float64 partials


def numba_signature(source: FusedGroupSource, params: Sequence[str]) -> tuple:
    """The numba argument types of a generated kernel (to compile it before its first run)."""
    from numba import types, typeof

    nd = len(source.domain)
    sig = []
    for p in params:
        if p in ("n", "chunk"):
            sig.append(types.int64)
        elif p == "layout":
            sig.append(types.UniTuple(types.int64, 3))
        elif p == "dims" or p.startswith("st"):
            sig.append(types.UniTuple(types.int64, nd))
        else:
            sig.append(typeof(np.empty(1, _array_dtype(source, p))))
    return tuple(sig)


def numba_arguments(source: FusedGroupSource, params: Sequence[str], inputs: Sequence[Any], outputs: Sequence[Any],
                    parts: Sequence[Any] = ()) -> List[Any]:
    """The arguments of a generated numba kernel, in its parameters' order."""
    stores = len(outputs) - len(source.reductions)
    vals: List[Any] = []
    for p in params:
        if p == "n":
            vals.append(np.int64(source.elements))
        elif p == "chunk":
            vals.append(np.int64(source.chunk))
        elif p == "layout":
            vals.append(tuple(np.int64(x) for x in source.layout))
        elif p == "dims":
            vals.append(tuple(np.int64(d) for d in source.domain))
        elif p.startswith("st"):
            vals.append(tuple(np.int64(s) for s in source.input_strides[int(p[2:])]))
        elif p.startswith("in"):
            vals.append(inputs[int(p[2:])])
        elif p.startswith("out"):
            vals.append(outputs[int(p[3:])])
        elif p.startswith("red"):
            vals.append(outputs[stores + int(p[3:])])
        elif p.startswith("part"):
            vals.append(parts[int(p[4:])])
    return vals


def reduction_identity(kind: str) -> float:
    """The float64 value a partial of a ``sum`` or ``max`` starts from."""
    return 0.0 if kind == "sum" else -np.inf


def chunks(source: FusedGroupSource) -> int:
    """Partials of an all-axes reduction (at least 1: chunk 0 is what the final step sees when n == 0)."""
    return max(1, -(-source.elements // source.chunk))


def work_items(source: FusedGroupSource) -> int:
    """Loop iterations (threads) of a group's kernel: chunks, output elements of a one-axis reduction, or elements."""
    if source.reductions and source.layout is None:
        return chunks(source)
    if source.layout is not None:
        return source.layout[0] * source.layout[2]
    return source.elements
