"""optirs.torch's optimizers: torch.optim's constructors over optirs' definitions.

Each class takes torch 2.13's arguments (names, defaults, keyword-only parts) plus
``backend="auto"`` and ``backend_options`` (a name checked at construction). ``foreach`` and
``fused`` only choose among torch's implementations: optirs answers every choice with its one
fused launch (both True is refused, as torch refuses it). What optirs cannot honour raises instead
of being ignored: ``differentiable=True``, sparse gradients, and
``capturable=True`` where it cannot hold (tensors on a backend without the ``capturable``
capability, such as CPU tensors, as torch; Lamb and Adafactor, whose steps are not elementwise).
``capturable=True`` keeps the step count on the device and reads a tensor lr there (CUDA graphs). Every optimizer but Adafactor also takes the step-format keywords
``master_weights=None``, ``state_dtype="float32"``, ``stochastic_rounding=False``, ``seed=0``
(docs/formats.md): bfloat16 and float16 parameters are stepped through the backend's
``formats`` capability.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from optirs.core import params as P
from optirs.core.errors import InvalidParameterError
from optirs.torch._frontend import OptirsOptimizer, closure_and_amp
from optirs.torch._mesh_adafactor import mesh_adafactor_step
from optirs.torch._mesh_lamb import MeshLamb, holds_shards
from optirs.torch._stepcall import observed_step


def _formats(master_weights, state_dtype, stochastic_rounding, seed) -> Dict[str, Any]:
    """The format keywords (docs/formats.md) as param-group defaults: each group may set its own."""
    return {"master_weights": master_weights, "state_dtype": state_dtype,
            "stochastic_rounding": stochastic_rounding, "seed": seed}


def _common(foreach, fused, backend, backend_options) -> Dict[str, Any]:
    return {"foreach": foreach, "fused": fused, "backend": backend, "backend_options": backend_options}


def _step_on_mesh(opt: OptirsOptimizer, closure, grad_scale, found_inf, mesh_step) -> Any:
    """The base step, or, with sharded DTensor parameters, ``mesh_step(opt, grad_scale, found_inf)``:
    the optimizer's per-tensor sums reduced over the mesh (optirs.torch._mesh_*)."""
    if not holds_shards(opt):  # (the base step itself: the hooks ran once, around this one)
        return OptirsOptimizer.step.__wrapped__(opt, closure, grad_scale=grad_scale, found_inf=found_inf)
    loss, grad_scale, found_inf = closure_and_amp(opt, closure, grad_scale, found_inf)
    with torch.no_grad():
        mesh_step(opt, grad_scale, found_inf)
    return loss


class Adam(OptirsOptimizer):
    """torch.optim.Adam on optirs' Adam/AdamW kernel (``decoupled_weight_decay=True`` is AdamW)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, *,
                 foreach: Optional[bool] = None, maximize: bool = False, capturable: bool = False,
                 differentiable: bool = False, fused: Optional[bool] = None, decoupled_weight_decay: bool = False,
                 master_weights: Optional[str] = None, state_dtype: str = "float32",
                 stochastic_rounding: bool = False, seed: int = 0, backend: str = "auto", backend_options: Optional[Dict[str, Any]] = None):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused,
                        decoupled_weight_decay=decoupled_weight_decay)
        defaults.update(_formats(master_weights, state_dtype, stochastic_rounding, seed))
        super().__init__(params, defaults, **_common(foreach, fused, backend, backend_options))

    def _hyperparameters(self, group):
        beta1, beta2 = self._pair(group)
        hp = P.AdamParams(lr=self._scalar(group, "lr"), beta1=beta1, beta2=beta2, eps=group["eps"],
                          weight_decay=group["weight_decay"], amsgrad=group["amsgrad"])
        return ("adamw" if group.get("decoupled_weight_decay", False) else "adam"), hp


class AdamW(Adam):
    """torch.optim.AdamW (decoupled weight decay, default 0.01) on optirs' Adam kernel."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize: bool = False, foreach: Optional[bool] = None, capturable: bool = False,
                 differentiable: bool = False, fused: Optional[bool] = None,
                 master_weights: Optional[str] = None, state_dtype: str = "float32",
                 stochastic_rounding: bool = False, seed: int = 0, backend: str = "auto", backend_options: Optional[Dict[str, Any]] = None):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, master_weights=master_weights, state_dtype=state_dtype,
                         stochastic_rounding=stochastic_rounding, seed=seed, backend=backend,
                         backend_options=backend_options)


class SGD(OptirsOptimizer):
    """torch.optim.SGD (momentum, dampening, nesterov, L2 decay) on optirs' SGD kernel."""

    _has_step_state = False  # torch's SGD keeps only momentum_buffer

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False, *,
                 maximize: bool = False, foreach: Optional[bool] = None, differentiable: bool = False,
                 fused: Optional[bool] = None, master_weights: Optional[str] = None, state_dtype: str = "float32",
                 stochastic_rounding: bool = False, seed: int = 0, backend: str = "auto",
                 backend_options: Optional[Dict[str, Any]] = None):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        maximize=maximize, foreach=foreach, differentiable=differentiable, fused=fused)
        defaults.update(_formats(master_weights, state_dtype, stochastic_rounding, seed))
        super().__init__(params, defaults, **_common(foreach, fused, backend, backend_options))

    def _hyperparameters(self, group):
        return "sgd", P.SgdParams(lr=self._scalar(group, "lr"), momentum=group["momentum"],
                                  dampening=group["dampening"], weight_decay=self._scalar(group, "weight_decay"),
                                  nesterov=group["nesterov"])


class RMSprop(OptirsOptimizer):
    """torch.optim.RMSprop (eps outside the square root, momentum, centered) on optirs' kernel."""

    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0, centered=False,
                 capturable=False, foreach: Optional[bool] = None, maximize: bool = False,
                 differentiable: bool = False, *, master_weights: Optional[str] = None, state_dtype: str = "float32",
                 stochastic_rounding: bool = False, seed: int = 0, backend: str = "auto",
                 backend_options: Optional[Dict[str, Any]] = None):
        defaults = dict(lr=lr, momentum=momentum, alpha=alpha, eps=eps, centered=centered, weight_decay=weight_decay,
                        capturable=capturable, foreach=foreach, maximize=maximize, differentiable=differentiable)
        defaults.update(_formats(master_weights, state_dtype, stochastic_rounding, seed))
        super().__init__(params, defaults, **_common(foreach, None, backend, backend_options))

    def _hyperparameters(self, group):
        return "rmsprop", P.RmspropParams(lr=self._scalar(group, "lr"), alpha=group["alpha"], eps=group["eps"],
                                          weight_decay=group["weight_decay"], momentum=group["momentum"],
                                          centered=group["centered"])


class Adagrad(OptirsOptimizer):
    """torch.optim.Adagrad (lr_decay, initial_accumulator_value) on optirs' kernel.

    Unlike torch, the state (``step``, ``sum``) appears at the first step, not at construction.
    """

    def __init__(self, params, lr=1e-2, lr_decay=0, weight_decay=0, initial_accumulator_value=0, eps=1e-10,
                 foreach: Optional[bool] = None, *, maximize: bool = False, differentiable: bool = False,
                 fused: Optional[bool] = None, master_weights: Optional[str] = None, state_dtype: str = "float32",
                 stochastic_rounding: bool = False, seed: int = 0, backend: str = "auto",
                 backend_options: Optional[Dict[str, Any]] = None):
        defaults = dict(lr=lr, lr_decay=lr_decay, eps=eps, weight_decay=weight_decay,
                        initial_accumulator_value=initial_accumulator_value, foreach=foreach, maximize=maximize,
                        differentiable=differentiable, fused=fused)
        defaults.update(_formats(master_weights, state_dtype, stochastic_rounding, seed))
        super().__init__(params, defaults, **_common(foreach, fused, backend, backend_options))

    def _hyperparameters(self, group):
        return "adagrad", P.AdagradParams(lr=self._scalar(group, "lr"), lr_decay=group["lr_decay"],
                                          weight_decay=group["weight_decay"],
                                          initial_accumulator_value=group["initial_accumulator_value"],
                                          eps=group["eps"])


class Adafactor(OptirsOptimizer):
    """torch.optim.Adafactor (factored second moments; ``maximize`` inside the kernel)."""

    _native_maximize = True

    def __init__(self, params, lr=1e-2, beta2_decay=-0.8, eps: Tuple[Optional[float], float] = (None, 1e-3), d=1.0,
                 weight_decay=0.0, *, foreach: Optional[bool] = None, maximize: bool = False,
                 backend: str = "auto", backend_options: Optional[Dict[str, Any]] = None):
        defaults = dict(lr=lr, beta2_decay=beta2_decay, eps=eps, d=d, weight_decay=weight_decay, foreach=foreach,
                        maximize=maximize)
        super().__init__(params, defaults, **_common(foreach, None, backend, backend_options))

    @observed_step
    def step(self, closure=None, *, grad_scale=None, found_inf=None):
        """The fused Adafactor step; with sharded DTensor parameters (FSDP2) the same step with its
        sums reduced over the mesh (optirs.torch._mesh_adafactor)."""
        return _step_on_mesh(self, closure, grad_scale, found_inf, mesh_adafactor_step)

    def _hyperparameters(self, group):
        return "adafactor", P.AdafactorParams(lr=self._scalar(group, "lr"), beta2_decay=group["beta2_decay"],
                                              eps=group["eps"], d=group["d"], weight_decay=group["weight_decay"],
                                              maximize=bool(group["maximize"]))


class Lamb(OptirsOptimizer):
    """LAMB as optax.lamb / optirs.GpuLamb (per-tensor trust ratios, optional global clipping)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, *,
                 bias_correction: bool = True, max_trust_ratio: Optional[float] = None,
                 max_grad_norm: Optional[float] = None, maximize: bool = False, foreach: Optional[bool] = None,
                 fused: Optional[bool] = None, capturable: bool = False, master_weights: Optional[str] = None, state_dtype: str = "float32",
                 stochastic_rounding: bool = False, seed: int = 0, backend: str = "auto",
                 backend_options: Optional[Dict[str, Any]] = None):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
                        max_trust_ratio=max_trust_ratio, max_grad_norm=max_grad_norm, maximize=maximize,
                        foreach=foreach, fused=fused, capturable=capturable)  # capturable=True: refused (norms)
        defaults.update(_formats(master_weights, state_dtype, stochastic_rounding, seed))
        super().__init__(params, defaults, **_common(foreach, fused, backend, backend_options))

    @observed_step
    def step(self, closure=None, *, grad_scale=None, found_inf=None):
        """The fused LAMB step; with sharded DTensor parameters (FSDP2) the same update with its
        norms reduced over the mesh (optirs.torch._mesh_lamb)."""
        return _step_on_mesh(self, closure, grad_scale, found_inf, Lamb._mesh_step)

    def _mesh_step(self, grad_scale, found_inf) -> None:
        mesh = self.__dict__.get("_mesh_lamb")
        if mesh is None:
            mesh = self.__dict__["_mesh_lamb"] = MeshLamb(AdamW)
        mesh.step(self, grad_scale, found_inf)

    def _hyperparameters(self, group):
        beta1, beta2 = self._pair(group)
        return "lamb", P.LambParams(lr=self._scalar(group, "lr"), beta1=beta1, beta2=beta2, eps=group["eps"],
                                    weight_decay=group["weight_decay"], bias_correction=group["bias_correction"],
                                    max_trust_ratio=group["max_trust_ratio"], max_grad_norm=group["max_grad_norm"])


class Lion(OptirsOptimizer):
    """Lion as the lion-pytorch package (``Lion(params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0)``)."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, maximize: bool = False,
                 foreach: Optional[bool] = None, fused: Optional[bool] = None, capturable: bool = False,
                 master_weights: Optional[str] = None, state_dtype: str = "float32",
                 stochastic_rounding: bool = False, seed: int = 0, backend: str = "auto",
                 backend_options: Optional[Dict[str, Any]] = None):
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize, foreach=foreach, fused=fused,
                        capturable=capturable)
        defaults.update(_formats(master_weights, state_dtype, stochastic_rounding, seed))
        super().__init__(params, defaults, **_common(foreach, fused, backend, backend_options))

    def _hyperparameters(self, group):
        beta1, beta2 = self._pair(group)
        return "lion", P.LionParams(lr=self._scalar(group, "lr"), beta1=beta1, beta2=beta2,
                                    weight_decay=group["weight_decay"])


__all__ = ["Adam", "AdamW", "SGD", "RMSprop", "Adagrad", "Adafactor", "Lamb", "Lion"]
