"""The step engine's side of the step formats (docs/formats.md): their descriptions and checkpoints.

:class:`optirs.optim.engine.StepEngine` holds a state of any :class:`~optirs.core.formats.StepFormat`
as one flat buffer per ``FormatState.buffer_sizes()`` entry, of ``buffer_dtypes()``'s dtype, and the
backend's one step hook runs it. A checkpoint holds each tensor's compact buffers as they are (int8
codes and float32 block scales, bfloat16 moments, remainders), so it is as small as the state and a
resumed run is bit-exact; this module turns flat buffers into checkpoint entries and back.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any, Dict, List, Mapping, Optional

import numpy as np

from optirs.core import checkpoint as ck
from optirs.core.errors import InvalidParameterError, UnsupportedOperationError
from optirs.core.formats import FormatState, Precision, StepFormat, resolve_format
from optirs.core.layout import TensorLayout

CAPABILITY = "formats"


def check_backend(backend: Any, fmt: StepFormat) -> None:
    """Raise UnsupportedOperationError naming the backend and the format unless it runs formats."""
    if not backend.supports(CAPABILITY):
        raise UnsupportedOperationError(
            f"backend {backend.name!r} has no {CAPABILITY!r} capability, needed for the step format "
            f"{describe_format(fmt)}; expected a backend that supports it (cpu, cuda, opencl) or float32 "
            "parameters with state_dtype='float32'")


def describe_format(fmt: StepFormat) -> str:
    """A short human-readable name of a step format (for messages)."""
    return (f"params={fmt.param_dtype}, grads={fmt.grad_dtype}, master_weights={fmt.master!r}, "
            f"state_dtype={fmt.state_dtype}, stochastic_rounding={fmt.stochastic}")


def same_storage(a: Optional[StepFormat], b: Optional[StepFormat]) -> bool:
    """Whether two formats keep the same buffers (the gradients' dtype may differ step to step)."""
    if a is None or b is None:
        return a is b
    return replace(a, grad_dtype="float32") == replace(b, grad_dtype="float32")


def describe(fmt: Optional[StepFormat]) -> str:
    """A state's format for messages: ``describe_format``'s, or float32 for None."""
    return "float32 (the ordinary step)" if fmt is None else describe_format(fmt)


def format_state(definition: Any, layout: TensorLayout, fmt: StepFormat, slots: Mapping[str, float]) -> FormatState:
    """The :class:`FormatState` of a definition's ``slots`` (names, as ``definition.state_slots(hp)`` gives them)."""
    return FormatState(layout, tuple(s for s in definition.slots if s.name in slots), fmt)


def _bfloat16() -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def checkpoint_state(fs: FormatState, flat: Mapping[str, np.ndarray]) -> List[Dict[str, np.ndarray]]:
    """Per tensor: checkpoint key -> a copy of its compact state (bfloat16 state as ml_dtypes.bfloat16)."""
    bf16 = fs.fmt.state_dtype == "bfloat16"
    out = []
    for t in range(len(fs.layout)):
        entry = {}
        for k, v in fs.tensor_views(t, dict(flat)).items():
            v = v.copy()
            if bf16 and k in fs.slot_names:
                v = v.view(_bfloat16())
            entry[k] = v
        out.append(entry)
    return out


def _as_numpy(value: Any) -> Any:
    """A torch tensor (a portable checkpoint) as numpy, bfloat16 through its bits; anything else as is."""
    if type(value).__module__.startswith("torch") and hasattr(value, "detach"):
        import torch

        t = value.detach().cpu()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(_bfloat16())
        return t.numpy()
    return value


def _typed_array(value: Any, what: str, shape: tuple, dtype: np.dtype) -> np.ndarray:
    """A copy of ``value`` when it is exactly of ``dtype`` and ``shape`` (a compact buffer is not converted)."""
    value = _as_numpy(value)
    if not isinstance(value, np.ndarray) or type(value) is not np.ndarray:
        raise InvalidParameterError(f"{what} of type {type(value).__name__}, expected a numpy array of dtype {dtype}")
    if value.dtype != dtype:
        raise InvalidParameterError(f"{what} has dtype {value.dtype}, expected {dtype} (compact state is stored as it is)")
    if value.shape != tuple(shape):
        from optirs.core.errors import ShapeMismatchError

        raise ShapeMismatchError(f"{what} has shape {value.shape}, expected {tuple(shape)}")
    return value.copy()


def checkpoint_dtype(fs: FormatState, key: str) -> np.dtype:
    """The dtype a checkpoint holds under ``key`` (a slot of a small int8 tensor is its float32 ``.small``)."""
    dtypes = fs.buffer_dtypes()
    if key in fs.slot_names:
        if fs.int8:
            return dtypes[f"{key}.small"]
        if fs.fmt.state_dtype == "bfloat16":
            return _bfloat16()
    return dtypes[key]


def restore_state(fs: FormatState, entries: List[Any], initial: Mapping[str, float]) -> Dict[str, np.ndarray]:
    """Flat host buffers from checkpoint entries; every entry is checked before any buffer is made."""
    values = []
    for i, entry in enumerate(entries):
        wanted = fs.state_shapes(i)
        if not isinstance(entry, Mapping) or set(entry) != set(wanted):
            got = sorted(map(str, entry)) if isinstance(entry, Mapping) else type(entry).__name__
            raise InvalidParameterError(f"state[{i}] has keys {got}, expected {sorted(wanted)} for shape {fs.layout.shapes[i]}")
        values.append({k: _typed_array(entry[k], f"state[{i}][{k!r}]", shape, checkpoint_dtype(fs, k))
                       for k, shape in wanted.items()})
    sizes, dtypes, fills = fs.buffer_sizes(), fs.buffer_dtypes(), fs.buffer_fills(dict(initial))
    flat = {k: np.full(sizes[k], fills[k], dtype=dtypes[k]) for k in sizes}
    for t, entry in enumerate(values):
        views = fs.tensor_views(t, flat)
        for k, value in entry.items():
            views[k][...] = value.view(views[k].dtype)
    return flat


def format_record(fmt: StepFormat) -> Dict[str, Any]:
    """The checkpoint's ``format`` entry."""
    return asdict(fmt)


def load_format(value: Any, precision: Precision, family: str) -> StepFormat:
    """A checkpoint's ``format`` entry, checked against the optimizer's ``precision``."""
    record = ck.mapping(value, "format", [f for f in asdict(StepFormat())])
    try:
        fmt = StepFormat(**dict(record))
        expected = resolve_format(precision, fmt.param_dtype, fmt.grad_dtype, family)
    except (TypeError, KeyError) as exc:
        raise InvalidParameterError(f"format={dict(record)!r} is not a step format ({exc})") from exc
    if not same_storage(expected, fmt):
        raise InvalidParameterError(
            f"the checkpoint's state is in format {describe_format(fmt)}, but this optimizer's {precision!r} "
            f"stores {describe_format(expected)}; expected a checkpoint of the same precision")
    return fmt


def state_bytes(state: Mapping[str, Any]) -> int:
    """Bytes held by a flat state (host or device arrays with ``size`` and ``dtype``)."""
    return sum(int(v.size) * np.dtype(v.dtype).itemsize for v in state.values())
