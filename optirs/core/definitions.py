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
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple

import numpy as np

from optirs.core import params as hp_types
from optirs.core import reference, scalars
from optirs.core.factored import factored_layout
from optirs.core.layout import TensorLayout

# Kernel families whose step is elementwise: the generic one-launch kernels of every backend run
# them from the per-element math alone. Other families need reductions of their own.
POINTWISE_FAMILIES = ("adam", "sgd", "rmsprop", "adagrad", "lion", "nadam", "radam", "adamax", "adadelta", "asgd", "rprop")


@dataclass(frozen=True)
class StateSlot:
    """One per-element state buffer: its name (as in ``state_dict()`` and torch), its initial
    value, whether a given set of hyperparameters needs it, and whether its values can be
    negative (``signed``: int8 state quantizes it with the signed dynamic map, else the unsigned one)."""

    name: str
    initial: Callable[[Any], float] = lambda hp: 0.0
    needed: Callable[[Any], bool] = lambda hp: True
    signed: bool = True


class ElementwiseState:
    """Where each tensor's state lives when every slot holds one value per element (most
    optimizers): each slot is laid out like the parameters."""

    def __init__(self, layout: TensorLayout, slots: Tuple[str, ...]):
        self.layout, self.slots = layout, slots

    def buffer_sizes(self) -> Dict[str, int]:
        """Elements of each slot's flat buffer."""
        return {k: self.layout.total for k in self.slots}

    def state_shapes(self, t: int) -> Dict[str, Tuple[int, ...]]:
        """Slot name -> the shape of tensor ``t``'s state in a checkpoint."""
        return {k: self.layout.shapes[t] for k in self.slots}

    def views(self, slot: str, flat: np.ndarray) -> List[Optional[np.ndarray]]:
        """Per-tensor views of a flat host buffer of ``slot`` (None where a tensor lacks the slot)."""
        return list(self.layout.views(flat))


@dataclass(frozen=True)
class OptimizerDefinition:
    """Everything optirs needs to know about one optimizer.

    :param name: the optimizer's name: ``state_dict()["optimizer"]``, the step hook
        ``optirs_step_<name>``, ``optirs bench --optimizers``.
    :param class_name: the seed API's class (``GpuAdam``).
    :param params_type: the validated hyperparameter dataclass.
    :param scalars: ``(hyperparameters, step, grad_factor=1.0) -> NamedTuple`` of float32/bool per-step
        scalars; every record ends with the float32 ``grad_factor`` that the step multiplies each
        gradient element by first (-1 for maximize, 1 / scale to unscale; 1 leaves it as it is).
    :param reference: the float64 step of :mod:`optirs.core.reference`.
    :param slots: the state slots in kernel order (slot 0, 1, 2 of the generic kernels).
    :param kernel: the kernel family whose per-element math runs the step (``adamw`` runs ``adam``).
    :param summary: one line: the hook's and the class's first line.
    :param algorithm: the update written out, for the class docstring.
    :param defaults: hyperparameter defaults that differ from ``params_type()``'s (AdamW's decay).
    :param examples: hyperparameter sets covering every option (the reference tests).
    :param benchmark: the hyperparameters ``optirs bench`` times (default: the first example).
    :param state_layout: ``(layout, slot names) -> `` where each tensor's slots live in their flat
        buffers (:class:`ElementwiseState` unless the state is not one value per element, as
        Adafactor's factored moments).
    :param traffic: bytes a step moves per element with ``benchmark`` (default: read p, g and
        every slot, write p and every slot, 4 bytes each), the numerator of bandwidth figures.
    :param tensor_state: ``(hyperparameters, step) -> {name: value}``: the 0-dim values torch keeps in
        each tensor's state after step ``step`` besides ``step`` (NAdam's ``mu_product``, ASGD's
        ``eta`` and ``mu``), float32; optirs.torch's state_dict carries them as torch does.
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
    benchmark: Any = None
    traffic: Optional[int] = None
    state_layout: Callable[[TensorLayout, Tuple[str, ...]], Any] = ElementwiseState
    tensor_state: Optional[Callable[[Any, int], Dict[str, float]]] = None

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

    def benchmark_params(self) -> Any:
        return self.benchmark if self.benchmark is not None else self.examples[0]

    def bytes_per_element(self) -> int:
        """Bytes one step moves per element with the benchmark's hyperparameters."""
        if self.traffic is not None:
            return self.traffic
        return 4 * (3 + 2 * len(self.state_slots(self.benchmark_params())))

    def slot_names(self) -> Tuple[str, ...]:
        """Every slot's name in kernel order (slot k of a generic kernel is ``slot_names()[k]``)."""
        return tuple(s.name for s in self.slots)


P = hp_types

ADAM = OptimizerDefinition(
    name="adam", class_name="GpuAdam", params_type=P.AdamParams, kernel="adam",
    scalars=lambda hp, step, grad_factor=1.0: scalars.adam_scalars(hp, step, decoupled=False, grad_factor=grad_factor),
    reference=reference.adam,
    slots=(StateSlot("exp_avg"), StateSlot("exp_avg_sq", signed=False),
           StateSlot("max_exp_avg_sq", needed=lambda hp: hp.amsgrad, signed=False)),
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
    scalars=lambda hp, step, grad_factor=1.0: scalars.adam_scalars(hp, step, decoupled=True, grad_factor=grad_factor),
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
    benchmark=P.SgdParams(lr=1e-2, momentum=0.9),
    examples=(P.SgdParams(lr=0.01), P.SgdParams(lr=0.01, weight_decay=0.1), P.SgdParams(lr=0.01, momentum=0.9),
              P.SgdParams(lr=0.01, momentum=0.9, dampening=0.5),
              P.SgdParams(lr=0.01, momentum=0.9, nesterov=True, weight_decay=0.01)),
)

RMSPROP = OptimizerDefinition(
    name="rmsprop", class_name="GpuRmsprop", params_type=P.RmspropParams, kernel="rmsprop",
    scalars=scalars.rmsprop_scalars, reference=reference.rmsprop,
    slots=(StateSlot("square_avg", signed=False), StateSlot("momentum_buffer", needed=lambda hp: hp.momentum > 0.0),
           StateSlot("grad_avg", needed=lambda hp: hp.centered)),
    summary="RMSprop, as torch.optim.RMSprop (eps outside the square root, momentum, centered).",
    algorithm="""
        g = g + weight_decay * p
        s = alpha * s + (1 - alpha) * g^2
        a = alpha * a + (1 - alpha) * g;  d = sqrt(s - a^2) + eps   (centered)
        d = sqrt(s) + eps                                            (otherwise)
        b = momentum * b + g / d;  p = p - lr * b                    (momentum > 0)
        p = p - lr * g / d                                           (otherwise)""",
    benchmark=P.RmspropParams(lr=1e-2),
    examples=(P.RmspropParams(), P.RmspropParams(weight_decay=0.1), P.RmspropParams(momentum=0.9),
              P.RmspropParams(centered=True), P.RmspropParams(lr=1e-3, alpha=0.9, momentum=0.5, centered=True)),
)

ADAGRAD = OptimizerDefinition(
    name="adagrad", class_name="GpuAdagrad", params_type=P.AdagradParams, kernel="adagrad",
    scalars=scalars.adagrad_scalars, reference=reference.adagrad,
    slots=(StateSlot("sum", initial=lambda hp: hp.initial_accumulator_value, signed=False),),
    summary="Adagrad, as torch.optim.Adagrad (lr_decay, initial_accumulator_value).",
    algorithm="""
        g = g + weight_decay * p
        s = s + g^2                       (s starts at initial_accumulator_value)
        p = p - lr / (1 + (t - 1) * lr_decay) * g / (sqrt(s) + eps)""",
    benchmark=P.AdagradParams(lr=1e-2),
    examples=(P.AdagradParams(), P.AdagradParams(lr_decay=0.1), P.AdagradParams(initial_accumulator_value=0.5),
              P.AdagradParams(weight_decay=0.1, eps=1e-6)),
)

LAMB = OptimizerDefinition(
    name="lamb", class_name="GpuLamb", params_type=P.LambParams, kernel="lamb",
    scalars=scalars.lamb_scalars, reference=reference.lamb,
    slots=(StateSlot("exp_avg"), StateSlot("exp_avg_sq", signed=False)),
    summary="LAMB (You et al. 2019), as optax.lamb: per-tensor trust ratios, optional global gradient clipping.",
    algorithm="""
        g = g * min(1, max_grad_norm / ||all g||)          (global clipping, optional)
        m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g^2
        u = (m / bc1) / (sqrt(v / bc2) + eps) + weight_decay * p    (bc = 1 without bias correction)
        r = ||p|| / ||u|| per tensor, 1 where either is 0, at most max_trust_ratio
        p = p - lr * r * u""",
    # two passes: (p, g, m, v) in and (m, v) out for the moments and norms; (p, m, v) in, p out
    traffic=40,
    examples=(P.LambParams(), P.LambParams(bias_correction=False), P.LambParams(max_trust_ratio=0.5),
              P.LambParams(max_grad_norm=1.0),
              P.LambParams(lr=1e-2, weight_decay=0.0, max_trust_ratio=10.0, max_grad_norm=5.0)),
)

LION = OptimizerDefinition(
    name="lion", class_name="GpuLion", params_type=P.LionParams, kernel="lion",
    scalars=scalars.lion_scalars, reference=reference.lion,
    slots=(StateSlot("exp_avg"),),
    summary="Lion (Chen et al. 2023), as the lion-pytorch package: the sign of an interpolated momentum.",
    algorithm="""
        p = p * (1 - lr * weight_decay)
        p = p - lr * sign(beta1 * m + (1 - beta1) * g)        (sign(0) = 0)
        m = beta2 * m + (1 - beta2) * g""",
    examples=(P.LionParams(), P.LionParams(lr=3e-4, weight_decay=0.1),
              P.LionParams(lr=1e-3, beta1=0.95, beta2=0.98, weight_decay=0.01)),
)

ADAFACTOR = OptimizerDefinition(
    name="adafactor", class_name="GpuAdafactor", params_type=P.AdafactorParams, kernel="adafactor",
    scalars=scalars.adafactor_scalars, reference=reference.adafactor,
    slots=(StateSlot("row_var", signed=False), StateSlot("col_var", signed=False),
           StateSlot("variance", signed=False)),
    # a 2+ dim tensor keeps row and column means of its last two dims, a 0-1 dim one a variance
    state_layout=lambda layout, slots: factored_layout(layout),
    summary="Adafactor (Shazeer & Stern 2018), as torch.optim.Adafactor: factored second moments.",
    algorithm="""
        g = -g (maximize);  w = t^beta2_decay;  rho = min(lr, 1 / sqrt(t))
        alpha = max(eps2, RMS(p)) * rho;  p = p * (1 - lr * weight_decay)
        2+ dims:  R = R + w * (mean(g^2, last dim) - R);  C = C + w * (mean(g^2, dim -2) - C)
                  v = R C / max(mean(R), eps1)
        0-1 dims: v = v + w * (g^2 - v)
        u = g / sqrt(max(v, eps1^2));  p = p - alpha / max(1, RMS(u) / d) * u""",
    # on the benchmark's 1-d tensors: p in for RMS(p); (g, v) in, v out; then (p, g, v) in, p out
    traffic=32,
    examples=(P.AdafactorParams(), P.AdafactorParams(lr=1e-3, weight_decay=0.1),
              P.AdafactorParams(beta2_decay=-0.5, eps=(1e-30, 1e-3), d=2.0, maximize=True)),
)

NADAM = OptimizerDefinition(
    name="nadam", class_name="GpuNadam", params_type=P.NadamParams, kernel="nadam",
    scalars=scalars.nadam_scalars, reference=reference.nadam,
    slots=(StateSlot("exp_avg"), StateSlot("exp_avg_sq", signed=False)),
    tensor_state=lambda hp, step: {"mu_product": scalars.nadam_mu_product(hp, step)},
    summary="NAdam (Dozat 2016), as torch.optim.NAdam (momentum_decay's mu schedule, L2 or decoupled decay).",
    algorithm="""
        p = p * (1 - lr * weight_decay) (decoupled), else g = g + weight_decay * p
        mu_t = beta1 * (1 - 0.5 * 0.96^(t * momentum_decay));  P_t = mu_1 * ... * mu_t
        m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g^2
        d = sqrt(v / (1 - beta2^t)) + eps
        p = p - lr (1 - mu_t) / (1 - P_t) * g / d - lr mu_{t+1} / (1 - P_t mu_{t+1}) * m / d""",
    examples=(P.NadamParams(), P.NadamParams(lr=1e-2, weight_decay=0.1),
              P.NadamParams(weight_decay=0.05, decoupled_weight_decay=True),
              P.NadamParams(lr=3e-3, beta1=0.5, beta2=0.9, eps=1e-6, momentum_decay=0.01),
              P.NadamParams(lr=1e-2, mu_product=0.25)),
)

RADAM = OptimizerDefinition(
    name="radam", class_name="GpuRadam", params_type=P.RadamParams, kernel="radam",
    scalars=scalars.radam_scalars, reference=reference.radam,
    slots=(StateSlot("exp_avg"), StateSlot("exp_avg_sq", signed=False)),
    summary="RAdam (Liu et al. 2020), as torch.optim.RAdam (variance rectification, L2 or decoupled decay).",
    algorithm="""
        p = p * (1 - lr * weight_decay) (decoupled), else g = g + weight_decay * p
        m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g^2
        rho_inf = 2 / (1 - beta2) - 1;  rho_t = rho_inf - 2 t beta2^t / (1 - beta2^t)
        p = p - lr m / (1 - beta1^t) * r_t sqrt(1 - beta2^t) / (sqrt(v) + eps)   (rho_t > 5)
        p = p - lr m / (1 - beta1^t)                                            (otherwise)
        r_t = sqrt((rho_t - 4)(rho_t - 2) rho_inf / ((rho_inf - 4)(rho_inf - 2) rho_t))""",
    examples=(P.RadamParams(), P.RadamParams(lr=1e-2, weight_decay=0.1),
              P.RadamParams(weight_decay=0.05, decoupled_weight_decay=True),
              P.RadamParams(lr=3e-3, beta1=0.5, beta2=0.9, eps=1e-6)),
)

ADAMAX = OptimizerDefinition(
    name="adamax", class_name="GpuAdamax", params_type=P.AdamaxParams, kernel="adamax",
    scalars=scalars.adamax_scalars, reference=reference.adamax,
    slots=(StateSlot("exp_avg"), StateSlot("exp_inf", signed=False)),
    summary="Adamax (Kingma & Ba), as torch.optim.Adamax: Adam with an infinity norm.",
    algorithm="""
        g = g + weight_decay * p
        m = beta1 * m + (1 - beta1) * g;  u = max(beta2 * u, |g| + eps)
        p = p - lr / (1 - beta1^t) * m / u""",
    examples=(P.AdamaxParams(), P.AdamaxParams(lr=1e-2, weight_decay=0.1),
              P.AdamaxParams(lr=3e-3, beta1=0.5, beta2=0.9, eps=1e-6)),
)

ADADELTA = OptimizerDefinition(
    name="adadelta", class_name="GpuAdadelta", params_type=P.AdadeltaParams, kernel="adadelta",
    scalars=scalars.adadelta_scalars, reference=reference.adadelta,
    slots=(StateSlot("square_avg", signed=False), StateSlot("acc_delta", signed=False)),
    summary="Adadelta (Zeiler 2012), as torch.optim.Adadelta (lr scales the delta).",
    algorithm="""
        g = g + weight_decay * p
        s = rho * s + (1 - rho) * g^2
        d = sqrt(a + eps) / sqrt(s + eps) * g;  a = rho * a + (1 - rho) * d^2
        p = p - lr * d""",
    examples=(P.AdadeltaParams(), P.AdadeltaParams(lr=0.5, weight_decay=0.1),
              P.AdadeltaParams(rho=0.5, eps=1e-4)),
)

ASGD = OptimizerDefinition(
    name="asgd", class_name="GpuAsgd", params_type=P.AsgdParams, kernel="asgd",
    scalars=scalars.asgd_scalars, reference=reference.asgd,
    slots=(StateSlot("ax"),),
    tensor_state=lambda hp, step: {"eta": scalars.asgd_eta(hp, hp.lr, step), "mu": scalars.asgd_mu(hp, step)},
    summary="Averaged SGD (Polyak & Juditsky), as torch.optim.ASGD (eta, mu and the average ax as torch keeps them).",
    algorithm="""
        g = g + weight_decay * p
        p = p * (1 - lambd * eta) - eta * g
        ax = ax + mu * (p - ax)  (mu != 1), else ax = p
        eta = lr / (1 + lambd * lr * t)^alpha;  mu = 1 / max(1, t - t0)   (for step t + 1)""",
    benchmark=P.AsgdParams(lr=1e-2, t0=0.0),
    examples=(P.AsgdParams(), P.AsgdParams(lr=0.05, weight_decay=0.1), P.AsgdParams(lambd=0.01, alpha=0.5, t0=5.0),
              P.AsgdParams(lr=0.02, t0=0.0, eta=0.01)),
)

RPROP = OptimizerDefinition(
    name="rprop", class_name="GpuRprop", params_type=P.RpropParams, kernel="rprop",
    scalars=scalars.rprop_scalars, reference=reference.rprop,
    # step_size starts at the first step's lr inside the step (so a later lr, which Rprop ignores as
    # torch does, never changes the state's description)
    slots=(StateSlot("prev"), StateSlot("step_size", signed=False)),
    summary="Rprop (Riedmiller & Braun), as torch.optim.Rprop: sign-based steps with per-element step sizes.",
    algorithm="""
        f = etaplus (g * prev > 0), etaminus (< 0), 1 (= 0)
        step_size = clamp(step_size * f, step_size_min, step_size_max)   (starts at lr)
        g = 0 where f = etaminus;  p = p - sign(g) * step_size;  prev = g""",
    examples=(P.RpropParams(), P.RpropParams(lr=0.05, etaminus=0.3, etaplus=1.5),
              P.RpropParams(lr=0.01, step_size_min=1e-3, step_size_max=0.02)),
)

# Every optimizer, in the order listings show them.
DEFINITIONS: Dict[str, OptimizerDefinition] = {
    d.name: d for d in (ADAM, ADAMW, SGD, RMSPROP, ADAGRAD, LAMB, LION, ADAFACTOR, NADAM, RADAM, ADAMAX, ADADELTA,
                        ASGD, RPROP)}


def definition(name: str) -> OptimizerDefinition:
    """The record of optimizer ``name``."""
    from optirs.core.errors import InvalidParameterError

    try:
        return DEFINITIONS[name]
    except KeyError:
        raise InvalidParameterError(f"optimizer={name!r}, expected one of {sorted(DEFINITIONS)}") from None

