"""optirs.torch.SparseAdam: ``torch.optim.SparseAdam`` (dense parameters, sparse gradients) on
optirs' sparse capability.

Each step hands every parameter's coalesced gradient to the seed API's lazy
:class:`optirs.optim.sparse.SparseAdam` (the ``sparse`` capability's ``optirs_sparse_adam_step``),
whose tables are rebuilt per step over the tensors ``opt.state`` holds: ``state[p]`` is torch's
``{"step": int, "exp_avg", "exp_avg_sq"}`` (moments shaped like the parameter), so a torch
checkpoint loads and an optirs one loads into torch. Only the rows present in a gradient change,
with torch's update ``p -= lr sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)``.

What torch refuses is refused (dense gradients); what optirs' sparse step cannot take raises
:class:`~optirs.core.errors.UnsupportedOperationError`: gradients sparse in more than the first
dimension, parameters other than float32.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from optirs.core.errors import InvalidParameterError, ShapeMismatchError, UnsupportedOperationError
from optirs.optim.sparse import CooGradient, SparseAdamConfig, SparseAdamTable
from optirs.optim.sparse import SparseAdam as _SeedSparseAdam
from optirs.torch._frontend import _open_backend, check_flags


class SparseAdam(torch.optim.Optimizer):
    """torch.optim.SparseAdam (module docstring): ``SparseAdam(params, lr=1e-3, betas=(0.9, 0.999),
    eps=1e-8, maximize=False)`` plus ``backend="auto"`` and ``backend_options``."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, maximize: bool = False, *,
                 backend: str = "auto", backend_options: Optional[Dict[str, Any]] = None):
        if not isinstance(backend, str) or not backend:
            raise InvalidParameterError(f"backend={backend!r}, expected a backend name or 'auto'")
        if backend_options is not None and not isinstance(backend_options, dict):
            raise InvalidParameterError(f"backend_options={backend_options!r}, expected a dict or None")
        self._backend_name, self._backend_options = backend, dict(backend_options or {})
        self._seeds: Dict[Tuple[str, Any], _SeedSparseAdam] = {}
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, maximize=maximize))
        for group in self.param_groups:
            self._config(group, "auto")  # the hyperparameters checked as the constructor's

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        self._config({**self.defaults, **param_group}, "auto")
        super().add_param_group(param_group)

    @staticmethod
    def _config(group: Dict[str, Any], backend: str) -> SparseAdamConfig:
        check_flags(group)
        betas = group["betas"]
        if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
            raise InvalidParameterError(f"betas={betas!r}, expected a pair of floats")
        lr = group["lr"]
        lr = float(lr.item()) if isinstance(lr, torch.Tensor) else lr
        return SparseAdamConfig(lr=lr, beta1=float(betas[0]), beta2=float(betas[1]), eps=group["eps"],
                                backend=backend)

    def _seed(self, device: torch.device) -> _SeedSparseAdam:
        """The seed API's optimizer for ``device`` (its backend opened once); every group's step sets
        its config."""
        options = self._backend_options
        key = (device.type, device.index)
        seed = self._seeds.get(key)
        if seed is None:
            name = _open_backend(self._backend_name, options, device.type).name
            seed = _SeedSparseAdam(SparseAdamConfig(backend=name, **options))
            seed.backend  # opened here: a backend without the sparse capability is refused before any change
            self._seeds[key] = seed
        return seed

    @staticmethod
    def _table_of(p: torch.Tensor, g: torch.Tensor, where: str) -> Tuple[int, int, torch.Tensor]:
        """(rows, row length, the coalesced gradient) of a parameter whose gradient is row-sparse."""
        if not g.is_sparse:
            raise UnsupportedOperationError(
                f"{where} has a dense gradient, expected a sparse one: SparseAdam does not support dense gradients "
                "(as torch.optim.SparseAdam); use optirs.torch.Adam instead")
        if p.dtype != torch.float32 or g.dtype != torch.float32:
            raise UnsupportedOperationError(f"{where} is {p.dtype} with a {g.dtype} gradient, expected float32 for both")
        if g.shape != p.shape or g.device != p.device:
            raise ShapeMismatchError(f"{where} has shape {tuple(p.shape)} on {p.device}, its gradient "
                                     f"{tuple(g.shape)} on {g.device}; expected the same")
        if p.dim() == 0 or g.sparse_dim() != 1:
            raise UnsupportedOperationError(
                f"{where}'s gradient is sparse in {g.sparse_dim()} dimensions of shape {tuple(p.shape)}, expected a "
                "gradient sparse in the first dimension only (rows of a table, as nn.Embedding(sparse=True) gives)")
        if not p.is_contiguous():
            raise ShapeMismatchError(f"{where} is not contiguous (strides {p.stride()}), expected a contiguous tensor")
        rows = p.shape[0]
        return rows, (p.numel() // rows if rows else 0), g.coalesce()

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None):
        """One step of every group; returns ``closure()``'s loss. Every gradient is checked before any
        parameter or state changes."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work: List[Tuple[_SeedSparseAdam, SparseAdamConfig, List[Any], List[Any], List[Any], List[Any]]] = []
        for gi, group in enumerate(self.param_groups):
            group_config = self._config(group, "auto")
            by_device: Dict[Tuple[str, Any], List[int]] = {}
            params = group["params"]
            for j, p in enumerate(params):
                if p.grad is not None:
                    by_device.setdefault((p.device.type, p.device.index), []).append(j)
            for (_, _), js in by_device.items():
                seed = self._seed(params[js[0]].device)
                config = replace(group_config, backend=seed.config.backend, device=seed.config.device,
                                 platform=seed.config.platform)
                arrays, grads, tables, stepped = [], [], [], []
                for j in js:
                    p = params[j]
                    rows, dim, g = self._table_of(p, p.grad, f"param_groups[{gi}]['params'][{j}]")
                    values = g._values().reshape(g._values().shape[0], dim)
                    if group["maximize"]:
                        values = -values
                    state = self.state.get(p) or {}
                    m = state.get("exp_avg", torch.zeros_like(p))
                    v = state.get("exp_avg_sq", torch.zeros_like(p))
                    for name, t in (("exp_avg", m), ("exp_avg_sq", v)):
                        if not isinstance(t, torch.Tensor) or t.shape != p.shape or t.dtype != torch.float32 \
                                or t.device != p.device or not t.is_contiguous():
                            raise InvalidParameterError(
                                f"the state of param_groups[{gi}]['params'][{j}] has {name} "
                                f"{getattr(t, 'shape', t)!r}, expected a contiguous float32 tensor shaped like "
                                f"the parameter {tuple(p.shape)} on {p.device}")
                    step = int(state.get("step", 0))
                    arrays.append(self._array(p.detach().view(rows, dim)))
                    # the row indices on the host: the seed API orders them there (torch's coalesce
                    # has already summed duplicates on the device)
                    indices = g._indices()[0].cpu().numpy()
                    grads.append(CooGradient(indices, self._array(values.contiguous())))
                    tables.append(SparseAdamTable(rows, dim, step, self._array(m.view(-1)), self._array(v.view(-1))))
                    stepped.append((p, m, v))
                work.append((seed, config, arrays, grads, tables, stepped))
        for seed, config, arrays, grads, tables, stepped in work:
            seed.config, seed.tables = config, tables
            seed.step(arrays, grads)
            for (p, m, v), table in zip(stepped, tables):
                self.state[p] = {"step": table.step, "exp_avg": m, "exp_avg_sq": v}
        return loss

    @staticmethod
    def _array(t: torch.Tensor) -> Any:
        """What the seed API steps: numpy views of CPU tensors, the tensors themselves on a device."""
        return t.numpy() if t.device.type == "cpu" else t


__all__ = ["SparseAdam"]
