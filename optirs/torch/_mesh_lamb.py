"""LAMB over sharded DTensor parameters: its per-tensor norms reduced over the mesh.

The LAMB kernel computes each tensor's norms inside its passes, over what it is given: one
rank's shard of a sharded parameter is not the tensor. So for an optimizer holding sharded
DTensors, :class:`optirs.torch.Lamb` steps as optax composes LAMB
(``chain(scale_by_adam, add_decayed_weights, scale_by_trust_ratio, scale_by_learning_rate)``):

1. the Adam direction by an optirs AdamW step (no decay, ``lr = 1``) over a zeroed scratch tensor
   per parameter, which it leaves holding ``-m_hat / (sqrt(v_hat) + eps)``; its state is LAMB's
   (``exp_avg``, ``exp_avg_sq``, ``step``, or their compact formats), shown in ``opt.state[p]``; the
   global gradient clipping (``max_grad_norm``, its norm reduced over the mesh) and the
   GradScaler's scale reach it as the step's ``grad_scale``;
2. ``u = -scratch + weight_decay * p`` and the squared norms of ``p`` and ``u`` on each shard, summed
   over the mesh dims the tensor is sharded on (one all-reduce per mesh and placement);
3. ``p -= lr * trust * u`` with ``trust = ||p|| / ||u||`` (1 where either is 0, clipped at
   ``max_trust_ratio``), as optirs.core.reference.lamb.

``bias_correction=False`` has no such composition (the Adam step always corrects) and is refused.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from optirs.core.errors import UnsupportedOperationError
from optirs.core.reference import lamb_trust_ratio
from optirs.torch._dtensor import is_dtensor, local, sharded, sharding_dims, sum_over_mesh
from optirs.torch._scratch import hand_over, scratch_for


def holds_shards(opt: Any) -> bool:
    return any(sharded(p) for group in opt.param_groups for p in group["params"])


def mesh_sums(tensors: List[torch.Tensor], values: torch.Tensor) -> torch.Tensor:
    """``values[i]`` (a per-shard sum of tensor ``i``) summed over the mesh dims tensor ``i`` is
    sharded on."""
    out = values.clone()
    sum_over_mesh([(out[i:i + 1], t.device_mesh, sharding_dims(t)) for i, t in enumerate(tensors) if is_dtensor(t)])
    return out


class MeshLamb:
    """The sharded path of one Lamb optimizer (module docstring): per group, an inner AdamW over
    scratch tensors, made at its first step."""

    def __init__(self, adam_class: type) -> None:
        self.adam_class = adam_class  # optirs.torch.AdamW
        self.inner: Dict[int, Tuple[Any, tuple]] = {}
        self.scratch: Dict[int, torch.Tensor] = {}

    def _adam(self, opt: Any, gi: int, group: Dict[str, Any]) -> Any:
        formats = {k: group.get(k, opt.defaults.get(k)) for k in opt.FORMAT_KEYS if k != "master_weights"}
        if group.get("master_weights") is not None and any(p.dtype != torch.float32 for p in group["params"]):
            raise UnsupportedOperationError(
                f"param_groups[{gi}] has master_weights={group['master_weights']!r} with sharded DTensor parameters, "
                "expected float32 parameters or master_weights=None: on shards LAMB's update is applied after its "
                "norms are reduced over the mesh, outside the kernel that keeps masters")
        key = (tuple(map(id, group["params"])), tuple(formats.values()))
        held = self.inner.get(gi)
        if held is not None and held[1] == key:
            return held[0]
        adam = self.adam_class([scratch_for(self.scratch, p) for p in group["params"]], lr=1.0, weight_decay=0.0,
                     backend=opt._backend_name, backend_options=opt._backend_options, **formats)
        self.inner[gi] = (adam, key)
        return adam

    def step(self, opt: Any, grad_scale: Any, found_inf: Any) -> None:
        if found_inf is not None and float(found_inf) != 0.0:
            return  # as the fused step: nothing changes, not even the count
        scale = 1.0 if grad_scale is None else float(grad_scale)
        for gi, group in enumerate(opt.param_groups):
            hp = opt._hyper(gi, group).hp  # (checked: the same errors as the fused path)
            if not hp.bias_correction:
                raise UnsupportedOperationError(
                    f"param_groups[{gi}] has bias_correction=False with sharded DTensor parameters, expected True: "
                    "on shards LAMB runs as an Adam step (which always corrects its bias) and a trust ratio whose "
                    "norms are reduced over the mesh")
            adam = self._adam(opt, gi, group)
            inner = adam.param_groups[0]
            inner["betas"], inner["eps"] = (hp.beta1, hp.beta2), hp.eps
            inner["maximize"] = bool(group.get("maximize", False))
            live = [p for p in group["params"] if p.grad is not None]
            if not live:
                continue
            clip = 1.0
            if hp.max_grad_norm is not None:
                sq = torch.stack([local(p.grad).float().pow(2).sum() for p in live])
                norm = float(mesh_sums(live, sq).sum().sqrt()) / scale
                clip = 1.0 if norm <= hp.max_grad_norm else hp.max_grad_norm / norm
            for p in group["params"]:
                z = self.scratch[id(p)]
                if p.grad is None:
                    z.grad = None
                    continue
                hand_over(opt.state, adam.state, p, z)
                local(z).zero_()
                z.grad = p.grad
            try:
                adam.step(grad_scale=torch.tensor(scale / clip))  # z <- -m_hat / (sqrt(v_hat) + eps)
            finally:
                for p in group["params"]:
                    self.scratch[id(p)].grad = None
            ps = [local(p).detach() for p in live]
            us = [local(self.scratch[id(p)]) for p in live]
            us = torch._foreach_add(torch._foreach_mul(ps, hp.weight_decay), us, alpha=-1.0) \
                if hp.weight_decay else torch._foreach_neg(us)
            sums = torch.stack([torch.stack([(t.float() ** 2).sum() for t in ps]),
                                torch.stack([(u.float() ** 2).sum() for u in us])], dim=1)
            norms = mesh_sums(live, sums).sqrt().tolist()
            lr = float(hp.lr)
            factors = [-lr * lamb_trust_ratio(pn, un, hp) for pn, un in norms]
            torch._foreach_add_(ps, torch._foreach_mul(us, factors))
            for p in live:
                opt.state[p] = adam.state[self.scratch[id(p)]]


__all__ = ["MeshLamb", "holds_shards", "mesh_sums"]
