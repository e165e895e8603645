"""Step formats: how parameters, master weights and optimizer state are stored.

The contract every backend follows bit for bit is docs/formats.md. This module holds its host
side: the user's options (:class:`Precision`), the format one step runs (:class:`StepFormat`,
resolved from the arrays' dtypes and the options, with every rule checked here), the integer
codes the kernels branch on (:class:`FormatCodes`, uniform over a launch), the two int8 codes
(the 8-bit dynamic quantization map and the square-root codes), and where every buffer of a
compact state lives (:class:`FormatState`).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from optirs.core.errors import InvalidParameterError, UnsupportedOperationError
from optirs.core.layout import TensorLayout, aligned_offsets

PARAM_DTYPES = ("float32", "bfloat16", "float16")
MASTER_WEIGHTS = (None, "float32", "remainder16", "remainder8")
STATE_DTYPES = ("float32", "bfloat16", "int8", "int8_sqrt", "float8_e4m3fn")
# The one-byte states: blocks of 256 byte codes with a float32 scale each; "int8" codes by
# bitsandbytes' dynamic map, "int8_sqrt" by the square root of the value (docs/formats.md, "int8
# square-root codes"), "float8_e4m3fn" as float8 values of the value over its scale ("float8 state").
INT8_STATES = ("int8", "int8_sqrt", "float8_e4m3fn")
# Their codes' buffer (and checkpoint key) suffix: distinct, so that codes are never read by another
# kind's decoder (a checkpoint of one loads into another through its values).
CODES_SUFFIX = {"int8": "codes", "int8_sqrt": "sqrt_codes", "float8_e4m3fn": "fp8_codes"}
CODES_KINDS = {v: k for k, v in CODES_SUFFIX.items()}
# Kernel families the formats capability runs: the pointwise ones and LAMB's two passes.
FORMAT_FAMILIES = ("adam", "sgd", "rmsprop", "adagrad", "lion", "lamb", "nadam", "radam", "adamax", "adadelta", "asgd",
                   "rprop")

BLOCK = 256  # elements per int8 block (one CUDA warp x 8 elements; see docs/formats.md)
MIN_INT8_SIZE = 4096  # tensors smaller than this keep float32 state, as bitsandbytes' min_8bit_size

# Codes of FormatCodes' fields (the kernels compare against these).
F32, BF16, F16 = 0, 1, 2  # param / grad dtypes
MASTER_NONE, MASTER_F32, MASTER_R16, MASTER_R8 = 0, 1, 2, 3
STATE_F32, STATE_BF16, STATE_INT8, STATE_INT8_SQRT, STATE_FP8 = 0, 1, 2, 3, 4

_DTYPE_CODE = {"float32": F32, "bfloat16": BF16, "float16": F16}
_MASTER_CODE = {None: MASTER_NONE, "float32": MASTER_F32, "remainder16": MASTER_R16, "remainder8": MASTER_R8}
_STATE_CODE = {"float32": STATE_F32, "bfloat16": STATE_BF16, "int8": STATE_INT8, "int8_sqrt": STATE_INT8_SQRT,
               "float8_e4m3fn": STATE_FP8}
INT8_STATE_CODES = tuple(_STATE_CODE[d] for d in INT8_STATES)  # the one-byte states' FormatCodes.state


def dtype_name(dtype: Any) -> Optional[str]:
    """``"float32"``, ``"bfloat16"`` or ``"float16"`` for a numpy / ml_dtypes / torch dtype, else None."""
    name = str(dtype).replace("torch.", "")
    try:
        name = np.dtype(dtype).name
    except TypeError:
        pass
    return name if name in PARAM_DTYPES else None


@dataclass(frozen=True)
class Precision:
    """The storage options of an optimizer (docs/formats.md, "The options").

    :param master_weights: what backs a 16-bit parameter: None, ``"float32"``, ``"remainder16"``
        or ``"remainder8"`` (ignored for float32 parameters, their own master).
    :param state_dtype: ``"float32"``, ``"bfloat16"``, ``"int8"`` (bitsandbytes' dynamic map),
        ``"int8_sqrt"`` (codes of the square root: no table, a few arithmetic instructions a value) or
        ``"float8_e4m3fn"`` (float8 values of each block's values over its absmax, as torchao's
        AdamWFp8: a GPU converts them by hardware).
    :param stochastic_rounding: with ``master_weights=None`` and bfloat16 parameters, round each
        updated parameter stochastically instead of to nearest.
    :param seed: seeds the stochastic rounding; taken mod 2**32.
    """

    master_weights: Optional[str] = None
    state_dtype: str = "float32"
    stochastic_rounding: bool = False
    seed: int = 0

    def __post_init__(self):
        if self.master_weights not in MASTER_WEIGHTS:
            raise InvalidParameterError(f"master_weights={self.master_weights!r}, expected one of {list(MASTER_WEIGHTS)}")
        if self.state_dtype not in STATE_DTYPES:
            raise InvalidParameterError(f"state_dtype={self.state_dtype!r}, expected one of {list(STATE_DTYPES)}")
        if not isinstance(self.stochastic_rounding, (bool, np.bool_)):
            raise InvalidParameterError(f"stochastic_rounding={self.stochastic_rounding!r}, expected a bool")
        if isinstance(self.seed, (bool, np.bool_)) or not isinstance(self.seed, (int, np.integer)):
            raise InvalidParameterError(f"seed={self.seed!r}, expected an int")
        if self.stochastic_rounding and self.master_weights is not None:
            # with master weights the parameter is a function of the master: nothing to round stochastically
            raise InvalidParameterError(
                f"stochastic_rounding=True with master_weights={self.master_weights!r}, expected "
                "master_weights=None (stochastic rounding replaces master weights)")
        object.__setattr__(self, "stochastic_rounding", bool(self.stochastic_rounding))
        object.__setattr__(self, "seed", int(self.seed) % (1 << 32))


class FormatCodes(NamedTuple):
    """The integer codes of a :class:`StepFormat` that kernels branch on (the same for every element)."""

    param: int  # F32, BF16, F16
    grad: int  # F32, BF16, F16
    master: int  # MASTER_NONE, MASTER_F32, MASTER_R16, MASTER_R8
    state: int  # STATE_F32, STATE_BF16, STATE_INT8, STATE_INT8_SQRT, STATE_FP8
    stochastic: bool  # stochastic rounding of bfloat16 parameters (master MASTER_NONE only)


@dataclass(frozen=True)
class StepFormat:
    """The format one step runs, resolved from the arrays and the :class:`Precision` (:func:`resolve_format`)."""

    param_dtype: str = "float32"
    grad_dtype: str = "float32"
    master: Optional[str] = None
    state_dtype: str = "float32"
    stochastic: bool = False

    @property
    def half_params(self) -> bool:
        """Whether the parameters are 16-bit (staged as uint16 bit patterns)."""
        return self.param_dtype != "float32"

    @property
    def plain(self) -> bool:
        """float32 parameters, gradients and state: the ordinary float32 step hook runs it."""
        return self.param_dtype == "float32" and self.grad_dtype == "float32" and self.state_dtype == "float32"

    @property
    def codes(self) -> FormatCodes:
        return FormatCodes(_DTYPE_CODE[self.param_dtype], _DTYPE_CODE[self.grad_dtype], _MASTER_CODE[self.master],
                           _STATE_CODE[self.state_dtype], bool(self.stochastic))


def resolve_format(precision: Precision, param_dtype: Any, grad_dtype: Any, family: str) -> StepFormat:
    """The :class:`StepFormat` of a step on parameters of ``param_dtype`` with gradients of ``grad_dtype``.

    :param precision: the optimizer's options.
    :param param_dtype: the parameters' dtype (numpy, ml_dtypes or torch; all parameters share it).
    :param grad_dtype: the gradients' dtype: the parameters' or float32.
    :param family: the definition's kernel family (``"adam"``, ``"lamb"``, ``"adafactor"`` ...).
    :raises InvalidParameterError: for a dtype that is not float32, bfloat16 or float16, gradients
        in another 16-bit dtype than the parameters, or remainder masters without bfloat16 parameters.
    :raises UnsupportedOperationError: stochastic rounding of float16 parameters; a non-float32
        format of a family the formats capability does not run (Adafactor).
    """
    if not isinstance(precision, Precision):
        raise InvalidParameterError(f"precision={precision!r}, expected an optirs.core.formats.Precision")
    pd, gd = dtype_name(param_dtype), dtype_name(grad_dtype)
    if pd is None:
        raise InvalidParameterError(f"parameter dtype {param_dtype}, expected one of {list(PARAM_DTYPES)}")
    if gd not in (pd, "float32"):
        raise InvalidParameterError(f"gradient dtype {grad_dtype} with {pd} parameters, expected {pd} or float32")
    master = precision.master_weights if pd != "float32" else None
    if master in ("remainder16", "remainder8") and pd != "bfloat16":
        raise InvalidParameterError(
            f"master_weights={master!r} with {pd} parameters, expected bfloat16 parameters "
            "(the remainder is the low bits below a bfloat16)")
    stochastic = precision.stochastic_rounding and pd != "float32"
    if stochastic and pd == "float16":
        raise UnsupportedOperationError("stochastic_rounding=True with float16 parameters: only bfloat16 "
                                        "parameters are rounded stochastically")
    fmt = StepFormat(pd, gd, master, precision.state_dtype, stochastic)
    if not fmt.plain and family not in FORMAT_FAMILIES:
        raise UnsupportedOperationError(
            f"the {family} family runs float32 parameters and state only, got {fmt}; the formats "
            f"capability runs {list(FORMAT_FAMILIES)}")
    return fmt


def format_slots(definition: Any, hp: Any) -> Tuple[Any, ...]:
    """The :class:`~optirs.core.definitions.StateSlot` records ``hp`` needs, in kernel order (a :class:`FormatState`'s slots)."""
    return tuple(s for s in definition.slots if s.needed(hp))


# ---------------------------------------------------------------- the 8-bit dynamic map


def _round_to_float32(x: Fraction) -> np.float32:
    """The float32 nearest to the exact rational ``x`` (ties to even), rounded once."""
    c = np.float32(float(x))  # within one float32 step of the answer (the double rounding may be off)
    best = None
    for cand in (np.nextafter(c, np.float32(-np.inf)), c, np.nextafter(c, np.float32(np.inf))):
        d = abs(Fraction(float(cand)) - x)
        key = (d, int(cand.view(np.uint32)) & 1)
        if best is None or key < best[0]:
            best = (key, cand)
    return np.float32(best[1])


@lru_cache(maxsize=2)
def _dynamic_map(signed: bool) -> np.ndarray:
    # bitsandbytes' create_dynamic_map(signed, max_exponent_bits=7, total_bits=8): for exponent
    # i = 0..6, the means of adjacent points of linspace(0.1, 1, n_i) scaled by 10**(i - 6), with
    # n_i = 2**i + 1 (signed, mirrored) or 2**(i + 1) + 1 (unsigned); plus 0 and 1, sorted. Every
    # value here is exact, rounded once to float32: torch.linspace (which bitsandbytes and
    # torchao call) rounds with the machine's vector width, so their maps differ by an ulp or two
    # from machine to machine, and every backend must share one table.
    values = [Fraction(0), Fraction(1)]
    for i in range(7):
        n = 2**i + 1 if signed else 2 ** (i + 1) + 1
        for k in range(n - 1):
            mean = Fraction(1, 10) + Fraction(9, 10) * Fraction(2 * k + 1, 2 * (n - 1))
            v = mean * Fraction(10) ** (i - 6)
            values += [v, -v] if signed else [v]
    assert len(values) == 256
    q = np.array([_round_to_float32(v) for v in sorted(values)], dtype=np.float32)
    q.setflags(write=False)
    return q


def dynamic_map(signed: bool) -> np.ndarray:
    """The 256 float32 codes of the signed or unsigned dynamic map, ascending (read-only)."""
    return _dynamic_map(bool(signed))


@lru_cache(maxsize=2)
def _midpoints(signed: bool) -> np.ndarray:
    q = dynamic_map(signed)
    mid = (np.float32(0.5) * (q[:-1] + q[1:])).astype(np.float32)
    mid.setflags(write=False)
    return mid


def map_midpoints(signed: bool) -> np.ndarray:
    """``mid[k] = 0.5 * (q[k] + q[k + 1])`` in float32, k = 0..254: code = the number of ``mid[k] < y``."""
    return _midpoints(bool(signed))


# ---------------------------------------------------------------- where a compact state lives


class FormatState:
    """Where every tensor's compact state and master weights live in their flat buffers.

    The same interface as the float32 layouts (``buffer_sizes``, ``state_shapes``, ``views``) plus
    ``buffer_dtypes``, ``buffer_fills`` and ``tensor_table`` (docs/formats.md, "State layout").

    :param layout: the model's :class:`~optirs.core.layout.TensorLayout`.
    :param slots: the definition's :class:`~optirs.core.definitions.StateSlot` records the
        hyperparameters need, in kernel order.
    :param fmt: the step format.
    """

    def __init__(self, layout: TensorLayout, slots: Sequence[Any], fmt: StepFormat):
        if not isinstance(fmt, StepFormat):
            raise InvalidParameterError(f"fmt={fmt!r}, expected an optirs.core.formats.StepFormat")
        self.layout, self.fmt = layout, fmt
        self.slots = tuple(slots)
        self.slot_names = tuple(s.name for s in self.slots)
        self.int8 = fmt.state_dtype in INT8_STATES
        self.codes = CODES_SUFFIX.get(fmt.state_dtype)  # the codes' buffer suffix (int8 states)
        sizes = layout.sizes
        # (a shard is small when its whole tensor is: the same state keys under every sharding)
        small = layout.whole_sizes < MIN_INT8_SIZE if self.int8 else np.zeros(len(sizes), dtype=bool)
        blocks = np.where(small, 0, (sizes + BLOCK - 1) // BLOCK) if self.int8 else np.zeros(len(sizes), np.int64)
        small_sizes = np.where(small, sizes, 0)
        table = np.full((len(sizes), 3), -1, dtype=np.int64)
        table[:, 0] = layout.offsets
        # the small tensors' float32 state on the vector grid, as the codes (none without int8: 0 elements)
        small_offset, self.total_small = aligned_offsets(small_sizes, layout.align)
        if self.int8:
            first_block = np.cumsum(blocks) - blocks
            table[~small, 1] = first_block[~small]
            table[small, 2] = small_offset[small]
        table.setflags(write=False)
        self._table, self._small, self._blocks = table, small, blocks
        self.total_blocks = int(blocks.sum())

    # -- buffers

    def master_buffer(self) -> Optional[str]:
        """The master buffer's name (``"master"``, ``"master_remainder"``) or None."""
        if self.fmt.master == "float32":
            return "master"
        if self.fmt.master in ("remainder16", "remainder8"):
            return "master_remainder"
        return None

    def slot_buffers(self, slot: str) -> Tuple[str, ...]:
        """The buffer names of state slot ``slot``."""
        return (f"{slot}.{self.codes}", f"{slot}.scales", f"{slot}.small") if self.int8 else (slot,)

    def buffer_dtypes(self) -> Dict[str, np.dtype]:
        """Buffer name -> numpy dtype (bfloat16 values are held as uint16 bit patterns)."""
        out: Dict[str, np.dtype] = {}
        for s in self.slot_names:
            if self.int8:
                out.update({f"{s}.{self.codes}": np.dtype(np.uint8), f"{s}.scales": np.dtype(np.float32),
                            f"{s}.small": np.dtype(np.float32)})
            else:
                out[s] = np.dtype(np.uint16 if self.fmt.state_dtype == "bfloat16" else np.float32)
        m = self.master_buffer()
        if m == "master":
            out[m] = np.dtype(np.float32)
        elif m is not None:
            out[m] = np.dtype(np.int16 if self.fmt.master == "remainder16" else np.int8)
        return out

    def buffer_sizes(self) -> Dict[str, int]:
        """Buffer name -> elements of its flat buffer."""
        total = self.layout.total
        out: Dict[str, int] = {}
        for name in self.buffer_dtypes():
            if name.endswith(".scales"):
                out[name] = self.total_blocks
            elif name.endswith(".small"):
                out[name] = self.total_small
            else:
                out[name] = total
        return out

    def buffer_fills(self, initial: Dict[str, float]) -> Dict[str, float]:
        """Buffer name -> the fill value of a fresh buffer (for ``optirs_alloc``), given each slot's
        initial value (``definition.state_slots(hp)``). A fresh master buffer is 0: the step reads
        the parameters themselves at step 1 (docs/formats.md)."""
        fills: Dict[str, float] = {}
        for slot in self.slots:
            v = np.float32(initial.get(slot.name, 0.0))
            if self.int8:
                scale = np.float32(abs(v))
                kind = self.fmt.state_dtype
                code = quantize_host(np.array([v], np.float32), scale, slot.signed, kind)[0] if scale != 0 else \
                    quantize_host(np.zeros(1, np.float32), np.float32(1), slot.signed, kind)[0]
                fills.update({f"{slot.name}.{self.codes}": float(code), f"{slot.name}.scales": float(scale),
                              f"{slot.name}.small": float(v)})
            elif self.fmt.state_dtype == "bfloat16":
                import ml_dtypes

                fills[slot.name] = float(np.array([v]).astype(ml_dtypes.bfloat16).view(np.uint16)[0])
            else:
                fills[slot.name] = float(v)
        m = self.master_buffer()
        if m is not None:
            fills[m] = 0.0
        return fills

    def tensor_table(self) -> np.ndarray:
        """int64[ntensors, 3]: state offset, first block (int8, else -1), small offset (-1 unless small)."""
        return self._table

    def is_small(self, t: int) -> bool:
        """Whether tensor ``t`` keeps float32 state under int8 (fewer than MIN_INT8_SIZE elements in its
        whole tensor: ``layout.whole_sizes``)."""
        return bool(self._small[t])

    # -- per-tensor views (checkpoints)

    def state_shapes(self, t: int) -> Dict[str, Tuple[int, ...]]:
        """Checkpoint key -> shape of tensor ``t``'s compact state (docs/formats.md, state_dict)."""
        shape = self.layout.shapes[t]
        out: Dict[str, Tuple[int, ...]] = {}
        for s in self.slot_names:
            if self.int8 and not self._small[t]:
                out[f"{s}.{self.codes}"] = shape
                out[f"{s}.scales"] = (int(self._blocks[t]),)
            else:
                out[s] = shape
        m = self.master_buffer()
        if m is not None:
            out[m] = shape
        return out

    def views(self, buffer: str, flat: np.ndarray) -> List[Optional[np.ndarray]]:
        """Per-tensor views of a flat host buffer ``buffer`` (None where a tensor has no part of it)."""
        layout, out = self.layout, []
        for t, shape in enumerate(layout.shapes):
            o, n = int(layout.offsets[t]), int(layout.sizes[t])
            if buffer.endswith(".scales"):
                b = int(self._table[t, 1])
                out.append(None if b < 0 else flat[b : b + int(self._blocks[t])])
            elif buffer.endswith(".small"):
                so = int(self._table[t, 2])
                out.append(None if so < 0 else flat[so : so + n].reshape(shape))
            elif buffer.endswith(f".{self.codes}") and self._small[t]:
                out.append(None)
            else:
                out.append(flat[o : o + n].reshape(shape))
        return out

    def tensor_views(self, t: int, buffers: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        """Checkpoint key -> view of tensor ``t``'s part of the flat host ``buffers`` (keys of :meth:`state_shapes`)."""
        out = {}
        for key in self.state_shapes(t):
            buffer = f"{key}.small" if self.int8 and key in self.slot_names else key
            out[key] = self.views(buffer, buffers[buffer])[t]
        return out


def quantize_factors(scales) -> Tuple[np.ndarray, np.ndarray]:
    """Each block's ``(pre, inv)`` (float32 arrays): its values are coded as ``(x * pre) * inv``
    (docs/formats.md). ``pre`` is 2**64 for a subnormal scale (exact, and the reciprocal then stays
    finite), else 1; ``inv`` is the float32 reciprocal of ``scale * pre``, 0 for a zero scale."""
    s = np.asarray(scales, np.float32)
    tiny = (s > 0) & (s < np.float32(2.0**-126))
    pre = np.where(tiny, np.float32(2.0**64), np.float32(1)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inv = np.where(s == 0, np.float32(0), np.float32(1) / (s * pre)).astype(np.float32)
    return pre, inv


def quantize_host(x: np.ndarray, scale: np.float32, signed: bool, kind: str = "int8") -> np.ndarray:
    """The int8 codes (uint8) of float32 values ``x`` at one block ``scale`` (numpy; docs/formats.md);
    ``kind`` is the state dtype, ``"int8"``, ``"int8_sqrt"`` or ``"float8_e4m3fn"``."""
    x = np.asarray(x, dtype=np.float32)
    if kind == "int8_sqrt":
        return sqrt_quantize(x, scale, signed)
    if kind == "float8_e4m3fn":
        return fp8_quantize(x, scale)
    pre, inv = quantize_factors(scale)
    with np.errstate(over="ignore", invalid="ignore"):
        y = ((x * pre) * inv).astype(np.float32)
    return np.searchsorted(map_midpoints(signed), y, side="left").astype(np.uint8)


# ---------------------------------------------------------------- the int8 square-root codes

def sqrt_levels(signed: bool) -> int:
    """The largest code of the square-root codes: 127 for a signed slot, 255 for an unsigned one."""
    return 127 if signed else 255


def sqrt_factors(scales, signed: bool) -> Tuple[np.ndarray, np.ndarray]:
    """Each block's ``(k, w)`` of the square-root codes (float32 arrays; docs/formats.md): a value's
    root times ``k`` is coded, ``(c * |c|) * w`` decoded. ``k = n / sqrt(scale)`` (both correctly
    rounded; 0 for a zero scale), ``w = scale / n**2``; ``n`` the largest code."""
    s = np.asarray(scales, np.float32)
    n = np.float32(sqrt_levels(signed))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        k = np.where(s == 0, np.float32(0), n / np.sqrt(s, dtype=np.float32)).astype(np.float32)
        w = (s / np.float32(n * n)).astype(np.float32)
    return k, w


def sqrt_quantize(x: np.ndarray, scales, signed: bool) -> np.ndarray:
    """The square-root codes (uint8; a signed slot's as two's complement int8) of float32 values
    ``x`` under block scales ``scales`` (one, or one per value): ``c`` = the float32 product of the
    root (the correctly rounded float32 square root of ``|x|`` in a signed slot, of ``x`` in an
    unsigned one) and the block's ``k``, rounded to the nearest integer, ties to even; negated for a
    negative ``x`` of a signed slot; a NaN product codes as 0."""
    x = np.asarray(x, np.float32)
    k, _ = sqrt_factors(scales, signed)
    with np.errstate(over="ignore", invalid="ignore"):
        t = (np.sqrt(np.abs(x) if signed else x, dtype=np.float32) * k).astype(np.float32)
    t = np.where(np.isnan(t), np.float32(0), t)
    c = np.rint(t).astype(np.int64)
    if signed:
        c = np.where(x < 0, -c, c)
    return (c & 0xFF).astype(np.uint8)


def sqrt_dequantize(codes: np.ndarray, scales, signed: bool) -> np.ndarray:
    """float32 values of square-root codes under block scales (one, or one per code): ``(c * |c|) * w``."""
    codes = np.asarray(codes, np.uint8)
    c = (codes.view(np.int8) if signed else codes).astype(np.float32)
    _, w = sqrt_factors(scales, signed)
    with np.errstate(over="ignore", invalid="ignore"):
        return ((c * np.abs(c)).astype(np.float32) * w).astype(np.float32)


# ---------------------------------------------------------------- the float8 state

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value: a block's absmax is coded as it
FP8_PRE_BELOW = 2.0**-64  # a scale below this (and above 0) takes pre = 2**64


def fp8_factors(scales) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each block's ``(pre, k, w, post)`` of the float8 state (float32 arrays; docs/formats.md): a
    value is coded as ``(x * pre) * k`` and decoded as ``(v * w) * post``. ``pre`` is 2**64 for a
    scale in (0, 2**-64) (so that ``k`` stays finite and ``w`` normal), else 1, and ``post`` its
    reciprocal; ``k = 448 / (scale * pre)`` (0 for a zero scale) and ``w = (scale * pre) / 448``,
    each correctly rounded."""
    s = np.asarray(scales, np.float32)
    tiny = (s > 0) & (s < np.float32(FP8_PRE_BELOW))
    pre = np.where(tiny, np.float32(2.0**64), np.float32(1)).astype(np.float32)
    post = np.where(tiny, np.float32(2.0**-64), np.float32(1)).astype(np.float32)
    sp = (s * pre).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        k = np.where(s == 0, np.float32(0), np.float32(FP8_MAX) / sp).astype(np.float32)
        w = (sp / np.float32(FP8_MAX)).astype(np.float32)
    return pre, k, w, post


def fp8_encode(y: np.ndarray) -> np.ndarray:
    """float32 values -> float8_e4m3fn bit patterns (uint8): nearest even, magnitudes above 448
    saturated to 448 (the GPUs' ``satfinite`` conversion), a NaN coded 0x7F whatever its sign."""
    import ml_dtypes

    y = np.asarray(y, np.float32)
    with np.errstate(invalid="ignore"):
        sat = np.where(np.abs(y) > np.float32(FP8_MAX), np.copysign(np.float32(FP8_MAX), y), y).astype(np.float32)
    codes = sat.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return np.where(np.isnan(y), np.uint8(0x7F), codes).astype(np.uint8)


def fp8_decode(codes: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bit patterns -> their float32 values (0x7F and 0xFF: NaN)."""
    import ml_dtypes

    return np.asarray(codes, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def fp8_quantize(x: np.ndarray, scales) -> np.ndarray:
    """The float8 codes (uint8) of float32 values ``x`` under block scales ``scales`` (one, or one per
    value): ``(x * pre) * k`` (:func:`fp8_factors`) as float8_e4m3fn (:func:`fp8_encode`)."""
    x = np.asarray(x, np.float32)
    pre, k, _, _ = fp8_factors(scales)
    with np.errstate(over="ignore", invalid="ignore"):
        y = ((x * pre).astype(np.float32) * k).astype(np.float32)
    return fp8_encode(y)


def fp8_dequantize(codes: np.ndarray, scales) -> np.ndarray:
    """float32 values of float8 codes under block scales (one, or one per code): ``(v * w) * post``."""
    _, _, w, post = fp8_factors(scales)
    with np.errstate(over="ignore", invalid="ignore"):
        return ((fp8_decode(codes) * w).astype(np.float32) * post).astype(np.float32)
