"""Validated hyperparameters, one frozen dataclass per optimizer family.

Names and defaults follow ``torch.optim`` (LAMB follows optax.lamb). Construction checks every
value, so a bad hyperparameter fails before any state or parameter is touched.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

import numpy as np

from optirs.core.errors import InvalidParameterError


FLOAT32_MAX = float(np.finfo(np.float32).max)


def fits_float32(value: float) -> bool:
    """Whether ``value`` is finite and stays finite when rounded to float32 (the kernels' arithmetic)."""
    try:
        value = float(value)
    except OverflowError:  # an int beyond float64
        return False
    if not math.isfinite(value):
        return False
    with np.errstate(over="ignore"):
        return bool(np.isfinite(np.float32(value)))


def _real(name: str, value: Any) -> float:
    """A hyperparameter that enters float32 arithmetic: a real number finite in float32."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not fits_float32(value):
        raise InvalidParameterError(
            f"{name}={value!r}, expected a finite real number within float32 range (|{name}| <= {FLOAT32_MAX:.8g})"
        )
    return float(value)


def _derived(expression: str, value: float, why: str) -> None:
    """A float32 scalar the step derives from several hyperparameters (``lr / (1 - beta1)``)."""
    if not fits_float32(value):
        raise InvalidParameterError(
            f"{expression} = {value!r} ({why}) is not finite in float32, expected hyperparameters whose "
            f"per-step scalars are within float32 range (<= {FLOAT32_MAX:.8g})"
        )


def _at_least(name: str, value: Any, low: float) -> None:
    if _real(name, value) < low:
        raise InvalidParameterError(f"{name}={value!r}, expected {name} >= {low:g}")


def _positive(name: str, value: Any) -> None:
    if _real(name, value) <= 0.0:
        raise InvalidParameterError(f"{name}={value!r}, expected {name} > 0")


def _unit_interval(name: str, value: Any) -> None:
    if not 0.0 <= _real(name, value) < 1.0:
        raise InvalidParameterError(f"{name}={value!r}, expected 0 <= {name} < 1")


def _flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise InvalidParameterError(f"{name}={value!r}, expected True or False")


def _decay_product(hp: Any) -> None:
    """Decoupled weight decay multiplies by ``1 - lr * weight_decay`` (AdamW, Lion, Adafactor)."""
    _derived(f"lr * weight_decay = {hp.lr!r} * {hp.weight_decay!r}", hp.lr * hp.weight_decay,
             "the decoupled decay factor 1 - lr * weight_decay")


class _Params:
    """Shared helpers: conversion to and from plain dicts (for state_dict)."""

    def to_dict(self) -> dict:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: dict):
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = set(data) - names
        if unknown:
            raise InvalidParameterError(
                f"unknown {cls.__name__} fields {sorted(unknown)}, expected a subset of {sorted(names)}"
            )
        return cls(**data)


@dataclass(frozen=True)
class AdamParams(_Params):
    """Adam / AdamW. ``weight_decay`` is L2 (added to the gradient) for Adam and decoupled for AdamW."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False

    def __post_init__(self) -> None:
        _at_least("lr", self.lr, 0.0)
        _unit_interval("beta1", self.beta1)
        _unit_interval("beta2", self.beta2)
        _at_least("eps", self.eps, 0.0)
        _at_least("weight_decay", self.weight_decay, 0.0)
        _flag("amsgrad", self.amsgrad)
        # The largest bias-corrected step size is step 1's (1 - beta1**t grows with t).
        _derived(f"lr / (1 - beta1) = {self.lr!r} / (1 - {self.beta1!r})", self.lr / (1.0 - self.beta1),
                 "the step size at step 1")
        _decay_product(self)


@dataclass(frozen=True)
class SgdParams(_Params):
    """SGD with torch's momentum, dampening, nesterov and L2 weight decay."""

    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self) -> None:
        _at_least("lr", self.lr, 0.0)
        _at_least("momentum", self.momentum, 0.0)
        _at_least("dampening", self.dampening, 0.0)
        _at_least("weight_decay", self.weight_decay, 0.0)
        _flag("nesterov", self.nesterov)
        if self.nesterov and (self.momentum <= 0.0 or self.dampening != 0.0):
            raise InvalidParameterError(
                f"nesterov=True with momentum={self.momentum!r} and dampening={self.dampening!r}, "
                "expected momentum > 0 and dampening == 0"
            )


@dataclass(frozen=True)
class RmspropParams(_Params):
    """RMSprop as torch.optim.RMSprop (alpha, eps outside the square root, momentum, centered)."""

    lr: float = 1e-2
    alpha: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0
    centered: bool = False

    def __post_init__(self) -> None:
        _at_least("lr", self.lr, 0.0)
        _at_least("alpha", self.alpha, 0.0)
        if self.alpha > 1.0:
            raise InvalidParameterError(f"alpha={self.alpha!r}, expected 0 <= alpha <= 1")
        _at_least("eps", self.eps, 0.0)
        _at_least("weight_decay", self.weight_decay, 0.0)
        _at_least("momentum", self.momentum, 0.0)
        _flag("centered", self.centered)


@dataclass(frozen=True)
class AdagradParams(_Params):
    """Adagrad as torch.optim.Adagrad."""

    lr: float = 1e-2
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10

    def __post_init__(self) -> None:
        _at_least("lr", self.lr, 0.0)
        _at_least("lr_decay", self.lr_decay, 0.0)
        _at_least("weight_decay", self.weight_decay, 0.0)
        _at_least("initial_accumulator_value", self.initial_accumulator_value, 0.0)
        _at_least("eps", self.eps, 0.0)


@dataclass(frozen=True)
class LambParams(_Params):
    """LAMB (You et al. 2019; defaults as optax.lamb, weight_decay 0.01).

    ``max_trust_ratio`` clips the trust ratio from above (None: no clip);
    ``max_grad_norm`` scales all gradients so their global L2 norm is at most this (None: off).
    """

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-6
    weight_decay: float = 0.01
    bias_correction: bool = True
    max_trust_ratio: Optional[float] = None
    max_grad_norm: Optional[float] = None

    def __post_init__(self) -> None:
        _at_least("lr", self.lr, 0.0)
        _unit_interval("beta1", self.beta1)
        _unit_interval("beta2", self.beta2)
        _at_least("eps", self.eps, 0.0)
        _at_least("weight_decay", self.weight_decay, 0.0)
        _flag("bias_correction", self.bias_correction)
        if self.max_trust_ratio is not None:
            _positive("max_trust_ratio", self.max_trust_ratio)
        if self.max_grad_norm is not None:
            _positive("max_grad_norm", self.max_grad_norm)


__all__ = ["AdamParams", "SgdParams", "RmspropParams", "AdagradParams", "LambParams", "LionParams",
           "AdafactorParams"]


def _closed_unit_interval(name: str, value: Any) -> None:
    if not 0.0 <= _real(name, value) <= 1.0:
        raise InvalidParameterError(f"{name}={value!r}, expected 0 <= {name} <= 1")


@dataclass(frozen=True)
class LionParams(_Params):
    """Lion (Chen et al. 2023) as the lion-pytorch package: sign of an interpolated momentum,
    decoupled weight decay ``p *= 1 - lr * weight_decay``."""

    lr: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.99
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _at_least("lr", self.lr, 0.0)
        _closed_unit_interval("beta1", self.beta1)
        _closed_unit_interval("beta2", self.beta2)
        _at_least("weight_decay", self.weight_decay, 0.0)
        _decay_product(self)


@dataclass(frozen=True)
class AdafactorParams(_Params):
    """Adafactor as ``torch.optim.Adafactor``: ``eps = (eps1, eps2)``, eps1 None meaning the
    float32 machine epsilon; ``beta2_decay`` <= 0, clipping threshold ``d`` >= 1, decoupled decay."""

    lr: float = 1e-2
    beta2_decay: float = -0.8
    eps: Any = (None, 1e-3)
    d: float = 1.0
    weight_decay: float = 0.0
    maximize: bool = False

    def __post_init__(self) -> None:
        _at_least("lr", self.lr, 0.0)
        if _real("beta2_decay", self.beta2_decay) > 0.0:
            raise InvalidParameterError(f"beta2_decay={self.beta2_decay!r}, expected beta2_decay <= 0")
        if not isinstance(self.eps, (tuple, list)) or len(self.eps) != 2:
            raise InvalidParameterError(f"eps={self.eps!r}, expected a pair (eps1 or None, eps2)")
        eps1, eps2 = self.eps
        if eps1 is not None:
            _at_least("eps[0]", eps1, 0.0)
        _at_least("eps[1]", eps2, 0.0)
        object.__setattr__(self, "eps", (eps1, eps2))  # a list from a checkpoint becomes the tuple
        _at_least("d", self.d, 1.0)
        _at_least("weight_decay", self.weight_decay, 0.0)
        _flag("maximize", self.maximize)
        _decay_product(self)


# ---------------------------------------------------------------- the rest of torch.optim's elementwise optimizers


def _adam_like(hp: Any) -> None:
    """torch's checks of the Adam family (NAdam, RAdam, Adamax): lr, eps, weight_decay >= 0, 0 <= betas < 1."""
    _at_least("lr", hp.lr, 0.0)
    _unit_interval("beta1", hp.beta1)
    _unit_interval("beta2", hp.beta2)
    _at_least("eps", hp.eps, 0.0)
    _at_least("weight_decay", hp.weight_decay, 0.0)


def _step_one(hp: Any) -> None:
    _derived(f"lr / (1 - beta1) = {hp.lr!r} / (1 - {hp.beta1!r})", hp.lr / (1.0 - hp.beta1), "the step size at step 1")


@dataclass(frozen=True)
class NadamParams(_Params):
    """NAdam as ``torch.optim.NAdam``: Nesterov momentum through the mu schedule
    ``mu_t = beta1 * (1 - 0.5 * 0.96 ** (t * momentum_decay))``; ``weight_decay`` is L2, or decoupled
    (``p *= 1 - lr * weight_decay``) with ``decoupled_weight_decay``.

    ``mu_product``: the product of the mu's of the steps before this one where the caller keeps it
    as state (torch does: a schedule of beta1 changes each factor as it comes); None computes it
    from this beta1 and momentum_decay.
    """

    lr: float = 2e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum_decay: float = 4e-3
    decoupled_weight_decay: bool = False
    mu_product: Optional[float] = None

    def __post_init__(self) -> None:
        _adam_like(self)
        _at_least("momentum_decay", self.momentum_decay, 0.0)
        _flag("decoupled_weight_decay", self.decoupled_weight_decay)
        if self.mu_product is not None:
            _at_least("mu_product", self.mu_product, 0.0)
        _decay_product(self)


@dataclass(frozen=True)
class RadamParams(_Params):
    """RAdam as ``torch.optim.RAdam``: Adam with the variance rectification of Liu et al. (plain
    momentum SGD while the rectification is undefined, rho_t <= 5)."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled_weight_decay: bool = False

    def __post_init__(self) -> None:
        _adam_like(self)
        _flag("decoupled_weight_decay", self.decoupled_weight_decay)
        _step_one(self)
        _decay_product(self)


@dataclass(frozen=True)
class AdamaxParams(_Params):
    """Adamax as ``torch.optim.Adamax``: Adam with the infinity norm ``u = max(beta2 * u, |g| + eps)``."""

    lr: float = 2e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _adam_like(self)
        _step_one(self)


@dataclass(frozen=True)
class AdadeltaParams(_Params):
    """Adadelta as ``torch.optim.Adadelta`` (``lr`` scales the delta; 1.0 is the paper's)."""

    lr: float = 1.0
    rho: float = 0.9
    eps: float = 1e-6
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _at_least("lr", self.lr, 0.0)
        _closed_unit_interval("rho", self.rho)
        _at_least("eps", self.eps, 0.0)
        _at_least("weight_decay", self.weight_decay, 0.0)


@dataclass(frozen=True)
class AsgdParams(_Params):
    """ASGD as ``torch.optim.ASGD``: SGD with the step size ``eta_t = lr / (1 + lambd * lr * (t - 1)) ** alpha``
    and decay ``p *= 1 - lambd * eta_t``, averaging the iterates into ``ax`` from step ``t0`` on.

    ``eta``: the step size of this step where the caller keeps it as state (torch computes it at the
    end of each step from that step's lr, so under a schedule a step uses the previous step's lr:
    optirs.torch passes the ``eta`` its state holds); None computes it from ``lr`` and the step.
    """

    lr: float = 1e-2
    lambd: float = 1e-4
    alpha: float = 0.75
    t0: float = 1e6
    weight_decay: float = 0.0
    eta: Optional[float] = None

    def __post_init__(self) -> None:
        _at_least("lr", self.lr, 0.0)
        _at_least("lambd", self.lambd, 0.0)
        _real("alpha", self.alpha)
        _real("t0", self.t0)
        _at_least("weight_decay", self.weight_decay, 0.0)
        if self.eta is not None:
            _at_least("eta", self.eta, 0.0)
        _derived(f"lambd * lr = {self.lambd!r} * {self.lr!r}", self.lambd * self.lr, "the decay 1 - lambd * eta")


@dataclass(frozen=True)
class RpropParams(_Params):
    """Rprop as ``torch.optim.Rprop``: per-element step sizes (starting at ``lr``) grown by ``etaplus``
    where the gradient kept its sign, shrunk by ``etaminus`` where it flipped (that step then
    skipped), clamped to ``[step_size_min, step_size_max]``; the parameter moves by the sign."""

    lr: float = 1e-2
    etaminus: float = 0.5
    etaplus: float = 1.2
    step_size_min: float = 1e-6
    step_size_max: float = 50.0

    def __post_init__(self) -> None:
        _at_least("lr", self.lr, 0.0)
        if not 0.0 < _real("etaminus", self.etaminus) < 1.0 or not 1.0 < _real("etaplus", self.etaplus):
            raise InvalidParameterError(f"etas=({self.etaminus!r}, {self.etaplus!r}), expected 0 < etaminus < 1 < etaplus")
        _at_least("step_size_min", self.step_size_min, 0.0)
        if _real("step_size_max", self.step_size_max) < self.step_size_min:
            raise InvalidParameterError(f"step_sizes=({self.step_size_min!r}, {self.step_size_max!r}), expected "
                                        "step_size_min <= step_size_max")


__all__ += ["NadamParams", "RadamParams", "AdamaxParams", "AdadeltaParams", "AsgdParams", "RpropParams"]
