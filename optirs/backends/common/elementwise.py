"""The per-element optimizer math, written once for numba and shared by the CPU and CUDA backends.

Each function updates one element and returns the new values; the loops that call them (a
parallel CPU loop, a CUDA grid) live in the backends. ``sc`` is the optimizer's record from
:mod:`optirs.core.scalars`: every field is float32 or bool, so the arithmetic stays float32 (no
literal floats appear here, since numba would promote them to float64). The branches test
per-step flags that are the same for every element.

Weight decay follows torch: with ``weight_decay`` 0 there is no decay term at all (torch adds
``weight_decay * p`` only when ``weight_decay != 0``), so an infinite weight stays infinite
instead of becoming ``0 * inf`` = NaN. The test is on a scalar, uniform over the elements.

``error_model="numpy"``: division follows IEEE (inf/nan, as on a GPU) instead of raising
ZeroDivisionError; the raise check would also stop LLVM from vectorizing the CPU loops.
"""

from __future__ import annotations

import math

import numpy as np
from numba import float32, float64
from numba.extending import overload

from optirs.backends.common.division import (divide_by_reciprocal, divide_by_uniform, times_reciprocal,
                                             uniform_reciprocal)
from optirs.backends.common.bits32 import f32_bits_cast, shl32, sub32
from optirs.backends.common.fast_paths import (DIVIDEND_HI, DIVIDEND_LO, SQRT_LO, div_approx, div_fast, max_nan,
                                               sqrt_approx, sqrt_fast)
from optirs.core.compile_cache import cached_njit, prepare_kernel_compilation
from optirs.core.definitions import DEFINITIONS

prepare_kernel_compilation()  # before the first decorator: numba picks the cache directory there


@cached_njit(error_model="numpy")
def _adam_terms(p, g, m, v, sc):
    """Adam/AdamW before its square root and division: (p, m, v, a), the new parameter then
    ``p - a / (sqrt(x) / sqrt(1 - beta2**t) + eps)`` with x = v (max(vmax, v) with amsgrad)."""
    g = g * sc.grad_factor
    if sc.decoupled:
        p = p * sc.decay_factor
    elif sc.weight_decay != 0:
        g = g + sc.weight_decay * p
    m = sc.beta1 * m + sc.one_minus_beta1 * g
    v = sc.beta2 * v + sc.one_minus_beta2 * g * g
    return p, m, v, sc.step_size * m


@cached_njit(error_model="numpy")
def adam_update(p, g, m, v, vmax, sc):
    """One Adam/AdamW element: returns (p, m, v, vmax). ``vmax`` is only meaningful with amsgrad."""
    p, m, v, a = _adam_terms(p, g, m, v, sc)
    if sc.amsgrad:
        vmax = max(vmax, v)
        denom = divide_by_uniform(math.sqrt(vmax), sc.bias_correction2_sqrt) + sc.eps
    else:
        denom = divide_by_uniform(math.sqrt(v), sc.bias_correction2_sqrt) + sc.eps
    return p - a / denom, m, v, vmax


# Adam by the GPU's fast square root and division (optirs.backends.common.fast_paths), for a kernel
# that takes a group of elements without a branch per element and redoes the group by adam_update
# where any element is outside the two windows: x's (sqrt_fast is the square root) and a's (a dividend
# of div_fast's window). Each window is an unsigned range test, ``bits - lo <= hi - lo``, so a group's
# test can be one compare of the largest ``bits - lo`` (adam_windows_ok: one maximum an element, for x
# sm_90's VIADDMNMX, where each element's compares and the predicate and-ed into the flag took three or
# four instructions). The divisor's window is implied: with x in [2**-101, 2**64) the root is in [2**-51, 2**32) (finite and positive: divide_by_reciprocal is
# divide_by_uniform), so with the bias correction in [2**-16, 1] and eps in [0, 1], which
# adam_fast_setup tests once, the denominator is in [2**-51, 2**49), div_fast's window: no test an
# element. On the cpu the operations are the IEEE ones and the results adam_update's.

_X_HI = np.uint32(0x5F7FFFFF)  # x < 2**64
_X_SPAN = np.uint32(_X_HI - SQRT_LO)
_A_LO2 = np.uint32(DIVIDEND_LO << 1)  # |a|'s window on bits(a) << 1 (the sign shifted out)
_A_SPAN = np.uint32((DIVIDEND_HI << 1) - (DIVIDEND_LO << 1))
ADAM_WINDOWS_START = (np.uint32(0), np.uint32(0))
_BC_MIN = np.float32(2.0**-16)
_ONE = np.float32(1)
_ZERO = np.float32(0)


@cached_njit(error_model="numpy")
def adam_fast_setup(sc):
    """(u, ok) for :func:`adam_update_fast`, once per launch: the bias correction's reciprocal and
    whether this step's scalars keep the denominator in div_fast's window."""
    c = sc.bias_correction2_sqrt
    return uniform_reciprocal(c), (c >= _BC_MIN) & (c <= _ONE) & (sc.eps >= _ZERO) & (sc.eps <= _ONE)


@cached_njit(error_model="numpy")
def _adam_fast_terms(p, g, m, v, vmax, sc, w):
    """(p, m, v, a, x, w) of the fast steps: adam_update's terms, the radicand ``x`` and the windows'
    words with this element's."""
    p, m, v, a = _adam_terms(p, g, m, v, sc)
    # the radicand without a test of amsgrad: without it ``vmax`` comes in as 0 (an unused slot) and
    # its result is dropped, so x is v wherever v is in the window, and 0 (outside) where v is 0 or
    # negative. NaN-propagating: a NaN v (or vmax) falls outside the window with amsgrad too, so that
    # where ok, no new state value is NaN (m: a is in its window; v <= x; vmax = x): a kernel may
    # encode them without a NaN test (FAST_ELEMENT_STEPS)
    if vmax is None:
        # a kernel without amsgrad's slot passes None (numba compiles this branch alone): x is v,
        # whose window rejects the NaN, negative and zero v that max_nan(0, v) would have turned
        # away (one instruction an element)
        x = v
    else:
        x = max_nan(vmax, v)
    ws, wa = w
    ws = max(ws, sub32(f32_bits_cast(x), SQRT_LO))
    wa = max(wa, sub32(shl32(f32_bits_cast(a), 1), _A_LO2))
    return p, m, v, a, x, (ws, wa)


@cached_njit(error_model="numpy")
def adam_update_fast(p, g, m, v, vmax, sc, u, w):
    """:func:`adam_update` by the fast paths: (p, m, v, vmax, w), adam_update's values where
    ``adam_windows_ok(w)`` (and ``adam_fast_setup``'s ok) is true; ``u`` is adam_fast_setup's
    reciprocal, ``w`` the windows' words of the elements before (ADAM_WINDOWS_START for none), which
    come back with this element's. ``vmax`` None: the kernel has no amsgrad slot (the vmax returned
    is then v, for nobody)."""
    p, m, v, a, x, w = _adam_fast_terms(p, g, m, v, vmax, sc, w)
    denom = divide_by_reciprocal(sqrt_fast(x), sc.bias_correction2_sqrt, u) + sc.eps
    return p - div_fast(a, denom), m, v, x, w


@cached_njit(error_model="numpy")
def adam_update_approx(p, g, m, v, vmax, sc, u, w):
    """:func:`adam_update_fast` with the GPU's approximate root and quotient (``sqrt.approx``,
    ``div.approx``) and the bias correction by its reciprocal: a few ulps from adam_update's
    float32 values in the same windows (a tuning build, OPTIRS_CUDA_FORMATS_APPROX)."""
    p, m, v, a, x, w = _adam_fast_terms(p, g, m, v, vmax, sc, w)
    denom = times_reciprocal(sqrt_approx(x), sc.bias_correction2_sqrt, u) + sc.eps
    return p - div_approx(a, denom), m, v, x, w


@cached_njit(error_model="numpy")
def adam_windows_ok(w):
    """Whether every element whose words :func:`adam_update_fast` accumulated into ``w`` has x and a
    in their windows (fast_paths.sqrt_in_window narrowed to _X_HI, dividend_in_window)."""
    return (w[0] <= _X_SPAN) & (w[1] <= _A_SPAN)


@cached_njit(error_model="numpy")
def sgd_update(p, g, buf, sc):
    """One SGD element: returns (p, momentum_buffer)."""
    g = g * sc.grad_factor
    if sc.weight_decay != 0:
        g = g + sc.weight_decay * p
    if sc.has_momentum:
        if sc.first_step:
            buf = g
        else:
            buf = sc.momentum * buf + sc.dampening_factor * g
        if sc.nesterov:
            g = g + sc.momentum * buf
        else:
            g = buf
    return p - sc.lr * g, buf


@cached_njit(error_model="numpy")
def rmsprop_update(p, g, square_avg, buf, grad_avg, sc):
    """One RMSprop element: returns (p, square_avg, momentum_buffer, grad_avg)."""
    g = g * sc.grad_factor
    if sc.weight_decay != 0:
        g = g + sc.weight_decay * p
    square_avg = sc.alpha * square_avg + sc.one_minus_alpha * g * g
    if sc.centered:
        grad_avg = sc.alpha * grad_avg + sc.one_minus_alpha * g
        avg = math.sqrt(square_avg - grad_avg * grad_avg) + sc.eps
    else:
        avg = math.sqrt(square_avg) + sc.eps
    if sc.has_momentum:
        buf = sc.momentum * buf + g / avg
        p = p - sc.lr * buf
    else:
        p = p - sc.lr * g / avg
    return p, square_avg, buf, grad_avg


@cached_njit(error_model="numpy")
def adagrad_update(p, g, acc, sc):
    """One Adagrad element: returns (p, sum)."""
    g = g * sc.grad_factor
    if sc.weight_decay != 0:
        g = g + sc.weight_decay * p
    acc = acc + g * g
    return p - sc.clr * g / (math.sqrt(acc) + sc.eps), acc


@cached_njit(error_model="numpy")
def lamb_moments(g, m, v, grad_scale, sc):
    """LAMB's first pass for one element: the clipped gradient folded into (m, v); ``grad_scale``
    is :func:`lamb_grad_scale`'s (the gradient factor and the clipping factor in one)."""
    g = g * grad_scale
    return sc.beta1 * m + sc.one_minus_beta1 * g, sc.beta2 * v + sc.one_minus_beta2 * g * g


@cached_njit(error_model="numpy")
def lamb_direction(p, m, v, sc):
    """LAMB's update direction u for one element (before the trust ratio and learning rate)."""
    # sqrt(v) / sqrt(bc2), not sqrt(v / bc2): v / bc2 overflows float32 where the quotient is finite
    u = (m / sc.bias_correction1) / (math.sqrt(v) / math.sqrt(sc.bias_correction2) + sc.eps)
    if sc.weight_decay != 0:
        u = u + sc.weight_decay * p
    return u


# The two functions below act once per tensor (or once per step), not per element, so they may
# work in float64; the kernels round their results to float32 before the element pass.


# Non-finite norms follow the float64 reference (optirs.core.reference) exactly: a NaN norm gives
# a NaN trust ratio or clip factor (every element of the tensor, or of the model, becomes NaN),
# never a clip to max_trust_ratio or 1; an infinite gradient norm clips by max_norm / inf = 0.


@cached_njit(error_model="numpy")
def lamb_trust_ratio(param_norm, update_norm, max_trust_ratio):
    """||p|| / ||u||, 1 where either norm is zero, at most ``max_trust_ratio`` (NaN stays NaN)."""
    ratio = 1.0 if param_norm == 0.0 or update_norm == 0.0 else param_norm / update_norm
    if ratio > max_trust_ratio:
        ratio = max_trust_ratio
    return ratio


@cached_njit(error_model="numpy")
def clip_scale(norm, max_norm):
    """The global gradient clipping factor: 1 where norm <= max_norm, else max_norm / norm (NaN for a
    NaN norm); ``max_norm`` 0 means off."""
    if not max_norm > 0.0 or norm <= max_norm:
        return 1.0
    return max_norm / norm


@cached_njit(error_model="numpy")
def lamb_grad_scale(raw_norm, sc):
    """What LAMB multiplies each raw gradient element by (float32): the gradient factor times the
    global clipping factor, the clip taken on the norm of the factored gradient, ``|factor| *
    raw_norm`` (``raw_norm``: the norm of the gradients as stored; unused without clipping)."""
    factor = float64(sc.grad_factor)
    return float32(clip_scale(raw_norm * abs(factor), float64(sc.max_grad_norm)) * factor)


@cached_njit(error_model="numpy")
def lion_update(p, g, m, sc):
    """One Lion element: returns (p, exp_avg). The sign is taken by branches so the step is
    exactly p -/+ lr (no multiply); c of 0 or NaN gives p - lr * c (p, or NaN), as torch.sign."""
    g = g * sc.grad_factor
    p = p * sc.decay_factor
    c = sc.beta1 * m + sc.one_minus_beta1 * g
    if c > 0:
        p = p - sc.lr
    elif c < 0:
        p = p + sc.lr
    else:
        p = p - sc.lr * c
    return p, sc.beta2 * m + sc.one_minus_beta2 * g


# Adafactor's per-element pieces; the per-tensor sums around them live in the backends'
# adafactor modules. ``sc`` is optirs.core.scalars.AdafactorScalars.


@cached_njit(error_model="numpy")
def adafactor_grad(g, sc):
    """The gradient as Adafactor uses it (times the gradient factor, negated with maximize)."""
    g = g * sc.grad_factor
    return -g if sc.maximize else g


@cached_njit(error_model="numpy")
def adafactor_running_mean(old, new, sc):
    """old + w * (new - old), w = step^beta2_decay (torch's lerp_ of the running means)."""
    return old + sc.beta2_weight * (new - old)


@cached_njit(error_model="numpy")
def adafactor_factored_direction(g, row, col, row_mean, sc):
    """The update of one element of a factored tensor: g / sqrt(max(row * col / max(mean(row), eps1), eps1^2))."""
    v = row * col / max(row_mean, sc.eps1)
    return g / math.sqrt(max(v, sc.eps1_squared))


@cached_njit(error_model="numpy")
def adafactor_direction(g, variance, sc):
    """The update of one element of a 0-1 dim tensor: g / sqrt(max(variance, eps1^2))."""
    return g / math.sqrt(max(variance, sc.eps1_squared))


@cached_njit(error_model="numpy")
def adafactor_apply(p, u, step, sc):
    """p * (1 - lr * wd) - (alpha / clip) * u, with ``step`` = alpha / clip of the tensor (float32)."""
    return p * sc.decay_factor - step * u


# ---------------------------------------------------------------- the generic kernels' element steps
# Every elementwise kernel family has one element step of one shape,
# ``(p, g, s0, s1, s2, sc) -> (p, s0, s1, s2)``, which multiplies ``g`` by ``sc.grad_factor`` first
# (every record of optirs.core.scalars ends with that float32 field): slot k is the definition's k-th state slot
# (optirs.core.definitions); a slot the hyperparameters do not use comes in as 0 and its result is
# dropped. The generic loops (a CPU chunk loop, a CUDA grid) are written once against this shape.

ELEMENT_STEPS = {}


def element_step(family: str):
    """Register the element step of kernel family ``family`` (a definition's ``kernel``)."""

    def register(fn):
        ELEMENT_STEPS[family] = fn
        return fn

    return register


@element_step("adam")
@cached_njit(error_model="numpy")
def adam_element(p, g, m, v, vmax, sc):
    return adam_update(p, g, m, v, vmax, sc)


# Families whose element step has a fast-path variant (adam_update_fast's contract):
# ``setup(sc) -> (u, ok)`` once per launch; ``step(p, g, s0, s1, s2, sc, u, w) -> (p, s0, s1, s2, w)``
# with ``w`` the windows' words (a tuple of uint32, accumulated by maximum from ``start``);
# ``windows_ok(w)``: the element step's values for every element accumulated into ``w`` wherever it
# and setup's ok are true, and where they are, no new state value is NaN (the kernels encode them
# without a NaN test; the parameter they test). A kernel tests ``w`` once per element or once per
# group of elements. The cuda formats kernels use them; the other families (RMSprop, Adagrad, NAdam, RAdam, Adadelta, LAMB) keep their
# IEEE operations.
FAST_ELEMENT_STEPS = {"adam": (adam_fast_setup, adam_update_fast, adam_windows_ok, ADAM_WINDOWS_START)}
# the same with approximate operations (a tuning build of the cuda formats kernels)
APPROX_ELEMENT_STEPS = {"adam": (adam_fast_setup, adam_update_approx, adam_windows_ok, ADAM_WINDOWS_START)}


@element_step("sgd")
@cached_njit(error_model="numpy")
def sgd_element(p, g, buf, unused1, unused2, sc):
    p, buf = sgd_update(p, g, buf, sc)
    return p, buf, unused1, unused2


@element_step("rmsprop")
@cached_njit(error_model="numpy")
def rmsprop_element(p, g, square_avg, buf, grad_avg, sc):
    return rmsprop_update(p, g, square_avg, buf, grad_avg, sc)


@element_step("adagrad")
@cached_njit(error_model="numpy")
def adagrad_element(p, g, acc, unused1, unused2, sc):
    p, acc = adagrad_update(p, g, acc, sc)
    return p, acc, unused1, unused2


@element_step("lion")
@cached_njit(error_model="numpy")
def lion_element(p, g, m, unused1, unused2, sc):
    p, m = lion_update(p, g, m, sc)
    return p, m, unused1, unused2


# The rest of torch.optim's elementwise optimizers, as its single-tensor steps (term order kept so
# a float32 element rounds as torch's where torch does not fuse).


@cached_njit(error_model="numpy")
def _l2_or_decoupled(p, g, sc):
    """torch's two weight decays (NAdam, RAdam): p * (1 - lr * wd) or g + wd * p; none at wd 0."""
    if sc.decoupled:
        p = p * sc.decay_factor
    elif sc.weight_decay != 0:
        g = g + sc.weight_decay * p
    return p, g


@cached_njit(error_model="numpy")
def _moments(g, m, v, sc):
    """Adam's two moments (NAdam, RAdam): beta1 m + (1 - beta1) g and beta2 v + (1 - beta2) g^2."""
    return sc.beta1 * m + sc.one_minus_beta1 * g, sc.beta2 * v + sc.one_minus_beta2 * g * g


@element_step("nadam")
@cached_njit(error_model="numpy")
def nadam_element(p, g, m, v, unused, sc):
    g = g * sc.grad_factor
    p, g = _l2_or_decoupled(p, g, sc)
    m, v = _moments(g, m, v, sc)
    denom = math.sqrt(v / sc.bias_correction2) + sc.eps
    p = p + sc.grad_coef * (g / denom)
    p = p + sc.avg_coef * (m / denom)
    return p, m, v, unused


@element_step("radam")
@cached_njit(error_model="numpy")
def radam_element(p, g, m, v, unused, sc):
    g = g * sc.grad_factor
    p, g = _l2_or_decoupled(p, g, sc)
    m, v = _moments(g, m, v, sc)
    update = m / sc.bias_correction1 * sc.lr
    if sc.rectified:
        update = update * (sc.bias_correction2_sqrt / (math.sqrt(v) + sc.eps)) * sc.rect
    return p - update, m, v, unused


@element_step("adamax")
@cached_njit(error_model="numpy")
def adamax_element(p, g, m, u, unused, sc):
    g = g * sc.grad_factor
    if sc.weight_decay != 0:
        g = g + sc.weight_decay * p
    m = sc.beta1 * m + sc.one_minus_beta1 * g
    u = sc.beta2 * u
    a = abs(g) + sc.eps
    if a > u or a != a:  # torch.maximum: a NaN on either side is the result
        u = a
    return p - sc.clr * (m / u), m, u, unused


@element_step("adadelta")
@cached_njit(error_model="numpy")
def adadelta_element(p, g, square_avg, acc_delta, unused, sc):
    g = g * sc.grad_factor
    if sc.weight_decay != 0:
        g = g + sc.weight_decay * p
    square_avg = sc.rho * square_avg + sc.one_minus_rho * g * g
    delta = math.sqrt(acc_delta + sc.eps) / math.sqrt(square_avg + sc.eps) * g
    acc_delta = sc.rho * acc_delta + sc.one_minus_rho * delta * delta
    return p - sc.lr * delta, square_avg, acc_delta, unused


@element_step("asgd")
@cached_njit(error_model="numpy")
def asgd_element(p, g, ax, unused1, unused2, sc):
    g = g * sc.grad_factor
    if sc.weight_decay != 0:
        g = g + sc.weight_decay * p
    p = p * sc.decay_factor
    p = p - sc.eta * g
    if sc.averaging:
        ax = ax + (p - ax) * sc.mu
    else:
        ax = p
    return p, ax, unused1, unused2


@element_step("rprop")
@cached_njit(error_model="numpy")
def rprop_element(p, g, prev, step_size, unused, sc):
    g = g * sc.grad_factor
    if sc.first_step:
        step_size = sc.lr
    s = g * prev
    if s > 0:
        f = sc.etaplus
    elif s < 0:
        f = sc.etaminus
    elif s == 0:
        f = float32(1.0)
    else:
        f = s  # NaN, as torch's sign
    step_size = step_size * f
    if step_size < sc.step_size_min:  # torch's clamp_: NaN stays NaN
        step_size = sc.step_size_min
    if step_size > sc.step_size_max:
        step_size = sc.step_size_max
    if f == sc.etaminus:  # the sign flipped: this element does not move, and forgets its gradient
        g = float32(0.0)
    if g > 0:
        p = p - step_size
    elif g < 0:
        p = p + step_size
    else:
        p = p - g * step_size  # g is 0 (p stays) or NaN
    return p, g, step_size, unused


def _by_scalars_type():
    return {d.scalars_type: ELEMENT_STEPS[d.kernel] for d in DEFINITIONS.values() if d.kernel in ELEMENT_STEPS}


def element_update(p, g, s0, s1, s2, sc):
    """The element step for ``sc``'s kernel family (chosen by the type of the scalars record).

    In compiled code the choice is made once, at typing time (the overload below), so a generic
    loop calling this compiles to the family's own math and caches on disk per family.
    """
    return _by_scalars_type()[type(sc)](p, g, s0, s1, s2, sc)


@overload(element_update, jit_options={"error_model": "numpy"})
def _element_update_typed(p, g, s0, s1, s2, sc):
    fn = _by_scalars_type().get(getattr(sc, "instance_class", None))
    if fn is None:
        return None

    def impl(p, g, s0, s1, s2, sc):
        return fn(p, g, s0, s1, s2, sc)

    return impl
