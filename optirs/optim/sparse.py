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
backend, opened through the registry (``cpu``, ``cuda``, ``opencl`` or a plugin). The optimizers
check and sort the gradient on the host and call only the backend's hooks: the ``sparse``
capability (``optirs_sparse_stage``, ``optirs_sparse_adam_step``, ``optirs_sparse_sgd_step``, see
:mod:`optirs.plugin.hookspecs`) and the dense ``optirs_alloc`` / ``optirs_to_device`` /
``optirs_to_host`` for the state. A backend without the capability raises
UnsupportedOperationError naming it. The built-in kernels are in ``optirs/backends/<b>/sparse*.py``.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, fields
from typing import Any, Callable, ClassVar, Dict, List, Mapping, Optional, Tuple, Union

import numpy as np

from optirs.core import checkpoint as ck
from optirs.core import scalars as sc
from optirs.core.arrays import check_no_overlap, describe  # also imported from here by optirs.optim.data_parallel
from optirs.core.errors import GpuOptimError, InvalidParameterError, ShapeMismatchError, UnsupportedOperationError
from optirs.core.params import AdamParams, SgdParams
from optirs.plugin.hookspecs import SparseRows, SparseTable
from optirs.plugin.registry import Backend, get_backend

# The capability (optirs.plugin.hookspecs.CAPABILITIES) whose hooks these optimizers call.
CAPABILITY = "sparse"

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


def _host_ints(array: Any, what: str) -> Any:
    """An index array checked as 1-D integers: host int64, or a device array kept as given (it is
    small, nnz or num_rows + 1, and the optimizer's step copies it through its backend's to_host)."""
    if isinstance(array, (list, tuple)):
        array = np.asarray(array)
        if array.size == 0:
            array = array.astype(np.int64)
    meta = describe(array, what)
    if len(meta.shape) != 1:
        raise ShapeMismatchError(f"{what} has shape {meta.shape}, expected a 1-D array")
    if meta.dtype.kind not in "iu":
        raise InvalidParameterError(f"{what} has dtype {meta.dtype}, expected an integer dtype")
    return array.astype(np.int64, copy=False) if isinstance(array, np.ndarray) else array


def _on_host(array: Any, what: str) -> np.ndarray:
    if not isinstance(array, np.ndarray):
        raise UnsupportedOperationError(
            f"{what} is a device array; the optimizer's step copies it to the host, or pass host indices")
    return array


def _length(array: Any, what: str) -> int:
    return int(describe(array, what).shape[0])


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
        count = _length(self.indices, "indices")
        if count != nnz:
            raise ShapeMismatchError(f"{count} indices for {nnz} value rows, expected one index per row")
        self.nnz = nnz

    def _copy_indices_to_host(self, to_host: Callable[[Any], np.ndarray]) -> None:
        """Device indices as host int64, through the stepping backend's ``to_host`` (once)."""
        if not isinstance(self.indices, np.ndarray):
            self.indices = np.asarray(to_host(self.indices)).reshape(-1).astype(np.int64, copy=False)

    def segments(self, num_rows: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, segments, order) as the sparse step hooks take them (:class:`optirs.plugin.hookspecs.SparseRows`);
        checks the indices."""
        idx = _on_host(self.indices, "indices")
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
        count = _length(self.indptr, "indptr")
        if count == 0:
            raise ShapeMismatchError("indptr is empty, expected num_rows + 1 offsets")
        self.num_rows = count - 1
        if isinstance(self.indptr, np.ndarray):
            self._check_offsets()

    def _check_offsets(self) -> None:
        ptr = self.indptr
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

    def _copy_indices_to_host(self, to_host: Callable[[Any], np.ndarray]) -> None:
        """Device offsets as host int64, through the stepping backend's ``to_host`` (once), then checked."""
        if not isinstance(self.indptr, np.ndarray):
            host = np.asarray(to_host(self.indptr)).reshape(-1).astype(np.int64, copy=False)
            device, self.indptr = self.indptr, host
            try:
                self._check_offsets()
            except GpuOptimError:
                self.indptr = device
                raise

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
                f"indptr has {self.num_rows + 1} entries, expected num_rows + 1 = {num_rows + 1} for this table"
            )
        indptr = _on_host(self.indptr, "indptr")
        rows = np.flatnonzero(np.diff(indptr)).astype(np.int64)
        # Empty rows between touched ones contribute nothing, so the segments are contiguous.
        seg = np.append(indptr[rows], self.nnz).astype(np.int64)
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
    """One embedding table's SparseAdam state on the backend: moments and its own step count.

    The moments are flat arrays of the backend (``optirs_alloc``) of ``num_rows * dim`` elements,
    row-major; ``state_dict()`` returns them as ``(num_rows, dim)`` numpy arrays.
    """

    SLOTS: ClassVar[Tuple[str, ...]] = ("exp_avg", "exp_avg_sq")
    num_rows: int
    dim: int
    step: int
    exp_avg: Any
    exp_avg_sq: Any
    pos: Any = None  # DENSE_DECAY's row -> gradient-segment map (int64, -1 for absent rows): "row_position"


@dataclass
class SparseSgdTable:
    """One embedding table's SparseSgd state: momentum buffer, per-row first-seen flags (LAZY), step count.

    Flat arrays of the backend: ``momentum_buffer`` has ``num_rows * dim`` float32 elements,
    ``row_seen`` ``num_rows`` uint8 flags; each is None when the hyperparameters do not use it.
    """

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
        self._backend: Optional[Backend] = None
        self.tables: List[Any] = []

    @property
    def backend(self) -> Backend:
        """The opened backend (opened on first use); raises UnsupportedOperationError when it lacks
        the ``sparse`` capability."""
        if self._backend is None:
            c = self.config
            options = {k: v for k, v in (("device", c.device), ("platform", c.platform)) if v is not None}
            backend = get_backend(c.backend, **options)
            self._stage = backend.hook(CAPABILITY, "optirs_sparse_stage")
            self._step_hook = backend.hook(CAPABILITY, self.step_hook)
            self._backend = backend
        return self._backend

    @property
    def backend_name(self) -> str:
        return self.backend.name

    # ------------------------------------------------------------ validation

    def _check(self, params: List[Any], grads: List[Any]):
        if len(params) != len(grads):
            raise ShapeMismatchError(f"{len(params)} tables and {len(grads)} gradients, expected one gradient per table")
        if self.tables and len(self.tables) != len(params):
            raise ShapeMismatchError(f"{len(params)} tables, expected {len(self.tables)} as in earlier steps")
        backend = self.backend
        plans = []
        metas = [describe(p, f"params[{i}]") for i, p in enumerate(params)]
        check_no_overlap(metas, expected="distinct tables")
        for i, (p, g) in enumerate(zip(params, grads)):
            meta = metas[i]
            if len(meta.shape) != 2:
                raise ShapeMismatchError(f"params[{i}] has shape {meta.shape}, expected a 2-D (num_rows, dim) table")
            if meta.dtype != F32:
                raise ShapeMismatchError(f"params[{i}] has dtype {meta.dtype}, expected float32")
            if not meta.contiguous or not meta.writeable:
                raise ShapeMismatchError(f"params[{i}] must be C-contiguous and writeable (updated in place)")
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
            g._copy_indices_to_host(lambda a: backend.to_host(backend.ctx, a))
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
        backend = self.backend
        live = [i for i, plan in enumerate(plans) if plan is not None]
        # Staged before any table changes: an array kind the backend cannot use changes nothing.
        staged = self._stage(backend.ctx, [plist[i] for i in live], [glist[i].values for i in live])
        if not self.tables:
            self.tables = [self._new_table(*describe(p).shape) for p in plist]
        for param, values, i in zip(staged.params, staged.grads, live):
            table = self.tables[i]
            rows, segments, order = plans[i]
            self._run(table, table.step + 1, param, SparseRows(rows, segments, order, values))
            table.step += 1
        if staged.finish is not None:
            staged.finish()

    def _alloc(self, size: int, dtype: Any, fill: float = 0.0) -> Any:
        backend = self.backend
        return backend.alloc(backend.ctx, int(size), np.dtype(dtype), fill)

    def _positions(self, table) -> Any:
        """DENSE_DECAY's row -> segment map (every element -1 between steps), made on first use."""
        if table.pos is None:
            table.pos = self._alloc(table.num_rows, np.int64, -1)
        return table.pos

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> Dict[str, Any]:
        """A self-contained checkpoint (numpy copies of every table's state)."""
        tables = []
        for t in self.tables:
            entry = {"num_rows": t.num_rows, "dim": t.dim, "step": t.step}
            for slot in t.SLOTS:
                arr = getattr(t, slot)
                if arr is not None:
                    backend = self.backend
                    shape = self._slot_shape(self.config, slot, t.num_rows, t.dim)
                    arr = np.asarray(backend.to_host(backend.ctx, arr)).reshape(shape)
                entry[slot] = arr
            tables.append(entry)
        return {"optimizer": self.name, "hyperparameters": self.config.hyperparameters(), "tables": tables}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a checkpoint from :meth:`state_dict`; everything is checked before anything changes
        (fields as :mod:`optirs.core.checkpoint` checks them: float32 moments exactly, 0/1 flags)."""
        ck.mapping(state_dict, "state_dict", {"optimizer", "hyperparameters", "tables"})
        if state_dict["optimizer"] != self.name:
            raise InvalidParameterError(f"state_dict is for optimizer {state_dict['optimizer']!r}, expected {self.name!r}")
        hp = dict(ck.mapping(state_dict["hyperparameters"], "hyperparameters"))
        names = {f.name for f in fields(self.config_type)} - {"backend", "device", "platform"}
        if set(hp) != names:
            raise InvalidParameterError(f"hyperparameters {sorted(map(str, hp))}, expected {sorted(names)}")
        config = self.config_type(**hp, backend=self.config.backend, device=self.config.device,
                                  platform=self.config.platform)
        host_tables = []
        for i, entry in enumerate(ck.sequence(state_dict["tables"], "tables")):
            entry = ck.mapping(entry, f"tables[{i}]")
            for key in ("num_rows", "dim", "step"):
                if key not in entry:
                    raise InvalidParameterError(f"tables[{i}] has no {key!r}, expected num_rows, dim, step and the state slots")
            num_rows, dim = ck.integer(entry["num_rows"], f"tables[{i}]['num_rows']"), ck.integer(entry["dim"], f"tables[{i}]['dim']")
            step = ck.integer(entry["step"], f"tables[{i}]['step']", 0, ck.INT64_MAX - 1)
            slots = {}
            for slot in self.table_type.SLOTS:
                expected = self._slot_shape(config, slot, num_rows, dim)
                if expected is None:
                    slots[slot] = None
                    continue
                if slot not in entry:
                    raise InvalidParameterError(f"tables[{i}] has no {slot!r}, expected it for these hyperparameters")
                what = f"tables[{i}][{slot!r}]"
                slots[slot] = (ck.flag_array(entry[slot], what, expected) if self._slot_dtype(slot) == np.uint8
                               else ck.float32_array(entry[slot], what, expected))
            host_tables.append((num_rows, dim, step, slots))
        backend = self.backend
        arrays = [{k: None if v is None else backend.to_device(backend.ctx, v)
                   for k, v in slots.items()} for _, _, _, slots in host_tables]
        self.config = config
        self.tables = [self.table_type(num_rows, dim, step, **a)
                       for (num_rows, dim, step, _), a in zip(host_tables, arrays)]

    def _slot_dtype(self, slot):
        return np.uint8 if slot == "row_seen" else F32

    def __repr__(self) -> str:
        where = self._backend.name if self._backend else self.config.backend
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
    step_hook = "optirs_sparse_adam_step"

    def _new_table(self, num_rows, dim):
        return SparseAdamTable(num_rows, dim, 0, self._alloc(num_rows * dim, F32), self._alloc(num_rows * dim, F32))

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

    def _run(self, table, step, param, grad):
        dense = self.config.mode is LazyAdamMode.DENSE_DECAY
        state = {"exp_avg": table.exp_avg, "exp_avg_sq": table.exp_avg_sq}
        if dense:
            state["row_position"] = self._positions(table)
        self._step_hook(self.backend.ctx, SparseTable(param, table.num_rows, table.dim, state), grad,
                        self.scalars(step), dense)


class SparseSgd(_SparseOptimizer):
    """SGD for row-sparse gradients with torch.optim.SGD's momentum, dampening, nesterov and L2 decay.

    ``DENSE_DECAY`` equals SGD on the zero-filled dense gradient (torch.optim.SGD's result for
    sparse gradients); ``LAZY`` updates only present rows, and a row's momentum buffer starts at
    its gradient the first time it is present.
    """

    name = "sparse_sgd"
    config_type = SparseSgdConfig
    table_type = SparseSgdTable
    step_hook = "optirs_sparse_sgd_step"

    def _has_momentum(self, config=None) -> bool:
        return (config or self.config).momentum != 0.0

    def _new_table(self, num_rows, dim):
        momentum = self._has_momentum()
        buf = self._alloc(num_rows * dim, F32) if momentum else None
        seen = self._alloc(num_rows, np.uint8) if momentum and self.config.mode is LazyAdamMode.LAZY else None
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

    def _run(self, table, step, param, grad):
        dense = self.config.mode is LazyAdamMode.DENSE_DECAY
        state = {}
        if table.momentum_buffer is not None:
            state["momentum_buffer"] = table.momentum_buffer
        if table.row_seen is not None:
            state["row_seen"] = table.row_seen
        if dense:
            state["row_position"] = self._positions(table)
        # LAZY decides the first step per row (row_seen), so its shared record is never "first".
        scalars = self.scalars(step if dense else max(step, 2))
        self._step_hook(self.backend.ctx, SparseTable(param, table.num_rows, table.dim, state), grad,
                        scalars, self.scalars(1), dense)


__all__ = [
    "CooGradient", "CsrGradient", "LazyAdamMode", "SparseAdam", "SparseAdamConfig", "SparseAdamTable",
    "SparseSgd", "SparseSgdConfig", "SparseSgdTable",
]
