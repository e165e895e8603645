"""Sparse optimizers for embedding tables: row-sparse gradients, lazy or dense-decay state.

An embedding table is a float32 ``(num_rows, dim)`` parameter whose gradient touches only the
rows looked up in the batch. The gradient arrives in one of two forms:

- :class:`CooGradient`: ``indices`` (one table row per gradient row, any order, duplicates
  allowed) and ``values`` ``(nnz, dim)``: what ``nn.Embedding(sparse=True)`` produces;
- :class:`CsrGradient`: ``indptr`` (``num_rows + 1`` non-decreasing offsets) and ``values``
  ``(nnz, dim)``; table row ``r`` receives the sum of ``values[indptr[r]:indptr[r + 1]]``. This is
  the compressed-row layout with dense ``1 x dim`` blocks (scipy's BSR with one block column),
  the layout a sort-by-row embedding backward produces.

Duplicate rows are summed (in the order given). Indices are checked before anything changes:
a negative or out-of-range row, a malformed ``indptr`` or mismatched shapes raise the project's
errors and leave parameters and state as they were.

:class:`SparseAdam` has two modes (:class:`LazyAdamMode`):

- ``LAZY``: as ``torch.optim.SparseAdam``: only the rows present in the gradient are touched
  (moments and parameters); the step count is per table. Its update is
  ``p -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)`` (torch's placement of eps).
- ``DENSE_DECAY``: every row steps as dense Adam (``torch.optim.Adam``) would with a zero
  gradient for the absent rows: their moments decay and their parameters keep moving. It reads
  the sparse gradient directly (no dense gradient is formed) but runs over the whole table.

:class:`SparseSgd` follows ``torch.optim.SGD`` (momentum, dampening, nesterov, L2 decay):
``DENSE_DECAY`` equals SGD with zero-filled dense gradients (what torch computes for sparse
gradients with momentum), ``LAZY`` updates only present rows, each row's momentum buffer
starting at its gradient the first time the row is present.

Each table's state is a :class:`SparseAdamTable` / :class:`SparseSgdTable` on the chosen
backend (``cpu``, ``cuda``, ``opencl``); the kernels are in :mod:`optirs.backends.common.sparse_kernels`.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Tuple, Union

import numpy as np

from optirs.core import scalars as sc
from optirs.core.arrays import ArrayMeta
from optirs.core.arrays import describe as _core_describe
from optirs.core.errors import (BackendUnavailableError, GpuOptimError, InvalidParameterError, ShapeMismatchError,
                     UnsupportedOperationError)
from optirs.core.params import AdamParams, SgdParams

F32 = np.dtype(np.float32)


class LazyAdamMode(enum.Enum):
    """How state of rows absent from a step's gradient evolves (used by SparseAdam and SparseSgd)."""

    LAZY = "lazy"  # absent rows untouched (torch.optim.SparseAdam)
    DENSE_DECAY = "dense_decay"  # absent rows step as dense with zero gradient


def _mode(value: Any) -> LazyAdamMode:
    try:
        return value if isinstance(value, LazyAdamMode) else LazyAdamMode(value)
    except ValueError:
        raise InvalidParameterError(
            f"mode={value!r}, expected one of {[m.value for m in LazyAdamMode]} or a LazyAdamMode"
        ) from None


# ---------------------------------------------------------------- gradients


def describe(array: Any, what: str = "array") -> ArrayMeta:
    """optirs.core.arrays.describe, plus the arrays of numba's CUDA simulator (kind "cuda")."""
    if type(array).__name__ == "FakeCUDAArray":  # the simulator's arrays have no __cuda_array_interface__
        a = array._ary
        return ArrayMeta("cuda", a.shape, a.dtype, bool(a.flags.c_contiguous), bool(a.flags.writeable),
                         a.__array_interface__["data"][0])
    return _core_describe(array, what)


def _host_ints(array: Any, what: str) -> np.ndarray:
    """An index array as host int64 (device index arrays are small: nnz or num_rows + 1)."""
    if isinstance(array, np.ndarray):
        host = array
    elif hasattr(array, "copy_to_host"):  # numba device arrays (and the simulator's)
        host = array.copy_to_host()
    elif hasattr(array, "__cuda_array_interface__"):
        from numba import cuda

        host = cuda.as_cuda_array(array).copy_to_host()
    elif type(array).__module__.startswith("pyopencl"):
        host = array.get()
    elif isinstance(array, (list, tuple)):
        host = np.asarray(array)
        if host.size == 0:
            host = host.astype(np.int64)
    else:
        raise InvalidParameterError(
            f"{what} of type {type(array).__name__}, expected an integer numpy array (or a device array)"
        )
    if host.ndim != 1:
        raise ShapeMismatchError(f"{what} has shape {host.shape}, expected a 1-D array")
    if host.dtype.kind not in "iu":
        raise InvalidParameterError(f"{what} has dtype {host.dtype}, expected an integer dtype")
    return host.astype(np.int64, copy=False)


def _check_values(values: Any, what: str = "values") -> Tuple[int, int]:
    meta = describe(values, what)
    if len(meta.shape) != 2:
        raise ShapeMismatchError(f"{what} has shape {meta.shape}, expected (nnz, dim)")
    if meta.dtype != F32:
        raise ShapeMismatchError(f"{what} has dtype {meta.dtype}, expected float32")
    if not meta.contiguous:
        raise ShapeMismatchError(f"{what} is not C-contiguous, expected a contiguous array")
    return meta.shape


class CooGradient:
    """A row-sparse gradient in coordinate form: ``values[i]`` is added to table row ``indices[i]``.

    :param indices: integer row indices, shape ``(nnz,)``, any order, duplicates summed.
    :param values: float32 gradient rows, shape ``(nnz, dim)`` (numpy or the backend's device array).
    """

    def __init__(self, indices: Any, values: Any):
        self.values = values
        self.indices = _host_ints(indices, "indices")
        nnz, self.dim = _check_values(values)
        if self.indices.shape[0] != nnz:
            raise ShapeMismatchError(f"{self.indices.shape[0]} indices for {nnz} value rows, expected one index per row")
        self.nnz = nnz

    def segments(self, num_rows: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, seg, order) as the kernels take them (see optirs.backends.common.sparse_kernels); checks the indices."""
        idx = self.indices
        if idx.size:
            low, high = int(idx.min()), int(idx.max())
            if low < 0:
                raise InvalidParameterError(f"indices contain {low} at position {int(np.argmin(idx))}, expected rows >= 0")
            if high >= num_rows:
                raise InvalidParameterError(
                    f"indices contain {high} at position {int(np.argmax(idx))}, expected rows < num_rows={num_rows}"
                )
        if idx.size and bool(np.all(idx[1:] > idx[:-1])):
            # Already sorted and unique (a coalesced gradient): no sort, one row per entry.
            n = idx.size
            return idx.copy(), np.arange(n + 1, dtype=np.int64), np.arange(n, dtype=np.int64)
        # A stable sort keeps duplicates in the order given, so sums are reproducible.
        order = np.argsort(idx, kind="stable")
        ordered = idx[order]
        starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]]) if idx.size else np.zeros(0, np.int64)
        rows = ordered[starts]
        seg = np.append(starts, idx.size).astype(np.int64)
        return rows.astype(np.int64), seg, order.astype(np.int64)

    def to_dense(self, num_rows: int) -> np.ndarray:
        """The dense float32 ``(num_rows, dim)`` gradient (host values only), duplicates summed in order."""
        rows, seg, order = self.segments(num_rows)
        values = _numpy_values(self.values)
        dense = np.zeros((num_rows, self.dim), F32)
        for k, r in enumerate(rows):
            acc = values[order[seg[k]]].copy()
            for q in range(seg[k] + 1, seg[k + 1]):
                acc += values[order[q]]
            dense[r] = acc
        return dense

    def __repr__(self) -> str:
        return f"CooGradient(nnz={self.nnz}, dim={self.dim})"


class CsrGradient:
    """A row-sparse gradient in compressed-row form: row ``r`` gets ``sum(values[indptr[r]:indptr[r+1]])``.

    :param indptr: ``num_rows + 1`` non-decreasing integer offsets, ``indptr[0] == 0`` and
        ``indptr[-1] == nnz``.
    :param values: float32 gradient rows, shape ``(nnz, dim)``.
    """

    def __init__(self, indptr: Any, values: Any):
        self.values = values
        self.indptr = _host_ints(indptr, "indptr")
        self.nnz, self.dim = _check_values(values)
        ptr = self.indptr
        if ptr.size == 0:
            raise ShapeMismatchError("indptr is empty, expected num_rows + 1 offsets")
        if ptr[0] != 0:
            raise InvalidParameterError(f"indptr[0]={int(ptr[0])}, expected 0")
        drops = np.flatnonzero(np.diff(ptr) < 0)
        if drops.size:
            i = int(drops[0])
            raise InvalidParameterError(
                f"indptr is not sorted: indptr[{i}]={int(ptr[i])} > indptr[{i + 1}]={int(ptr[i + 1])}, "
                "expected non-decreasing row pointers"
            )
        if ptr[-1] != self.nnz:
            raise ShapeMismatchError(f"indptr[-1]={int(ptr[-1])}, expected nnz={self.nnz} (the number of value rows)")
        self.num_rows = ptr.size - 1

    @classmethod
    def from_coo(cls, coo: CooGradient, num_rows: int) -> "CsrGradient":
        """The same gradient in CSR form (host values only; rows sorted, duplicates kept in order)."""
        rows, seg, order = coo.segments(num_rows)
        counts = np.zeros(num_rows, np.int64)
        counts[rows] = np.diff(seg)
        indptr = np.r_[0, np.cumsum(counts)].astype(np.int64)
        return cls(indptr, np.ascontiguousarray(_numpy_values(coo.values)[order]))

    def segments(self, num_rows: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self.num_rows != num_rows:
            raise ShapeMismatchError(
                f"indptr has {self.indptr.size} entries, expected num_rows + 1 = {num_rows + 1} for this table"
            )
        rows = np.flatnonzero(np.diff(self.indptr)).astype(np.int64)
        # Empty rows between touched ones contribute nothing, so the segments are contiguous.
        seg = np.append(self.indptr[rows], self.nnz).astype(np.int64)
        return rows, seg, np.arange(self.nnz, dtype=np.int64)

    def to_dense(self, num_rows: int) -> np.ndarray:
        values = _numpy_values(self.values)
        rows, seg, _ = self.segments(num_rows)
        dense = np.zeros((num_rows, self.dim), F32)
        for k, r in enumerate(rows):
            acc = values[seg[k]].copy()
            for q in range(seg[k] + 1, seg[k + 1]):
                acc += values[q]
            dense[r] = acc
        return dense

    def __repr__(self) -> str:
        return f"CsrGradient(num_rows={self.num_rows}, nnz={self.nnz}, dim={self.dim})"


SparseGradient = Union[CooGradient, CsrGradient]


def _numpy_values(values: Any) -> np.ndarray:
    if not isinstance(values, np.ndarray):
        raise UnsupportedOperationError("to_dense/from_coo need host (numpy) values; copy device values to the host first")
    return values


# ---------------------------------------------------------------- devices


class _Device:
    """Where a sparse optimizer keeps its tables and runs its kernels (one subclass per backend)."""

    name: ClassVar[str]
    kind: ClassVar[str]  # the optirs.core.arrays kind of this device's arrays

    def zeros(self, shape, dtype):
        raise NotImplementedError

    def upload(self, host: np.ndarray):
        raise NotImplementedError

    def download(self, array) -> np.ndarray:
        raise NotImplementedError

    def adopt(self, array):
        """The caller's device array as something the kernels take (no copy)."""
        return array

    def run(self, kernel: str, items: int, *args) -> None:
        raise NotImplementedError


class _CpuDevice(_Device):
    name, kind = "cpu", "numpy"

    def __init__(self):
        from optirs.backends.common import sparse_kernels

        self.kernels = sparse_kernels.CPU

    def zeros(self, shape, dtype):
        # Written now rather than calloc'd: otherwise the lazy steps pay the page faults of a
        # table's untouched pages one random row at a time.
        out = np.empty(shape, dtype)
        out.fill(0)
        return out

    def upload(self, host):
        return np.ascontiguousarray(host)

    def download(self, array):
        return np.array(array, copy=True)

    def run(self, kernel, items, *args):
        self.kernels[kernel](*args)


class _CudaDevice(_Device):
    name, kind = "cuda", "cuda"

    def __init__(self, device: Optional[int]):
        from numba import cuda

        if not cuda.is_available():
            raise BackendUnavailableError("backend 'cuda' cannot open: numba.cuda finds no CUDA GPU (or the simulator is off)")
        if device is not None:
            cuda.select_device(int(device))
        from optirs.backends.common import sparse_kernels

        self.cuda = cuda
        self.kernels = sparse_kernels.cuda_kernels()
        self.grid = sparse_kernels.cuda_grid
        self.block = sparse_kernels.CUDA_BLOCK

    def zeros(self, shape, dtype):
        return self.cuda.to_device(np.zeros(shape, dtype))

    def upload(self, host):
        return self.cuda.to_device(np.ascontiguousarray(host))

    def download(self, array):
        return array.copy_to_host()

    def adopt(self, array):
        return array if hasattr(array, "copy_to_host") else self.cuda.as_cuda_array(array)

    def run(self, kernel, items, *args):
        if items:
            self.kernels[kernel][self.grid(items), self.block](*args)

    def synchronize(self):
        self.cuda.synchronize()


class _OpenclDevice(_Device):
    name, kind = "opencl", "opencl"

    def __init__(self, options: Dict[str, Any]):
        import pyopencl as cl
        import pyopencl.array as cla

        from optirs.backends.common import sparse_kernels
        from optirs.plugin.registry import REGISTRY

        # Share the opencl backend's context and queue when it is installed, so arrays made for
        # the dense optimizers can be stepped here too.
        try:
            ctx = REGISTRY.get_backend("opencl", options).ctx
            self.context, self.queue = ctx.context, ctx.queue
        except (GpuOptimError, AttributeError):
            # Not installed, or cannot open: the sparse kernels need no more than a context.
            platforms = cl.get_platforms()
            if not platforms:
                raise BackendUnavailableError("backend 'opencl' cannot open: no OpenCL platform") from None
            self.context = cl.Context(platforms[0].get_devices())
            self.queue = cl.CommandQueue(self.context)
        self.cl, self.cla = cl, cla
        program = cl.Program(self.context, sparse_kernels.opencl_source()).build(
            options=["-cl-fp32-correctly-rounded-divide-sqrt"])
        self.record = sparse_kernels.opencl_record
        # Kernel objects are built once and reused (looking up program.name per call rebuilds them).
        self.kernels = {k.function_name: k for k in program.all_kernels()}

    def zeros(self, shape, dtype):
        return self.cla.zeros(self.queue, shape, dtype)

    def upload(self, host):
        return self.cla.to_device(self.queue, np.ascontiguousarray(host))

    def download(self, array):
        return array.get()

    def run(self, kernel, items, *args):
        if not items:
            return
        k = self.kernels[kernel]
        # Device arrays go in as their buffers; numpy scalars and struct records by value.
        k(self.queue, (int(items),), None, *[a.data if isinstance(a, self.cla.Array) else a for a in args])

    def synchronize(self):
        self.queue.finish()


def _open_device(backend: str, device, platform) -> _Device:
    name = backend
    if backend == "auto":
        from optirs.plugin.registry import REGISTRY

        name = REGISTRY.get_backend("auto", {}).name
    if name == "cpu":
        return _CpuDevice()
    if name == "cuda":
        return _CudaDevice(device if isinstance(device, int) else None)
    if name == "opencl":
        opts = {k: v for k, v in (("device", device), ("platform", platform)) if v is not None}
        return _OpenclDevice(opts)
    raise UnsupportedOperationError(
        f"backend {name!r} has no sparse kernels; the sparse optimizers run on 'cpu', 'cuda' and 'opencl'"
    )


# ---------------------------------------------------------------- configs and tables


def _validate_backend(config) -> None:
    if not isinstance(config.backend, str) or not config.backend:
        raise InvalidParameterError(f"backend={config.backend!r}, expected a backend name or 'auto'")


@dataclass(frozen=True)
class SparseAdamConfig:
    """Hyperparameters and placement of :class:`SparseAdam` (torch.optim.SparseAdam's defaults)."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    mode: LazyAdamMode = LazyAdamMode.LAZY
    backend: str = "auto"
    device: Optional[int] = None
    platform: Optional[Union[int, str]] = None

    def __post_init__(self) -> None:
        AdamParams(lr=self.lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps)  # validates
        object.__setattr__(self, "mode", _mode(self.mode))
        _validate_backend(self)

    def hyperparameters(self) -> Dict[str, Any]:
        return {"lr": self.lr, "beta1": self.beta1, "beta2": self.beta2, "eps": self.eps, "mode": self.mode.value}


@dataclass(frozen=True)
class SparseSgdConfig:
    """Hyperparameters and placement of :class:`SparseSgd` (torch.optim.SGD's names and rules)."""

    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    mode: LazyAdamMode = LazyAdamMode.LAZY
    backend: str = "auto"
    device: Optional[int] = None
    platform: Optional[Union[int, str]] = None

    def __post_init__(self) -> None:
        SgdParams(lr=self.lr, momentum=self.momentum, dampening=self.dampening,
                  weight_decay=self.weight_decay, nesterov=self.nesterov)  # validates
        object.__setattr__(self, "mode", _mode(self.mode))
        _validate_backend(self)

    def hyperparameters(self) -> Dict[str, Any]:
        return {"lr": self.lr, "momentum": self.momentum, "dampening": self.dampening,
                "weight_decay": self.weight_decay, "nesterov": self.nesterov, "mode": self.mode.value}


@dataclass
class SparseAdamTable:
    """One embedding table's SparseAdam state on the device: moments and its own step count."""

    SLOTS: ClassVar[Tuple[str, ...]] = ("exp_avg", "exp_avg_sq")
    num_rows: int
    dim: int
    step: int
    exp_avg: Any
    exp_avg_sq: Any
    pos: Any = None  # DENSE_DECAY's row -> gradient-segment map (-1 for absent rows)


@dataclass
class SparseSgdTable:
    """One embedding table's SparseSgd state: momentum buffer, per-row first-seen flags (LAZY), step count."""

    SLOTS: ClassVar[Tuple[str, ...]] = ("momentum_buffer", "row_seen")
    num_rows: int
    dim: int
    step: int
    momentum_buffer: Any
    row_seen: Any
    pos: Any = None


# ---------------------------------------------------------------- optimizers


class _SparseOptimizer:
    name: ClassVar[str]
    config_type: ClassVar[type]
    table_type: ClassVar[type]

    def __init__(self, config=None):
        config = self.config_type() if config is None else config
        if not isinstance(config, self.config_type):
            raise InvalidParameterError(f"config={config!r}, expected a {self.config_type.__name__}")
        self.config = config
        self._device: Optional[_Device] = None
        self.tables: List[Any] = []

    @property
    def device(self) -> _Device:
        if self._device is None:
            self._device = _open_device(self.config.backend, self.config.device, self.config.platform)
        return self._device

    @property
    def backend_name(self) -> str:
        return self.device.name

    # ------------------------------------------------------------ validation

    def _check(self, params: List[Any], grads: List[Any]):
        if len(params) != len(grads):
            raise ShapeMismatchError(f"{len(params)} tables and {len(grads)} gradients, expected one gradient per table")
        if self.tables and len(self.tables) != len(params):
            raise ShapeMismatchError(f"{len(params)} tables, expected {len(self.tables)} as in earlier steps")
        dev = self.device
        plans = []
        seen: Dict[int, int] = {}
        for i, (p, g) in enumerate(zip(params, grads)):
            meta = describe(p, f"params[{i}]")
            if len(meta.shape) != 2:
                raise ShapeMismatchError(f"params[{i}] has shape {meta.shape}, expected a 2-D (num_rows, dim) table")
            if meta.dtype != F32:
                raise ShapeMismatchError(f"params[{i}] has dtype {meta.dtype}, expected float32")
            if not meta.contiguous or not meta.writeable:
                raise ShapeMismatchError(f"params[{i}] must be C-contiguous and writeable (updated in place)")
            if meta.kind not in ("numpy", dev.kind):
                raise InvalidParameterError(
                    f"params[{i}] is a {meta.kind} array, expected numpy or a {dev.kind} array on backend {dev.name!r}"
                )
            if meta.address in seen:
                raise InvalidParameterError(f"params[{i}] is the same memory as params[{seen[meta.address]}], expected distinct tables")
            seen[meta.address] = i
            num_rows, dim = meta.shape
            if self.tables and (self.tables[i].num_rows, self.tables[i].dim) != (num_rows, dim):
                raise ShapeMismatchError(
                    f"params[{i}] has shape {meta.shape}, expected {(self.tables[i].num_rows, self.tables[i].dim)} as in earlier steps"
                )
            if g is None:
                plans.append(None)
                continue
            if not isinstance(g, (CooGradient, CsrGradient)):
                raise InvalidParameterError(f"grads[{i}] is a {type(g).__name__}, expected a CooGradient, CsrGradient or None")
            if g.dim != dim:
                raise ShapeMismatchError(f"grads[{i}] has rows of {g.dim} values, expected dim={dim} like params[{i}]")
            vkind = describe(g.values, f"grads[{i}].values").kind
            if vkind not in ("numpy", dev.kind):
                raise InvalidParameterError(
                    f"grads[{i}].values is a {vkind} array, expected numpy or a {dev.kind} array on backend {dev.name!r}"
                )
            plans.append(g.segments(num_rows))
        return plans

    @staticmethod
    def _as_list(x, what):
        if isinstance(x, (list, tuple)):
            if not x:
                raise InvalidParameterError(f"{what}=[], expected at least one")
            return list(x)
        return [x]

    def step(self, params: Any, grads: Any) -> None:
        """One step over one table or a list of tables, updating them in place.

        :param params: a float32 ``(num_rows, dim)`` table, or a list of them (numpy, or the
            backend's device arrays; numpy tables on a device backend are uploaded and written back).
        :param grads: a :class:`CooGradient` / :class:`CsrGradient` per table; ``None`` skips a
            table (its step count does not advance, as torch skips a parameter without gradient).
        """
        plist, glist = self._as_list(params, "params"), self._as_list(grads, "grads")
        plans = self._check(plist, glist)
        dev = self.device
        if not self.tables:
            self.tables = [self._new_table(*describe(p).shape) for p in plist]
        for p, g, plan, table in zip(plist, glist, plans, self.tables):
            if plan is None:
                continue
            host_param = isinstance(p, np.ndarray) and dev.kind != "numpy"
            dp = dev.upload(p) if host_param else dev.adopt(p)
            values = dev.upload(g.values) if isinstance(g.values, np.ndarray) else dev.adopt(g.values)
            rows, seg, order = plan
            self._run(dev, table, table.step + 1, dp, rows, seg, order, values)
            table.step += 1
            if host_param:
                p[...] = dev.download(dp).reshape(p.shape)

    def _arrays(self, dev, rows, seg, order):
        if dev.kind == "numpy":
            return rows, seg, order
        if dev.kind == "opencl":  # kernel arguments must start at their buffer's beginning
            return dev.upload(rows), dev.upload(seg), dev.upload(order)
        # One host-to-device copy for the three index arrays, then views into it.
        both = dev.upload(np.concatenate([rows, seg, order]))
        a, b = rows.size, rows.size + seg.size
        return both[:a], both[a:b], both[b:]

    def _pos(self, dev, table):
        if table.pos is None:
            table.pos = dev.upload(np.full(table.num_rows, -1, np.int64))
        return table.pos

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> Dict[str, Any]:
        """A self-contained checkpoint (numpy copies of every table's state)."""
        dev = self._device
        tables = []
        for t in self.tables:
            entry = {"num_rows": t.num_rows, "dim": t.dim, "step": t.step}
            for slot in t.SLOTS:
                arr = getattr(t, slot)
                entry[slot] = None if arr is None else (dev.download(arr) if dev is not None else np.array(arr))
            tables.append(entry)
        return {"optimizer": self.name, "hyperparameters": self.config.hyperparameters(), "tables": tables}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a checkpoint from :meth:`state_dict`; everything is checked before anything changes."""
        if not isinstance(state_dict, Mapping) or set(state_dict) != {"optimizer", "hyperparameters", "tables"}:
            raise InvalidParameterError("state_dict must be a mapping with keys ['hyperparameters', 'optimizer', 'tables']")
        if state_dict["optimizer"] != self.name:
            raise InvalidParameterError(f"state_dict is for optimizer {state_dict['optimizer']!r}, expected {self.name!r}")
        hp = dict(state_dict["hyperparameters"])
        names = {f.name for f in fields(self.config_type)} - {"backend", "device", "platform"}
        if set(hp) != names:
            raise InvalidParameterError(f"hyperparameters {sorted(hp)}, expected {sorted(names)}")
        config = self.config_type(**hp, backend=self.config.backend, device=self.config.device,
                                  platform=self.config.platform)
        host_tables = []
        for i, entry in enumerate(state_dict["tables"]):
            num_rows, dim, step = int(entry["num_rows"]), int(entry["dim"]), int(entry["step"])
            if num_rows < 0 or dim < 0 or step < 0:
                raise InvalidParameterError(f"tables[{i}] has num_rows={num_rows}, dim={dim}, step={step}, expected values >= 0")
            slots = {}
            for slot in self.table_type.SLOTS:
                value = entry.get(slot)
                expected = self._slot_shape(config, slot, num_rows, dim)
                if expected is None:
                    slots[slot] = None
                    continue
                value = np.asarray(value)
                if value.shape != expected:
                    raise ShapeMismatchError(f"tables[{i}][{slot!r}] has shape {value.shape}, expected {expected}")
                slots[slot] = value
            host_tables.append((num_rows, dim, step, slots))
        dev = self.device
        self.config = config
        self.tables = []
        for num_rows, dim, step, slots in host_tables:
            arrays = {k: None if v is None else dev.upload(v.astype(self._slot_dtype(k), copy=True)) for k, v in slots.items()}
            self.tables.append(self.table_type(num_rows, dim, step, **arrays))

    def _slot_dtype(self, slot):
        return np.uint8 if slot == "row_seen" else F32

    def __repr__(self) -> str:
        where = self._device.name if self._device else self.config.backend
        return f"{type(self).__name__}({self.config.hyperparameters()}, backend={where!r}, tables={len(self.tables)})"


class SparseAdam(_SparseOptimizer):
    """Adam for row-sparse gradients, lazy (as torch.optim.SparseAdam) or with dense decay.

    .. code-block:: text

        LAZY, for present rows only (t: the table's step count):
            m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
            p = p - lr sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)
        DENSE_DECAY, every row, g = 0 where absent (torch.optim.Adam's update):
            p = p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    """

    name = "sparse_adam"
    config_type = SparseAdamConfig
    table_type = SparseAdamTable

    def _new_table(self, num_rows, dim):
        dev = self.device
        return SparseAdamTable(num_rows, dim, 0, dev.zeros((num_rows, dim), F32), dev.zeros((num_rows, dim), F32))

    def _slot_shape(self, config, slot, num_rows, dim):
        return (num_rows, dim)

    def scalars(self, step: int) -> sc.AdamScalars:
        c = self.config
        if c.mode is LazyAdamMode.DENSE_DECAY:
            return sc.adam_scalars(AdamParams(lr=c.lr, beta1=c.beta1, beta2=c.beta2, eps=c.eps), step, decoupled=False)
        # torch.optim.SparseAdam folds sqrt(1 - b2^t) into the step size and adds eps to sqrt(v).
        bc1, bc2 = 1.0 - c.beta1**step, 1.0 - c.beta2**step
        f = np.float32
        return sc.AdamScalars(f(c.beta1), f(c.beta2), f(1.0 - c.beta1), f(1.0 - c.beta2), f(c.eps), f(0.0),
                              f(c.lr * math.sqrt(bc2) / bc1), f(1.0), f(1.0), False, False)

    def _run(self, dev, table, step, p, rows, seg, order, values):
        s = self.scalars(step)
        drows, dseg, dorder = self._arrays(dev, rows, seg, order)
        n, dim = rows.shape[0], table.dim
        if dev.name == "opencl":
            return self._run_opencl(dev, table, p, drows, dseg, dorder, values, n, s)
        if self.config.mode is LazyAdamMode.LAZY:
            dev.run("adam_lazy", n * dim, p, table.exp_avg, table.exp_avg_sq, drows, dseg, dorder, values, s)
            return
        pos = self._pos(dev, table)
        dev.run("scatter_pos", n, pos, drows, False)
        dev.run("adam_dense", table.num_rows * dim, p, table.exp_avg, table.exp_avg_sq, pos, dseg, dorder, values, s)
        dev.run("scatter_pos", n, pos, drows, True)

    def _run_opencl(self, dev, table, p, rows, seg, order, values, n, s):
        rec, dim = dev.record(s), np.int64(table.dim)
        if self.config.mode is LazyAdamMode.LAZY:
            dev.run("adam_lazy", n * table.dim, p, table.exp_avg, table.exp_avg_sq, rows, seg, order, values,
                    np.int64(n), dim, rec)
            return
        pos = self._pos(dev, table)
        dev.run("scatter_pos", n, pos, rows, np.int64(n), np.int32(0))
        dev.run("adam_dense", table.num_rows * table.dim, p, table.exp_avg, table.exp_avg_sq, pos, seg, order,
                values, np.int64(table.num_rows), dim, rec)
        dev.run("scatter_pos", n, pos, rows, np.int64(n), np.int32(1))


class SparseSgd(_SparseOptimizer):
    """SGD for row-sparse gradients with torch.optim.SGD's momentum, dampening, nesterov and L2 decay.

    ``DENSE_DECAY`` equals SGD on the zero-filled dense gradient (torch.optim.SGD's result for
    sparse gradients); ``LAZY`` updates only present rows, and a row's momentum buffer starts at
    its gradient the first time it is present.
    """

    name = "sparse_sgd"
    config_type = SparseSgdConfig
    table_type = SparseSgdTable

    def _has_momentum(self, config=None) -> bool:
        return (config or self.config).momentum != 0.0

    def _new_table(self, num_rows, dim):
        dev = self.device
        buf = dev.zeros((num_rows, dim), F32) if self._has_momentum() else None
        seen = dev.zeros(num_rows, np.uint8) if self._has_momentum() and self.config.mode is LazyAdamMode.LAZY else None
        return SparseSgdTable(num_rows, dim, 0, buf, seen)

    def _slot_shape(self, config, slot, num_rows, dim):
        if not self._has_momentum(config):
            return None
        if slot == "momentum_buffer":
            return (num_rows, dim)
        return (num_rows,) if config.mode is LazyAdamMode.LAZY else None

    def scalars(self, step: int) -> sc.SgdScalars:
        """The scalars of table step ``step`` (``first_step`` only at step 1, as torch)."""
        c = self.config
        hp = SgdParams(lr=c.lr, momentum=c.momentum, dampening=c.dampening, weight_decay=c.weight_decay,
                       nesterov=c.nesterov)
        return sc.sgd_scalars(hp, step)

    def _run(self, dev, table, step, p, rows, seg, order, values):
        drows, dseg, dorder = self._arrays(dev, rows, seg, order)
        n, dim = rows.shape[0], table.dim
        lazy = self.config.mode is LazyAdamMode.LAZY
        # Stand-ins for slots these hyperparameters do not use (never indexed by the kernels).
        buf = table.momentum_buffer if table.momentum_buffer is not None else self._dummy(dev, np.float32, 2)
        seen = table.row_seen if table.row_seen is not None else self._dummy(dev, np.uint8, 1)
        # LAZY decides the first step per row (row_seen), so its shared record is never "first".
        s = self.scalars(max(step, 2) if lazy else step)
        if dev.name == "opencl":
            if lazy:
                dev.run("sgd_lazy", n * dim, p, buf, seen, drows, dseg, dorder, values, np.int64(n), np.int64(dim),
                        dev.record(s), dev.record(self.scalars(1)))
                if table.row_seen is not None:
                    dev.run("mark_seen", n, seen, drows, np.int64(n))
                return
            pos = self._pos(dev, table)
            dev.run("scatter_pos", n, pos, drows, np.int64(n), np.int32(0))
            dev.run("sgd_dense", table.num_rows * dim, p, buf, pos, dseg, dorder, values, np.int64(table.num_rows),
                    np.int64(dim), dev.record(s))
            dev.run("scatter_pos", n, pos, drows, np.int64(n), np.int32(1))
            return
        if lazy:
            dev.run("sgd_lazy", n * dim, p, buf, seen, drows, dseg, dorder, values, s, self.scalars(1))
            # The CPU loop marks rows itself; on CUDA every thread of a row must first read the old flag.
            if dev.name == "cuda" and table.row_seen is not None:
                dev.run("mark_seen", n, seen, drows)
            return
        pos = self._pos(dev, table)
        dev.run("scatter_pos", n, pos, drows, False)
        dev.run("sgd_dense", table.num_rows * dim, p, buf, pos, dseg, dorder, values, s)
        dev.run("scatter_pos", n, pos, drows, True)

    def _dummy(self, dev, dtype, ndim):
        """A one-element stand-in for a state buffer these hyperparameters do not use, kept on the
        device object itself (an id()-keyed cache could hand a freed device's array to a new one)."""
        cache = dev.__dict__.setdefault("_dummies", {})
        key = (np.dtype(dtype).str, ndim)
        if key not in cache:
            cache[key] = dev.upload(np.zeros((1,) * ndim, dtype))
        return cache[key]


__all__ = [
    "CooGradient", "CsrGradient", "LazyAdamMode", "SparseAdam", "SparseAdamConfig", "SparseAdamTable",
    "SparseSgd", "SparseSgdConfig", "SparseSgdTable",
]
