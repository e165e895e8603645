"""The rest of torch.optim's elementwise optimizers on optirs' definitions: NAdam, RAdam, Adamax,
Adadelta, ASGD and Rprop, with torch 2.13's constructors (names, defaults, keyword-only parts),
param groups, schedulers and ``state_dict()`` keys (``mu_product`` of NAdam, ``eta`` / ``mu`` /
``ax`` of ASGD, ``prev`` / ``step_size`` of Rprop, as torch keeps them), plus ``backend`` /
``backend_options`` and the step-format keywords (docs/formats.md).

Refused rather than ignored, as in :mod:`optirs.torch.optimizers`: ``foreach=True``,
``differentiable=True`` and ``capturable=True`` (their per-step scalars are computed on the host:
NAdam's mu product and ASGD's step size are carried from step to step as torch carries them).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, Optional

from optirs.core import params as P
from optirs.core.errors import UnsupportedOperationError
from optirs.torch._frontend import OptirsOptimizer
from optirs.torch.optimizers import _common, _formats


class _HostScalars(OptirsOptimizer):
    """Base of the optimizers whose scalars only the host computes (no ``capturable``).

    ``_carried``: the 0-dim state torch carries from step to step that the next step uses (NAdam's
    ``mu_product``, ASGD's ``eta``), each also a field of the hyperparameters of that name: a
    group's step takes it from the state of its first parameter that has it (the group's tensors
    step together, so they hold the same value unless some had no gradient at some step), so a
    torch checkpoint's value and a schedule's effect on it are torch's.
    """

    _carried: tuple = ()

    def _check_group(self, group: Dict[str, Any], where: str = "the param group"):
        if group.get("capturable", False):
            raise UnsupportedOperationError(
                f"capturable=True for {type(self).__name__}, expected False: its per-step scalars are computed on "
                "the host (capturable steps keep the count and lr on the device: Adam, AdamW, SGD, RMSprop, Adagrad "
                "and Lion have them)")
        return super()._check_group(group, where)

    def _hyper(self, gi: int, group: Dict[str, Any]):
        hyper = super()._hyper(gi, group)
        if not self._carried:
            return hyper
        state = self.state
        for p in group["params"]:
            entry = state.get(p)
            if entry and all(entry.get(k) is not None for k in self._carried):
                held = {k: float(entry[k]) for k in self._carried}
                return hyper._replace(hp=replace(hyper.hp, **held))
        return hyper


def _defaults(locals_: Dict[str, Any], *names: str) -> Dict[str, Any]:
    """torch's defaults dict (the constructor's arguments by name) plus the format keywords."""
    out = {k: locals_[k] for k in names}
    out.update(_formats(locals_["master_weights"], locals_["state_dtype"], locals_["stochastic_rounding"],
                        locals_["seed"]))
    return out


class NAdam(_HostScalars):
    """torch.optim.NAdam (momentum_decay's mu schedule; ``decoupled_weight_decay``) on optirs' kernel.
    ``state[p]["mu_product"]`` is torch's float32 product of the mu's so far (carried: a schedule of
    beta1 multiplies each step's own mu in, as with torch)."""

    _carried = ("mu_product",)

    def __init__(self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, momentum_decay=4e-3,
                 decoupled_weight_decay=False, *, foreach: Optional[bool] = None, maximize: bool = False,
                 capturable: bool = False, differentiable: bool = False, master_weights: Optional[str] = None,
                 state_dtype: str = "float32", stochastic_rounding: bool = False, seed: int = 0,
                 backend: str = "auto", backend_options: Optional[Dict[str, Any]] = None):
        defaults = _defaults(locals(), "lr", "betas", "eps", "weight_decay", "momentum_decay",
                             "decoupled_weight_decay", "maximize", "foreach", "capturable", "differentiable")
        super().__init__(params, defaults, **_common(foreach, None, backend, backend_options))

    def _hyperparameters(self, group):
        beta1, beta2 = self._pair(group)
        return "nadam", P.NadamParams(lr=self._scalar(group, "lr"), beta1=beta1, beta2=beta2, eps=group["eps"],
                                      weight_decay=group["weight_decay"], momentum_decay=group["momentum_decay"],
                                      decoupled_weight_decay=bool(group["decoupled_weight_decay"]))


class RAdam(_HostScalars):
    """torch.optim.RAdam (variance rectification; ``decoupled_weight_decay``) on optirs' kernel."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, decoupled_weight_decay=False,
                 *, foreach: Optional[bool] = None, maximize: bool = False, capturable: bool = False,
                 differentiable: bool = False, master_weights: Optional[str] = None, state_dtype: str = "float32",
                 stochastic_rounding: bool = False, seed: int = 0, backend: str = "auto",
                 backend_options: Optional[Dict[str, Any]] = None):
        defaults = _defaults(locals(), "lr", "betas", "eps", "weight_decay", "decoupled_weight_decay", "maximize",
                             "foreach", "capturable", "differentiable")
        super().__init__(params, defaults, **_common(foreach, None, backend, backend_options))

    def _hyperparameters(self, group):
        beta1, beta2 = self._pair(group)
        return "radam", P.RadamParams(lr=self._scalar(group, "lr"), beta1=beta1, beta2=beta2, eps=group["eps"],
                                      weight_decay=group["weight_decay"],
                                      decoupled_weight_decay=bool(group["decoupled_weight_decay"]))


class Adamax(_HostScalars):
    """torch.optim.Adamax (the infinity norm ``exp_inf``) on optirs' kernel."""

    def __init__(self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, foreach: Optional[bool] = None,
                 *, maximize: bool = False, differentiable: bool = False, capturable: bool = False,
                 master_weights: Optional[str] = None, state_dtype: str = "float32",
                 stochastic_rounding: bool = False, seed: int = 0, backend: str = "auto",
                 backend_options: Optional[Dict[str, Any]] = None):
        defaults = _defaults(locals(), "lr", "betas", "eps", "weight_decay", "foreach", "maximize", "differentiable",
                             "capturable")
        super().__init__(params, defaults, **_common(foreach, None, backend, backend_options))

    def _hyperparameters(self, group):
        beta1, beta2 = self._pair(group)
        return "adamax", P.AdamaxParams(lr=self._scalar(group, "lr"), beta1=beta1, beta2=beta2, eps=group["eps"],
                                        weight_decay=group["weight_decay"])


class Adadelta(_HostScalars):
    """torch.optim.Adadelta (``square_avg``, ``acc_delta``; lr scales the delta) on optirs' kernel."""

    def __init__(self, params, lr=1.0, rho=0.9, eps=1e-6, weight_decay=0, foreach: Optional[bool] = None, *,
                 capturable: bool = False, maximize: bool = False, differentiable: bool = False,
                 master_weights: Optional[str] = None, state_dtype: str = "float32",
                 stochastic_rounding: bool = False, seed: int = 0, backend: str = "auto",
                 backend_options: Optional[Dict[str, Any]] = None):
        defaults = _defaults(locals(), "lr", "rho", "eps", "weight_decay", "maximize", "capturable", "foreach",
                             "differentiable")
        super().__init__(params, defaults, **_common(foreach, None, backend, backend_options))

    def _hyperparameters(self, group):
        return "adadelta", P.AdadeltaParams(lr=self._scalar(group, "lr"), rho=group["rho"], eps=group["eps"],
                                            weight_decay=group["weight_decay"])


class ASGD(_HostScalars):
    """torch.optim.ASGD on optirs' kernel: ``state[p]`` holds torch's ``eta``, ``mu`` and ``ax``.

    As torch, a step uses the ``eta`` its state holds (carried), computed at the end of the previous
    step from that step's lr, so a scheduler's new lr takes effect one step later, as with torch.
    """

    _carried = ("eta",)

    def __init__(self, params, lr=1e-2, lambd=1e-4, alpha=0.75, t0=1e6, weight_decay=0,
                 foreach: Optional[bool] = None, maximize: bool = False, differentiable: bool = False,
                 capturable: bool = False, *, master_weights: Optional[str] = None, state_dtype: str = "float32",
                 stochastic_rounding: bool = False, seed: int = 0, backend: str = "auto",
                 backend_options: Optional[Dict[str, Any]] = None):
        defaults = _defaults(locals(), "lr", "lambd", "alpha", "t0", "weight_decay", "foreach", "maximize",
                             "differentiable", "capturable")
        super().__init__(params, defaults, **_common(foreach, None, backend, backend_options))

    def _hyperparameters(self, group):
        return "asgd", P.AsgdParams(lr=self._scalar(group, "lr"), lambd=group["lambd"], alpha=group["alpha"],
                                    t0=group["t0"], weight_decay=group["weight_decay"])


class Rprop(_HostScalars):
    """torch.optim.Rprop (``etas``, ``step_sizes``; ``prev`` and ``step_size`` state) on optirs' kernel.
    As torch, the step sizes start at the first step's lr; a later lr changes nothing."""

    def __init__(self, params, lr=1e-2, etas=(0.5, 1.2), step_sizes=(1e-6, 50), *, capturable: bool = False,
                 foreach: Optional[bool] = None, maximize: bool = False, differentiable: bool = False,
                 master_weights: Optional[str] = None, state_dtype: str = "float32",
                 stochastic_rounding: bool = False, seed: int = 0, backend: str = "auto",
                 backend_options: Optional[Dict[str, Any]] = None):
        defaults = _defaults(locals(), "lr", "etas", "step_sizes", "foreach", "maximize", "differentiable",
                             "capturable")
        super().__init__(params, defaults, **_common(foreach, None, backend, backend_options))

    def _hyperparameters(self, group):
        etaminus, etaplus = self._pair(group, "etas")
        low, high = self._pair(group, "step_sizes")
        return "rprop", P.RpropParams(lr=self._scalar(group, "lr"), etaminus=etaminus, etaplus=etaplus,
                                      step_size_min=low, step_size_max=high)


class LBFGS:
    """torch.optim.LBFGS is not offered by optirs.torch: constructing it raises
    :class:`~optirs.core.errors.UnsupportedOperationError` saying why.

    L-BFGS is not an elementwise step: each ``step(closure)`` re-evaluates the closure up to
    ``max_iter`` times, takes dot products over the whole flattened model against a history of
    up to ``history_size`` pairs of vectors, and (with ``line_search_fn="strong_wolfe"``) runs a
    line search whose every trial point is another closure call. Its cost is the closure's
    forward and backward passes and torch's own dot products, which optirs' one-launch kernels
    would not shorten; use ``torch.optim.LBFGS`` itself (it works beside optirs.torch optimizers).
    """

    def __init__(self, params: Any = None, lr: float = 1, max_iter: int = 20, max_eval: Optional[int] = None,
                 tolerance_grad: float = 1e-7, tolerance_change: float = 1e-9, history_size: int = 100,
                 line_search_fn: Optional[str] = None, **kwargs: Any):
        raise UnsupportedOperationError(
            "optirs.torch.LBFGS is not provided, expected torch.optim.LBFGS: L-BFGS is closure-driven and not "
            "elementwise (several closure evaluations per step, dot products over the whole model against its "
            "history, a strong-Wolfe line search), so an optirs kernel has nothing to fuse; torch.optim.LBFGS "
            "with the same arguments is the implementation to use")


__all__ = ["NAdam", "RAdam", "Adamax", "Adadelta", "ASGD", "Rprop", "LBFGS"]
