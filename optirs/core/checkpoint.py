"""Checks of checkpoint fields, shared by every ``load_state_dict``.

A checkpoint is untrusted input: each field is checked for its type and range and converted
here, before anything is restored, and a bad one raises InvalidParameterError (or
ShapeMismatchError) naming the field and what was expected.

State arrays: optirs keeps state in float32, and a resumed run must be bit-exact, so a state
array is accepted when it is a real floating array (float16, float32, float64; a plain
``numpy.ndarray``, a list, anything ``numpy.asarray`` reads) whose conversion to float32 is
lossless: every value equal after the round trip, NaN where NaN. Integer, boolean, complex and
object arrays are refused even when their values would fit, as is any loss of precision.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Collection, List, Optional, Tuple

import numpy as np

from optirs.core.errors import InvalidParameterError, ShapeMismatchError

INT64_MAX = int(np.iinfo(np.int64).max)
FLOAT32 = np.dtype(np.float32)


def mapping(value: Any, what: str, keys: Optional[Collection[str]] = None) -> Mapping:
    """``value`` if it is a mapping (with exactly ``keys`` when given)."""
    if not isinstance(value, Mapping):
        raise InvalidParameterError(f"{what}={value!r} of type {type(value).__name__}, expected a mapping")
    if keys is not None and set(value) != set(keys):
        raise InvalidParameterError(f"{what} keys {sorted(map(str, value))}, expected {sorted(keys)}")
    return value


def sequence(value: Any, what: str) -> List[Any]:
    """``value`` as a list when it is a list, tuple or other sequence (not a string or mapping)."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (Sequence, np.ndarray)):
        raise InvalidParameterError(f"{what}={value!r} of type {type(value).__name__}, expected a list")
    return list(value)


def integer(value: Any, what: str, low: int = 0, high: int = INT64_MAX) -> int:
    """``value`` as an int when it is an integer (not a bool) in ``[low, high]``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or not low <= value <= high:
        raise InvalidParameterError(f"{what}={value!r}, expected an integer >= {low} and <= {high}")
    return int(value)


def shapes(value: Any, what: str = "shapes") -> List[Tuple[int, ...]]:
    """A list of tensor shapes: each a list of integers >= 0."""
    out = []
    for i, shape in enumerate(sequence(value, what)):
        dims = sequence(shape, f"{what}[{i}]")
        out.append(tuple(integer(d, f"{what}[{i}][{j}]", 0) for j, d in enumerate(dims)))
    return out


def float32_array(value: Any, what: str, shape: Optional[Tuple[int, ...]] = None) -> np.ndarray:
    """A new float32 array holding ``value`` exactly (see the module docstring for what is accepted)."""
    if isinstance(value, np.ndarray) and type(value) is not np.ndarray:
        raise InvalidParameterError(
            f"{what} of type {type(value).__module__}.{type(value).__qualname__}, expected a plain numpy.ndarray"
        )
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as exc:  # ragged lists, objects numpy cannot read
        raise InvalidParameterError(f"{what} cannot be read as an array ({exc}), expected a float32 array") from exc
    if array.dtype.kind != "f":
        raise InvalidParameterError(
            f"{what} has dtype {array.dtype}, expected float32 (or float16/float64 holding float32 values exactly)"
        )
    if shape is not None and array.shape != tuple(shape):
        raise ShapeMismatchError(f"{what} has shape {array.shape}, expected {tuple(shape)}")
    if array.dtype == FLOAT32:
        return array.copy()
    with np.errstate(over="ignore", invalid="ignore"):
        narrowed = array.astype(FLOAT32)
        same = (narrowed.astype(array.dtype) == array) | (np.isnan(narrowed) & np.isnan(array))
    if not bool(np.all(same)):
        bad = tuple(int(k) for k in np.argwhere(~same)[0])
        raise InvalidParameterError(
            f"{what} has dtype {array.dtype} and {what}[{', '.join(map(str, bad))}]={array[bad]!r} is not exactly a float32 "
            "value, expected float32 state (a lossless conversion at most)"
        )
    return narrowed


def flag_array(value: Any, what: str, shape: Tuple[int, ...]) -> np.ndarray:
    """A new uint8 array of 0/1 flags from a boolean or integer array holding only 0 and 1."""
    if isinstance(value, np.ndarray) and type(value) is not np.ndarray:
        raise InvalidParameterError(
            f"{what} of type {type(value).__module__}.{type(value).__qualname__}, expected a plain numpy.ndarray"
        )
    try:
        array = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise InvalidParameterError(f"{what} cannot be read as an array ({exc}), expected 0/1 flags") from exc
    if array.dtype.kind not in "biu":
        raise InvalidParameterError(f"{what} has dtype {array.dtype}, expected uint8 (or bool/integer) 0/1 flags")
    if array.shape != tuple(shape):
        raise ShapeMismatchError(f"{what} has shape {array.shape}, expected {tuple(shape)}")
    if array.size and not bool(np.isin(array, (0, 1)).all()):
        raise InvalidParameterError(f"{what} holds values other than 0 and 1, expected 0/1 flags")
    return array.astype(np.uint8)
