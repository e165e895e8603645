"""One record per optimizer: everything optirs derives an optimizer from.

A :class:`OptimizerDefinition` names the optimizer, its hyperparameter type and defaults, its
state slots (a typed tuple, in the order every backend passes them to its kernels), its per-step
scalars, its float64 reference step, the kernel family whose per-element math it runs, and the
hyperparameter sets the tests and the benchmark use. From it come the optimizer class
(:mod:`optirs.optim.optimizers`), the step hook ``optirs_step_<name>``
(:mod:`optirs.plugin.hookspecs`), each backend's slot order, the reference tests and
``optirs bench``.

Adding an optimizer means: its hyperparameters (:mod:`optirs.core.params`), its scalars and
float64 step (:mod:`optirs.core.scalars`, :mod:`optirs.core.reference`), one record here, and its
per-element math once for numba (``optirs/backends/common/elementwise.py``) and once in OpenCL C
(``optirs/backends/common/kernels/optirs_elementwise.h``). Optimizers whose step needs per-tensor
reductions (LAMB's norms, Adafactor's factored moments) have a ``kernel`` family of their own that
each backend implements as a capability.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, NamedTuple, Tuple

from optirs.core import params as hp_types
from optirs.core import reference, scalars

# Kernel families whose step is elementwise: the generic one-launch kernels of every backend run
# them from the per-element math alone. Other families need reductions of their own.
POINTWISE_FAMILIES = ("adam", "sgd", "rmsprop", "adagrad")


@dataclass(frozen=True)
class StateSlot:
    """One per-element state buffer: its name (as in ``state_dict()`` and torch), its initial
    value and whether a given set of hyperparameters needs it."""

    name: str
    initial: Callable[[Any], float] = lambda hp: 0.0
    needed: Callable[[Any], bool] = lambda hp: True


@dataclass(frozen=True)
class OptimizerDefinition:
    """Everything optirs needs to know about one optimizer.

    :param name: the optimizer's name: ``state_dict()["optimizer"]``, the step hook
        ``optirs_step_<name>``, ``optirs bench --optimizers``.
    :param class_name: the seed API's class (``GpuAdam``).
    :param params_type: the validated hyperparameter dataclass.
    :param scalars: ``(hyperparameters, step) -> NamedTuple`` of float32/bool per-step scalars.
    :param reference: the float64 step of :mod:`optirs.core.reference`.
    :param slots: the state slots in kernel order (slot 0, 1, 2 of the generic kernels).
    :param kernel: the kernel family whose per-element math runs the step (``adamw`` runs ``adam``).
    :param summary: one line: the hook's and the class's first line.
    :param algorithm: the update written out, for the class docstring.
    :param defaults: hyperparameter defaults that differ from ``params_type()``'s (AdamW's decay).
    :param examples: hyperparameter sets covering every option (tests, benchmark: the first).
    """

    name: str
    class_name: str
    params_type: type
    scalars: Callable[[Any, int], NamedTuple]
    reference: Callable[..., Any]
    slots: Tuple[StateSlot, ...]
    kernel: str
    summary: str
    algorithm: str = ""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    examples: Tuple[Any, ...] = ()

    @property
    def hook(self) -> str:
        """The step hook's name."""
        return f"optirs_step_{self.name}"

    @property
    def pointwise(self) -> bool:
        """Whether the generic elementwise kernels run this optimizer."""
        return self.kernel in POINTWISE_FAMILIES

    @property
    def scalars_type(self) -> type:
        """The NamedTuple type of this optimizer's per-step scalars (one per kernel family)."""
        return type(self.scalars(self.default_params(), 1))

    def default_params(self) -> Any:
        return self.params_type(**self.defaults)

    def state_slots(self, hp: Any) -> Dict[str, float]:
        """Slot name -> initial value of every state buffer these hyperparameters need, in kernel order."""
        return {s.name: float(s.initial(hp)) for s in self.slots if s.needed(hp)}

    def slot_names(self) -> Tuple[str, ...]:
        """Every slot's name in kernel order (slot k of a generic kernel is ``slot_names()[k]``)."""
        return tuple(s.name for s in self.slots)


P = hp_types

ADAM = OptimizerDefinition(
    name="adam", class_name="GpuAdam", params_type=P.AdamParams, kernel="adam",
    scalars=lambda hp, step: scalars.adam_scalars(hp, step, decoupled=False),
    reference=reference.adam,
    slots=(StateSlot("exp_avg"), StateSlot("exp_avg_sq"), StateSlot("max_exp_avg_sq", needed=lambda hp: hp.amsgrad)),
    summary="Adam (Kingma & Ba), as torch.optim.Adam; weight_decay is L2 (added to the gradient).",
    algorithm="""
        g = g + weight_decay * p
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g^2
        v_max = max(v_max, v)                      (amsgrad; then v_max replaces v below)
        p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)""",
    examples=(P.AdamParams(), P.AdamParams(lr=1e-2, weight_decay=0.1), P.AdamParams(amsgrad=True),
              P.AdamParams(lr=3e-3, beta1=0.5, beta2=0.9, eps=1e-6, weight_decay=0.05, amsgrad=True)),
)

ADAMW = OptimizerDefinition(
    name="adamw", class_name="GpuAdamW", params_type=P.AdamParams, kernel="adam",
    scalars=lambda hp, step: scalars.adam_scalars(hp, step, decoupled=True),
    reference=reference.adamw, slots=ADAM.slots, defaults={"weight_decay": 0.01},
    summary="AdamW (Loshchilov & Hutter), as torch.optim.AdamW: decoupled weight decay, default 0.01.",
    algorithm="""
        p = p * (1 - lr * weight_decay)
        then the Adam update above without the L2 term""",
    examples=(P.AdamParams(weight_decay=0.01), P.AdamParams(lr=1e-2, weight_decay=0.3),
              P.AdamParams(weight_decay=0.1, amsgrad=True)),
)

SGD = OptimizerDefinition(
    name="sgd", class_name="GpuSgd", params_type=P.SgdParams, kernel="sgd",
    scalars=scalars.sgd_scalars, reference=reference.sgd,
    slots=(StateSlot("momentum_buffer", needed=lambda hp: hp.momentum != 0.0),),
    summary="SGD with momentum, dampening, nesterov and L2 weight decay, as torch.optim.SGD.",
    algorithm="""
        g = g + weight_decay * p
        b = g (first step), else momentum * b + (1 - dampening) * g
        g = g + momentum * b (nesterov), else b        (when momentum != 0)
        p = p - lr * g""",
    examples=(P.SgdParams(lr=0.01), P.SgdParams(lr=0.01, weight_decay=0.1), P.SgdParams(lr=0.01, momentum=0.9),
              P.SgdParams(lr=0.01, momentum=0.9, dampening=0.5),
              P.SgdParams(lr=0.01, momentum=0.9, nesterov=True, weight_decay=0.01)),
)

RMSPROP = OptimizerDefinition(
    name="rmsprop", class_name="GpuRmsprop", params_type=P.RmspropParams, kernel="rmsprop",
    scalars=scalars.rmsprop_scalars, reference=reference.rmsprop,
    slots=(StateSlot("square_avg"), StateSlot("momentum_buffer", needed=lambda hp: hp.momentum > 0.0),
           StateSlot("grad_avg", needed=lambda hp: hp.centered)),
    summary="RMSprop, as torch.optim.RMSprop (eps outside the square root, momentum, centered).",
    algorithm="""
        g = g + weight_decay * p
        s = alpha * s + (1 - alpha) * g^2
        a = alpha * a + (1 - alpha) * g;  d = sqrt(s - a^2) + eps   (centered)
        d = sqrt(s) + eps                                            (otherwise)
        b = momentum * b + g / d;  p = p - lr * b                    (momentum > 0)
        p = p - lr * g / d                                           (otherwise)""",
    examples=(P.RmspropParams(), P.RmspropParams(weight_decay=0.1), P.RmspropParams(momentum=0.9),
              P.RmspropParams(centered=True), P.RmspropParams(lr=1e-3, alpha=0.9, momentum=0.5, centered=True)),
)

ADAGRAD = OptimizerDefinition(
    name="adagrad", class_name="GpuAdagrad", params_type=P.AdagradParams, kernel="adagrad",
    scalars=scalars.adagrad_scalars, reference=reference.adagrad,
    slots=(StateSlot("sum", initial=lambda hp: hp.initial_accumulator_value),),
    summary="Adagrad, as torch.optim.Adagrad (lr_decay, initial_accumulator_value).",
    algorithm="""
        g = g + weight_decay * p
        s = s + g^2                       (s starts at initial_accumulator_value)
        p = p - lr / (1 + (t - 1) * lr_decay) * g / (sqrt(s) + eps)""",
    examples=(P.AdagradParams(), P.AdagradParams(lr_decay=0.1), P.AdagradParams(initial_accumulator_value=0.5),
              P.AdagradParams(weight_decay=0.1, eps=1e-6)),
)

LAMB = OptimizerDefinition(
    name="lamb", class_name="GpuLamb", params_type=P.LambParams, kernel="lamb",
    scalars=scalars.lamb_scalars, reference=reference.lamb,
    slots=(StateSlot("exp_avg"), StateSlot("exp_avg_sq")),
    summary="LAMB (You et al. 2019), as optax.lamb: per-tensor trust ratios, optional global gradient clipping.",
    algorithm="""
        g = g * min(1, max_grad_norm / ||all g||)          (global clipping, optional)
        m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g^2
        u = (m / bc1) / (sqrt(v / bc2) + eps) + weight_decay * p    (bc = 1 without bias correction)
        r = ||p|| / ||u|| per tensor, 1 where either is 0, at most max_trust_ratio
        p = p - lr * r * u""",
    examples=(P.LambParams(), P.LambParams(bias_correction=False), P.LambParams(max_trust_ratio=0.5),
              P.LambParams(max_grad_norm=1.0),
              P.LambParams(lr=1e-2, weight_decay=0.0, max_trust_ratio=10.0, max_grad_norm=5.0)),
)

# Every optimizer, in the order listings show them.
DEFINITIONS: Dict[str, OptimizerDefinition] = {d.name: d for d in (ADAM, ADAMW, SGD, RMSPROP, ADAGRAD, LAMB)}


def definition(name: str) -> OptimizerDefinition:
    """The record of optimizer ``name``."""
    from optirs.core.errors import InvalidParameterError

    try:
        return DEFINITIONS[name]
    except KeyError:
        raise InvalidParameterError(f"optimizer={name!r}, expected one of {sorted(DEFINITIONS)}") from None

