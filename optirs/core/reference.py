"""The specification: every optimizer's step in float64 numpy, written to be read.

Each function takes a model (a list of parameter arrays), its gradients, the per-parameter state
(a list of dicts of arrays, empty dicts before the first step), the hyperparameters and the
1-based step number, and returns new parameters and state; nothing is modified in place.
Every backend is tested against these functions. The state slot names are the ones
``state_dict()`` uses.

Weight decay is applied as torch applies it: only when ``weight_decay != 0`` (so an infinite
weight with no decay stays infinite instead of becoming ``0 * inf`` = NaN).

The step formats (docs/formats.md) have their reference here too (:func:`format_step`): the
contract's encodings in numpy and ml_dtypes, independent of the backends' element code.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np

from optirs.core.formats import (BLOCK, FP8_MAX, FormatState, StepFormat, dynamic_map, fp8_decode, fp8_dequantize,
                                 fp8_quantize, map_midpoints, quantize_factors, sqrt_dequantize, sqrt_levels,
                                 sqrt_quantize)
from optirs.core.params import (AdadeltaParams, AdafactorParams, AdagradParams, AdamaxParams, AdamParams, AsgdParams,
                                LambParams, LionParams, NadamParams, RadamParams, RmspropParams, RpropParams, SgdParams)

State = Dict[str, np.ndarray]
StepResult = Tuple[List[np.ndarray], List[State]]


def _f64(arrays: Sequence[np.ndarray]) -> List[np.ndarray]:
    return [np.asarray(a, dtype=np.float64) for a in arrays]


def _zeros_like_all(params: Sequence[np.ndarray], names: Sequence[str], fill: float = 0.0) -> List[State]:
    return [{n: np.full(p.shape, fill, np.float64) for n in names} for p in params]


def _decay(p: np.ndarray, hp) -> np.ndarray:
    """Decoupled weight decay p * (1 - lr * wd), skipped when wd is 0 (as torch: ``if weight_decay != 0``)."""
    return p * (1.0 - hp.lr * hp.weight_decay) if hp.weight_decay != 0 else p


def adam(params, grads, state, hp: AdamParams, step: int, decoupled: bool = False) -> StepResult:
    """Adam (L2 weight decay) or, with ``decoupled``, AdamW; amsgrad as torch.optim.Adam."""
    names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if hp.amsgrad else [])
    state = state if state and state[0] else _zeros_like_all(params, names)
    bc1 = 1.0 - hp.beta1**step
    bc2 = 1.0 - hp.beta2**step
    new_p, new_s = [], []
    for p, g, s in zip(_f64(params), _f64(grads), state):
        if decoupled:
            p = _decay(p, hp)
        elif hp.weight_decay != 0:
            g = g + hp.weight_decay * p
        m = hp.beta1 * s["exp_avg"] + (1.0 - hp.beta1) * g
        v = hp.beta2 * s["exp_avg_sq"] + (1.0 - hp.beta2) * g * g
        ns = {"exp_avg": m, "exp_avg_sq": v}
        if hp.amsgrad:
            vmax = np.maximum(s["max_exp_avg_sq"], v)
            ns["max_exp_avg_sq"] = vmax
            denom = np.sqrt(vmax) / np.sqrt(bc2) + hp.eps
        else:
            denom = np.sqrt(v) / np.sqrt(bc2) + hp.eps
        new_p.append(p - (hp.lr / bc1) * m / denom)
        new_s.append(ns)
    return new_p, new_s


def adamw(params, grads, state, hp: AdamParams, step: int) -> StepResult:
    return adam(params, grads, state, hp, step, decoupled=True)


def sgd(params, grads, state, hp: SgdParams, step: int) -> StepResult:
    """SGD as torch.optim.SGD: the first step's momentum buffer is the gradient itself."""
    new_p, new_s = [], []
    for i, (p, g) in enumerate(zip(_f64(params), _f64(grads))):
        if hp.weight_decay != 0:
            g = g + hp.weight_decay * p
        ns: State = {}
        if hp.momentum != 0.0:
            if step == 1:
                buf = g.copy()
            else:
                buf = hp.momentum * state[i]["momentum_buffer"] + (1.0 - hp.dampening) * g
            ns["momentum_buffer"] = buf
            g = g + hp.momentum * buf if hp.nesterov else buf
        new_p.append(p - hp.lr * g)
        new_s.append(ns)
    return new_p, new_s


def rmsprop(params, grads, state, hp: RmspropParams, step: int) -> StepResult:
    """RMSprop as torch.optim.RMSprop (eps added after the square root)."""
    names = ["square_avg"] + (["momentum_buffer"] if hp.momentum > 0 else []) + (["grad_avg"] if hp.centered else [])
    state = state if state and state[0] else _zeros_like_all(params, names)
    new_p, new_s = [], []
    for p, g, s in zip(_f64(params), _f64(grads), state):
        if hp.weight_decay != 0:
            g = g + hp.weight_decay * p
        sq = hp.alpha * s["square_avg"] + (1.0 - hp.alpha) * g * g
        ns = {"square_avg": sq}
        if hp.centered:
            ga = hp.alpha * s["grad_avg"] + (1.0 - hp.alpha) * g
            ns["grad_avg"] = ga
            avg = np.sqrt(sq - ga * ga) + hp.eps
        else:
            avg = np.sqrt(sq) + hp.eps
        if hp.momentum > 0:
            buf = hp.momentum * s["momentum_buffer"] + g / avg
            ns["momentum_buffer"] = buf
            p = p - hp.lr * buf
        else:
            p = p - hp.lr * g / avg
        new_p.append(p)
        new_s.append(ns)
    return new_p, new_s


def adagrad(params, grads, state, hp: AdagradParams, step: int) -> StepResult:
    """Adagrad as torch.optim.Adagrad, with lr decayed as lr / (1 + (step - 1) * lr_decay)."""
    state = state if state and state[0] else _zeros_like_all(params, ["sum"], hp.initial_accumulator_value)
    clr = hp.lr / (1.0 + (step - 1) * hp.lr_decay)
    new_p, new_s = [], []
    for p, g, s in zip(_f64(params), _f64(grads), state):
        if hp.weight_decay != 0:
            g = g + hp.weight_decay * p
        acc = s["sum"] + g * g
        new_p.append(p - clr * g / (np.sqrt(acc) + hp.eps))
        new_s.append({"sum": acc})
    return new_p, new_s


def lamb_grad_scale(grads, hp: LambParams) -> float:
    """The factor that global gradient-norm clipping applies: min(1, max_grad_norm / ||g||)."""
    if hp.max_grad_norm is None:
        return 1.0
    norm = float(np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in grads)))
    return 1.0 if norm <= hp.max_grad_norm else hp.max_grad_norm / norm


def lamb_trust_ratio(p_norm: float, u_norm: float, hp: LambParams) -> float:
    """||p|| / ||u||, 1 where either is zero, optionally clipped from above."""
    ratio = 1.0 if p_norm == 0.0 or u_norm == 0.0 else p_norm / u_norm
    return ratio if hp.max_trust_ratio is None else min(ratio, hp.max_trust_ratio)


def lamb(params, grads, state, hp: LambParams, step: int) -> StepResult:
    """LAMB: Adam direction (bias-corrected unless disabled) plus decoupled decay, scaled per tensor."""
    state = state if state and state[0] else _zeros_like_all(params, ["exp_avg", "exp_avg_sq"])
    scale = lamb_grad_scale(grads, hp)
    bc1 = 1.0 - hp.beta1**step if hp.bias_correction else 1.0
    bc2 = 1.0 - hp.beta2**step if hp.bias_correction else 1.0
    new_p, new_s = [], []
    for p, g, s in zip(_f64(params), _f64(grads), state):
        g = g * scale
        m = hp.beta1 * s["exp_avg"] + (1.0 - hp.beta1) * g
        v = hp.beta2 * s["exp_avg_sq"] + (1.0 - hp.beta2) * g * g
        u = (m / bc1) / (np.sqrt(v) / np.sqrt(bc2) + hp.eps)
        if hp.weight_decay != 0:
            u = u + hp.weight_decay * p
        ratio = lamb_trust_ratio(float(np.linalg.norm(p)), float(np.linalg.norm(u)), hp)
        new_p.append(p - hp.lr * ratio * u)
        new_s.append({"exp_avg": m, "exp_avg_sq": v})
    return new_p, new_s


def run(name: str, params, grad_sequence, hp, start_step: int = 1, state=None) -> StepResult:
    """Apply ``len(grad_sequence)`` steps of optimizer ``name`` and return the final params and state.

    ``name`` is an optimizer's name; its step is this module's function of that name (the one its
    definition in optirs.core.definitions names).
    """
    step_fn = STEPS.get(name)
    if step_fn is None:
        from optirs.core.errors import InvalidParameterError

        raise InvalidParameterError(f"optimizer={name!r}, expected one of {sorted(STEPS)}")
    state = state or [{} for _ in params]
    params = _f64(params)
    for k, grads in enumerate(grad_sequence):
        params, state = step_fn(params, grads, state, hp, start_step + k)
    return params, state


def lion(params, grads, state, hp: LionParams, step: int) -> StepResult:
    """Lion as lion-pytorch: p *= 1 - lr * wd; p -= lr * sign(beta1 * m + (1 - beta1) * g);
    m = beta2 * m + (1 - beta2) * g. sign(0) = 0, as torch.sign."""
    state = state if state and state[0] else _zeros_like_all(params, ["exp_avg"])
    new_p, new_s = [], []
    for p, g, s in zip(_f64(params), _f64(grads), state):
        p = _decay(p, hp)
        update = np.sign(hp.beta1 * s["exp_avg"] + (1.0 - hp.beta1) * g)
        new_p.append(p - hp.lr * update)
        new_s.append({"exp_avg": hp.beta2 * s["exp_avg"] + (1.0 - hp.beta2) * g})
    return new_p, new_s


def adafactor_state_shapes(shape: Sequence[int]) -> Dict[str, Tuple[int, ...]]:
    """The state slots of one tensor and their shapes, as torch.optim.Adafactor keeps them:
    row_var and col_var (keepdim shapes) for 2+ dims, a full variance otherwise."""
    shape = tuple(int(d) for d in shape)
    if len(shape) >= 2:
        return {"row_var": shape[:-1] + (1,), "col_var": shape[:-2] + (1,) + shape[-1:]}
    return {"variance": shape}


def adafactor(params, grads, state, hp: AdafactorParams, step: int) -> StepResult:
    """Adafactor as torch.optim.Adafactor (torch 2.13): factored second moment over the last two
    dims for 2+ dim tensors, relative step size from RMS(p), update clipped by RMS(update) / d."""
    if not (state and state[0]):
        state = [{k: np.zeros(s, np.float64) for k, s in adafactor_state_shapes(p.shape).items()} for p in params]
    weight = float(step) ** hp.beta2_decay  # 1 - beta2_t
    rho = min(hp.lr, 1.0 / np.sqrt(step))
    eps1 = float(np.finfo(np.float32).eps) if hp.eps[0] is None else float(hp.eps[0])
    new_p, new_s = [], []
    for p, g, s in zip(_f64(params), _f64(grads), state):
        if p.size == 0:
            new_p.append(p.copy())
            new_s.append({k: v.copy() for k, v in s.items()})
            continue
        g = -g if hp.maximize else g
        alpha = max(hp.eps[1], float(np.sqrt(np.mean(p * p)))) * rho  # RMS of p before the decay
        p = _decay(p, hp)
        if p.ndim >= 2:
            row = s["row_var"] + weight * (np.mean(g * g, axis=-1, keepdims=True) - s["row_var"])
            col = s["col_var"] + weight * (np.mean(g * g, axis=-2, keepdims=True) - s["col_var"])
            var = row * col / np.maximum(np.mean(row, axis=-2, keepdims=True), eps1)
            ns = {"row_var": row, "col_var": col}
        else:
            var = s["variance"] + weight * (g * g - s["variance"])
            ns = {"variance": var}
        update = g / np.sqrt(np.maximum(var, eps1 * eps1))
        denom = max(1.0, float(np.sqrt(np.mean(update * update))) / hp.d)
        new_p.append(p - (alpha / denom) * update)
        new_s.append(ns)
    return new_p, new_s


# ---------------------------------------------------------------- step formats (docs/formats.md)
# The reference of a format step (docs/formats.md): decode, the float64 step, encode.
# 
# Written in numpy and ml_dtypes, independently of the numba element code
# (``optirs/backends/common/formats.py``), so the tests compare two implementations of the
# contract: the encodings on uint32 arrays, the random bits in numpy uint32, the int8 blocks with
# ``np.searchsorted`` over the map's midpoints. A step decodes the compact parameters, masters and
# state to float32, runs the definition's float64 step (:mod:`optirs.core.reference`), rounds the
# results once to float32 and encodes them with the contract's rounding. Where a backend's float32
# step computes the same value the results are bit-exact; elsewhere they differ by the float32
# step's own rounding (an ulp before encoding: one bfloat16 step or one int8 code after it).


_U32 = np.uint32


# ---------------------------------------------------------------- random bits


def fmix32(h) -> np.ndarray:
    h = np.asarray(h, dtype=np.uint64) & 0xFFFFFFFF
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h = h ^ (h >> 16)
    return h.astype(_U32)


def stream_key(seed: int, step: int, stream: int) -> np.uint32:
    """``fmix32(seed ^ fmix32(step * 4 + stream))``."""
    inner = fmix32((int(step) * 4 + int(stream)) & 0xFFFFFFFF)
    return _U32(fmix32(np.uint64(int(seed) & 0xFFFFFFFF) ^ np.uint64(inner)))


def rand_bits(key, index: np.ndarray) -> np.ndarray:
    """``fmix32(key ^ (i * 0x9E3779B1))`` for flat layout indices ``index`` (low 32 bits)."""
    i = np.asarray(index, dtype=np.int64).astype(np.uint64) & 0xFFFFFFFF
    return fmix32(np.uint64(key) ^ ((i * 0x9E3779B1) & 0xFFFFFFFF))


def state_stream(k: int) -> int:
    """State slot ``k``'s random stream: slots 0 and 1 share stream 1 (one word, two halves), slot 2 takes 2."""
    return 1 + (int(k) >> 1)


def slot_bits(word: np.ndarray, k: int) -> np.ndarray:
    """Slot ``k``'s 16 random bits of its stream's words: the low half for even ``k``, the high half for odd."""
    w = np.asarray(word, _U32)
    return (w >> 16) if int(k) & 1 else (w & 0xFFFF)


# ---------------------------------------------------------------- encodings (float32 arrays <-> bits)


def bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(_U32)


def from_bits(u: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(u, dtype=_U32).view(np.float32)


def _half(dtype: str) -> np.dtype:
    """numpy's dtype of ``dtype`` ("bfloat16" / "float16"); ml_dtypes loads on first use (its
    import takes about a second, and most programs never decode a 16-bit word here)."""
    if dtype != "bfloat16":
        return np.dtype(np.float16)
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def decode16(h: np.ndarray, dtype: str) -> np.ndarray:
    """uint16 bits of ``dtype`` ("bfloat16" / "float16") -> float32."""
    h = np.ascontiguousarray(h, dtype=np.uint16)
    return h.view(_half(dtype)).astype(np.float32)


def nearest16(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 -> uint16 bits, nearest even (ml_dtypes' bfloat16 cast, numpy's float16 cast)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(x, np.float32).astype(_half(dtype)).view(np.uint16)


def bf16_stochastic(x: np.ndarray, r: np.ndarray) -> np.ndarray:
    """``(bits(x) + (r & 0xFFFF)) >> 16`` for finite x; inf and NaN to nearest."""
    u = bits(x).astype(np.uint64)
    out = ((u + (np.asarray(r, np.uint64) & 0xFFFF)) & 0xFFFFFFFF) >> 16
    finite = (u & 0x7F800000) != 0x7F800000
    return np.where(finite, out, nearest16(x, "bfloat16")).astype(np.uint16)


def quiet_nan_master(master: np.ndarray) -> np.ndarray:
    """A float32 master's NaNs as the quiet NaN of their sign (0x7FC00000 | sign), before a remainder
    split: a payload with bit 15 set would round the bfloat16 parameter up through the sign to a
    zero (0x7FFFFFFF to 0x8000 and a remainder of -1)."""
    u = bits(master)
    return from_bits(np.where(np.isnan(from_bits(u)), (u & 0x80000000) | 0x7FC00000, u).astype(_U32))


def remainder16_split(master: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    u = bits(quiet_nan_master(master)).astype(np.int64)
    hi, lo = u >> 16, u & 0xFFFF
    hi = np.where(lo >= 0x8000, hi + 1, hi) & 0xFFFF
    return hi.astype(np.uint16), lo.astype(np.uint16).view(np.int16)


def remainder16_join(hi: np.ndarray, rem: np.ndarray) -> np.ndarray:
    h = np.asarray(hi, np.int64) & 0xFFFF
    r = np.asarray(rem, np.int64)
    h = np.where(r < 0, h - 1, h) & 0xFFFF
    return from_bits(((h << 16) | (r & 0xFFFF)).astype(_U32))


def round24(x: np.ndarray) -> np.ndarray:
    u = bits(quiet_nan_master(x)).astype(np.int64)
    u24 = (u + 0x7F + ((u >> 8) & 1)) >> 8
    finite = (u & 0x7F800000) != 0x7F800000
    return from_bits(np.where(finite, (u24 << 8) & 0xFFFFFFFF, u).astype(_U32))


def remainder8_split(master24: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    u24 = bits(master24).astype(np.int64) >> 8
    hi, lo = u24 >> 8, u24 & 0xFF
    hi = np.where(lo >= 0x80, hi + 1, hi) & 0xFFFF
    return hi.astype(np.uint16), lo.astype(np.uint8).view(np.int8)


def remainder8_join(hi: np.ndarray, rem: np.ndarray) -> np.ndarray:
    h = np.asarray(hi, np.int64) & 0xFFFF
    r = np.asarray(rem, np.int64)
    h = np.where(r < 0, h - 1, h) & 0xFFFF
    return from_bits((((h << 8) | (r & 0xFF)) << 8).astype(_U32))


# ---------------------------------------------------------------- int8 blocks


def quantize_blocks(x: np.ndarray, signed: bool, kind: str = "int8") -> Tuple[np.ndarray, np.ndarray]:
    """Flat float32 values of one tensor -> (uint8 codes, float32 scale per 256-element block);
    ``kind`` the state dtype, ``"int8"`` (the dynamic map), ``"int8_sqrt"`` or ``"float8_e4m3fn"``."""
    x = np.asarray(x, np.float32).reshape(-1)
    nblocks = -(-x.size // BLOCK)
    pad = np.zeros(nblocks * BLOCK, np.float32)
    pad[: x.size] = x
    scales = np.abs(pad.reshape(nblocks, BLOCK)).max(axis=1)  # np.max propagates NaN
    if kind == "int8_sqrt":
        return sqrt_quantize(x, np.repeat(scales, BLOCK)[: x.size], signed), scales.astype(np.float32)
    if kind == "float8_e4m3fn":
        return fp8_quantize(x, np.repeat(scales, BLOCK)[: x.size]), scales.astype(np.float32)
    pre, inv = quantize_factors(scales)
    with np.errstate(over="ignore", invalid="ignore"):
        y = (x * np.repeat(pre, BLOCK)[: x.size]) * np.repeat(inv, BLOCK)[: x.size]
    codes = np.searchsorted(map_midpoints(signed), y, side="left")
    codes[np.isnan(y)] = 0
    return codes.astype(np.uint8), scales.astype(np.float32)


def dequantize_blocks(codes: np.ndarray, scales: np.ndarray, signed: bool, kind: str = "int8") -> np.ndarray:
    codes = np.asarray(codes).reshape(-1)
    each = np.repeat(np.asarray(scales, np.float32), BLOCK)[: codes.size]
    if kind == "int8_sqrt":
        return sqrt_dequantize(codes, each, signed)
    if kind == "float8_e4m3fn":
        return fp8_dequantize(codes, each)
    return (dynamic_map(signed)[codes] * each).astype(np.float32)


def code_step(codes: np.ndarray, scales: np.ndarray, signed: bool, kind: str = "int8") -> np.ndarray:
    """The value of one code step at each element: the larger gap to a neighbouring code, times the scale."""
    c = np.asarray(codes, np.int64).reshape(-1)
    if kind == "float8_e4m3fn":
        # neighbours in magnitude (the sign bit apart), the block's value of a float8 unit: scale / 448
        m = c & 0x7F
        v = fp8_decode(np.arange(0x7F, dtype=np.uint8)).astype(np.float64)  # 0x00..0x7E, ascending
        m = np.minimum(m, 0x7E)
        gap = np.maximum(v[np.minimum(m + 1, 0x7E)] - v[m], v[m] - v[np.maximum(m - 1, 0)])
        return gap * np.repeat(np.asarray(scales, np.float32), BLOCK)[: c.size] / FP8_MAX
    if kind == "int8_sqrt":
        n = sqrt_levels(signed)
        c = np.where(c > 127, c - 256, c) if signed else c
        q = np.arange(-n if signed else 0, n + 1, dtype=np.float64)
        q = q * np.abs(q) / (n * n)  # the codes' values at scale 1, ascending
        c = c + (n if signed else 0)
        top = q.size - 1
    else:
        q = dynamic_map(signed)
        top = 255
    gap = np.maximum(q[np.minimum(c + 1, top)] - q[c], q[c] - q[np.maximum(c - 1, 0)])
    return gap * np.repeat(np.asarray(scales, np.float32), BLOCK)[: c.size]


# ---------------------------------------------------------------- decode, step, encode


def _slot_signed(fs: FormatState) -> Dict[str, bool]:
    return {s.name: s.signed for s in fs.slots}


def decode_master(fs: FormatState, params: Sequence[np.ndarray], buffers: Dict[str, np.ndarray]) -> List[np.ndarray]:
    """Each tensor's float32 master, from its parameter words (float32, or uint16 bits) and the
    master buffer; a float32 master of 0 bits (a fresh buffer) is the parameter's value."""
    fmt, out = fs.fmt, []
    for t, p in enumerate(params):
        o, n = int(fs.layout.offsets[t]), int(fs.layout.sizes[t])
        p = np.asarray(p).reshape(-1)
        if fmt.param_dtype == "float32":
            out.append(p.astype(np.float32))
        elif fmt.master == "float32":
            m = np.asarray(buffers["master"][o : o + n], np.float32)
            out.append(np.where(bits(m) == 0, decode16(p.view(np.uint16), fmt.param_dtype), m))
        elif fmt.master == "remainder16":
            out.append(remainder16_join(p.view(np.uint16), buffers["master_remainder"][o : o + n]))
        elif fmt.master == "remainder8":
            out.append(remainder8_join(p.view(np.uint16), buffers["master_remainder"][o : o + n]))
        else:
            out.append(decode16(p.view(np.uint16), fmt.param_dtype))
    return out


def decode_grads(fmt: StepFormat, grads: Sequence[np.ndarray]) -> List[np.ndarray]:
    if fmt.grad_dtype == "float32":
        return [np.asarray(g, np.float32).reshape(-1) for g in grads]
    return [decode16(np.asarray(g).reshape(-1).view(np.uint16), fmt.grad_dtype) for g in grads]


def decode_state(fs: FormatState, buffers: Dict[str, np.ndarray]) -> List[Dict[str, np.ndarray]]:
    """Each tensor's float32 state values per slot, from the compact buffers."""
    signed, fmt = _slot_signed(fs), fs.fmt
    out = []
    for t in range(len(fs.layout)):
        o, n = int(fs.layout.offsets[t]), int(fs.layout.sizes[t])
        row = fs.tensor_table()[t]
        st = {}
        for s in fs.slot_names:
            if fmt.state_dtype == "float32":
                st[s] = buffers[s][o : o + n].astype(np.float32)
            elif fmt.state_dtype == "bfloat16":
                st[s] = decode16(buffers[s][o : o + n], "bfloat16")
            elif fs.is_small(t):
                st[s] = buffers[f"{s}.small"][row[2] : row[2] + n].astype(np.float32)
            else:
                nb = -(-n // BLOCK)
                st[s] = dequantize_blocks(buffers[f"{s}.{fs.codes}"][o : o + n], buffers[f"{s}.scales"][row[1] : row[1] + nb],
                                          signed[s], fmt.state_dtype)
        out.append(st)
    return out


def format_step(definition, hp, fs: FormatState, params: Sequence[np.ndarray], grads: Sequence[np.ndarray],
         buffers: Dict[str, np.ndarray], seed: int, step_number: int) -> Tuple[List[np.ndarray], Dict[str, np.ndarray]]:
    """One format step of ``definition`` with hyperparameters ``hp``; nothing is modified in place.

    :param fs: the :class:`~optirs.core.formats.FormatState` (its ``fmt`` is the step's format).
    :param params: each tensor's parameter words: float32, or the uint16 bits of 16-bit parameters.
    :param grads: each tensor's gradient: float32, or uint16 bits of ``fmt.grad_dtype``.
    :param buffers: buffer name -> flat host array, as ``fs.buffer_sizes()`` / ``buffer_dtypes()``.
    :param seed: the stochastic rounding's seed.
    :param step_number: the 1-based step.
    :return: (new parameter words, each shaped like the input; new buffers).
    """
    fmt, layout = fs.fmt, fs.layout
    masters = decode_master(fs, params, buffers)
    state = decode_state(fs, buffers)
    new_p, new_s = definition.reference([m.astype(np.float64) for m in masters],
                                        [g.astype(np.float64) for g in decode_grads(fmt, grads)],
                                        [{k: v.astype(np.float64) for k, v in s.items()} for s in state],
                                        hp, step_number)
    out = {k: np.array(v, copy=True) for k, v in buffers.items()}
    kernel_slots = definition.slot_names()
    signed = _slot_signed(fs)
    words = []
    with np.errstate(over="ignore", invalid="ignore"):
        for t, p in enumerate(params):
            o, n = int(layout.offsets[t]), int(layout.sizes[t])
            index = np.arange(o, o + n, dtype=np.int64)
            x = np.asarray(new_p[t], np.float64).astype(np.float32).reshape(-1)
            shape = np.asarray(p).shape
            if fmt.param_dtype == "float32":
                words.append(x.reshape(shape))
                pw = None
            elif fmt.master == "remainder16":
                pw, out["master_remainder"][o : o + n] = remainder16_split(x)
            elif fmt.master == "remainder8":
                pw, out["master_remainder"][o : o + n] = remainder8_split(round24(x))
            elif fmt.stochastic:
                pw = bf16_stochastic(x, rand_bits(stream_key(seed, step_number, 0), index))
            else:
                pw = nearest16(x, fmt.param_dtype)
                if fmt.master == "float32":
                    out["master"][o : o + n] = x
            if pw is not None:
                words.append(pw.reshape(shape))
            row = fs.tensor_table()[t]
            for s in fs.slot_names:
                v = np.asarray(new_s[t][s], np.float64).astype(np.float32).reshape(-1)
                if fmt.state_dtype == "float32":
                    out[s][o : o + n] = v
                elif fmt.state_dtype == "bfloat16":
                    k = kernel_slots.index(s)
                    word = rand_bits(stream_key(seed, step_number, state_stream(k)), index)
                    out[s][o : o + n] = bf16_stochastic(v, slot_bits(word, k))
                elif fs.is_small(t):
                    out[f"{s}.small"][row[2] : row[2] + n] = v
                else:
                    codes, scales = quantize_blocks(v, signed[s], fmt.state_dtype)
                    out[f"{s}.{fs.codes}"][o : o + n] = codes
                    out[f"{s}.scales"][row[1] : row[1] + scales.size] = scales
    return words, out


def fresh_buffers(fs: FormatState, definition, hp) -> Dict[str, np.ndarray]:
    """The host buffers of a fresh state (as a backend allocates them with ``buffer_fills``)."""
    fills = fs.buffer_fills(definition.state_slots(hp))
    dtypes = fs.buffer_dtypes()
    return {k: np.full(n, fills[k], dtype=dtypes[k]) for k, n in fs.buffer_sizes().items()}


# ---------------------------------------------------------------- the rest of torch.optim's elementwise optimizers
# As torch.optim 2.x's single-tensor steps (the function names in comments are torch's).


def _l2_or_decoupled(p, g, hp, decoupled: bool):
    """torch's two weight decays: ``p *= 1 - lr * wd`` (decoupled) or ``g += wd * p`` (L2); none at wd 0."""
    if hp.weight_decay == 0:
        return p, g
    if decoupled:
        return p * (1.0 - hp.lr * hp.weight_decay), g
    return p, g + hp.weight_decay * p


def _moments(g, s, hp):
    """Adam's two moments (NAdam, RAdam): beta1 m + (1 - beta1) g and beta2 v + (1 - beta2) g^2."""
    return hp.beta1 * s["exp_avg"] + (1.0 - hp.beta1) * g, hp.beta2 * s["exp_avg_sq"] + (1.0 - hp.beta2) * g * g


def nadam(params, grads, state, hp: NadamParams, step: int) -> StepResult:
    """NAdam (torch's ``_single_tensor_nadam``): mu_t = beta1 (1 - 0.5 * 0.96^(t momentum_decay)), the
    gradient weighted by (1 - mu_t) / (1 - prod mu_{<=t}), the momentum by mu_{t+1} / (1 - prod mu_{<=t+1})."""
    state = state if state and state[0] else _zeros_like_all(params, ["exp_avg", "exp_avg_sq"])
    mus = [hp.beta1 * (1.0 - 0.5 * 0.96 ** (k * hp.momentum_decay)) for k in range(1, step + 2)]
    mu_product = float(np.prod(mus[:step])) if hp.mu_product is None else hp.mu_product * mus[step - 1]
    mu, mu_next = mus[step - 1], mus[step]
    bc2 = 1.0 - hp.beta2**step
    new_p, new_s = [], []
    for p, g, s in zip(_f64(params), _f64(grads), state):
        p, g = _l2_or_decoupled(p, g, hp, hp.decoupled_weight_decay)
        m, v = _moments(g, s, hp)
        denom = np.sqrt(v / bc2) + hp.eps
        p = p - hp.lr * (1.0 - mu) / (1.0 - mu_product) * g / denom
        p = p - hp.lr * mu_next / (1.0 - mu_product * mu_next) * m / denom
        new_p.append(p)
        new_s.append({"exp_avg": m, "exp_avg_sq": v})
    return new_p, new_s


def radam(params, grads, state, hp: RadamParams, step: int) -> StepResult:
    """RAdam (torch's ``_single_tensor_radam``): the rectified adaptive step where rho_t > 5, else
    the bias-corrected momentum step ``p -= lr * m / (1 - beta1^t)``."""
    state = state if state and state[0] else _zeros_like_all(params, ["exp_avg", "exp_avg_sq"])
    bc1, bc2 = 1.0 - hp.beta1**step, 1.0 - hp.beta2**step
    rho_inf = 2.0 / (1.0 - hp.beta2) - 1.0
    rho_t = rho_inf - 2.0 * step * hp.beta2**step / bc2
    new_p, new_s = [], []
    for p, g, s in zip(_f64(params), _f64(grads), state):
        p, g = _l2_or_decoupled(p, g, hp, hp.decoupled_weight_decay)
        m, v = _moments(g, s, hp)
        update = m / bc1 * hp.lr
        if rho_t > 5.0:
            rect = np.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
            update = update * (np.sqrt(bc2) / (np.sqrt(v) + hp.eps)) * rect
        new_p.append(p - update)
        new_s.append({"exp_avg": m, "exp_avg_sq": v})
    return new_p, new_s


def adamax(params, grads, state, hp: AdamaxParams, step: int) -> StepResult:
    """Adamax (torch's ``_single_tensor_adamax``): u = max(beta2 u, |g| + eps), p -= lr / (1 - beta1^t) m / u."""
    state = state if state and state[0] else _zeros_like_all(params, ["exp_avg", "exp_inf"])
    new_p, new_s = [], []
    for p, g, s in zip(_f64(params), _f64(grads), state):
        p, g = _l2_or_decoupled(p, g, hp, False)
        m = hp.beta1 * s["exp_avg"] + (1.0 - hp.beta1) * g
        u = np.maximum(hp.beta2 * s["exp_inf"], np.abs(g) + hp.eps)
        new_p.append(p - hp.lr / (1.0 - hp.beta1**step) * m / u)
        new_s.append({"exp_avg": m, "exp_inf": u})
    return new_p, new_s


def adadelta(params, grads, state, hp: AdadeltaParams, step: int) -> StepResult:
    """Adadelta (torch's ``_single_tensor_adadelta``): delta = sqrt(a + eps) / sqrt(s + eps) g."""
    state = state if state and state[0] else _zeros_like_all(params, ["square_avg", "acc_delta"])
    new_p, new_s = [], []
    for p, g, s in zip(_f64(params), _f64(grads), state):
        p, g = _l2_or_decoupled(p, g, hp, False)
        sq = hp.rho * s["square_avg"] + (1.0 - hp.rho) * g * g
        delta = np.sqrt(s["acc_delta"] + hp.eps) / np.sqrt(sq + hp.eps) * g
        acc = hp.rho * s["acc_delta"] + (1.0 - hp.rho) * delta * delta
        new_p.append(p - hp.lr * delta)
        new_s.append({"square_avg": sq, "acc_delta": acc})
    return new_p, new_s


def asgd(params, grads, state, hp: AsgdParams, step: int) -> StepResult:
    """ASGD (torch's ``_single_tensor_asgd``): p = p (1 - lambd eta) - eta g with the eta of the end of
    the previous step (``hp.eta`` where given), then ax averages the iterates with the previous step's mu."""
    state = state if state and state[0] else _zeros_like_all(params, ["ax"])
    prev = step - 1
    eta = hp.lr / (1.0 + hp.lambd * hp.lr * prev) ** hp.alpha if hp.eta is None else hp.eta
    mu = 1.0 if prev == 0 else 1.0 / max(1.0, prev - hp.t0)
    new_p, new_s = [], []
    for p, g, s in zip(_f64(params), _f64(grads), state):
        p, g = _l2_or_decoupled(p, g, hp, False)
        p = p * (1.0 - hp.lambd * eta) - eta * g
        new_p.append(p)
        new_s.append({"ax": s["ax"] + (p - s["ax"]) * mu if mu != 1.0 else p.copy()})
    return new_p, new_s


def rprop(params, grads, state, hp: RpropParams, step: int) -> StepResult:
    """Rprop (torch's ``_single_tensor_rprop``): where g * prev > 0 the step size grows by etaplus, < 0
    shrinks by etaminus (and that element does not move, its prev becomes 0), clamped; p -= sign(g) step.
    The step sizes start at the lr of step 1 (torch fills them with it when it makes the state)."""
    if not (state and state[0]):
        state = _zeros_like_all(params, ["prev", "step_size"])
    new_p, new_s = [], []
    for p, g, s in zip(_f64(params), _f64(grads), state):
        start = np.full(np.shape(p), float(hp.lr)) if step == 1 else s["step_size"]
        with np.errstate(invalid="ignore"):
            sign = np.sign(g * s["prev"])
            factor = np.where(sign > 0, hp.etaplus, np.where(sign < 0, hp.etaminus, np.where(sign == 0, 1.0, sign)))
            step_size = np.clip(start * factor, hp.step_size_min, hp.step_size_max)
        g = np.where(factor == hp.etaminus, 0.0, g)
        new_p.append(p - np.sign(g) * step_size)
        new_s.append({"prev": g, "step_size": step_size})
    return new_p, new_s


# Each optimizer's float64 step, by name (run() looks steps up here).
STEPS: Dict[str, Callable[..., StepResult]] = {f.__name__: f for f in (adam, adamw, sgd, rmsprop, adagrad, lamb, lion,
                                                                        adafactor, nadam, radam, adamax, adadelta, asgd,
                                                                        rprop)}
