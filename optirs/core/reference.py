"""The specification: every optimizer's step in float64 numpy, written to be read.

Each function takes a model (a list of parameter arrays), its gradients, the per-parameter state
(a list of dicts of arrays, empty dicts before the first step), the hyperparameters and the
1-based step number, and returns new parameters and state; nothing is modified in place.
Every backend is tested against these functions. The state slot names are the ones
``state_dict()`` uses.

Weight decay is applied as torch applies it: only when ``weight_decay != 0`` (so an infinite
weight with no decay stays infinite instead of becoming ``0 * inf`` = NaN).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np

from optirs.core.params import (AdafactorParams, AdagradParams, AdamParams, LambParams, LionParams, RmspropParams,
                                SgdParams)

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


# Each optimizer's float64 step, by name (run() looks steps up here).
STEPS: Dict[str, Callable[..., StepResult]] = {f.__name__: f for f in (adam, adamw, sgd, rmsprop, adagrad, lamb, lion,
                                                                        adafactor)}
