"""The graph a fusion plan is made from: tensor ops with static shapes and dtypes.

A :class:`FusionGraph` is a DAG of elementwise unary/binary/ternary ops from a fixed vocabulary
(:mod:`optirs.analysis.fusion.ops`), with numpy broadcasting of scalars and lower-rank operands;
explicit broadcasts; ``sum``/``max`` reductions over one axis or all; and opaque ops (a user
callable, never fused). :meth:`FusionGraph.evaluate` is the unfused numpy meaning of a graph.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from optirs.core.errors import InvalidParameterError, ShapeMismatchError
from optirs.analysis.fusion.ops import DTYPES, OPS, REDUCTIONS

__all__ = ["OpKind", "FusionOp", "FusionGraph", "evaluate_op_numpy", "call_opaque"]

Shape = Tuple[int, ...]
Operand = Union[str, float, int]


class OpKind(enum.Enum):
    """What an op does, which decides where it may sit in a fused group."""

    ELEMENTWISE = "elementwise"  # one output element from the same element of each operand
    BROADCAST = "broadcast"  # an operand repeated to a larger shape (numpy rules)
    REDUCTION = "reduction"  # sum/max over one axis or all; may only end a group
    OPAQUE = "opaque"  # a user callable; always alone


@dataclass(frozen=True)
class FusionOp:
    """One op of a graph; its output value is named after the op.

    :param name: the op's (and its output value's) name, unique in the graph.
    :param op: a vocabulary name (``add``, ``exp``, ``where``...; see ``optirs.analysis.fusion.ops.OPS``),
        ``"broadcast_to"``, ``"sum"``/``"max"``, or ``"opaque"``.
    :param inputs: value names, or Python numbers for constants of elementwise ops (a constant
        takes the dtype of the op's other operands, as numpy treats Python scalars).
    :param kind: inferred from ``op`` when omitted.
    :param shape: inferred (numpy broadcasting) when omitted; required for broadcast and opaque.
    :param dtype: inferred when omitted; required for opaque ops.
    :param axis: reduction axis, or None for all axes.
    :param fn: the callable of an opaque op: ``fn(*input_arrays) -> array``.
    """

    name: str
    op: str
    inputs: Tuple[Operand, ...]
    kind: Optional[OpKind] = None
    shape: Optional[Shape] = None
    dtype: Any = None
    axis: Optional[int] = None
    fn: Optional[Callable] = None

    def operand_names(self) -> Tuple[str, ...]:
        """The named (non-constant) operands, in order."""
        return tuple(v for v in self.inputs if isinstance(v, str))

    @property
    def nbytes(self) -> int:
        return _nbytes(self.shape, self.dtype)


def _nbytes(shape: Shape, dtype: Any) -> int:
    return int(math.prod(shape)) * np.dtype(dtype).itemsize


def _check_shape(shape: Any, what: str) -> Shape:
    try:
        out = tuple(int(d) for d in shape)
        ok = all(d >= 0 and d == s for d, s in zip(out, shape))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ShapeMismatchError(f"{what}: shape={shape!r}, expected a tuple of non-negative integers")
    return out


def _check_dtype(dtype: Any, what: str) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt not in DTYPES:
        raise ShapeMismatchError(f"{what}: dtype={dtype!r}, expected one of {[str(d) for d in DTYPES]}")
    return dt


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool)


class FusionGraph:
    """A DAG of tensor ops with static shapes and dtypes.

    Build it with :meth:`input` and the op methods (each returns the new value's name), or pass
    every input and op at once (in any order) to the constructor. Every op is checked as it is
    added: unknown operands, cycles, shape and dtype mismatches raise ``InvalidParameterError``
    or ``ShapeMismatchError`` naming the op, and leave the graph as it was. Planning freezes
    the graph, so that a plan never refers to a graph that has changed under it.
    """

    def __init__(
        self,
        inputs: Optional[Mapping[str, Tuple[Sequence[int], Any]]] = None,
        ops: Iterable[FusionOp] = (),
        outputs: Optional[Sequence[str]] = None,
    ):
        self._inputs: Dict[str, Tuple[Shape, np.dtype]] = {}
        self._ops: Dict[str, FusionOp] = {}  # topological order (insertion order)
        self._outputs: Optional[List[str]] = None
        self._frozen = False
        for name, spec in (inputs or {}).items():
            if not (isinstance(spec, (tuple, list)) and len(spec) == 2):
                raise InvalidParameterError(f"input {name!r}: spec={spec!r}, expected (shape, dtype)")
            self.input(name, spec[0], spec[1])
        self._add_unordered(list(ops))
        if outputs is not None:
            self.mark_output(*outputs)

    # ------------------------------------------------------------ building

    def input(self, name: str, shape: Sequence[int], dtype: Any = np.float32) -> str:
        """Declare a graph input; returns its name."""
        self._check_mutable()
        self._check_new_name(name)
        self._inputs[name] = (_check_shape(shape, f"input {name!r}"), _check_dtype(dtype, f"input {name!r}"))
        return name

    def op(self, op: str, *operands: Operand, name: Optional[str] = None) -> str:
        """Add an elementwise op from the vocabulary (``optirs.analysis.fusion.ops.OPS``); returns its name."""
        return self.add(FusionOp(name or self._fresh(op), op, tuple(operands)))

    def broadcast(self, operand: str, shape: Sequence[int], name: Optional[str] = None) -> str:
        """Broadcast ``operand`` to ``shape`` (numpy rules); returns the new value's name."""
        return self.add(FusionOp(name or self._fresh("broadcast"), "broadcast_to", (operand,), shape=tuple(shape)))

    def reduce(self, op: str, operand: str, axis: Optional[int] = None, name: Optional[str] = None) -> str:
        """``sum`` or ``max`` of ``operand`` over ``axis`` (None: all axes, a 0-d result)."""
        return self.add(FusionOp(name or self._fresh(op), op, (operand,), axis=axis))

    def opaque(self, fn: Callable, *operands: str, shape: Sequence[int], dtype: Any = np.float32, name: Optional[str] = None) -> str:
        """An op the planner never fuses: ``fn(*operand_arrays)`` must return ``shape``/``dtype``."""
        return self.add(FusionOp(name or self._fresh("opaque"), "opaque", tuple(operands), shape=tuple(shape), dtype=dtype, fn=fn))

    def add(self, op: FusionOp) -> str:
        """Add one op whose operands are already in the graph; returns its name."""
        self._check_mutable()
        if not isinstance(op, FusionOp):
            raise InvalidParameterError(f"op={op!r}, expected a FusionOp")
        self._check_new_name(op.name)
        for v in op.operand_names():
            if v not in self._inputs and v not in self._ops:
                raise InvalidParameterError(
                    f"op {op.name!r} uses {v!r}, which is neither a graph input nor an earlier op "
                    f"(known: {sorted(self._inputs) + list(self._ops)})"
                )
        resolved = self._resolve(op)
        self._ops[op.name] = resolved
        return op.name

    def mark_output(self, *names: str) -> None:
        """Declare graph outputs (by default every op whose value no other op uses)."""
        self._check_mutable()
        for n in names:
            if n not in self._ops:
                where = "a graph input" if n in self._inputs else "not in the graph"
                raise InvalidParameterError(f"output {n!r} is {where}; expected the name of an op")
        outs = list(self._outputs or [])
        outs += [n for n in names if n not in outs]
        self._outputs = outs

    def _add_unordered(self, ops: List[FusionOp]) -> None:
        """Add ops given in any order: topologically sorted here, cycles reported."""
        pending = {}
        for op in ops:
            if not isinstance(op, FusionOp):
                raise InvalidParameterError(f"op={op!r}, expected a FusionOp")
            if op.name in pending:
                raise InvalidParameterError(f"op name {op.name!r} appears twice")
            pending[op.name] = op
        while pending:
            ready = [op for op in pending.values() if all(v in self._inputs or v in self._ops for v in op.operand_names())]
            if not ready:
                unknown = sorted(
                    {v for op in pending.values() for v in op.operand_names()} - set(pending) - set(self._inputs) - set(self._ops)
                )
                if unknown:
                    users = [op.name for op in pending.values() if set(op.operand_names()) & set(unknown)]
                    raise InvalidParameterError(
                        f"ops {users} use unknown values {unknown}; expected graph inputs or op names"
                    )
                raise InvalidParameterError(f"the graph has a cycle: {' -> '.join(_find_cycle(pending))}")
            for op in ready:
                self.add(op)
                del pending[op.name]

    def _resolve(self, op: FusionOp) -> FusionOp:
        """The op with kind, shape and dtype filled in and checked."""
        shapes = [self.shape(v) for v in op.operand_names()]
        dtypes = [self.dtype(v) for v in op.operand_names()]
        where = f"op {op.name!r} ({op.op})"
        if op.op == "opaque":
            if op.fn is None or not callable(op.fn):
                raise InvalidParameterError(f"{where}: fn={op.fn!r}, expected a callable")
            if op.shape is None or op.dtype is None:
                raise InvalidParameterError(f"{where}: an opaque op needs its output shape and dtype")
            if len(op.operand_names()) != len(op.inputs):
                raise InvalidParameterError(f"{where}: inputs={op.inputs!r}, expected value names only")
            return replace(op, kind=OpKind.OPAQUE, shape=_check_shape(op.shape, where), dtype=_check_dtype(op.dtype, where))
        if op.fn is not None:
            raise InvalidParameterError(f"{where}: fn is only for opaque ops")
        if op.op == "broadcast_to":
            if len(op.inputs) != 1 or len(shapes) != 1 or op.shape is None:
                raise InvalidParameterError(f"{where}: expected one named operand and a target shape")
            target = _check_shape(op.shape, where)
            try:
                ok = np.broadcast_shapes(shapes[0], target) == target
            except ValueError:
                ok = False
            if not ok:
                raise ShapeMismatchError(f"{where}: cannot broadcast shape {shapes[0]} to {target} (numpy rules)")
            return self._check_declared(replace(op, kind=OpKind.BROADCAST, shape=target), target, dtypes[0], where, op)
        if op.op in REDUCTIONS:
            if len(op.inputs) != 1 or len(shapes) != 1:
                raise InvalidParameterError(f"{where}: inputs={op.inputs!r}, expected one named operand")
            (shape,), (dt,) = shapes, dtypes
            if dt.kind != "f":
                raise ShapeMismatchError(f"{where}: operand dtype {dt}, expected a float dtype")
            nd = len(shape)
            if op.axis is None:
                out, axis = (), None
            else:
                if not isinstance(op.axis, (int, np.integer)) or not -nd <= op.axis < nd:
                    raise InvalidParameterError(f"{where}: axis={op.axis!r}, expected None or an integer in [{-nd}, {nd})")
                axis = int(op.axis) % nd
                out = shape[:axis] + shape[axis + 1:]
            reduced = math.prod(shape) if axis is None else shape[axis]
            if op.op == "max" and reduced == 0:
                raise ShapeMismatchError(f"{where}: max over an empty axis of shape {shape} has no identity")
            return self._check_declared(replace(op, kind=OpKind.REDUCTION, axis=axis), out, dt, where, op)
        spec = OPS.get(op.op)
        if spec is None:
            raise InvalidParameterError(
                f"{where}: unknown op {op.op!r}; expected one of {sorted(OPS) + ['broadcast_to', 'opaque'] + list(REDUCTIONS)}"
            )
        if op.axis is not None:
            raise InvalidParameterError(f"{where}: axis is only for reductions")
        if len(op.inputs) != spec.arity:
            raise InvalidParameterError(f"{where}: {len(op.inputs)} operands, expected {spec.arity}")
        for v in op.inputs:
            if not isinstance(v, str) and not _is_number(v):
                raise InvalidParameterError(f"{where}: operand {v!r}, expected a value name or a real number")
        if not shapes:
            raise InvalidParameterError(f"{where}: every operand is a constant; expected at least one value")
        try:
            shape = tuple(np.broadcast_shapes(*shapes))
        except ValueError:
            raise ShapeMismatchError(f"{where}: operand shapes {shapes} do not broadcast together (numpy rules)") from None
        dt = _result_dtype(spec.typing, op.inputs, [self.dtype(v) if isinstance(v, str) else None for v in op.inputs], where)
        return self._check_declared(replace(op, kind=OpKind.ELEMENTWISE), shape, dt, where, op)

    @staticmethod
    def _check_declared(op: FusionOp, shape: Shape, dtype: np.dtype, where: str, given: FusionOp) -> FusionOp:
        if given.kind is not None and given.kind != op.kind:
            raise InvalidParameterError(f"{where}: kind={given.kind}, but the op is {op.kind}")
        if given.shape is not None and tuple(given.shape) != tuple(shape):
            raise ShapeMismatchError(f"{where}: declared shape {tuple(given.shape)}, but the operands give {shape}")
        if given.dtype is not None and np.dtype(given.dtype) != dtype:
            raise ShapeMismatchError(f"{where}: declared dtype {np.dtype(given.dtype)}, but the operands give {dtype}")
        return replace(op, shape=tuple(shape), dtype=dtype)

    def _check_new_name(self, name: str) -> None:
        if not isinstance(name, str) or not name.isidentifier():
            raise InvalidParameterError(f"name={name!r}, expected an identifier")
        if name in self._inputs or name in self._ops:
            raise InvalidParameterError(f"name {name!r} is already in the graph")

    def _check_mutable(self) -> None:
        if self._frozen:
            raise InvalidParameterError("this graph has been planned and is frozen; build a new FusionGraph")

    def _fresh(self, base: str) -> str:
        k = len(self._ops)
        while f"{base}_{k}" in self._ops or f"{base}_{k}" in self._inputs:
            k += 1
        return f"{base}_{k}"

    def freeze(self) -> "FusionGraph":
        self._frozen = True
        return self

    # ------------------------------------------------------------ reading

    @property
    def inputs(self) -> Dict[str, Tuple[Shape, np.dtype]]:
        return dict(self._inputs)

    @property
    def ops(self) -> Tuple[FusionOp, ...]:
        """Every op, in a topological order."""
        return tuple(self._ops.values())

    @property
    def outputs(self) -> Tuple[str, ...]:
        if self._outputs is not None:
            return tuple(self._outputs)
        used = {v for op in self._ops.values() for v in op.operand_names()}
        return tuple(n for n in self._ops if n not in used)

    def __getitem__(self, name: str) -> FusionOp:
        return self._ops[name]

    def __len__(self) -> int:
        return len(self._ops)

    def shape(self, value: str) -> Shape:
        if value in self._inputs:
            return self._inputs[value][0]
        return self._ops[value].shape

    def dtype(self, value: str) -> np.dtype:
        if value in self._inputs:
            return self._inputs[value][1]
        return self._ops[value].dtype

    def nbytes(self, value: str) -> int:
        return _nbytes(self.shape(value), self.dtype(value))

    def consumers(self, value: str) -> Tuple[str, ...]:
        return tuple(op.name for op in self._ops.values() if value in op.operand_names())

    def check_inputs(self, inputs: Mapping[str, Any]) -> Dict[str, np.ndarray]:
        """The graph's inputs from ``inputs`` as numpy arrays of the declared shapes and dtypes."""
        missing = [n for n in self._inputs if n not in inputs]
        extra = [n for n in inputs if n not in self._inputs]
        if missing or extra:
            raise InvalidParameterError(f"inputs missing {missing} and unexpected {extra}; expected exactly {list(self._inputs)}")
        out = {}
        for n, (shape, dt) in self._inputs.items():
            a = inputs[n]
            if _is_number(a) or isinstance(a, (bool, np.bool_)):
                a = np.asarray(a, dtype=dt)
            if not isinstance(a, np.ndarray):
                raise InvalidParameterError(f"input {n!r}: {type(a).__name__}, expected a numpy array")
            if a.shape != shape or a.dtype != dt:
                raise ShapeMismatchError(f"input {n!r}: shape {a.shape} dtype {a.dtype}, expected shape {shape} dtype {dt}")
            out[n] = a
        return out

    def evaluate(self, inputs: Mapping[str, Any]) -> Dict[str, np.ndarray]:
        """The unfused graph in numpy, one op at a time; returns the graph outputs."""
        env: Dict[str, np.ndarray] = dict(self.check_inputs(inputs))
        for op in self._ops.values():
            env[op.name] = evaluate_op_numpy(op, [env[v] if isinstance(v, str) else v for v in op.inputs])
        return {n: env[n] for n in self.outputs}

    def __repr__(self) -> str:
        return f"<FusionGraph {len(self._inputs)} inputs, {len(self._ops)} ops, outputs={list(self.outputs)}>"


def evaluate_op_numpy(op: FusionOp, args: List[Any]) -> np.ndarray:
    """One op in numpy (constants cast to the op's float dtype, as numpy's weak scalars are)."""
    if op.kind is OpKind.OPAQUE:
        return call_opaque(op, args)
    if op.kind is OpKind.BROADCAST:
        return np.broadcast_to(args[0], op.shape).copy()
    if op.kind is OpKind.REDUCTION:
        fn = np.sum if op.op == "sum" else np.max
        return np.asarray(fn(args[0], axis=op.axis), dtype=op.dtype)
    spec = OPS[op.op]
    const_dt = op.dtype if op.dtype.kind == "f" else np.result_type(*[a.dtype for a in args if isinstance(a, np.ndarray)])
    args = [a if isinstance(a, np.ndarray) else const_dt.type(a) for a in args]
    return np.asarray(spec.numpy(*args), dtype=op.dtype).reshape(op.shape)


def call_opaque(op: FusionOp, args: List[np.ndarray]) -> np.ndarray:
    out = np.asarray(op.fn(*args))
    if out.shape != op.shape or out.dtype != op.dtype:
        raise ShapeMismatchError(
            f"opaque op {op.name!r} returned shape {out.shape} dtype {out.dtype}, expected shape {op.shape} dtype {op.dtype}"
        )
    return out


def _result_dtype(typing: str, operands: Tuple[Operand, ...], dtypes: List[Optional[np.dtype]], where: str) -> np.dtype:
    if typing == "select":
        cond, vals = dtypes[0], [d for d in dtypes[1:] if d is not None]
        if cond is None or cond.kind != "b":
            raise ShapeMismatchError(f"{where}: condition dtype {cond}, expected bool (a comparison's result)")
        named = vals
    else:
        named = [d for d in dtypes if d is not None]
    if any(d.kind != "f" for d in named):
        raise ShapeMismatchError(f"{where}: operand dtypes {[str(d) for d in named]}, expected float dtypes")
    if not named:  # where(cond, 1.0, 2.0): the constants' dtype has nothing to follow
        raise InvalidParameterError(f"{where}: every value operand is a constant; expected at least one value")
    dt = np.result_type(*named)
    return np.dtype(np.bool_) if typing == "compare" else dt


def _find_cycle(ops: Mapping[str, FusionOp]) -> List[str]:
    """A cycle among ops whose operands all lie in ``ops`` (or are known already)."""
    color: Dict[str, int] = {}
    stack: List[str] = []

    def visit(n: str) -> Optional[List[str]]:
        color[n] = 1
        stack.append(n)
        for v in ops[n].operand_names():
            if v in ops:
                if color.get(v) == 1:
                    return stack[stack.index(v):] + [v]
                if v not in color:
                    found = visit(v)
                    if found:
                        return found
        color[n] = 2
        stack.pop()
        return None

    for n in ops:
        if n not in color:
            found = visit(n)
            if found:
                return found[::-1]
    return list(ops)  # not reached when the caller saw no op ready
