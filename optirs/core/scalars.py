"""Per-step scalar records that cross the backend interface.

The host computes everything that changes per step (bias corrections, decayed learning rates)
in float64 and rounds once to float32 here, so kernels keep pure float32 arithmetic. Every
field is a ``numpy.float32`` or a ``bool``: numba types them as float32 and boolean, and the
per-element functions in ``optirs.backends.common.elementwise`` read them by name.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, NamedTuple, Tuple

import numpy as np

from optirs.core.errors import InvalidParameterError
from optirs.core.params import (AdadeltaParams, AdafactorParams, AdagradParams, AdamaxParams, AdamParams, AsgdParams,
                                LambParams, LionParams, NadamParams, RadamParams, RmspropParams, RpropParams, SgdParams)

f32 = np.float32


def _checked(record: NamedTuple, hp, step: int, unbounded: tuple = ()) -> NamedTuple:
    """``record`` if every float32 field is finite (``unbounded`` fields may be +inf: "no limit").

    Hyperparameters are checked at construction (optirs.core.params), including the derived
    values that are largest at step 1; this is the last line for any other combination, so a
    step never hands a kernel an inf or NaN scalar: it raises before the backend is called.
    """
    for name, value in zip(record._fields, record):
        if type(value) is np.float32 and not math.isfinite(value):
            if name in unbounded and value == np.inf:
                continue
            raise InvalidParameterError(
                f"{type(record).__name__}.{name}={float(value)!r} at step {step} for {hp!r}, expected "
                "hyperparameters and a step whose per-step scalars are finite in float32"
            )
    return record


class AdamScalars(NamedTuple):
    beta1: np.float32
    beta2: np.float32
    one_minus_beta1: np.float32
    one_minus_beta2: np.float32
    eps: np.float32
    weight_decay: np.float32
    step_size: np.float32  # lr / (1 - beta1**t)
    bias_correction2_sqrt: np.float32  # sqrt(1 - beta2**t)
    decay_factor: np.float32  # 1 - lr * weight_decay (AdamW only)
    decoupled: bool
    amsgrad: bool
    grad_factor: np.float32 = f32(1.0)  # multiplies every gradient element first (maximize, unscale)


class SgdScalars(NamedTuple):
    lr: np.float32
    momentum: np.float32
    dampening_factor: np.float32  # 1 - dampening
    weight_decay: np.float32
    nesterov: bool
    has_momentum: bool
    first_step: bool  # torch starts the momentum buffer at the gradient itself
    grad_factor: np.float32 = f32(1.0)  # multiplies every gradient element first (maximize, unscale)


class RmspropScalars(NamedTuple):
    lr: np.float32
    alpha: np.float32
    one_minus_alpha: np.float32
    eps: np.float32
    weight_decay: np.float32
    momentum: np.float32
    centered: bool
    has_momentum: bool
    grad_factor: np.float32 = f32(1.0)  # multiplies every gradient element first (maximize, unscale)


class AdagradScalars(NamedTuple):
    clr: np.float32  # lr / (1 + (t - 1) * lr_decay)
    weight_decay: np.float32
    eps: np.float32
    grad_factor: np.float32 = f32(1.0)  # multiplies every gradient element first (maximize, unscale)


class LambScalars(NamedTuple):
    lr: np.float32
    beta1: np.float32
    beta2: np.float32
    one_minus_beta1: np.float32
    one_minus_beta2: np.float32
    eps: np.float32
    weight_decay: np.float32
    bias_correction1: np.float32  # 1 - beta1**t, or 1 without bias correction
    bias_correction2: np.float32
    max_trust_ratio: np.float32  # +inf: no clip
    max_grad_norm: np.float32  # 0: no global gradient clipping
    grad_factor: np.float32 = f32(1.0)  # multiplies every gradient element first (maximize, unscale)


# ------------------------------------------------------------------ the pointwise families' formulas
# Each is a plain float64 function of (constants, lr, step, grad_factor) returning every field of
# its record in order, bools as 1.0 / 0.0: the host builders below round its results to float32,
# and the cuda backend compiles the same functions into its device-side scalars kernel
# (capturable steps, step and lr on the device), so both compute the same bits. ``constants`` is
# a tuple of floats from the hyperparameters (what a CUDA graph bakes in); only lr, the step and
# the gradient factor may change on the device.


class ScalarFormula(NamedTuple):
    """How a pointwise family's record is computed: ``constants(hp)`` and ``values(c, lr, step, grad_factor)``."""

    record: type
    constants: Callable[[Any], Tuple[float, ...]]
    values: Callable[..., Tuple[float, ...]]


def _record(cls: type, values) -> NamedTuple:
    """``values`` (float64, bools as 0/1) as the float32/bool record ``cls``: every float rounded once
    to float32 by one array conversion (a step builds a record per launch: this is its host cost)."""
    fields = list(np.array(values, dtype=np.float32))
    for i in _BOOL_FIELDS[cls]:
        fields[i] = bool(values[i])
    return cls._make(fields)


# Below this, a sum of magnitudes says every value rounds to a finite float32 (float32's largest
# value; a float64 value rounds to inf from half an ulp above it). NaN fails the comparison too.
_FINITE_SUM = float(np.finfo(np.float32).max)


def _finite_record(cls: type, values, hp, step: int) -> NamedTuple:
    """:func:`_record` of ``values``, checked as :func:`_checked` does: one sum says all is finite in
    the common case, else the fields are checked one by one (and the message names the field)."""
    record = _record(cls, values)
    if not sum(map(abs, values)) <= _FINITE_SUM:
        _checked(record, hp, step)
    return record


def adam_values(c, lr, step, grad_factor):
    beta1, beta2, eps, weight_decay, decoupled, amsgrad = c
    return (beta1, beta2, 1.0 - beta1, 1.0 - beta2, eps, weight_decay, lr / (1.0 - beta1**step),
            math.sqrt(1.0 - beta2**step), 1.0 - lr * weight_decay, decoupled, amsgrad, grad_factor)


def adam_constants(hp: AdamParams, decoupled: bool) -> Tuple[float, ...]:
    return (float(hp.beta1), float(hp.beta2), float(hp.eps), float(hp.weight_decay), float(bool(decoupled)),
            float(bool(hp.amsgrad)))


def sgd_values(c, lr, step, grad_factor):
    momentum, dampening, weight_decay, nesterov = c
    return (lr, momentum, 1.0 - dampening, weight_decay, nesterov, 1.0 if momentum != 0.0 else 0.0,
            1.0 if step == 1.0 else 0.0, grad_factor)


def sgd_constants(hp: SgdParams) -> Tuple[float, ...]:
    return (float(hp.momentum), float(hp.dampening), float(hp.weight_decay), float(bool(hp.nesterov)))


def rmsprop_values(c, lr, step, grad_factor):
    alpha, eps, weight_decay, momentum, centered = c
    return (lr, alpha, 1.0 - alpha, eps, weight_decay, momentum, centered, 1.0 if momentum > 0.0 else 0.0,
            grad_factor)


def rmsprop_constants(hp: RmspropParams) -> Tuple[float, ...]:
    return (float(hp.alpha), float(hp.eps), float(hp.weight_decay), float(hp.momentum), float(bool(hp.centered)))


def adagrad_values(c, lr, step, grad_factor):
    lr_decay, weight_decay, eps = c
    return (lr / (1.0 + (step - 1.0) * lr_decay), weight_decay, eps, grad_factor)


def adagrad_constants(hp: AdagradParams) -> Tuple[float, ...]:
    return (float(hp.lr_decay), float(hp.weight_decay), float(hp.eps))


def lion_values(c, lr, step, grad_factor):
    beta1, beta2, weight_decay = c
    return (lr, beta1, 1.0 - beta1, beta2, 1.0 - beta2, 1.0 - lr * weight_decay, grad_factor)


def lion_constants(hp: LionParams) -> Tuple[float, ...]:
    return (float(hp.beta1), float(hp.beta2), float(hp.weight_decay))


def _pointwise(formula_values, constants, hp, step: int, grad_factor: float, record: type) -> NamedTuple:
    return _finite_record(record, formula_values(constants, float(hp.lr), float(step), float(grad_factor)), hp, step)


def adam_scalars(hp: AdamParams, step: int, decoupled: bool, grad_factor: float = 1.0) -> AdamScalars:
    return _pointwise(adam_values, adam_constants(hp, decoupled), hp, step, grad_factor, AdamScalars)


def sgd_scalars(hp: SgdParams, step: int, grad_factor: float = 1.0) -> SgdScalars:
    return _pointwise(sgd_values, sgd_constants(hp), hp, step, grad_factor, SgdScalars)


def rmsprop_scalars(hp: RmspropParams, step: int, grad_factor: float = 1.0) -> RmspropScalars:
    return _pointwise(rmsprop_values, rmsprop_constants(hp), hp, step, grad_factor, RmspropScalars)


def adagrad_scalars(hp: AdagradParams, step: int, grad_factor: float = 1.0) -> AdagradScalars:
    return _pointwise(adagrad_values, adagrad_constants(hp), hp, step, grad_factor, AdagradScalars)


def lamb_scalars(hp: LambParams, step: int, grad_factor: float = 1.0) -> LambScalars:
    bc1 = 1.0 - hp.beta1**step if hp.bias_correction else 1.0
    bc2 = 1.0 - hp.beta2**step if hp.bias_correction else 1.0
    return _checked(LambScalars(
        f32(hp.lr), f32(hp.beta1), f32(hp.beta2), f32(1.0 - hp.beta1), f32(1.0 - hp.beta2), f32(hp.eps),
        f32(hp.weight_decay), f32(bc1), f32(bc2),
        f32(np.inf if hp.max_trust_ratio is None else hp.max_trust_ratio),
        f32(0.0 if hp.max_grad_norm is None else hp.max_grad_norm), f32(grad_factor),
    ), hp, step, unbounded=("max_trust_ratio",))


class LionScalars(NamedTuple):
    lr: np.float32
    beta1: np.float32
    one_minus_beta1: np.float32
    beta2: np.float32
    one_minus_beta2: np.float32
    decay_factor: np.float32  # 1 - lr * weight_decay
    grad_factor: np.float32 = f32(1.0)  # multiplies every gradient element first (maximize, unscale)


def lion_scalars(hp: LionParams, step: int, grad_factor: float = 1.0) -> LionScalars:
    return _pointwise(lion_values, lion_constants(hp), hp, step, grad_factor, LionScalars)


class AdafactorScalars(NamedTuple):
    beta2_weight: np.float32  # step^beta2_decay: the weight of the new mean in the running means (1 - beta2_t)
    rho: np.float32  # min(lr, 1 / sqrt(step))
    eps1: np.float32  # floor of the row-mean normaliser
    eps1_squared: np.float32  # floor of the variance estimate
    eps2: np.float32  # floor of RMS(p) in the step size
    d: np.float32  # clipping threshold of RMS(update)
    decay_factor: np.float32  # 1 - lr * weight_decay
    maximize: bool
    grad_factor: np.float32 = f32(1.0)  # multiplies every gradient element first (maximize, unscale)


def adafactor_eps1(hp: AdafactorParams) -> float:
    """eps1, where None means float32's machine epsilon (torch.finfo(param.dtype).eps)."""
    return float(np.finfo(np.float32).eps) if hp.eps[0] is None else float(hp.eps[0])


def adafactor_scalars(hp: AdafactorParams, step: int, grad_factor: float = 1.0) -> AdafactorScalars:
    eps1 = adafactor_eps1(hp)
    return _checked(AdafactorScalars(
        f32(float(step) ** hp.beta2_decay), f32(min(hp.lr, 1.0 / math.sqrt(step))), f32(eps1), f32(eps1 * eps1),
        f32(hp.eps[1]), f32(hp.d), f32(1.0 - hp.lr * hp.weight_decay), bool(hp.maximize), f32(grad_factor),
    ), hp, step)


def _bool_positions(cls: type) -> Tuple[int, ...]:
    return tuple(i for i, name in enumerate(cls._fields)
                 if getattr(cls.__annotations__[name], "__forward_arg__", cls.__annotations__[name]) in (bool, "bool"))


# The positions of each record's bool fields (the rest are float32), for _record.
_BOOL_FIELDS: Dict[type, Tuple[int, ...]] = {
    cls: _bool_positions(cls)
    for cls in (AdamScalars, SgdScalars, RmspropScalars, AdagradScalars, LambScalars, LionScalars, AdafactorScalars)}

# The pointwise kernel families' formulas (adamw shares adam's record and formula; decoupled is a constant).
FORMULAS: Dict[str, ScalarFormula] = {
    "adam": ScalarFormula(AdamScalars, lambda hp: adam_constants(hp, False), adam_values),
    "adamw": ScalarFormula(AdamScalars, lambda hp: adam_constants(hp, True), adam_values),
    "sgd": ScalarFormula(SgdScalars, sgd_constants, sgd_values),
    "rmsprop": ScalarFormula(RmspropScalars, rmsprop_constants, rmsprop_values),
    "adagrad": ScalarFormula(AdagradScalars, adagrad_constants, adagrad_values),
    "lion": ScalarFormula(LionScalars, lion_constants, lion_values),
}


# ---------------------------------------------------------------- the rest of torch.optim's elementwise optimizers
# Their records are computed on the host only (no device-side formula: capturable steps are not
# offered for them): NAdam's mu product and ASGD's eta are carried from step to step as torch
# carries them, which a formula of (constants, lr, step) alone would not reproduce.


class NadamScalars(NamedTuple):
    beta1: np.float32
    beta2: np.float32
    one_minus_beta1: np.float32
    one_minus_beta2: np.float32
    eps: np.float32
    weight_decay: np.float32
    bias_correction2: np.float32  # 1 - beta2**t
    grad_coef: np.float32  # -lr * (1 - mu_t) / (1 - prod_{k<=t} mu_k)
    avg_coef: np.float32  # -lr * mu_{t+1} / (1 - prod_{k<=t+1} mu_k)
    decay_factor: np.float32  # 1 - lr * weight_decay (decoupled)
    decoupled: bool
    grad_factor: np.float32 = f32(1.0)  # multiplies every gradient element first (maximize, unscale)


class RadamScalars(NamedTuple):
    beta1: np.float32
    beta2: np.float32
    one_minus_beta1: np.float32
    one_minus_beta2: np.float32
    eps: np.float32
    weight_decay: np.float32
    lr: np.float32
    bias_correction1: np.float32  # 1 - beta1**t
    bias_correction2_sqrt: np.float32  # sqrt(1 - beta2**t)
    rect: np.float32  # the variance rectification term (when rectified)
    decay_factor: np.float32  # 1 - lr * weight_decay (decoupled)
    rectified: bool  # rho_t > 5: the adaptive step; otherwise the momentum step alone
    decoupled: bool
    grad_factor: np.float32 = f32(1.0)  # multiplies every gradient element first (maximize, unscale)


class AdamaxScalars(NamedTuple):
    beta1: np.float32
    one_minus_beta1: np.float32
    beta2: np.float32
    eps: np.float32
    weight_decay: np.float32
    clr: np.float32  # lr / (1 - beta1**t)
    grad_factor: np.float32 = f32(1.0)  # multiplies every gradient element first (maximize, unscale)


class AdadeltaScalars(NamedTuple):
    lr: np.float32
    rho: np.float32
    one_minus_rho: np.float32
    eps: np.float32
    weight_decay: np.float32
    grad_factor: np.float32 = f32(1.0)  # multiplies every gradient element first (maximize, unscale)


class AsgdScalars(NamedTuple):
    eta: np.float32  # this step's step size
    decay_factor: np.float32  # 1 - lambd * eta
    weight_decay: np.float32
    mu: np.float32  # the averaging weight of this step
    averaging: bool  # mu != 1 (else ax = p)
    grad_factor: np.float32 = f32(1.0)  # multiplies every gradient element first (maximize, unscale)


class RpropScalars(NamedTuple):
    lr: np.float32  # the step sizes' start (torch fills them with the lr of the first step)
    etaminus: np.float32
    etaplus: np.float32
    step_size_min: np.float32
    step_size_max: np.float32
    first_step: bool
    grad_factor: np.float32 = f32(1.0)  # multiplies every gradient element first (maximize, unscale)


def nadam_mu(hp: NadamParams, step: int) -> float:
    """torch.optim.NAdam's momentum coefficient mu_t (float64)."""
    return hp.beta1 * (1.0 - 0.5 * 0.96 ** (step * hp.momentum_decay))


# (beta1, momentum_decay) -> (t, prod_{k<=t} mu_k as torch's float32 state keeps it): a step continues
# the product of the step before it instead of multiplying t factors again.
_MU_PRODUCTS: Dict[Tuple[float, float], Tuple[int, np.float32]] = {}


def nadam_mu_product(hp: NadamParams, step: int) -> float:
    """prod_{k<=step} mu_k as torch keeps it: a float32 0-dim tensor multiplied by float32(mu_k) each step
    (``hp.mu_product``, where given, is the product of the steps before ``step``)."""
    if hp.mu_product is not None:
        return float(f32(f32(hp.mu_product) * f32(nadam_mu(hp, step))))
    key = (float(hp.beta1), float(hp.momentum_decay))
    t, value = _MU_PRODUCTS.get(key, (0, f32(1.0)))
    if t > step:
        t, value = 0, f32(1.0)
    while t < step:
        t += 1
        value = f32(value * f32(nadam_mu(hp, t)))
    if len(_MU_PRODUCTS) > 64:  # a sweep over many hyperparameters: keep the cache small
        _MU_PRODUCTS.clear()
    _MU_PRODUCTS[key] = (t, value)
    return float(value)


def nadam_scalars(hp: NadamParams, step: int, grad_factor: float = 1.0) -> NadamScalars:
    mu, mu_next = nadam_mu(hp, step), nadam_mu(hp, step + 1)
    mu_product = nadam_mu_product(hp, step)
    mu_product_next = mu_product * mu_next  # as torch: the held float32 product times a float64 mu
    lr = float(hp.lr)
    values = (hp.beta1, hp.beta2, 1.0 - hp.beta1, 1.0 - hp.beta2, hp.eps, hp.weight_decay, 1.0 - hp.beta2**step,
              -lr * (1.0 - mu) / (1.0 - mu_product), -lr * mu_next / (1.0 - mu_product_next),
              1.0 - lr * hp.weight_decay, float(bool(hp.decoupled_weight_decay)), grad_factor)
    return _finite_record(NadamScalars, values, hp, step)


def radam_rectification(hp: RadamParams, step: int) -> Tuple[bool, float]:
    """(whether rho_t > 5, the rectification term r_t then) as torch.optim.RAdam computes them."""
    rho_inf = 2.0 / (1.0 - hp.beta2) - 1.0
    bc2 = 1.0 - hp.beta2**step
    rho_t = rho_inf - 2.0 * step * hp.beta2**step / bc2
    if not rho_t > 5.0:
        return False, 0.0
    return True, math.sqrt((rho_t - 4.0) * (rho_t - 2.0) * rho_inf / ((rho_inf - 4.0) * (rho_inf - 2.0) * rho_t))


def radam_scalars(hp: RadamParams, step: int, grad_factor: float = 1.0) -> RadamScalars:
    rectified, rect = radam_rectification(hp, step)
    values = (hp.beta1, hp.beta2, 1.0 - hp.beta1, 1.0 - hp.beta2, hp.eps, hp.weight_decay, hp.lr,
              1.0 - hp.beta1**step, math.sqrt(1.0 - hp.beta2**step), rect, 1.0 - hp.lr * hp.weight_decay,
              float(rectified), float(bool(hp.decoupled_weight_decay)), grad_factor)
    return _finite_record(RadamScalars, values, hp, step)


def adamax_scalars(hp: AdamaxParams, step: int, grad_factor: float = 1.0) -> AdamaxScalars:
    values = (hp.beta1, 1.0 - hp.beta1, hp.beta2, hp.eps, hp.weight_decay, hp.lr / (1.0 - hp.beta1**step),
              grad_factor)
    return _finite_record(AdamaxScalars, values, hp, step)


def adadelta_scalars(hp: AdadeltaParams, step: int, grad_factor: float = 1.0) -> AdadeltaScalars:
    return _finite_record(AdadeltaScalars, (hp.lr, hp.rho, 1.0 - hp.rho, hp.eps, hp.weight_decay, grad_factor),
                          hp, step)


def asgd_eta(hp: AsgdParams, lr: float, step: int) -> float:
    """The step size torch stores at the end of step ``step`` (lr of that step), used by the next: float32."""
    return float(f32(lr / ((1.0 + hp.lambd * lr * step) ** hp.alpha)))


def asgd_mu(hp: AsgdParams, step: int) -> float:
    """The averaging weight torch stores at the end of step ``step`` (1 before the first): float32."""
    return 1.0 if step == 0 else float(f32(1.0 / max(1.0, step - hp.t0)))


def asgd_scalars(hp: AsgdParams, step: int, grad_factor: float = 1.0) -> AsgdScalars:
    # torch's step t uses the eta and mu its state holds, both computed at the end of step t - 1
    # (eta from that step's lr; the first from the lr of the first step)
    eta = asgd_eta(hp, hp.lr, step - 1) if hp.eta is None else float(f32(hp.eta))
    mu = asgd_mu(hp, step - 1)
    values = (eta, 1.0 - hp.lambd * eta, hp.weight_decay, mu, float(mu != 1.0), grad_factor)
    return _finite_record(AsgdScalars, values, hp, step)


def rprop_scalars(hp: RpropParams, step: int, grad_factor: float = 1.0) -> RpropScalars:
    values = (hp.lr, hp.etaminus, hp.etaplus, hp.step_size_min, hp.step_size_max, float(step == 1), grad_factor)
    return _finite_record(RpropScalars, values, hp, step)


_BOOL_FIELDS.update({cls: _bool_positions(cls) for cls in (NadamScalars, RadamScalars, AdamaxScalars, AdadeltaScalars,
                                                          AsgdScalars, RpropScalars)})
