"""One tensor's optimizer state converted between step formats (docs/formats.md), on the host.

State a front end adopts (a checkpoint, or entries set by hand) may be held in another format
than the optimizer steps in: float32 moments loaded into int8 state, int8 codes and block scales
into float32, bfloat16 into int8, another kind of master weights. :func:`convert_entry` gives
the entry in the target's keys, dtypes and shapes. A key the source already holds in the
target's dtype and shape is copied as it is (a resumed run stays bit-exact); anything else is
decoded to float32 with the contract's own decoders (:func:`optirs.core.reference.format_step`'s) and
encoded as the target keeps it. What the target has no place for (master weights into a format
without them) and what is missing (a moment the target needs) are refused, naming the key:
nothing is dropped or restarted silently.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Set, Tuple

import numpy as np

from optirs.core.errors import InvalidParameterError, ShapeMismatchError
from optirs.core.formats import BLOCK, CODES_KINDS, CODES_SUFFIX, FormatState, StepFormat
from optirs.core import reference as ref

FLOAT32 = np.dtype(np.float32)
MASTER_KEYS = ("master", "master_remainder")


def _bfloat16() -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


class TensorTarget:
    """What one tensor's state must become: checkpoint key -> (shape, dtype), and how to encode it.

    :param wanted: key -> (shape, numpy dtype) of the target entry (bfloat16 as ml_dtypes.bfloat16).
    :param slots: the state slots' names, and whether each is signed (int8's dynamic map).
    :param fmt: the target's storage format (None: float32 state, no masters).
    :param param_words: the parameter as the kernels read it (float32 values, or the uint16 bits
        of a 16-bit parameter): masters are joined with or split from it.
    """

    def __init__(self, wanted: Mapping[str, Tuple[Tuple[int, ...], np.dtype]], signed: Mapping[str, bool],
                 fmt: Optional[StepFormat], param_words: Optional[np.ndarray]):
        self.wanted, self.signed, self.fmt, self.param_words = dict(wanted), dict(signed), fmt, param_words


def target_of(fs: FormatState, t: int, param_words: Optional[np.ndarray]) -> TensorTarget:
    """The target of tensor ``t`` of a step format's state (its checkpoint keys and dtypes)."""
    from optirs.optim.formats import checkpoint_dtype

    wanted = {k: (tuple(shape), np.dtype(checkpoint_dtype(fs, k))) for k, shape in fs.state_shapes(t).items()}
    return TensorTarget(wanted, {s.name: s.signed for s in fs.slots}, fs.fmt, param_words)


def convert_entry(entry: Mapping[str, Any], target: TensorTarget, what: str) -> Tuple[Dict[str, np.ndarray], Set[str]]:
    """(the entry in the target's keys, dtypes and shapes; the source keys it replaces).

    :param entry: the source state (numpy arrays, bfloat16 as ml_dtypes.bfloat16; ``step`` is not read).
    :param target: what the state must become.
    :param what: how messages name the entry (``state of param_groups[0]['params'][3]``).
    :raises InvalidParameterError: for a missing or None key the target needs, a dtype that
        cannot be read, or master weights the target has no place for.
    :raises ShapeMismatchError: for a value of another shape than the tensor's.
    """
    out: Dict[str, np.ndarray] = {}
    consumed: Set[str] = set()
    for key, (shape, dtype) in target.wanted.items():
        if key in out:
            continue
        value = entry.get(key)
        if isinstance(value, np.ndarray) and value.dtype == dtype and value.shape == shape:
            out[key] = value.copy()  # already as the target keeps it: bit for bit
            consumed.add(key)
            continue
        if key in MASTER_KEYS:
            out[key] = _master(entry, key, shape, dtype, target, what, consumed)
            continue
        slot, part = key.split(".", 1) if "." in key else (key, "")
        if part == "scales":  # the codes were copied as they are: their scales must be readable too
            scales = _array(entry, key, what)
            if scales.dtype.kind != "f" or scales.shape != shape:
                raise ShapeMismatchError(
                    f"{what} has {key!r} of {scales.dtype} {scales.shape}, expected float32 {shape}")
            out[key] = scales.astype(dtype)
            consumed.add(key)
            continue
        values = _slot_values(entry, slot, shape, target, what, consumed)
        if part in CODES_KINDS:
            codes, scales = ref.quantize_blocks(values, target.signed[slot], CODES_KINDS[part])
            out[key] = codes.reshape(shape)
            out[f"{slot}.scales"] = scales
        else:  # float32, or bfloat16 rounded to nearest even (the closest moment it holds)
            with np.errstate(over="ignore"):
                out[key] = values.astype(dtype)
    leftover = sorted(k for k in MASTER_KEYS if entry.get(k) is not None and k not in consumed)
    if leftover:
        keeps = "no master weights" if target.fmt is None or target.fmt.master is None else \
            f"master_weights={target.fmt.master!r}"
        raise InvalidParameterError(
            f"{what} holds {leftover}, but this optimizer keeps {keeps} for it; expected state without master "
            "weights, or an optimizer whose master_weights keep them (its param group's master_weights)")
    return out, consumed


def _array(entry: Mapping[str, Any], key: str, what: str) -> np.ndarray:
    value = entry.get(key)
    if value is None:
        raise InvalidParameterError(f"{what} has {key!r}={value!r}, expected a tensor")
    if not isinstance(value, np.ndarray) or (value.dtype.kind not in "fiu" and value.dtype != _bfloat16()):
        raise InvalidParameterError(f"{what} has {key!r} of type {type(value).__name__}"
                                    f"{'' if not isinstance(value, np.ndarray) else ' ' + str(value.dtype)}, "
                                    "expected a tensor of real numbers")
    return value


def _slot_values(entry: Mapping[str, Any], slot: str, shape: Tuple[int, ...], target: TensorTarget, what: str,
                 consumed: Set[str]) -> np.ndarray:
    """A state slot's float32 values from whichever form the source holds it in."""
    n = int(np.prod(shape, dtype=np.int64))
    if slot in entry:
        value = _array(entry, slot, what)
        if value.dtype.kind in "iu":
            raise InvalidParameterError(f"{what} has {slot!r} of dtype {value.dtype}, expected a floating-point tensor")
        if value.shape != tuple(shape):
            raise ShapeMismatchError(f"{what} has {slot!r} of shape {value.shape}, expected {tuple(shape)}")
        consumed.add(slot)
        with np.errstate(over="ignore"):
            return value.astype(FLOAT32)
    scales_key = f"{slot}.scales"
    for kind, suffix in CODES_SUFFIX.items():
        codes_key = f"{slot}.{suffix}"
        if codes_key not in entry:
            continue
        codes, scales = _array(entry, codes_key, what), _array(entry, scales_key, what)
        blocks = -(-n // BLOCK)
        if codes.dtype != np.uint8 or codes.shape != tuple(shape):
            raise ShapeMismatchError(f"{what} has {codes_key!r} of {codes.dtype} {codes.shape}, expected uint8 "
                                     f"{tuple(shape)}")
        if scales.dtype.kind != "f" or scales.shape != (blocks,):
            raise ShapeMismatchError(f"{what} has {scales_key!r} of {scales.dtype} {scales.shape}, expected float32 "
                                     f"({blocks},): one scale per {BLOCK} elements")
        consumed.update((codes_key, scales_key))
        return ref.dequantize_blocks(codes, scales.astype(FLOAT32), target.signed[slot], kind).reshape(shape)
    codes_key = f"{slot}.{CODES_SUFFIX['int8']}"
    if scales_key in entry:
        _array(entry, codes_key, what)  # scales without their codes: says which key is missing
    raise InvalidParameterError(
        f"{what} lacks {slot!r} (has {sorted(entry)}), expected {slot!r} (or {codes_key!r} and {scales_key!r}): "
        "a state without it would restart that moment at its initial value")


def _param_master(target: TensorTarget) -> np.ndarray:
    """The float32 master a parameter alone gives (its own value)."""
    words, fmt = target.param_words, target.fmt
    if fmt is None or fmt.param_dtype == "float32":
        return np.asarray(words, FLOAT32)
    return ref.decode16(words.view(np.uint16), fmt.param_dtype).reshape(words.shape)


def _float32_master(entry: Mapping[str, Any], target: TensorTarget, what: str, consumed: Set[str]) -> np.ndarray:
    """The source's float32 master: its ``master``, its ``master_remainder`` joined with the
    parameter, or the parameter itself."""
    shape = target.param_words.shape
    if entry.get("master") is not None:
        value = _array(entry, "master", what)
        if value.shape != shape:
            raise ShapeMismatchError(f"{what} has 'master' of shape {value.shape}, expected {shape}")
        consumed.add("master")
        return value.astype(FLOAT32)
    if entry.get("master_remainder") is not None:
        rem = _array(entry, "master_remainder", what)
        if rem.shape != shape or rem.dtype not in (np.int16, np.int8):
            raise ShapeMismatchError(f"{what} has 'master_remainder' of {rem.dtype} {rem.shape}, expected int16 or "
                                     f"int8 {shape}")
        if target.fmt is None or target.fmt.param_dtype != "bfloat16":
            raise InvalidParameterError(f"{what} holds 'master_remainder', the low bits below a bfloat16 parameter, "
                                        "but the parameter is not bfloat16; expected bfloat16 parameters")
        consumed.add("master_remainder")
        hi = target.param_words.view(np.uint16).reshape(-1)
        join = ref.remainder16_join if rem.dtype == np.int16 else ref.remainder8_join
        return join(hi, rem.reshape(-1)).reshape(shape)
    return _param_master(target)


def _master(entry: Mapping[str, Any], key: str, shape: Tuple[int, ...], dtype: np.dtype, target: TensorTarget,
            what: str, consumed: Set[str]) -> np.ndarray:
    master = _float32_master(entry, target, what, consumed)
    if key == "master":
        return master.astype(FLOAT32)
    # a remainder: the low bits below the parameter, which must stay the master's high half
    flat = master.reshape(-1)
    if dtype == np.int16:
        hi, rem = ref.remainder16_split(flat)
    else:
        hi, rem = ref.remainder8_split(ref.round24(flat))
    words = target.param_words.view(np.uint16).reshape(-1)
    bad = np.flatnonzero(hi != words)
    if bad.size:
        i = int(bad[0])
        raise InvalidParameterError(
            f"{what}: its float32 master {float(flat[i])!r} at element {i} does not round to the parameter's "
            f"bfloat16 bits {int(words[i]):#06x}, so no remainder ({dtype}) can hold it; expected master weights that "
            "round to the parameters (as saved with them)")
    return rem.reshape(shape).astype(dtype)


__all__ = ["MASTER_KEYS", "TensorTarget", "convert_entry", "target_of"]
