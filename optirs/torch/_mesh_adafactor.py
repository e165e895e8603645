"""Adafactor over sharded DTensor parameters: its per-tensor sums reduced over the mesh.

The Adafactor kernel does each tensor's whole step in one pass over it, its sums included (RMS of
``p``, the row and column means of ``g^2``, the mean of the row means, RMS of the update): on one
rank's shard of a sharded parameter those are sums over the shard, not over the tensor. So for an
optimizer holding sharded DTensors, :class:`optirs.torch.Adafactor` steps each rank's local shards
with torch ops, in the kernel's precision (float32 elements, sums in float64) and with its scalars
(:func:`optirs.core.scalars.adafactor_scalars`), and adds each sum over the mesh dims that cut
what it sums, one all-reduce per (mesh dim, kind of sum) for all the tensors together:

- ``sum(p^2)`` and ``sum(u^2)`` (the step size's two RMS): over every mesh dim sharding the tensor;
- a row's ``sum(g^2)`` over the last dim: over the mesh dims sharding the last dim;
- a column's ``sum(g^2)`` and the sum of the row means over dim -2: over the mesh dims sharding
  dim -2. A ``Shard`` of a leading (batch) dim cuts no sum but the two RMS.

The factored state is held as torch keeps it (``row_var``: ``shape[:-1] + (1,)``, ``col_var``:
``shape[:-2] + (1, shape[-1])``; ``variance`` for 0-1 dim tensors) as DTensors placed as the
parameter except on the mesh dims sharding the dim a factor is reduced over, where it is
``Replicate`` (every rank holds the same sums), so ``torch.distributed.checkpoint`` saves it once
and reshards it. A step checks every group and tensor before it changes anything; a GradScaler's
``found_inf`` skips it, its scale divides the gradients.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch

from optirs.core.errors import InvalidParameterError, ShapeMismatchError, UnsupportedOperationError
from optirs.core.interrupts import deferred_interrupts
from optirs.core.reference import adafactor_state_shapes
from optirs.core.scalars import adafactor_scalars
from optirs.torch._buckets import step_value
from optirs.torch._dtensor import (DTensor, Replicate, is_dtensor, local, refusal, row_major_strides,
                                   sharding_dims, sum_over_mesh)


def factor_placements(p: torch.Tensor, reduced: int) -> tuple:
    """The placements of a factor of ``p`` reduced over tensor dim ``reduced``: ``p``'s, but Replicate
    on the mesh dims sharding that dim."""
    cut = set(sharding_dims(p, reduced))
    return tuple(Replicate() if i in cut else pl for i, pl in enumerate(p.placements))


def state_layout(p: torch.Tensor) -> Dict[str, Tuple[tuple, Optional[tuple]]]:
    """key -> (the global shape of its state, as torch keeps it; its placements, None for a plain ``p``)."""
    reduced = {"row_var": -1, "col_var": -2}
    return {k: (shape, None if not is_dtensor(p) else
                factor_placements(p, reduced[k]) if k in reduced else tuple(p.placements))
            for k, shape in adafactor_state_shapes(p.shape).items()}


class _Work:
    """One parameter's step: its local tensors, its state's local tensors (fresh, held or adopted),
    and what the step computes before anything is written."""

    __slots__ = ("p", "x", "state", "install", "step", "sc", "new")

    def __init__(self, p: torch.Tensor, x: torch.Tensor, state: Dict[str, torch.Tensor], install: bool, step: int,
                 sc: Any):
        self.p, self.x, self.state, self.install, self.step, self.sc = p, x, state, install, step, sc
        self.new: Dict[str, torch.Tensor] = {}


def _held_state(opt: Any, p: torch.Tensor, where: str) -> Tuple[Dict[str, torch.Tensor], bool, int]:
    """``p``'s state as local float32 tensors laid out as its shard (a DTensor placed otherwise
    redistributed), whether ``opt.state[p]`` must be (re)installed after the step, and its step."""
    entry = opt.state.get(p)
    layout = state_layout(p)
    if not entry:  # (a factor's local shape is that of the local tensor's factor: the dim it sums is whole)
        lp = local(p)
        return {k: torch.zeros(shape, dtype=torch.float32, device=lp.device)
                for k, shape in adafactor_state_shapes(lp.shape).items()}, True, 0
    missing = [k for k in ("step", *layout) if k not in entry]
    if missing:
        raise InvalidParameterError(f"the state of {where} has keys {sorted(entry)}, expected "
                                    f"{sorted(['step', *layout])} (torch.optim.Adafactor's)")
    step = step_value(entry["step"], f"the state of {where}")
    out, install = {}, False
    for k, (shape, placements) in layout.items():
        v = entry[k]
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != shape or v.dtype != torch.float32:
            raise ShapeMismatchError(
                f"the state of {where} has {k} {getattr(v, 'dtype', type(v).__name__)} of shape "
                f"{tuple(getattr(v, 'shape', ()))}, expected a float32 tensor of shape {shape}")
        if placements is not None:
            if not is_dtensor(v):
                raise UnsupportedOperationError(
                    f"the state of {where} has {k} as a {type(v).__name__}, expected a DTensor placed {placements} "
                    "(load a sharded parameter's state through torch.distributed.checkpoint)")
            if v.device_mesh != p.device_mesh or tuple(v.placements) != placements:
                v = v.redistribute(p.device_mesh, placements)
                install = True
            v = v._local_tensor
        out[k] = v
    return out, install, step


def mesh_adafactor_step(opt: Any, grad_scale: Any, found_inf: Any) -> None:
    """One step of every param group of a :class:`optirs.torch.Adafactor` holding sharded
    DTensors (module docstring)."""
    if found_inf is not None and float(found_inf) != 0.0:
        return  # as the fused step: nothing changes, not even the count
    factor = 1.0 if grad_scale is None else 1.0 / float(grad_scale)
    works: List[_Work] = []
    for gi, group in enumerate(opt.param_groups):  # every check first: a refused step changes nothing
        hp = opt._hyper(gi, group).hp
        for j, p in enumerate(group["params"]):
            g = p.grad
            if g is None:
                continue
            where = f"param_groups[{gi}]['params'][{j}]"
            error = opt._bad_tensor(gi, j, p, g)
            if error is None and (is_dtensor(p) or is_dtensor(g)):
                error = refusal(p, g, where, None, False)
            if error is None and (p.dtype != torch.float32 or g.dtype != torch.float32):
                error = UnsupportedOperationError(
                    f"{where} is {p.dtype} with a {g.dtype} gradient, expected float32 parameters and gradients "
                    "for Adafactor on sharded DTensors (its sums are reduced over the mesh between torch ops in "
                    "float32, outside the kernels that step 16-bit parameters)")
            if error is not None:
                raise error
            state, install, step = _held_state(opt, p, where)
            sc = adafactor_scalars(hp, step + 1, grad_factor=factor)
            x = local(g).detach().float() * sc.grad_factor
            works.append(_Work(p, -x if sc.maximize else x, state, install, step, sc))
    if not works:
        return
    # the sums of each shard, then over the mesh
    sums: List[Tuple[torch.Tensor, Any, List[int]]] = []
    mesh_of = lambda w: w.p.device_mesh if is_dtensor(w.p) else None  # noqa: E731
    for w in works:
        lp = local(w.p).detach()
        sq = w.x * w.x
        w.new["p_sumsq"] = (lp * lp).double().sum()
        sums.append((w.new["p_sumsq"], mesh_of(w), sharding_dims(w.p)))
        if w.p.dim() >= 2:
            w.new["row_sum"] = sq.double().sum(-1, keepdim=True)
            w.new["col_sum"] = sq.double().sum(-2, keepdim=True)
            sums.append((w.new["row_sum"], mesh_of(w), sharding_dims(w.p, -1)))
            sums.append((w.new["col_sum"], mesh_of(w), sharding_dims(w.p, -2)))
    sum_over_mesh(sums)
    sums = []
    for w in works:
        sc, shape = w.sc, w.p.shape
        weight = float(sc.beta2_weight)
        if w.p.dim() >= 2:
            rows, cols = shape[-2], shape[-1]
            row, col = w.state["row_var"], w.state["col_var"]
            w.new["row_var"] = row + weight * ((w.new["row_sum"] / cols).float() - row)
            w.new["col_var"] = col + weight * ((w.new["col_sum"] / rows).float() - col)
            w.new["row_total"] = w.new["row_var"].double().sum(-2, keepdim=True)
            sums.append((w.new["row_total"], mesh_of(w), sharding_dims(w.p, -2)))
        else:
            var = w.state["variance"]
            w.new["variance"] = var + weight * (w.x * w.x - var)
    sum_over_mesh(sums)
    sums = []
    for w in works:
        sc = w.sc
        eps1, eps1_sq = float(sc.eps1), float(sc.eps1_squared)
        if w.p.dim() >= 2:
            row_mean = (w.new["row_total"] / w.p.shape[-2]).float()
            v = w.new["row_var"] * w.new["col_var"] / row_mean.clamp(min=eps1)
        else:
            v = w.new["variance"]
        w.new["u"] = w.x / v.clamp(min=eps1_sq).sqrt()
        w.new["u_sumsq"] = (w.new["u"] * w.new["u"]).double().sum()
        sums.append((w.new["u_sumsq"], mesh_of(w), sharding_dims(w.p)))
    sum_over_mesh(sums)
    # the updates, then every write (the parameters, the state, its step and entries)
    for w in works:
        sc, n = w.sc, w.p.numel()
        if n:
            alpha = max(float(sc.eps2), math.sqrt(float(w.new["p_sumsq"]) / n)) * float(sc.rho)
            size = alpha / max(1.0, math.sqrt(float(w.new["u_sumsq"]) / n) / float(sc.d))
            w.new["p"] = local(w.p).detach() * sc.decay_factor - torch.tensor(size, dtype=torch.float32) * w.new["u"]
    with deferred_interrupts():
        for w in works:
            if w.p.numel():
                local(w.p).detach().copy_(w.new["p"])
                for k, v in w.state.items():
                    v.copy_(w.new[k])
            entry = opt.state.get(w.p)
            if w.install or not entry:
                entry = {"step": torch.tensor(0.0, dtype=torch.float32)}
                for k, (shape, placements) in state_layout(w.p).items():
                    v = w.state[k]
                    entry[k] = v if placements is None else DTensor.from_local(
                        v, w.p.device_mesh, placements, run_check=False, shape=torch.Size(shape),
                        stride=row_major_strides(shape))
                opt.state[w.p] = entry
            step = entry["step"]
            if isinstance(step, torch.Tensor):
                step.fill_(w.step + 1)
            else:
                entry["step"] = torch.tensor(float(w.step + 1), dtype=torch.float32)


__all__ = ["mesh_adafactor_step", "state_layout", "factor_placements"]
