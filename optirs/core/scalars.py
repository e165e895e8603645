"""Per-step scalar records that cross the backend interface.

The host computes everything that changes per step (bias corrections, decayed learning rates)
in float64 and rounds once to float32 here, so kernels keep pure float32 arithmetic. Every
field is a ``numpy.float32`` or a ``bool``: numba types them as float32 and boolean, and the
per-element functions in ``optirs.backends.common.elementwise`` read them by name.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from optirs.core.errors import InvalidParameterError
from optirs.core.params import (AdafactorParams, AdagradParams, AdamParams, LambParams, LionParams, RmspropParams,
                                SgdParams)

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


class SgdScalars(NamedTuple):
    lr: np.float32
    momentum: np.float32
    dampening_factor: np.float32  # 1 - dampening
    weight_decay: np.float32
    nesterov: bool
    has_momentum: bool
    first_step: bool  # torch starts the momentum buffer at the gradient itself


class RmspropScalars(NamedTuple):
    lr: np.float32
    alpha: np.float32
    one_minus_alpha: np.float32
    eps: np.float32
    weight_decay: np.float32
    momentum: np.float32
    centered: bool
    has_momentum: bool


class AdagradScalars(NamedTuple):
    clr: np.float32  # lr / (1 + (t - 1) * lr_decay)
    weight_decay: np.float32
    eps: np.float32


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


def adam_scalars(hp: AdamParams, step: int, decoupled: bool) -> AdamScalars:
    return _checked(AdamScalars(
        f32(hp.beta1), f32(hp.beta2), f32(1.0 - hp.beta1), f32(1.0 - hp.beta2), f32(hp.eps),
        f32(hp.weight_decay), f32(hp.lr / (1.0 - hp.beta1**step)), f32(math.sqrt(1.0 - hp.beta2**step)),
        f32(1.0 - hp.lr * hp.weight_decay), bool(decoupled), bool(hp.amsgrad),
    ), hp, step)


def sgd_scalars(hp: SgdParams, step: int) -> SgdScalars:
    return _checked(SgdScalars(
        f32(hp.lr), f32(hp.momentum), f32(1.0 - hp.dampening), f32(hp.weight_decay),
        bool(hp.nesterov), hp.momentum != 0.0, step == 1,
    ), hp, step)


def rmsprop_scalars(hp: RmspropParams, step: int) -> RmspropScalars:
    return _checked(RmspropScalars(
        f32(hp.lr), f32(hp.alpha), f32(1.0 - hp.alpha), f32(hp.eps), f32(hp.weight_decay),
        f32(hp.momentum), bool(hp.centered), hp.momentum > 0.0,
    ), hp, step)


def adagrad_scalars(hp: AdagradParams, step: int) -> AdagradScalars:
    return _checked(AdagradScalars(f32(hp.lr / (1.0 + (step - 1) * hp.lr_decay)), f32(hp.weight_decay), f32(hp.eps)),
                    hp, step)


def lamb_scalars(hp: LambParams, step: int) -> LambScalars:
    bc1 = 1.0 - hp.beta1**step if hp.bias_correction else 1.0
    bc2 = 1.0 - hp.beta2**step if hp.bias_correction else 1.0
    return _checked(LambScalars(
        f32(hp.lr), f32(hp.beta1), f32(hp.beta2), f32(1.0 - hp.beta1), f32(1.0 - hp.beta2), f32(hp.eps),
        f32(hp.weight_decay), f32(bc1), f32(bc2),
        f32(np.inf if hp.max_trust_ratio is None else hp.max_trust_ratio),
        f32(0.0 if hp.max_grad_norm is None else hp.max_grad_norm),
    ), hp, step, unbounded=("max_trust_ratio",))


class LionScalars(NamedTuple):
    lr: np.float32
    beta1: np.float32
    one_minus_beta1: np.float32
    beta2: np.float32
    one_minus_beta2: np.float32
    decay_factor: np.float32  # 1 - lr * weight_decay


def lion_scalars(hp: LionParams, step: int) -> LionScalars:
    return _checked(LionScalars(f32(hp.lr), f32(hp.beta1), f32(1.0 - hp.beta1), f32(hp.beta2), f32(1.0 - hp.beta2),
                                f32(1.0 - hp.lr * hp.weight_decay)), hp, step)


class AdafactorScalars(NamedTuple):
    beta2_weight: np.float32  # step^beta2_decay: the weight of the new mean in the running means (1 - beta2_t)
    rho: np.float32  # min(lr, 1 / sqrt(step))
    eps1: np.float32  # floor of the row-mean normaliser
    eps1_squared: np.float32  # floor of the variance estimate
    eps2: np.float32  # floor of RMS(p) in the step size
    d: np.float32  # clipping threshold of RMS(update)
    decay_factor: np.float32  # 1 - lr * weight_decay
    maximize: bool


def adafactor_eps1(hp: AdafactorParams) -> float:
    """eps1, where None means float32's machine epsilon (torch.finfo(param.dtype).eps)."""
    return float(np.finfo(np.float32).eps) if hp.eps[0] is None else float(hp.eps[0])


def adafactor_scalars(hp: AdafactorParams, step: int) -> AdafactorScalars:
    eps1 = adafactor_eps1(hp)
    return _checked(AdafactorScalars(
        f32(float(step) ** hp.beta2_decay), f32(min(hp.lr, 1.0 / math.sqrt(step))), f32(eps1), f32(eps1 * eps1),
        f32(hp.eps[1]), f32(hp.d), f32(1.0 - hp.lr * hp.weight_decay), bool(hp.maximize),
    ), hp, step)
